"""torch_memory_saver.utils on vmstash: the helpers torch_memory_saver's tests, hooks and
frameworks import from it, written for the drop-in (vmstash serves the rest).

  is_xpu()                        whether torch sees an Intel XPU (cached; False without torch)
  change_env(key, value)          a context manager setting one environment variable and
                                  putting back the previous value (or its absence) on exit
  get_binary_path_from_package(stem)
                                  the library `<stem>...so` shipped beside the package, for
                                  the CUDA major version of the installed torch: the drop-in
                                  wheel ships vmstash's preload library under
                                  torch_memory_saver's names (`<stem>_cu13.abi3.so` and the
                                  unsuffixed `<stem>.abi3.so`, which serves any CUDA version:
                                  vmstash finds the runtime's calls at run time). RuntimeError
                                  naming the pattern when none, or several, match.
"""
import contextlib
import functools
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["is_xpu", "change_env", "get_binary_path_from_package"]


def _torch_or_none():
    try:
        import torch
    except ImportError:
        return None
    return torch


@functools.lru_cache(maxsize=1)
def is_xpu() -> bool:
    torch = _torch_or_none()
    xpu = getattr(torch, "xpu", None) if torch is not None else None
    return bool(xpu is not None and xpu.is_available())


def _cuda_major():
    """The CUDA major version torch was built for, or None (no torch, a CPU or ROCm build)."""
    torch = _torch_or_none()
    version = getattr(getattr(torch, "version", None), "cuda", None) if torch is not None else None
    try:
        return int(str(version).split(".", 1)[0]) if version else None
    except ValueError:
        logger.warning("torch.version.cuda=%r is not a version number", version)
        return None


def _matches(folder, pattern):
    return sorted(p for p in Path(folder).glob(pattern) if p.is_file())


def get_binary_path_from_package(stem: str) -> Path:
    here = Path(__file__).resolve().parent
    major = _cuda_major()
    patterns = ([f"{stem}_cu{major}.*.so"] if major is not None else []) + [f"{stem}.*.so"]
    for pattern in patterns:
        for folder in (here, here.parent):
            found = _matches(folder, pattern)
            if len(found) == 1:
                return found[0]
            if len(found) > 1:
                raise RuntimeError(f"torch_memory_saver (vmstash drop-in): {len(found)} libraries match {pattern!r} "
                                   f"in {folder}: {found}; expected one")
    raise RuntimeError(f"torch_memory_saver (vmstash drop-in): no library matches {' or '.join(map(repr, patterns))} "
                       f"in {here} or {here.parent}; reinstall the drop-in wheel (it ships vmstash's preload "
                       "library under torch_memory_saver's names)")


@contextlib.contextmanager
def change_env(key: str, value: str):
    previous = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous
