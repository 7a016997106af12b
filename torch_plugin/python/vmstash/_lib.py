"""ctypes binding of libvmstash.so (torch_plugin/include/vmstash/vmstash.h).

Only control calls go through Python: tensors are allocated and freed by PyTorch calling
the library's C entry points directly. Every call that fails raises vmstash.Error (or
vmstash.OutOfMemoryError) with the library's message and code (vmstash._codes, the C
table's copy); nothing here exits the process.

The library is libvmstash_preload.so when LD_PRELOAD names it (it carries the C ABI too),
else VMSTASH_LIBRARY, else the copy next to this package (pip install puts it in
vmstash/lib/).
"""
import ctypes
import json
import os
import threading

from . import _codes
from ._codes import (ABORTED, FAILED_PRECONDITION, INTERNAL, INVALID_ARGUMENT, NOOP, NOT_FOUND,  # noqa: F401
                     OK, RESOURCE_EXHAUSTED, UNAVAILABLE, UNIMPLEMENTED, UNKNOWN)


def _oom_base():
    try:
        import torch  # noqa: F401  (only for the exception type)
        return torch.OutOfMemoryError
    except Exception:  # torch absent (CPU-only installs, CI): a plain MemoryError
        return MemoryError


class Error(RuntimeError):
    """A vmstash call failed. `code` is the absl::StatusCode number, `code_name` its name.
    `done` is True when the transition it reports is done nonetheless (every tag in its
    requested state on every device; only after-resume hooks failed), False when the call
    changed nothing or failed otherwise (Note [All-or-Nothing Transitions])."""

    def __init__(self, message, code=UNKNOWN, done=False):
        super().__init__(message)
        self.code = code
        self.code_name = _codes.name_of(code)
        self.done = done


class OutOfMemoryError(Error, _oom_base()):
    """Device (or pinned host) memory ran out: RESOURCE_EXHAUSTED. Also a torch.OutOfMemoryError."""


def error(message, code, done=False):
    """The exception for a failed call's code (Python's mapping of the C codes, one place):
    OutOfMemoryError for RESOURCE_EXHAUSTED, else Error."""
    if code == RESOURCE_EXHAUSTED:
        return OutOfMemoryError(message, code, done)
    return Error(message, code, done)


def preloaded_library():
    """The libvmstash_preload.so named in LD_PRELOAD, or None. When the process runs with
    it, it is also the C ABI library (one vmstash runtime per process)."""
    for entry in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        base = os.path.basename(entry)
        if base.startswith("libvmstash_preload"):
            return entry
        # The torch_memory_saver drop-in installs it under torch_memory_saver's names.
        if base.startswith("torch_memory_saver_hook_mode_preload") and _is_vmstash_preload(entry):
            return entry
    return None


def _is_vmstash_preload(path):
    """Whether `path` is loaded (never loading it: a late dlopen would run its constructors)
    and is vmstash's preload library."""
    try:
        return hasattr(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY), "vmstash_preload_routed")
    except OSError:
        return False


def preload_hooks():
    """The preload library's routing calls (vmstash_preload_*), or None when the process
    was not started with it."""
    if preloaded_library() is None:
        return None
    l = lib()
    return l if hasattr(l, "vmstash_preload_routed") else None  # prototypes: _declare


def preload_library_path():
    """Where libvmstash_preload.so is (for LD_PRELOAD of child processes)."""
    env = os.environ.get("VMSTASH_PRELOAD_LIBRARY")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    candidate = os.path.join(here, "lib", "libvmstash_preload.so")
    if os.path.exists(candidate):
        return candidate
    raise Error("libvmstash_preload.so not found: install the package (pip install .) or set "
                "VMSTASH_PRELOAD_LIBRARY", NOT_FOUND)


def library_path():
    preloaded = preloaded_library()
    if preloaded:
        return preloaded
    env = os.environ.get("VMSTASH_LIBRARY")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(here, "lib", "libvmstash.so"), os.path.join(here, "libvmstash.so")):
        if os.path.exists(candidate):
            return candidate
    raise Error("libvmstash.so not found: install the package (pip install .) or set VMSTASH_LIBRARY", NOT_FOUND)


