"""torch_memory_saver's Python API on vmstash: switch with one import change.

    from vmstash.compat.torch_memory_saver import torch_memory_saver, configure_subprocess

Same names and arguments (region, cuda_graph, disable, pause, resume, get_cpu_backup,
hook_mode, memory_margin_bytes, retain_cpu_backup, enabled, set_disk_backup_dir,
configure_subprocess; TMS_* environment variables). What differs, on purpose:
  * Errors raise vmstash.Error (out of memory: vmstash.OutOfMemoryError, also a
    torch.OutOfMemoryError); nothing exits the process.
  * A torch_memory_saver tag maps to a vmstash tag per backup setting: the first setting
    seen keeps the name, the other gets ":backup" / ":discard" appended; pause(tag) and
    resume(tag) act on both.
  * Pause copies only PyTorch's live blocks; the pinned backup is kept across cycles
    (retain_cpu_backup defaults to True; False gives the host memory back after resume,
    as torch_memory_saver's default does, at the price of re-pinning at the next pause).
  * cuda_graph works in torch mode: the graph's memory goes to the tag's MemPool (shared
    by every graph of that tag, so a `pool=` argument is not needed and is ignored).
  * hook_mode "preload" and TMS_INIT_ENABLE need the process started with
    LD_PRELOAD=libvmstash_preload.so (configure_subprocess() sets it for children); tensors
    still go through the tag's MemPool, and raw cudaMalloc/cuMemAlloc calls of a thread in
    a region go to its tag. Disk backup is not supported (UNIMPLEMENTED).
  * cpu_backup_backend "mmap" is process-wide in vmstash (VMSTASH_CONF backup:pageable,
    or TMS_INIT_CPU_BACKUP_BACKEND=mmap before the first use).
"""
import contextlib
import os
import threading
import warnings

from .. import _api, _lib, _torch
from .._lib import Error

__all__ = ["torch_memory_saver", "configure_subprocess", "TorchMemorySaver"]


def _env_flag(name, default=False):
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def _process_backend():
    conf = os.environ.get("VMSTASH_CONF", "")
    if os.environ.get("TMS_INIT_CPU_BACKUP_BACKEND", "").strip().lower() == "mmap" and "backup:" not in conf:
        if not _lib.lib().vmstash_is_initialized():
            os.environ["VMSTASH_CONF"] = (conf + "," if conf else "") + "backup:pageable"
            conf = os.environ["VMSTASH_CONF"]
    return "mmap" if "backup:pageable" in conf.replace(" ", "") else "pinned"


def _unimplemented(what):
    return _lib.Error(f"torch_memory_saver compatibility: {what} is not supported by this vmstash version", 12)


def _if_created(fn, name):
    """fn(name), unless no region of that tag was ever entered (vmstash does not know the
    name yet: torch_memory_saver treats such a tag as empty). True when fn ran."""
    try:
        fn(name)
    except Error as e:
        if e.code_name != "NOT_FOUND":
            raise
        return False
    return True


