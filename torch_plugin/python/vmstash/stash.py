"""vmstash.stash: the paged stash tier from Python (C ABI: vmstash_stash.h).

An Arena holds fixed-size pages (page_rows rows of row_bytes bytes each) on one device,
plus an optional pinned host tier. `stash` copies the first n rows of a [max_rows, ...]
tensor into free pages, where n is read *on the device* from an int64 tensor, so the call
never synchronizes and can be captured in a CUDA graph; `restore` copies them back and
returns the pages. The memory comes from the vmstash allocator under the arena's tag
(policy discard, default "stash"): `vmstash.pause("stash")` releases it when the arena is
idle, and is refused while pages are live.

    arena = vmstash.stash.Arena(row_bytes=hidden * 2, device_pages=4096)
    s = arena.stash(expert_input, rows=tokens_per_expert[e:e + 1])   # forward
    x = s.restore()                                                   # backward

    with vmstash.stash.saved_tensors(arena, max_rows=capacity):       # autograd helper
        y = expert_mlp(x)          # saved [capacity, ...] activations go to the arena

Rules (docs/architecture.md §6):
  - Call `arena.reset()` at the start of every step (inside the captured graph, if any);
    it forgets everything stashed and clears the sticky overflow flag.
  - Check `arena.flags()` (or `write_flags` into a device tensor, capturable) after the
    step: on `overflow` a stash found no room and the step's gradients are wrong; redo or
    skip the step, and give the arena more pages.
  - One stream at a time per arena (torch's current stream of each call); operations on
    two streams concurrently are not supported.
  - Handles (the device page tables) are taken from a per-arena pool and reused; they are
    created outside capture (`reserve_handles` ahead of a capture).
The low-level methods (`stash_ptr`, `restore_ptr`, ...) take raw addresses and need no
torch; the CPU tests use them on the simulated driver.
"""
import contextlib
import ctypes
import threading

from . import _lib
from ._lib import FAILED_PRECONDITION, INVALID_ARGUMENT, OK, UNIMPLEMENTED, Error, check, encode

__all__ = ["Arena", "Stashed", "Flags", "saved_tensors", "set_launch_shape"]

# torch.library custom ops (registered on first use; see Arena.stash_op): torch.compile
# sees vmstash::stash / vmstash::restore as opaque operators with fake (meta) kernels, so
# a compiled function that stashes and restores runs them eagerly, in order, with the
# result it would have eagerly. The token between them is a CPU int64 tensor naming the
# Stashed object on the host (no device read).
_ops_lock = threading.Lock()
_ops_registered = False
_op_arenas = {}
_op_tokens = {}
_op_next = [1]


