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

The state lives in the C library, as in torch_memory_saver: its tms_* entry points
(torch_plugin/include/vmstash/vmstash_tms.h) hold each thread's config (region() sets it,
readable through `_impl._binary_wrapper.cdll.tms_get_*`), the tag names, the disk
directory and retain_cpu_backup; tms_pause / tms_resume from C (ctypes.CDLL(None) in a
preloaded process) act on the same tags as pause() / resume() here. `_impl` has what
torch_memory_saver's own tests reach: `_binary_wrapper.cdll` (a ctypes library with the
tms_* prototypes; other names, e.g. cudaHostGetFlags, come from the CUDA runtime loaded in
the process), `_mem_pools` (keys (tag, enable_cpu_backup, enable_disk_backup, backend,
device); pop() hands the region's MemPool over, so that dropping it frees its memory) and
`_with_region_config(...)`.

What differs, on purpose:
  * Errors raise vmstash.Error (out of memory: vmstash.OutOfMemoryError, also a
    torch.OutOfMemoryError); nothing exits the process. Pausing a paused tag or resuming
    an active one does nothing.
  * A torch_memory_saver tag maps to a vmstash tag per backup setting (discard, pinned,
    mmap, disk): the first setting seen keeps the name, the others get ":<setting>"
    appended; pause(tag) and resume(tag) act on all of them (Note [TMS Tags]).
  * Pause copies only PyTorch's live blocks of a region's pool.
  * cuda_graph works in torch mode too: the graph's memory goes to a MemPool of the tag,
    chosen as torch.cuda.graph(pool=...) chooses (vmstash._torch.graph_pool): graphs given
    one pool (torch.cuda.graph_pool_handle(), an earlier graph's pool()) share it, a graph
    given none has one of its own (an idle one reused); either way its memory is the tag's.
    The capture goes to that vmstash pool's id, not to the id given: memory routed to the
    given id by other means (pynccl's set_graph_pool_id, a user's own MemPool) is not the
    tag's.
  * Backups go to vmstash backup stores (vmstash.set_backup_store): cpu_backup_backend
    "pinned" -> "pinned", "mmap" -> "pageable", enable_disk_backup -> "disk_files" in the
    disk backup directory (TMS_DISK_BACKUP_DIR or set_disk_backup_dir(), default /tmp;
    read when a tag pauses). A backup is one host arena per vmstash tag and device, not
    one buffer per allocation: get_cpu_backup's pointers lie inside it.
  * retain_cpu_backup=True: a resume keeps the backup readable (get_cpu_backup, zero_copy
    included, at the same address; the next pause of the tag reuses it in place); the
    backup is given back at a resume with retain_cpu_backup False (its host memory
    handed back to the OS, the address range kept for the next pause), or when the tag's last
    backed-up block is freed (torch_memory_saver: each allocation's own), or when the tag
    grows so that an explicit vmstash.prepare replaces its arena.
  * Disk: while paused, one visible file per backed-up allocation (vmstash-tms-<pid>-...,
    as torch_memory_saver's layout), removed at the resume (torch_memory_saver keeps them
    until the allocation is freed), after a failed pause, and at exit; files of dead
    processes are swept at the next pause into the directory. A missing or full directory
    fails the pause (vmstash.Error NOT_FOUND / OutOfMemoryError) with the tag untouched.
    get_cpu_backup also works for a disk backup while paused (it views the files'
    mapping; torch_memory_saver returns None).
  * memory_margin_bytes and hook_mode can be read (torch_memory_saver raises).
"""
import atexit
import contextlib
import ctypes
import os
import sys
import threading
import warnings

from .. import _alloc_conf, _api, _lib, _torch
from .._lib import Error

__all__ = ["torch_memory_saver", "configure_subprocess", "TorchMemorySaver"]


def _check_env_backend():
    """A bad TMS_INIT_CPU_BACKUP_BACKEND is a ValueError at the first use, not at a pause
    (torch_memory_saver's variables are read once, by the C library: tms_env.h)."""
    if _lib.lib().vmstash_tms_check_env() != 0:
        raise ValueError(_lib.lib().vmstash_last_error().decode().removeprefix("INVALID_ARGUMENT: "))


def _tag_arg(tag):
    """torch_memory_saver's rule: an empty or None tag means every tag."""
    return _lib.encode(tag) if tag else None


# --- What torch_memory_saver's tests reach under _impl --------------------------------------

# torch_memory_saver's prototypes of its entry points (vmstash_tms.h).
_B, _P, _I, _U8P = ctypes.c_bool, ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_uint8)
_TMS_PROTOTYPES = {
    "tms_set_current_tag": (None, [_P]), "tms_get_current_tag": (_P, []),
    "tms_set_interesting_region": (None, [_B]), "tms_get_interesting_region": (_B, []),
    "tms_set_enable_cpu_backup": (None, [_B]), "tms_get_enable_cpu_backup": (_B, []),
    "tms_set_cpu_backup_backend": (None, [_P]), "tms_get_cpu_backup_backend": (_P, []),
    "tms_set_enable_disk_backup": (None, [_B]), "tms_get_enable_disk_backup": (_B, []),
    "tms_set_disk_backup_dir": (None, [_P]),
    "tms_pause": (_I, [_P]), "tms_resume": (_I, [_P]),
    "set_memory_margin_bytes": (None, [ctypes.c_uint64]),
    "tms_set_retain_cpu_backup": (None, [_B]), "tms_get_retain_cpu_backup": (_B, []),
    "tms_get_cpu_backup_pointer": (_U8P, [_U8P, ctypes.c_uint64]),
}


def _cuda_runtime():
    """The CUDA runtime library loaded in this process (torch's libcudart), else the global
    scope; for names the vmstash library does not export."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        paths = set()
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return ctypes.CDLL(None)


class _TmsCdll(ctypes.CDLL):
    """torch_memory_saver's `cdll`: the library carrying vmstash's C ABI (the preload library
    when the process runs under it, else libvmstash.so) as a ctypes handle of its own, its
    tms_* functions with torch_memory_saver's prototypes. A name it does not export comes
    from the CUDA runtime in the process (torch_memory_saver's library links it)."""

    def __init__(self, path):
        super().__init__(path)
        for name, (restype, argtypes) in _TMS_PROTOTYPES.items():
            fn = getattr(self, name)
            fn.restype, fn.argtypes = restype, argtypes

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__") and name.endswith("__"):
                raise
        fn = getattr(_cuda_runtime(), name)  # AttributeError when the runtime lacks it too
        setattr(self, name, fn)
        return fn


class _BinaryWrapperView:
    def __init__(self):
        self.cdll = _TmsCdll(_lib.library_path())


class _MemPools:
    """torch_memory_saver's _impl._mem_pools over vmstash's region pools (vmstash._torch):
    a key (tag, enable_cpu_backup, enable_disk_backup, resolved backend or "", device)
    names the MemPool of the tag's vmstash tag on that device."""

    def __init__(self, saver):
        self._saver = saver

    def _where(self, key):
        tag, cpu, disk, backend, device = key
        setting = self._saver._setting(bool(cpu), bool(disk), backend or None)
        name, policy = self._saver._vmstash_tag(tag, setting)
        return name, policy, device

    def __getitem__(self, key):
        name, policy, device = self._where(key)
        return _torch.pool(name, policy, device)

    def __contains__(self, key):
        name, _, device = self._where(key)
        return device in _torch.pool_devices(name)

    def get(self, key, default=None):
        return self[key] if key in self else default

    def pop(self, key, *default):
        name, _, device = self._where(key)
        found = _torch.take_pool(name, device)
        if found is not None:
            return found
        if default:
            return default[0]
        raise KeyError(key)


class _Impl:
    def __init__(self, saver):
        self._binary_wrapper = _BinaryWrapperView()
        self._mem_pools = _MemPools(saver)
        self._hook_mode = saver.hook_mode
        self._is_xpu = False

    @contextlib.contextmanager
    def _with_region_config(self, tag, enable_cpu_backup, cpu_backup_backend, enable_disk_backup=False):
        """The calling thread's torch_memory_saver config for a region (C, per thread),
        put back exactly on exit."""
        l = _lib.lib()
        backend = None if cpu_backup_backend is None else _lib.encode(cpu_backup_backend, "cpu_backup_backend")
        _lib.check(l.vmstash_tms_push_region(_lib.encode(tag), int(bool(enable_cpu_backup)), backend,
                                             int(bool(enable_disk_backup))), f"region config ({tag!r})")
        try:
            yield
        finally:
            _lib.check(l.vmstash_tms_pop_region(), f"region config ({tag!r}) exit")


# --- Expandable segments in whole-process mode (vmstash/_alloc_conf.py) ----------------------

def _torch_segments():
    """PyTorch's memory snapshot's segments, or [] when PyTorch has not made a CUDA context
    (then it holds no device memory)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return []
    return torch.cuda.memory_snapshot()


_HOOK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p)
_REGISTER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, _HOOK, _HOOK, ctypes.c_void_p)
_guard = []  # the process tag's before-pause callback, never freed (see _guard_process_tag)
_guard_lock = threading.Lock()
_checked = threading.local()  # set while pause() runs, which checked already
_exiting = []  # set at exit: the guard lets every pause through from then on


def _guard_process_tag():
    """Every pause of the process tag, from any caller (tms_pause from C, vmstash.pause, a
    switch), is vetoed while PyTorch's expandable segments hold live tensors on that device:
    the refusal goes to stderr (the caller's error says a hook vetoed it). pause() here checks
    first and says so in its own error. Registered once the preload library has made its
    process tag (registering hooks for a tag with no pool yet would make it, with policy
    discard): tried at the first use and at each pause() until then. The callback is never
    freed (a pause from the control thread may come during the interpreter's exit)."""
    if _guard:
        return
    with _guard_lock:
        if _guard:
            return
        l = _lib.lib()
        name = l.vmstash_tms_process_tag()
        if not name or _api.policy_of(name.decode()) is None:
            return

        def before_pause(tag, device, user):
            if _exiting or getattr(_checked, "done", False):
                return 0
            try:
                segments = [s for s in _torch_segments() if device < 0 or s.get("device") == device]
                refusal = _alloc_conf.pause_refusal(segments)
            except Exception as e:  # noqa: BLE001 - a guard that cannot look never blocks a pause
                sys.stderr.write(f"vmstash: could not check PyTorch's expandable segments before a pause: {e}\n")
                return 0
            if refusal is None:
                return 0
            sys.stderr.write(refusal + "\n")
            return 1

        callback = _HOOK(before_pause)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(callback))  # kept past the module's teardown
        register = _REGISTER(("vmstash_register_hooks", l))
        _lib.check(register(name, callback, _HOOK(), None), "the process tag's expandable-segments guard")
        _guard.append(callback)
        atexit.register(_exiting.append, True)


# --- The singleton's class --------------------------------------------------------------------

class TorchMemorySaver:
    """The torch_memory_saver singleton's interface (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._hook_mode = None  # chosen at the first use (see hook_mode)
        self._used = False
        self._margin = 0
        self._impl = None
        self._parked_pools = []  # disable()'s pools made inside regions (see disable)

    def _ensure_initialized(self):
        """Checks the process set-up once (torch_memory_saver does it at the first use):
        whole-process mode needs the preload library and cannot pause PyTorch's expandable
        segments (vmstash/_alloc_conf.py); both are refused with a clear error. Regions,
        graphs and disable() work with expandable segments on, in either hook mode: their
        pools have vmstash's allocator, for which PyTorch turns expandable segments off."""
        if self._impl is not None:
            return
        whole = _lib.lib().vmstash_tms_whole_process() == 1
        if whole and _lib.preloaded_library() is None:
            raise _lib.Error("TMS_INIT_ENABLE=1 (every CUDA allocation of the process managed) needs the process "
                             "started with LD_PRELOAD=<libvmstash_preload.so> (configure_subprocess() does it for "
                             "children); refusing to manage nothing", _lib.FAILED_PRECONDITION)
        refusal = _alloc_conf.whole_process_refusal(os.environ) if whole else None
        if refusal is not None:
            raise RuntimeError(refusal)
        _check_env_backend()
        if whole:
            _guard_process_tag()
        self._impl = _Impl(self)

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
        """Process-wide, in the C library (tms_get_retain_cpu_backup; TMS_RETAIN_CPU_BACKUP)."""
        return bool(_lib.lib().tms_get_retain_cpu_backup())

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value):
        _lib.lib().tms_set_retain_cpu_backup(bool(value))

    def set_disk_backup_dir(self, path):
        """Where disk backups of later pauses go (created if needed); process-wide."""
        os.makedirs(path, exist_ok=True)
        _lib.lib().tms_set_disk_backup_dir(_lib.encode(os.fspath(path), "path"))

    # --- tags -------------------------------------------------------------------------
    def _setting(self, enable_cpu_backup, enable_disk_backup, cpu_backup_backend):
        """discard | pinned | mmap | disk, checked as torch_memory_saver checks them; with
        no backend, the calling thread's (tms_get_cpu_backup_backend: an enclosing region's,
        else TMS_INIT_CPU_BACKUP_BACKEND)."""
        if cpu_backup_backend not in (None, "pinned", "mmap"):
            raise ValueError(f"cpu_backup_backend must be None, 'pinned' or 'mmap', got {cpu_backup_backend!r}")
        if cpu_backup_backend is not None and not enable_cpu_backup:
            raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
        if enable_cpu_backup and enable_disk_backup:
            raise ValueError("enable_cpu_backup and enable_disk_backup are mutually exclusive")
        if enable_disk_backup:
            return "disk"
        if enable_cpu_backup:
            return cpu_backup_backend or _lib.lib().tms_get_cpu_backup_backend().decode()
        return "discard"

    def _vmstash_tag(self, tag, setting):
        """(vmstash tag, policy) of (tag, setting), declared with its policy and store
        (Note [TMS Tags], in the C library: one naming for C and Python callers)."""
        name = _lib.lib().vmstash_tms_tag(_lib.encode(tag), setting.encode())
        if name is None:
            raise _lib.last_failure(f"torch_memory_saver tag {tag!r} ({setting})")
        return name.decode(), "discard" if setting == "discard" else "backup"

    def _targets(self, tag):
        """The vmstash tags that pause(tag) acts on (tag None: every one)."""
        capacity = 16
        while True:
            names = (ctypes.c_char_p * capacity)()
            count = ctypes.c_size_t(0)
            _lib.check(_lib.lib().vmstash_tms_targets(_tag_arg(tag), names, capacity, ctypes.byref(count)),
                       "torch_memory_saver targets")
            if count.value <= capacity:  # else a tag was added meanwhile: again, with room
                return [names[i].decode() for i in range(count.value)]
            capacity = count.value + 16

    # --- regions and graphs -----------------------------------------------------------
    @contextlib.contextmanager
    def region(self, tag="default", enable_cpu_backup=False, enable_disk_backup=False, cpu_backup_backend=None):
        setting = self._setting(enable_cpu_backup, enable_disk_backup, cpu_backup_backend)
        self._ensure_initialized()
        name, policy = self._vmstash_tag(tag, setting)
        self._used = True
        with _torch.region(name, policy), \
                self._impl._with_region_config(tag, enable_cpu_backup, cpu_backup_backend, enable_disk_backup):
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
        # torch.cuda.graph's pool= semantics inside the tag (the module's docstring), on the
        # device the capture runs on.
        device = stream.device if stream is not None else None
        mem_pool = _torch.graph_pool(name, policy, device=device, share=pool, graph=cuda_graph)
        with _torch.cuda_graph(cuda_graph, tag=name, policy=policy, device=device, mem_pool=mem_pool, **kwargs), \
                self._impl._with_region_config(tag, enable_cpu_backup, cpu_backup_backend):
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
        l = _lib.lib()
        override = l.vmstash_tms_set_interesting(0)  # tms_get_interesting_region() is False inside
        _api.set_current_tag("default")
        pool = torch.cuda.MemPool()
        try:
            with torch.cuda.use_mem_pool(pool):
                yield
        finally:
            _api.set_current_tag(previous)
            l.vmstash_tms_set_interesting(override)
            with self._lock:
                self._parked_pools.append(pool)
                if _torch.open_regions() == 0:
                    self._parked_pools.clear()  # no region's pool context is active
            del pool

    # --- pause / resume ----------------------------------------------------------------
    def pause(self, tag=None):
        """Pauses every vmstash tag of `tag` (None: all), with PyTorch's live blocks of their
        MemPools as liveness hints; on failure every tag is as it was."""
        self._ensure_initialized()
        if not tag or tag == "default":
            self._check_expandable()
        if _lib.lib().vmstash_tms_whole_process() == 1:
            _guard_process_tag()  # once the process tag exists
        targets = [(name, name.encode()) for name in self._targets(tag)]
        _checked.done = True  # the process tag's guard need not look again (_guard_process_tag)
        try:
            with _api._hinted(targets, -1) as (live, n_live):
                _lib.check(_lib.lib().vmstash_tms_pause(_tag_arg(tag), live, n_live), f"pause({tag!r})")
        finally:
            _checked.done = False

    def _check_expandable(self):
        """A whole-process pause refuses while PyTorch's expandable segments (turned on at
        run time, as frameworks do around a training step) hold live tensors it cannot
        pause; their free cached memory only gets a warning (torch.cuda.empty_cache())."""
        if _lib.lib().vmstash_tms_whole_process() != 1:
            return
        segments = _torch_segments()
        refusal = _alloc_conf.pause_refusal(segments)
        if refusal is not None:
            raise _lib.Error(refusal, _lib.FAILED_PRECONDITION)
        reserved = _alloc_conf.expandable_bytes(segments)[1]
        if reserved:
            warnings.warn(f"torch_memory_saver on vmstash: PyTorch's expandable segments keep {reserved >> 20} MiB "
                          f"cached on the device through this pause (whole-process mode cannot pause them); "
                          f"torch.cuda.empty_cache() before the pause gives them back", RuntimeWarning, stacklevel=3)

    def resume(self, tag=None):
        self._ensure_initialized()
        _lib.check(_lib.lib().tms_resume(_tag_arg(tag)), f"resume({tag!r})")

    def get_cpu_backup(self, x, zero_copy=False):
        """What the pause saved for tensor `x` (contiguous) as a CPU tensor, or None when
        `x` has no backup (not paused with one, and none retained). zero_copy=True views
        the backup itself (valid until the resume, or, retained, until the tag's next
        pause or release; no copy), False returns a copy."""
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
        if nbytes == 0:
            return torch.empty(x.shape, dtype=x.dtype, device="cpu")
        raw = (ctypes.c_uint8 * nbytes).from_address(out.value)
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
