"""torch_memory_saver's Python API on vmstash.

    from vmstash.compat.torch_memory_saver import torch_memory_saver, configure_subprocess

or, unchanged, `import torch_memory_saver` once the drop-in wheel is installed
(scripts/build_tms_dropin_wheel.py; README "torch_memory_saver drop-in"). Same names and
arguments (region, cuda_graph, disable, pause, resume, get_cpu_backup, hook_mode,
memory_margin_bytes, retain_cpu_backup, enabled, set_disk_backup_dir, _ensure_initialized,
configure_subprocess; TMS_* environment variables) with torch_memory_saver 0.0.10's
defaults: retain_cpu_backup False (TMS_RETAIN_CPU_BACKUP), hook_mode "preload" when the
process runs under the preload library (else "torch", where torch_memory_saver would
fail). Whole-process mode: under the preload library with TMS_INIT_ENABLE=1 every CUDA
allocation outside a region goes to the preload library's process tag (backed up with
TMS_INIT_ENABLE_CPU_BACKUP=1); pause()/resume() without a tag, and with tag "default",
act on it too. disable() sends the calling thread's allocations to CUDA (also in
whole-process mode and while paused) through a throw-away PyTorch pool.

What differs, on purpose:
  * Errors raise vmstash.Error (out of memory: vmstash.OutOfMemoryError, also a
    torch.OutOfMemoryError); nothing exits the process.
  * A torch_memory_saver tag maps to a vmstash tag per backup setting (discard, pinned,
    mmap, disk): the first setting seen keeps the name, the others get ":<setting>"
    appended; pause(tag) and resume(tag) act on all of them.
  * Pause copies only PyTorch's live blocks of a region's pool.
  * cuda_graph works in torch mode too: the graph's memory goes to the tag's MemPool.
  * Backups go to vmstash backup stores (vmstash.set_backup_store): cpu_backup_backend
    "pinned" -> "pinned", "mmap" -> "pageable" (its RSS is given back after each resume),
    enable_disk_backup -> "disk" in the disk backup directory (TMS_DISK_BACKUP_DIR or
    set_disk_backup_dir(), default /tmp; read when a tag pauses). The disk file is
    unlinked at creation, so nothing is left in the directory; a missing or full directory
    fails the pause (vmstash.Error NOT_FOUND / OutOfMemoryError) with the tag untouched.
    With whole-process mode the process tag follows TMS_INIT_CPU_BACKUP_BACKEND and
    TMS_INIT_ENABLE_DISK_BACKUP. Each setting of one torch_memory_saver tag is its own
    vmstash tag (see above: ":pinned", ":mmap", ":disk", ":discard").
"""
import contextlib
import ctypes
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


# torch_memory_saver's backup settings and the vmstash backup store of each.
_STORES = {"pinned": "pinned", "mmap": "pageable", "disk": "disk"}


def _default_backend():
    """cpu_backup_backend=None: TMS_INIT_CPU_BACKUP_BACKEND, else pinned."""
    value = os.environ.get("TMS_INIT_CPU_BACKUP_BACKEND", "").strip().lower() or "pinned"
    if value not in ("pinned", "mmap"):
        raise ValueError(f"TMS_INIT_CPU_BACKUP_BACKEND must be 'pinned' or 'mmap', got {value!r}")
    return value


def _if_created(fn, name):
    """fn(name), unless the tag was never declared (torch_memory_saver treats a tag it never
    saw as empty). True when fn ran; its errors (a missing disk directory's NOT_FOUND
    among them) propagate."""
    if _api.policy_of(name) is None:
        return False
    fn(name)
    return True


class _CdllView:
    """What frameworks reach through torch_memory_saver._impl._binary_wrapper.cdll: the
    calling thread's interesting-region flag (whether its CUDA allocations are managed).
    Under the preload library it is the library's per-thread routing override; without
    it, only the thread's region tag."""

    def tms_get_interesting_region(self):
        hooks = _lib.preload_hooks()
        if hooks is not None:
            return bool(hooks.vmstash_preload_routed())
        return _api.current_tag() != "default"

    def tms_set_interesting_region(self, value):
        hooks = _lib.preload_hooks()
        if hooks is not None:
            hooks.vmstash_preload_set_routed(1 if value else 0)
        elif not value:
            _api.set_current_tag("default")


class _BinaryWrapperView:
    def __init__(self):
        self.cdll = _CdllView()


class _ImplView:
    def __init__(self):
        self._binary_wrapper = _BinaryWrapperView()