class TorchMemorySaver:
    """The torch_memory_saver singleton's interface (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._names = {}  # (tms tag, policy) -> vmstash tag
        self._hook_mode = "torch"
        self._used = False
        self._margin = 0
        self._retain = _env_flag("TMS_RETAIN_CPU_BACKUP", default=True)
        self._disk_dir = os.environ.get("TMS_DISK_BACKUP_DIR", "/tmp")
        if _env_flag("TMS_INIT_ENABLE") and _lib.preloaded_library() is None:
            warnings.warn("TMS_INIT_ENABLE (every thread inside a region) needs the process started with "
                          "LD_PRELOAD=<libvmstash_preload.so>; without it, allocations outside regions are not managed", RuntimeWarning)
        if _env_flag("TMS_INIT_ENABLE_DISK_BACKUP"):
            warnings.warn("TMS_INIT_ENABLE_DISK_BACKUP: vmstash has no disk backup tier; ignored", RuntimeWarning)

    # --- configuration ---------------------------------------------------------------
    @property
    def enabled(self):
        return True

    @property
    def hook_mode(self):
        return self._hook_mode

    @hook_mode.setter
    def hook_mode(self, mode):
        if mode not in ("torch", "preload"):
            raise ValueError(f"hook_mode must be 'torch' or 'preload', got {mode!r}")
        if mode == "preload" and _lib.preloaded_library() is None:
            raise _lib.Error("hook_mode='preload' needs the process started with LD_PRELOAD=<libvmstash_preload.so> "
                             "(vmstash.preload_library_path(); configure_subprocess() does it for children)", 9)
        if self._used and mode != self._hook_mode:
            raise _lib.Error("hook_mode must be set before the first region", 9)
        self._hook_mode = mode

    @property
    def memory_margin_bytes(self):
        return self._margin

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value):
        _api.set_memory_margin(int(value))
        self._margin = int(value)

    @property
    def retain_cpu_backup(self):
        return self._retain

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value):
        self._retain = bool(value)

    def set_disk_backup_dir(self, path):
        self._disk_dir = str(path)

    # --- tags -------------------------------------------------------------------------
    def _vmstash_tag(self, tag, backup):
        policy = "backup" if backup else "discard"
        with self._lock:
            name = self._names.get((tag, policy))
            if name is None:
                taken = any(t == tag for (t, _) in self._names)
                name = f"{tag}:{policy}" if taken else tag
                self._names[(tag, policy)] = name
            return name, policy

    def _targets(self, tag):
        with self._lock:
            return [(name, policy) for (t, policy), name in self._names.items() if tag is None or t == tag]

    def _check_backup_args(self, enable_cpu_backup, enable_disk_backup, cpu_backup_backend):
        if enable_disk_backup:
            raise _unimplemented("enable_disk_backup")
        if cpu_backup_backend not in (None, "pinned", "mmap"):
            raise ValueError(f"cpu_backup_backend must be None, 'pinned' or 'mmap', got {cpu_backup_backend!r}")
        if enable_cpu_backup and cpu_backup_backend is not None and cpu_backup_backend != _process_backend():
            raise _lib.Error(f"cpu_backup_backend={cpu_backup_backend!r}: vmstash's backup backend is process-wide "
                             f"and is {_process_backend()!r} here (VMSTASH_CONF backup:pinned|pageable, or "
                             "TMS_INIT_CPU_BACKUP_BACKEND before the first use)", 9)

    # --- regions and graphs -----------------------------------------------------------
    @contextlib.contextmanager
    def region(self, tag="default", enable_cpu_backup=False, enable_disk_backup=False, cpu_backup_backend=None):
        backup = bool(enable_cpu_backup)
        self._check_backup_args(backup, enable_disk_backup, cpu_backup_backend)
        _process_backend()
        name, policy = self._vmstash_tag(tag, backup)
        self._used = True
        with _torch.region(name, policy):
            yield

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global", tag="default",
                   enable_cpu_backup=False, cpu_backup_backend=None):
        self._check_backup_args(enable_cpu_backup, False, cpu_backup_backend)
        _process_backend()
        name, policy = self._vmstash_tag(tag, enable_cpu_backup)
        self._used = True
        kwargs = {"capture_error_mode": capture_error_mode}
        if stream is not None:
            kwargs["stream"] = stream
        with _torch.cuda_graph(cuda_graph, tag=name, policy=policy, **kwargs):
            yield

    @contextlib.contextmanager
    def disable(self):
        """Allocations of this thread inside go to a throw-away PyTorch pool (never paused),
        released on exit."""
        import torch
        previous = _api.current_tag()
        _api.set_current_tag("default")
        pool = torch.cuda.MemPool()
        try:
            with torch.cuda.use_mem_pool(pool):
                yield
        finally:
            _api.set_current_tag(previous)
            del pool

    # --- pause / resume ----------------------------------------------------------------
    def pause(self, tag=None):
        for name, _ in self._targets(tag):
            _if_created(_api.pause, name)

    def resume(self, tag=None):
        for name, policy in self._targets(tag):
            if _if_created(_api.resume, name) and policy == "backup" and not self._retain:
                _api.release_backup(name)

    def get_cpu_backup(self, x, zero_copy=False):
        """A CPU copy of what the pause saved for tensor `x` (contiguous), or None when `x`
        is not paused with a backup. zero_copy is accepted; the result is always a copy."""
        import torch
        if not x.is_contiguous():
            raise ValueError("get_cpu_backup needs a contiguous tensor")
        out = torch.empty(x.shape, dtype=x.dtype, device="cpu")
        try:
            _api.read_backup(x.data_ptr(), x.numel() * x.element_size(), out.data_ptr(), device=x.device.index)
        except _lib.Error as e:
            if e.code == _lib.NOT_FOUND:
                return None
            raise
        return out


torch_memory_saver = TorchMemorySaver()


@contextlib.contextmanager
def configure_subprocess():
    """Child processes started inside get libvmstash_preload.so prepended to LD_PRELOAD
    (other entries kept; restored on exit). Torch-mode children need nothing, but get it
    anyway so that hook_mode='preload' and TMS_INIT_ENABLE work there."""
    path = _lib.preload_library_path()
    previous = os.environ.get("LD_PRELOAD")
    entries = [e for e in (previous or "").replace(":", " ").split() if e]
    if path not in entries:
        os.environ["LD_PRELOAD"] = " ".join([path] + entries)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = previous