_lock = threading.Lock()
_lib = None


def lib():
    """The loaded library with its prototypes (loaded once)."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            path = library_path()
            try:
                handle = ctypes.CDLL(path)
            except OSError as e:
                raise Error(f"cannot load {path}: {e}", UNAVAILABLE) from e
            _declare(handle)
            _lib = handle
    return _lib


class LiveRanges(ctypes.Structure):
    """vmstash_live_ranges (vmstash.h): a tag's live byte ranges on one device (an outgoing tag
    of vmstash_switch, the paused tag of vmstash_pause_live_devices)."""
    _fields_ = [("tag", ctypes.c_char_p), ("device", ctypes.c_int), ("starts", ctypes.POINTER(ctypes.c_uint64)),
                ("sizes", ctypes.POINTER(ctypes.c_uint64)), ("n", ctypes.c_size_t)]


# vmstash_agree_fn (vmstash.h): (ctx, local_code, local_message, reason, reason_size) -> 0 to commit.
AGREE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p,
                            ctypes.c_size_t)


def _declare(l):
    c_char_p, c_int, c_size_t, c_void_p = ctypes.c_char_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p
    u64p = ctypes.POINTER(ctypes.c_uint64)
    protos = {
        "vmstash_init": (c_int, [c_char_p]),
        "vmstash_is_initialized": (c_int, []),
        "vmstash_version": (c_char_p, []),
        "vmstash_malloc": (c_void_p, [c_size_t, c_int, c_void_p]),
        "vmstash_free": (None, [c_void_p, c_size_t, c_int, c_void_p]),
        "vmstash_owner_device": (c_int, [c_void_p]),
        "vmstash_create_tag": (c_int, [c_char_p, c_char_p]),
        "vmstash_set_current_tag": (c_int, [c_char_p]),
        "vmstash_tag_policy": (c_char_p, [c_char_p]),
        "vmstash_tags_json": (c_void_p, []),
        "vmstash_get_current_tag": (c_char_p, []),
        "vmstash_bind_tag_slot": (c_int, [c_char_p]),
        "vmstash_pause": (c_int, [c_char_p, c_int]),
        "vmstash_pause_live": (c_int, [c_char_p, c_int, u64p, u64p, c_size_t]),
        "vmstash_pause_live_devices": (c_int, [c_char_p, c_int, ctypes.POINTER(LiveRanges), c_size_t]),
        "vmstash_resume": (c_int, [c_char_p, c_int]),
        "vmstash_switch": (c_int, [ctypes.POINTER(c_char_p), c_size_t, ctypes.POINTER(c_char_p), c_size_t, c_int,
                                   ctypes.POINTER(LiveRanges), c_size_t]),
        "vmstash_switch_agreed": (c_int, [ctypes.POINTER(c_char_p), c_size_t, ctypes.POINTER(c_char_p), c_size_t,
                                          c_int, ctypes.POINTER(LiveRanges), c_size_t, AGREE_FN, c_void_p]),
        "vmstash_read_backup": (c_int, [c_void_p, c_size_t, c_int, c_void_p]),
        "vmstash_backup_address": (c_int, [c_void_p, c_size_t, c_int, ctypes.POINTER(c_void_p)]),
        "vmstash_set_memory_margin": (c_int, [c_size_t]),
        "vmstash_prepare": (c_int, [c_char_p, c_int, c_size_t]),
        "vmstash_release_backup": (c_int, [c_char_p, c_int]),
        "vmstash_set_backup_store": (c_int, [c_char_p, c_char_p, c_char_p]),
        "vmstash_set_prepare_ahead": (c_int, [c_char_p, c_int]),
        "vmstash_backup_store": (c_void_p, [c_char_p]),
        "vmstash_empty_cache": (c_int, [c_int, c_char_p]),
        "vmstash_stats_json": (c_void_p, [c_int]),
        "vmstash_node_connect": (c_int, [c_int]),
        "vmstash_node_stats_json": (c_void_p, []),
        "vmstash_node_switch": (c_int, [c_char_p, c_char_p, c_int, c_int, ctypes.POINTER(c_void_p)]),
        "vmstash_share_tag": (c_int, [c_char_p, c_char_p, c_char_p, ctypes.POINTER(ctypes.c_ulonglong)]),
        "vmstash_unshare_tag": (c_int, [c_char_p]),
        "vmstash_map_tag": (c_int, [c_int, c_char_p, c_int, c_int, ctypes.POINTER(ctypes.c_ulonglong)]),
        "vmstash_mapped_acquire": (c_int, [ctypes.c_ulonglong]),
        "vmstash_mapped_acquire_any": (c_int, [ctypes.c_ulonglong, c_int, ctypes.POINTER(c_int),
                                               ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_ulonglong)]),
        "vmstash_mapped_release": (c_int, [ctypes.c_ulonglong]),
        "vmstash_mapped_local": (c_int, [ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_ulonglong,
                                         ctypes.POINTER(ctypes.c_ulonglong)]),
        "vmstash_mapped_check": (c_int, [ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_ulonglong),
                                         ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_ulonglong),
                                         c_size_t]),
        "vmstash_mapped_locals": (c_int, [ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_ulonglong),
                                          ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_ulonglong),
                                          c_size_t]),
        "vmstash_mapped_write_backup": (c_int, [ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_ulonglong),
                                                ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_ulonglong),
                                                c_size_t, c_void_p]),
        "vmstash_mapped_state": (c_int, [ctypes.c_ulonglong, ctypes.POINTER(c_int), ctypes.POINTER(ctypes.c_ulonglong)]),
        "vmstash_mapped_info_json": (c_void_p, [ctypes.c_ulonglong]),
        "vmstash_mapped_index_json": (c_void_p, [ctypes.c_ulonglong]),
        "vmstash_mapped_close": (c_int, [ctypes.c_ulonglong]),
        "vmstash_snapshot_json": (c_void_p, [c_int]),
        "vmstash_string_free": (None, [c_void_p]),
        "vmstash_last_error": (c_char_p, []),
        "vmstash_last_error_done": (c_int, []),
        "vmstash_last_error_code": (c_int, []),
        "vmstash_code_name": (c_char_p, [c_int]),
        # torch_memory_saver's layer (vmstash_tms.h): what vmstash.compat.torch_memory_saver calls.
        "vmstash_tms_tag": (c_char_p, [c_char_p, c_char_p]),
        "vmstash_tms_targets": (c_int, [c_char_p, ctypes.POINTER(c_char_p), c_size_t, ctypes.POINTER(c_size_t)]),
        "vmstash_tms_check_env": (c_int, []),
        "vmstash_tms_whole_process": (c_int, []),
        "vmstash_tms_process_tag": (c_char_p, []),
        "vmstash_tms_pause": (c_int, [c_char_p, ctypes.POINTER(LiveRanges), c_size_t]),
        "vmstash_tms_push_region": (c_int, [c_char_p, c_int, c_char_p, c_int]),
        "vmstash_tms_pop_region": (c_int, []),
        "vmstash_tms_set_interesting": (c_int, [c_int]),
        "tms_resume": (c_int, [c_char_p]),
        "tms_get_interesting_region": (ctypes.c_bool, []),
        "tms_get_cpu_backup_backend": (c_char_p, []),
        "tms_get_retain_cpu_backup": (ctypes.c_bool, []),
        "tms_set_retain_cpu_backup": (None, [ctypes.c_bool]),
        "tms_set_disk_backup_dir": (None, [c_char_p]),
    }
    missing = [name for name in protos if getattr(l, name, None) is None]
    if missing:  # e.g. VMSTASH_LIBRARY naming a build older than this package
        raise Error(f"the vmstash library {l._name} lacks {', '.join(missing)}: it does not match this "
                    "Python package (rebuild it, or unset VMSTASH_LIBRARY to use the package's own)",
                    FAILED_PRECONDITION)
    for name, (restype, argtypes) in protos.items():
        fn = getattr(l, name)
        fn.restype = restype
        fn.argtypes = argtypes
    # Optional entry points: the paged stash (vmstash_stash.h; absent from
    # libvmstash_preload.so and from builds without the CUDA kernels, vmstash.stash reports
    # that when used) and the preload library's routing calls (only there).
    vpp, u64, c_uint32, i64p = ctypes.POINTER(c_void_p), ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p
    stash_protos = {
        "vmstash_stash_create": (c_int, [c_int, c_char_p, u64, c_uint32, vpp]),
        "vmstash_stash_prepare": (c_int, [c_void_p, u64, u64, c_void_p]),
        "vmstash_stash_destroy": (c_int, [c_void_p]),
        "vmstash_stash_new_handle": (c_int, [c_void_p, u64, vpp]),
        "vmstash_stash_free_handle": (c_int, [c_void_p, c_void_p]),
        "vmstash_stash_reset": (c_int, [c_void_p, c_void_p]),
        "vmstash_stash_link_flags": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p]),
        "vmstash_stash_set_launch_shape": (c_int, [c_uint32, c_uint32, c_uint32]),
        "vmstash_stash_stash": (c_int, [c_void_p, c_void_p, c_void_p, i64p, u64, c_void_p]),
        "vmstash_stash_restore": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p, u64, c_int]),
        "vmstash_stash_discard": (c_int, [c_void_p, c_void_p, c_void_p, u64]),
        "vmstash_stash_write_flags": (c_int, [c_void_p, c_void_p, c_void_p]),
        "vmstash_stash_read_flags": (c_int, [c_void_p, c_void_p, c_void_p]),
        "vmstash_stash_pages_in_use": (c_int, [c_void_p, u64p]),
        "vmstash_stash_info": (c_int, [c_void_p, u64p, ctypes.POINTER(c_char_p)]),
    }
    # The preload library's routing calls (only in libvmstash_preload.so).
    stash_protos.update({
        "vmstash_preload_set_routed": (c_int, [c_int]),
        "vmstash_preload_routed": (c_int, []),
        "vmstash_preload_process_tag": (c_char_p, []),
    })
    for name, (restype, argtypes) in stash_protos.items():
        fn = getattr(l, name, None)
        if fn is not None:
            fn.restype = restype
            fn.argtypes = argtypes


def last_error():
    msg = lib().vmstash_last_error()
    return msg.decode(errors="replace") if msg else ""


def last_failure(what):
    """The exception for this thread's last failed call, for a call that returns NULL or -1
    instead of a code: its code (vmstash_last_error_code), message and done flag."""
    l = lib()
    code = l.vmstash_last_error_code()
    if code == OK:  # the call did not fail through the C ABI's error convention
        code = UNKNOWN
    return error(f"{what}: {last_error()}", code, done=bool(l.vmstash_last_error_done()))


def raise_for(code, what):
    """Raises for a failed call; returns True when done, False for VMSTASH_NOOP."""
    if code == OK:
        return True
    if code == NOOP:
        return False
    raise error(f"{what}: {last_error()}", code, done=bool(lib().vmstash_last_error_done()))


def check(code, what):
    raise_for(code, what)


def string_call(fn, arg, what):
    """The string fn(arg) returns, freed after reading."""
    raw = fn(arg)
    if not raw:
        raise last_failure(what)
    try:
        return ctypes.string_at(raw).decode()
    finally:
        lib().vmstash_string_free(raw)


def json_call(fn, device, what):
    """The JSON document fn(device) returns (fn(), device None), freed after reading."""
    raw = fn() if device is None else fn(device)
    if not raw:
        raise last_failure(what)
    try:
        return json.loads(ctypes.string_at(raw).decode())
    finally:
        lib().vmstash_string_free(raw)


def encode(s, what="tag"):
    if not isinstance(s, str):
        raise TypeError(f"{what} must be a str, got {type(s).__name__}")
    return s.encode()