class TorchMemorySaver:
    """The torch_memory_saver singleton's interface (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._names = {}  # (tms tag, setting) -> vmstash tag; setting: discard | pinned | mmap | disk
        self._stores = {}  # vmstash tag -> the store last set on it (disk: with its directory)
        self._declared = set()  # vmstash tags created with their policy and store
        self._hook_mode = None  # chosen at the first use (see hook_mode)
        self._used = False
        self._margin = 0
        self._retain = _env_flag("TMS_RETAIN_CPU_BACKUP", default=False)
        self._disk_dir = os.environ.get("TMS_DISK_BACKUP_DIR", "/tmp")
        self._impl = None
        self._parked_pools = []  # disable()'s pools made inside regions (see disable)

    def _ensure_initialized(self):
        """Checks the process set-up once (torch_memory_saver does it at the first use):
        whole-process mode needs the preload library and cannot work with PyTorch's
        expandable segments; both are refused with a clear error."""
        if self._impl is not None:
            return
        whole = _env_flag("TMS_INIT_ENABLE")
        if whole and _lib.preloaded_library() is None:
            raise _lib.Error("TMS_INIT_ENABLE=1 (every CUDA allocation of the process managed) needs the process "
                             "started with LD_PRELOAD=<libvmstash_preload.so> (configure_subprocess() does it for "
                             "children); refusing to manage nothing", _lib.FAILED_PRECONDITION)
        if (whole or self.hook_mode == "preload") and \
                "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", ""):
            raise RuntimeError("torch_memory_saver on vmstash: PyTorch's expandable_segments allocates through "
                               "cuMemCreate, which the preload library cannot see; unset expandable_segments:True "
                               "in PYTORCH_CUDA_ALLOC_CONF (torch_memory_saver refuses it too)")
        _default_backend()  # a bad TMS_INIT_CPU_BACKUP_BACKEND fails here, not at a pause
        self._impl = _ImplView()

    # --- configuration ---------------------------------------------------------------
    @property
    def enabled(self):
        return True

    @property
    def hook_mode(self):
        if self._hook_mode is None:
            return "preload" if _lib.preloaded_library() is not None else "torch"
        return self._hook_mode

    @hook_mode.setter
    def hook_mode(self, mode):
        if mode not in ("torch", "preload"):
            raise ValueError(f"hook_mode must be 'torch' or 'preload', got {mode!r}")
        if mode == "preload" and _lib.preloaded_library() is None:
            raise _lib.Error("hook_mode='preload' needs the process started with LD_PRELOAD=<libvmstash_preload.so> "
                             "(vmstash.preload_library_path(); configure_subprocess() does it for children)",
                             _lib.FAILED_PRECONDITION)
        if self._used and mode != self.hook_mode:
            raise _lib.Error("hook_mode must be set before the first region", _lib.FAILED_PRECONDITION)
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
        """Where disk backups of later pauses go (created if needed); process-wide."""
        os.makedirs(path, exist_ok=True)
        self._disk_dir = os.fspath(path)

    # --- tags -------------------------------------------------------------------------
    def _setting(self, enable_cpu_backup, enable_disk_backup, cpu_backup_backend):
        """discard | pinned | mmap | disk, checked as torch_memory_saver checks them."""
        if cpu_backup_backend not in (None, "pinned", "mmap"):
            raise ValueError(f"cpu_backup_backend must be None, 'pinned' or 'mmap', got {cpu_backup_backend!r}")
        if cpu_backup_backend is not None and not enable_cpu_backup:
            raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
        if enable_cpu_backup and enable_disk_backup:
            raise ValueError("enable_cpu_backup and enable_disk_backup are mutually exclusive")
        if enable_disk_backup:
            return "disk"
        if enable_cpu_backup:
            return cpu_backup_backend or _default_backend()
        return "discard"

    def _vmstash_tag(self, tag, setting):
        """The vmstash tag of (tag, setting), declared with its policy and store."""
        policy = "discard" if setting == "discard" else "backup"
        with self._lock:
            name = self._names.get((tag, setting))
            if name is None:
                taken = any(t == tag for (t, _) in self._names)
                name = f"{tag}:{setting}" if taken else tag
                self._names[(tag, setting)] = name
            declared = name in self._declared
        if not declared:  # once, not at every region entry (a failed attempt is retried)
            _api.create_tag(name, policy)
            if policy == "backup":
                self._apply_store(name, setting)
            with self._lock:
                self._declared.add(name)
        return name, policy

    def _apply_store(self, name, setting):
        """Sets the vmstash store of `name` for `setting` unless it is already that (disk:
        in the present disk backup directory). Not while `name` is paused (a paused tag
        keeps the store its bytes are in; the next pause uses the new one)."""
        store = _STORES[setting]
        directory = self._disk_dir if store == "disk" else None
        if self._stores.get(name) == (store, directory):
            return
        _api.set_backup_store(name, store, directory)
        self._stores[name] = (store, directory)

    def _process_setting(self):
        """The whole-process tag's setting (TMS_INIT_* variables), or None for discard."""
        if _env_flag("TMS_INIT_ENABLE_DISK_BACKUP"):
            return "disk"
        if _env_flag("TMS_INIT_ENABLE_CPU_BACKUP") or _env_flag("VMSTASH_PRELOAD_BACKUP"):
            return _default_backend()
        return None

    def _targets(self, tag):
        """(vmstash tag, setting) for `tag`, or for every tag when None."""
        with self._lock:
            out = [(name, setting) for (t, setting), name in self._names.items() if tag is None or t == tag]
        # Whole-process mode: what threads allocated outside regions (torch_memory_saver's
        # implicit tag "default").
        hooks = _lib.preload_hooks()
        process = hooks.vmstash_preload_process_tag() if hooks is not None else None
        if process is not None and (tag is None or tag == "default"):
            name = process.decode()
            policy = _api.policy_of(name)  # None until the first captured allocation
            if policy is not None and all(n != name for n, _ in out):
                out.append((name, (self._process_setting() or "pinned") if policy == "backup" else "discard"))
        return out

    # --- regions and graphs -----------------------------------------------------------
    @contextlib.contextmanager
    def region(self, tag="default", enable_cpu_backup=False, enable_disk_backup=False, cpu_backup_backend=None):
        setting = self._setting(enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
        self._ensure_initialized()
        name, policy = self._vmstash_tag(tag, setting)
        self._used = True
        with _torch.region(name, policy):
            yield

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global", tag="default",
                   enable_cpu_backup=False, cpu_backup_backend=None):
        setting = self._setting(enable_cpu_backup, False, cpu_backup_backend)
        self._ensure_initialized()
        name, policy = self._vmstash_tag(tag, setting)
        self._used = True
        kwargs = {"capture_error_mode": capture_error_mode}
        if stream is not None:
            kwargs["stream"] = stream
        with _torch.cuda_graph(cuda_graph, tag=name, policy=policy, **kwargs):
            yield

    @contextlib.contextmanager
    def disable(self):
        """Allocations of this thread inside go to CUDA, not vmstash (also in whole-process
        mode, inside a region, and while managed memory is paused), through a throw-away
        PyTorch pool given back on exit. Note [Throw-Away Pools]: PyTorch asserts (and
        aborts the process) when a MemPool is destroyed while a pool context is active on
        the device, so while a region is open (in any thread) the pool is parked and given
        back at the next exit of disable() with none open. A pool context of the program's
        own (torch.cuda.use_mem_pool, a graph capture) in another thread is not seen."""
        import torch
        self._ensure_initialized()
        previous = _api.current_tag()
        hooks = _lib.preload_hooks()
        override = hooks.vmstash_preload_set_routed(0) if hooks is not None else None
        _api.set_current_tag("default")
        pool = torch.cuda.MemPool()
        try:
            with torch.cuda.use_mem_pool(pool):
                yield
        finally:
            _api.set_current_tag(previous)
            if hooks is not None:
                hooks.vmstash_preload_set_routed(override)
            with self._lock:
                self._parked_pools.append(pool)
                if _torch.open_regions() == 0:
                    self._parked_pools.clear()  # no region's pool context is active
            del pool

    # --- pause / resume ----------------------------------------------------------------
    def pause(self, tag=None):
        self._ensure_initialized()
        for name, setting in self._targets(tag):
            if setting != "discard":
                try:
                    self._apply_store(name, setting)  # the disk directory may have changed
                except Error as e:
                    if e.code_name != "FAILED_PRECONDITION":  # already paused: the pause is a no-op
                        raise
            _if_created(_api.pause, name)

    def resume(self, tag=None):
        self._ensure_initialized()
        for name, setting in self._targets(tag):
            if _if_created(_api.resume, name) and setting != "discard" and not self._retain:
                _api.release_backup(name)

    def get_cpu_backup(self, x, zero_copy=False):
        """What the pause saved for tensor `x` (contiguous) as a CPU tensor, or None when
        `x` is not paused with a backup. zero_copy=True views the backup itself (valid
        until the resume; no copy), False returns a copy."""
        import torch
        self._ensure_initialized()
        if not x.is_contiguous():
            raise ValueError("get_cpu_backup needs a contiguous tensor")
        nbytes = x.numel() * x.element_size()
        device = x.device.index if x.device.index is not None else torch.cuda.current_device()
        out = ctypes.c_void_p()
        code = _lib.lib().vmstash_backup_address(x.data_ptr(), nbytes, device, ctypes.byref(out))
        if code == _lib.NOT_FOUND:
            return None
        _lib.check(code, "get_cpu_backup")
        address = out.value
        if nbytes == 0:
            return torch.empty(x.shape, dtype=x.dtype, device="cpu")
        raw = (ctypes.c_uint8 * nbytes).from_address(address)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "non-writable buffer": it is writable
            view = torch.frombuffer(raw, dtype=torch.uint8).view(x.dtype).view(x.shape)
        return view if zero_copy else view.clone()


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
