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
    """A process started with a torch_memory_saver preload library in LD_PRELOAD that is not
    vmstash's loaded one is told so (a RuntimeWarning): the loader refused it (it printed
    why on stderr and went on; the usual cause: the vmstash package, whose libraries it
    needs, is not installed beside it), or it is torch_memory_saver's own. The drop-in then
    serves regions without preload hooks, and TMS_INIT_ENABLE=1 is refused. Nothing is
    loaded here (a late dlopen would run a preload library's constructors)."""
    from vmstash import _lib
    if _lib.preloaded_library() is not None:
        return
    for entry in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        if not os.path.basename(entry).startswith("torch_memory_saver_hook_mode_preload"):
            continue
        try:
            ctypes.CDLL(entry, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            why = "it is loaded, but it is torch_memory_saver's own preload library, not vmstash's"
        except OSError:
            why = ("the dynamic loader refused it at the start, saying why on stderr; usually the vmstash package "
                   "of the same version is missing beside it")
        warnings.warn(f"torch_memory_saver (vmstash's drop-in): LD_PRELOAD names {entry}, which is not vmstash's "
                      f"loaded preload library ({why})", RuntimeWarning, stacklevel=2)


try:
    _say_why_the_preload_library_is_missing()
except Exception:  # noqa: BLE001 - a warning turned into an error (-W error) must not fail the import
    pass

__all__ = ["TorchMemorySaver", "configure_subprocess", "torch_memory_saver"]
served_by = "vmstash"