def _register_ops():
    global _ops_registered
    with _ops_lock:
        if _ops_registered:
            return
        import torch

        @torch.library.custom_op("vmstash::stash", mutates_args=())
        def _stash_op(x: torch.Tensor, rows: torch.Tensor, arena: int) -> torch.Tensor:
            a = _op_arenas.get(arena)
            if a is None:
                raise Error(f"vmstash::stash: arena {arena} is closed", FAILED_PRECONDITION)
            stashed = a.stash(x.contiguous(), a._rows_tensor(rows))
            with _ops_lock:
                key = _op_next[0]
                _op_next[0] += 1
                _op_tokens[key] = stashed
            return torch.tensor([key], dtype=torch.int64)

        @_stash_op.register_fake
        def _(x, rows, arena):
            return torch.empty(1, dtype=torch.int64)

        @torch.library.custom_op("vmstash::restore", mutates_args=())
        def _restore_op(token: torch.Tensor, shape: list[int], dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:
            with _ops_lock:
                stashed = _op_tokens.pop(int(token[0]), None)
            if stashed is None:
                raise Error("vmstash::restore: the token was restored already or never stashed", FAILED_PRECONDITION)
            out = torch.empty(shape, dtype=dtype, device=device)
            return stashed.restore(out=out, zero_tail=True)

        @_restore_op.register_fake
        def _(token, shape, dtype, device):
            return torch.empty(shape, dtype=dtype, device=device)

        _ops_registered = True


def set_launch_shape(max_grid=0, threads=0, units_in_flight=0):
    """Tuning for benchmarks: the most blocks and the threads per block of later
    stash/restore launches (max_grid 0: one wave, the default; threads 0 keeps it), and the
    16-byte units each thread keeps in flight (4, the default, or 8; 0 keeps it). Graphs keep the shape they were captured with."""
    check(_fn("vmstash_stash_set_launch_shape")(ctypes.c_uint32(max_grid), ctypes.c_uint32(threads),
                                                 ctypes.c_uint32(units_in_flight)),
          f"vmstash.stash.set_launch_shape({max_grid}, {threads}, {units_in_flight})")


class _CFlags(ctypes.Structure):
    _fields_ = [("overflow", ctypes.c_uint32), ("host_spill", ctypes.c_uint32),
                ("peak_pages", ctypes.c_uint64 * 2), ("overflow_count", ctypes.c_uint64),
                ("last_failed_pages", ctypes.c_uint64)]


class Flags:
    """The arena's flags: overflow (sticky until reset), host_spill, peak pages per tier."""

    def __init__(self, c):
        self.overflow = bool(c.overflow)
        self.host_spill = bool(c.host_spill)
        self.peak_device_pages = int(c.peak_pages[0])
        self.peak_host_pages = int(c.peak_pages[1])
        self.overflow_count = int(c.overflow_count)
        self.last_failed_pages = int(c.last_failed_pages)

    def __repr__(self):
        return (f"Flags(overflow={self.overflow}, host_spill={self.host_spill}, "
                f"peak_device_pages={self.peak_device_pages}, peak_host_pages={self.peak_host_pages}, "
                f"overflow_count={self.overflow_count}, last_failed_pages={self.last_failed_pages})")


def _fn(name):
    fn = getattr(_lib.lib(), name, None)
    if fn is None:
        where = _lib.library_path()
        raise Error(f"{name} is not in {where}: the paged stash tier needs libvmstash.so built with the CUDA "
                    "kernels (it is not part of libvmstash_preload.so)", UNIMPLEMENTED)
    return fn


def _stream_of(device):
    import torch
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


_fast = {}


def _fast_fns():
    """The per-call entry points typed for plain ints (no ctypes objects built per call)
    and torch's raw current-stream getter: the torch paths of stash() / restore() cost
    a few microseconds of Python each (bench/megatron_stash_bench.py measures it)."""
    if not _fast:
        import torch
        vp, u64 = ctypes.c_void_p, ctypes.c_uint64
        _fast["stash"] = ctypes.cast(_fn("vmstash_stash_stash"),
                                     ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, vp, vp, u64, vp))
        _fast["restore"] = ctypes.cast(_fn("vmstash_stash_restore"),
                                       ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, vp, vp, u64, ctypes.c_int))
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _fast["stream"] = raw if raw is not None else (lambda d: torch.cuda.current_stream(d).cuda_stream)
    return _fast


def _capturing():
    import torch
    return torch.cuda.is_current_stream_capturing()


