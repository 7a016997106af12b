"""torch_memory_saver, served by vmstash.

This is vmstash's drop-in package (its version ends in "+vmstash.<vmstash version>"):
`import torch_memory_saver` gives vmstash.compat.torch_memory_saver, so a program written
against torch_memory_saver 0.0.10 runs on vmstash unchanged; torch_memory_saver's C entry
points (tms_*) are vmstash's library's. Modules: entrypoint, hooks (base, mode_preload,
mode_torch), utils and testing_utils (for torch_memory_saver's own tests). `pip uninstall
torch_memory_saver` removes it; reinstalling the original package brings that back.
"""
import ctypes
import os
import warnings

try:
    from vmstash.compat.torch_memory_saver import TorchMemorySaver, torch_memory_saver
except ImportError as e:
    if not (e.name or "").startswith("vmstash"):
        raise
    raise ImportError(
        "torch_memory_saver here is vmstash's drop-in: it needs the vmstash package of the same version "
        "installed beside it (python3 -m pip install --no-deps vmstash-<version>-*.whl), and that cannot be "
        f"imported ({e})", name=e.name) from e

from .hooks.mode_preload import configure_subprocess


def _say_why_the_preload_library_is_missing():
    """A process started with the drop-in's preload library in LD_PRELOAD that the loader
    refused (it prints one line and goes on; the usual cause: the vmstash package, whose
    libraries it needs, is not installed beside it) is told here, with the loader's reason:
    the drop-in then serves regions without the preload hooks, and TMS_INIT_ENABLE=1 is
    refused."""
    from vmstash import _lib
    if _lib.preloaded_library() is not None:
        return
    for entry in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        if not os.path.basename(entry).startswith("torch_memory_saver_hook_mode_preload"):
            continue
        try:
            ctypes.CDLL(entry)
            why = "it is not vmstash's preload library (torch_memory_saver's own is installed there?)"
        except OSError as e:
            why = f"the loader refused it: {e}; install the vmstash package of the same version beside it"
        warnings.warn(f"torch_memory_saver (vmstash's drop-in): LD_PRELOAD names {entry}, which is not loaded ({why})",
                      RuntimeWarning, stacklevel=2)


_say_why_the_preload_library_is_missing()

__all__ = ["TorchMemorySaver", "configure_subprocess", "torch_memory_saver"]
served_by = "vmstash"
