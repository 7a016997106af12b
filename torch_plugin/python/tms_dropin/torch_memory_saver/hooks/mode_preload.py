"""torch_memory_saver.hooks.mode_preload on vmstash: configure_subprocess() puts vmstash's
preload library into LD_PRELOAD for the child processes started inside it."""
from vmstash.compat.torch_memory_saver import configure_subprocess

__all__ = ["configure_subprocess"]
