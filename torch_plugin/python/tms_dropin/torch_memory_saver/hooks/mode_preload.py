"""torch_memory_saver.hooks.mode_preload on vmstash: configure_subprocess() puts the preload
library shipped beside this package (vmstash's, under torch_memory_saver's name:
utils.get_binary_path_from_package) first into LD_PRELOAD for the child processes started
inside, the other entries kept, joined with ":" as torch_memory_saver does; the previous
value (or its absence) comes back on exit."""
import contextlib
import os

from torch_memory_saver.utils import change_env, get_binary_path_from_package

__all__ = ["configure_subprocess"]


@contextlib.contextmanager
def configure_subprocess():
    path = str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload"))
    current = os.environ.get("LD_PRELOAD", "")
    with change_env("LD_PRELOAD", f"{path}:{current}" if current else path):
        yield