class Arena:
    """One page class on one device. `row_bytes`: bytes of one row of the tensors it
    holds; `page_rows`: rows per page (a power of two); `device_pages` / `host_pages`:
    capacity of the device tier and of the optional pinned host tier."""

    def __init__(self, row_bytes, device_pages, host_pages=0, page_rows=64, tag="stash", device=None, stream=None):
        if not isinstance(row_bytes, int) or row_bytes <= 0:
            raise ValueError(f"row_bytes must be a positive int, got {row_bytes!r}")
        if not isinstance(device_pages, int) or device_pages <= 0:
            raise ValueError(f"device_pages must be a positive int, got {device_pages!r}")
        if not isinstance(host_pages, int) or host_pages < 0:
            raise ValueError(f"host_pages must be an int >= 0, got {host_pages!r}")
        if device is None:
            device = self._torch_device()
        self.device = int(device)
        self.row_bytes = row_bytes
        self.page_rows = page_rows
        self.tag = tag
        self._lock = threading.Lock()
        self._pool = {}  # max_rows -> [handle addresses]
        self._handles = set()
        from . import _api
        _api.create_tag(tag, "discard")  # so vmstash.pause() / resume() with no tag include it
        handle = ctypes.c_void_p()
        check(_fn("vmstash_stash_create")(self.device, encode(tag), row_bytes, page_rows, ctypes.byref(handle)),
              f"vmstash.stash.Arena(row_bytes={row_bytes}, page_rows={page_rows}, tag={tag!r})")
        self._arena = handle
        try:
            check(_fn("vmstash_stash_prepare")(self._arena, device_pages, host_pages, self._raw_stream(stream)),
                  f"vmstash.stash.Arena: prepare {device_pages} device and {host_pages} host pages")
        except BaseException:
            _fn("vmstash_stash_destroy")(self._arena)
            self._arena = None
            raise
        self.device_pages = device_pages
        self.host_pages = host_pages
        self._op_id = None
        try:
            import torch  # noqa: F401
        except ImportError:
            return  # the raw methods work without torch; the operators need it
        _register_ops()
        with _ops_lock:
            self._op_id = _op_next[0]
            _op_next[0] += 1
            _op_arenas[self._op_id] = self

    @staticmethod
    def _torch_device():
        try:
            import torch
            return torch.cuda.current_device()
        except Exception:
            return 0

    def _raw_stream(self, stream):
        if stream is None:
            try:
                return _stream_of(self.device)
            except Exception:  # no torch / no CUDA (simulated driver): the default stream
                return None
        return ctypes.c_void_p(int(stream) if not hasattr(stream, "cuda_stream") else stream.cuda_stream)

    def _live(self):
        if self._arena is None:
            raise Error("vmstash.stash.Arena: the arena is closed", FAILED_PRECONDITION)
        return self._arena

    # --- handles -------------------------------------------------------------------
    def reserve_handles(self, count, max_rows):
        """Creates `count` handles for tensors of up to max_rows rows ahead of a capture."""
        made = [self._new_handle(max_rows) for _ in range(count)]
        with self._lock:
            self._pool.setdefault(max_rows, []).extend(made)

    def _new_handle(self, max_rows):
        out = ctypes.c_void_p()
        check(_fn("vmstash_stash_new_handle")(self._live(), max_rows, ctypes.byref(out)),
              f"vmstash.stash: new handle for {max_rows} rows")
        self._handles.add(out.value)
        return out.value

    def _take_handle(self, max_rows):
        with self._lock:
            free = self._pool.get(max_rows)
            if free:
                return free.pop()
        try:
            capturing = _capturing()
        except Exception:
            capturing = False
        if capturing:
            raise Error(f"vmstash.stash: no free handle for {max_rows} rows during a CUDA graph capture; call "
                        f"arena.reserve_handles(count, {max_rows}) before capturing", FAILED_PRECONDITION)
        return self._new_handle(max_rows)

    def _give_handle(self, max_rows, handle):
        with self._lock:
            self._pool.setdefault(max_rows, []).append(handle)

    # --- raw operations (addresses; no torch needed) -------------------------------
    def reset(self, stream=None):
        """Forgets every stash and clears the flags (capturable). Stashed objects not yet
        restored become invalid."""
        check(_fn("vmstash_stash_reset")(self._live(), self._raw_stream(stream)), "vmstash.stash: reset")

    # --- torch.library operators (torch.compile) -------------------------------------
    def stash_op(self, tensor, rows):
        """stash() as the custom operator torch.ops.vmstash.stash, for code that
        torch.compile traces: `rows` a device int64 tensor; returns a token (a CPU int64
        tensor) for restore_op."""
        import torch
        return torch.ops.vmstash.stash(tensor, rows, self._op_id)

    def restore_op(self, token, shape, dtype):
        """The tensor stashed under `token` (torch.ops.vmstash.restore): a new tensor of
        `shape` and `dtype` on the arena's device, rows past the live count zeroed."""
        import torch
        return torch.ops.vmstash.restore(token, list(shape), dtype, torch.device("cuda", self.device))

    def link_flags(self, overflow=None, host_spill=None, stream=None):
        """Shares flags with other arenas: `overflow` / `host_spill` are int64 device
        tensors (or addresses; None unlinks), as Megatron-LM shares one of each among its
        buffers. A nonzero overflow makes this arena's stashes and restores no-ops; its own
        overflow / host spill sets them to 1. Their owner clears them (reset does not).
        Resets the arena; not capturable."""
        def addr(t, name):
            if t is None:
                return None
            if hasattr(t, "data_ptr"):
                import torch
                if t.dtype != torch.int64 or t.numel() < 1 or not t.is_cuda or t.device.index != self.device:
                    raise ValueError(f"link_flags: {name} must be an int64 tensor on cuda:{self.device}, got "
                                     f"{t.dtype} on {t.device}")
                return ctypes.c_void_p(t.data_ptr())
            return ctypes.c_void_p(int(t))
        check(_fn("vmstash_stash_link_flags")(self._live(), self._raw_stream(stream), addr(overflow, "overflow"),
                                              addr(host_spill, "host_spill")), "vmstash.stash: link_flags")
        self._linked = (overflow, host_spill)  # kept alive while linked

    def stash_ptr(self, src, n_rows_ptr, max_rows, handle, stream=None):
        check(_fn("vmstash_stash_stash")(self._live(), self._raw_stream(stream), src, n_rows_ptr, max_rows, handle),
              "vmstash.stash: stash")

    def restore_ptr(self, handle, dst, max_rows, zero_tail=False, stream=None):
        check(_fn("vmstash_stash_restore")(self._live(), self._raw_stream(stream), handle, dst, max_rows,
                                           1 if zero_tail else 0), "vmstash.stash: restore")

    def discard_ptr(self, handle, max_rows, stream=None):
        check(_fn("vmstash_stash_discard")(self._live(), self._raw_stream(stream), handle, max_rows),
              "vmstash.stash: discard")

    def write_flags(self, out, stream=None):
        """Copies the flags into device memory (a tensor of >= 48 bytes, or an address);
        capturable. Layout: u32 overflow, u32 host_spill, u64 peak[2], u64 overflow_count,
        u64 last_failed_pages."""
        ptr = out.data_ptr() if hasattr(out, "data_ptr") else int(out)
        if hasattr(out, "nbytes") and out.nbytes < ctypes.sizeof(_CFlags):
            raise ValueError(f"write_flags needs {ctypes.sizeof(_CFlags)} bytes, got {out.nbytes}")
        check(_fn("vmstash_stash_write_flags")(self._live(), self._raw_stream(stream), ctypes.c_void_p(ptr)),
              "vmstash.stash: write_flags")

    def flags(self, stream=None):
        """Synchronizes the stream and reads the flags (host call, not capturable)."""
        c = _CFlags()
        check(_fn("vmstash_stash_read_flags")(self._live(), self._raw_stream(stream), ctypes.byref(c)),
              "vmstash.stash: read flags")
        return Flags(c)

    def pages_in_use(self):
        out = ctypes.c_uint64()
        check(_fn("vmstash_stash_pages_in_use")(self._live(), ctypes.byref(out)), "vmstash.stash: pages in use")
        return out.value

    def info(self):
        nbytes, executor = ctypes.c_uint64(), ctypes.c_char_p()
        check(_fn("vmstash_stash_info")(self._live(), ctypes.byref(nbytes), ctypes.byref(executor)),
              "vmstash.stash: info")
        return {"device_bytes": nbytes.value, "executor": executor.value.decode(), "row_bytes": self.row_bytes,
                "page_rows": self.page_rows, "device_pages": self.device_pages, "host_pages": self.host_pages,
                "tag": self.tag, "device": self.device}

    # --- torch tensors --------------------------------------------------------------
    def _check_tensor(self, tensor, what):
        if not tensor.is_cuda or tensor.device.index != self.device:
            raise ValueError(f"{what}: the tensor is on {tensor.device}, the arena on cuda:{self.device}")
        if tensor.dim() < 1 or not tensor.is_contiguous():
            raise ValueError(f"{what}: needs a contiguous tensor with a row dimension, got shape "
                             f"{tuple(tensor.shape)} contiguous={tensor.is_contiguous()}")
        row = tensor.element_size() * _prod(tensor.shape[1:])
        if row != self.row_bytes:
            raise ValueError(f"{what}: rows of {row} bytes (shape {tuple(tensor.shape)}, {tensor.dtype}) do not "
                             f"fit an arena of {self.row_bytes}-byte rows")

    def _rows_tensor(self, rows):
        import torch
        if isinstance(rows, int):
            if _capturing():
                raise Error("vmstash.stash: pass the row count as a device int64 tensor during a CUDA graph "
                            "capture (a Python int would be frozen into the graph)", INVALID_ARGUMENT)
            return torch.tensor([rows], dtype=torch.int64, device=f"cuda:{self.device}")
        if not isinstance(rows, torch.Tensor) or rows.numel() < 1 or not rows.is_cuda:
            raise ValueError("rows: a CUDA tensor holding the row count (its first element), or an int")
        if rows.device.index != self.device:
            raise ValueError(f"rows is on {rows.device}, the arena on cuda:{self.device}")
        if rows.dtype != torch.int64 or not rows.is_contiguous():
            rows = rows.reshape(-1)[:1].to(torch.int64).contiguous()
        return rows

    def stash(self, tensor, rows):
        """Stashes rows [0, n) of `tensor` ([max_rows, ...], contiguous, on the arena's
        device) where n = rows (an int, or the first element of a device integer tensor,
        read on the device and clamped to [0, max_rows]). Returns a Stashed. Uses torch's
        current stream; the tensor may be freed right after (stream-ordered)."""
        # A fast check; the full one (which raises saying what is wrong) only when it fails.
        if (tensor.get_device() != self.device or tensor.dim() < 1 or not tensor.is_contiguous()
                or tensor.element_size() * tensor.stride(0) != self.row_bytes):
            self._check_tensor(tensor, "vmstash.stash.Arena.stash")
        rows_t = rows if (type(rows) is not int and rows.dtype is _int64() and rows.get_device() == self.device
                          and rows.is_contiguous() and rows.numel() >= 1) else self._rows_tensor(rows)
        max_rows = tensor.shape[0]
        handle = self._take_handle(max_rows)
        fast = _fast_fns()
        code = fast["stash"](self._live(), fast["stream"](self.device), tensor.data_ptr(), rows_t.data_ptr(),
                             max_rows, handle)
        if code != OK:
            self._give_handle(max_rows, handle)
            check(code, "vmstash.stash: stash")
        return Stashed(self, handle, tuple(tensor.shape), tensor.dtype, rows_t)

    def close(self):
        """Frees the handles and the arena's memory (the pages are gone, stashed or not)."""
        if self._arena is None:
            return
        for h in list(self._handles):
            _fn("vmstash_stash_free_handle")(self._arena, ctypes.c_void_p(h))
        self._handles.clear()
        self._pool.clear()
        check(_fn("vmstash_stash_destroy")(self._arena), "vmstash.stash: destroy")
        self._arena = None
        if getattr(self, "_op_id", None) is not None:
            with _ops_lock:
                _op_arenas.pop(self._op_id, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"vmstash.stash.Arena(row_bytes={self.row_bytes}, page_rows={self.page_rows}, "
                f"device_pages={getattr(self, 'device_pages', '?')}, host_pages={getattr(self, 'host_pages', '?')}, "
                f"tag={self.tag!r}, device={self.device})")


