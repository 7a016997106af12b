"""torch_memory_saver.hooks.base on vmstash: the hook mode names (HookMode); the modes
themselves are vmstash's (torch_memory_saver.hook_mode)."""
from typing import Literal

HookMode = Literal["preload", "torch"]

__all__ = ["HookMode"]