_torch_int64 = []


def _int64():
    if not _torch_int64:
        import torch
        _torch_int64.append(torch.int64)
    return _torch_int64[0]


def _prod(shape):
    out = 1
    for s in shape:
        out *= s
    return out


class Stashed:
    """A stashed tensor: restore it (once; later calls return the same tensor) or discard it."""

    def __init__(self, arena, handle, shape, dtype, rows):
        self.arena = arena
        self.shape = shape
        self.dtype = dtype
        self.max_rows = shape[0]
        self._handle = handle
        self._rows = rows  # kept alive until the stash kernel has read it (stream order)
        self._restored = None

    def restore(self, out=None, zero_tail=False):
        """Copies the rows back into `out` (or a new tensor of the stashed shape) on torch's
        current stream and returns the pages. Rows past n are left as they are unless
        zero_tail (then zeroed)."""
        if self._restored is not None:
            return self._restored
        if self._handle is None:
            raise Error("vmstash.stash: this tensor was discarded", FAILED_PRECONDITION)
        arena = self.arena
        if out is None:
            import torch
            out = torch.empty(self.shape, dtype=self.dtype, device=f"cuda:{arena.device}")
        elif (out.get_device() != arena.device or out.dim() < 1 or not out.is_contiguous()
              or out.element_size() * out.stride(0) != arena.row_bytes or out.shape[0] < self.max_rows):
            arena._check_tensor(out, "vmstash.stash.Stashed.restore(out=)")
            if out.shape[0] < self.max_rows:
                raise ValueError(f"restore: out has {out.shape[0]} rows, the stashed tensor {self.max_rows}")
        fast = _fast_fns()
        check(fast["restore"](arena._live(), fast["stream"](arena.device), self._handle, out.data_ptr(),
                              self.max_rows, 1 if zero_tail else 0), "vmstash.stash: restore")
        self._release()
        self._restored = out
        return out

    def discard(self):
        """Returns the pages without copying (capturable)."""
        if self._handle is None or self._restored is not None:
            return
        self.arena.discard_ptr(ctypes.c_void_p(self._handle), self.max_rows)
        self._release()

    def _release(self):
        self.arena._give_handle(self.max_rows, self._handle)
        self._handle = None
        self._rows = None


@contextlib.contextmanager
def saved_tensors(arenas, max_rows, rows=None, zero_tail=False, select=None):
    """Stashes the activations autograd saves inside the block and restores them when
    backward needs them (torch.autograd.graph.saved_tensors_hooks).

    arenas: an Arena or several (one per row size); max_rows: the padded row capacity of
    the tensors to stash (saved tensors with another first dimension are kept as usual);
    rows: the live row count (an int or a device tensor) — None means all max_rows rows.
    Parameters and other leaves that require grad are never stashed. A saved tensor whose
    row size matches no arena is kept as usual. select: an optional predicate the producer
    uses to mark which saved tensors are pageable (called only for tensors that pass the
    checks above); without it every [max_rows, ...] activation of a matching row size is.
    """
    import torch
    by_row = {}
    for a in (arenas if isinstance(arenas, (list, tuple)) else [arenas]):
        by_row.setdefault(a.row_bytes, a)

    def pack(t):
        if (not isinstance(t, torch.Tensor) or not t.is_cuda or t.dim() < 1 or t.shape[0] != max_rows
                or not t.is_contiguous() or (t.requires_grad and t.is_leaf)):
            return t
        row = t.element_size() * _prod(t.shape[1:])
        arena = by_row.get(row)
        if arena is None or t.device.index != arena.device or (select is not None and not select(t)):
            return t
        return arena.stash(t, max_rows if rows is None else rows)

    def unpack(x):
        if isinstance(x, Stashed):
            return x.restore(zero_tail=zero_tail)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
