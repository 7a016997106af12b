"""PyTorch integration: tagged MemPools (region), graph pools (cuda_graph), install().

One torch.cuda.MemPool per (tag, device), whose allocator is a CUDAPluggableAllocator
over the tag's own entry point vmstash_malloc_slot<N> (vmstash_bind_tag_slot), so every
segment PyTorch asks for lands in the tag whatever thread asks. PyTorch caches tensors
inside those segments; vmstash.pause swaps the physical memory under them (same
addresses) and copies only PyTorch's active blocks (MemPool.snapshot(): live_ranges).

Pools and their allocator objects live until interpreter exit, where the pools are
dropped first (PyTorch documents crashes when an allocator wrapper dies before its pools).
"""
import atexit
import collections
import contextlib
import threading
import warnings
import weakref

from . import _api, _lib

_lock = threading.RLock()
_allocators = {}  # tag -> CUDAPluggableAllocator (kept alive as long as its pools)
_pools = {}  # (tag, device) -> torch.cuda.MemPool
# More MemPools of a tag, for graph captures that say which pool (graph_pool), each with
# the pool id its captures were given (None: private) and how many of its graphs live. A
# pool whose graphs are all gone is reused by the next capture that needs a pool of its
# own: its cached memory serves again, as PyTorch's would once freed. Never destroyed
# before exit: PyTorch aborts the process when a MemPool is destroyed while any pool
# context is active on its device (Note [Throw-Away Pools] in
# compat/torch_memory_saver.py), which a region in another thread may be.
class _GraphPool:
    __slots__ = ("mp", "key", "graphs")

    def __init__(self, mp, key):
        self.mp, self.key, self.graphs = mp, key, 0


_graph_pools = {}  # (tag, device) -> [_GraphPool]


_torch_module = None


def _torch():
    global _torch_module
    if _torch_module is not None:
        return _torch_module
    try:
        import torch
    except ImportError as e:
        raise _lib.Error("this vmstash function needs PyTorch (import torch failed)",
                         _lib.FAILED_PRECONDITION) from e
    if not torch.cuda.is_available():
        raise _lib.Error("this vmstash function needs a CUDA device (torch.cuda.is_available() is False)",
                         _lib.FAILED_PRECONDITION)
    _torch_module = torch
    return torch


def _device_index(torch, device):
    """The index of `device` (None, "cuda" or a torch.device without one: the current device),
    so that a pool and the routings into it are keyed alike (Note [Hints and Routing])."""
    if device is None:
        return torch.cuda.current_device()
    index = torch.device("cuda", device).index if isinstance(device, int) else torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def pool(tag, policy="discard", device=None):
    """The MemPool of `tag` on `device` (created on first use, with the tag)."""
    torch = _torch()
    dev = _device_index(torch, device)
    found = _pools.get((tag, dev))
    if found is not None and _api.policy_of(tag) == policy:
        return found  # fast path: region() enters often
    _api.create_tag(tag, policy)
    with _lock:
        found = _pools.get((tag, dev))
        if found is not None:
            return found
        alloc = _allocators.get(tag)
        if alloc is None:
            slot = _api.bind_tag_slot(tag)  # raises with the library's code and message
            alloc = torch.cuda.memory.CUDAPluggableAllocator(_lib.library_path(), f"vmstash_malloc_slot{slot}",
                                                               "vmstash_free")
            _allocators[tag] = alloc
        with torch.cuda.device(dev):
            mp = torch.cuda.MemPool(alloc.allocator())
        _pools[(tag, dev)] = mp
        return mp


def graph_pool(tag, policy="discard", device=None, share=None, graph=None):
    """A MemPool of `tag` on `device` for capturing `graph`, as torch.cuda.graph(pool=share)
    would choose: share None, a pool of its own; else the pool `share` (a pool id:
    torch.cuda.graph_pool_handle(), a graph's pool(), a MemPool's id) names — the tag's own
    pool, or a graph pool of this tag whose id it is or that captures were given it for —
    else one of its own, which every later capture given `share` shares. A pool of its own
    is an idle one (its graphs all gone) when there is one, else a new one. Its memory is
    the tag's (pause and resume take it). Unlike torch, the graph captures into that pool's
    id, not into `share` itself: memory routed to `share` by other means
    (pynccl's set_graph_pool_id, a user's own MemPool) is not the tag's."""
    torch = _torch()
    dev = _device_index(torch, device)
    primary = pool(tag, policy, device)
    key = None if share is None else tuple(share.id if hasattr(share, "id") else share)
    with _lock:
        entries = _graph_pools.setdefault((tag, dev), [])
        if key is not None and tuple(primary.id) == key:
            return primary
        entry = None
        if key is not None:
            entry = next((e for e in entries if e.key == key or tuple(e.mp.id) == key), None)
            if entry is not None and entry.key is None:
                entry.key = key  # a private pool named by its graph's pool(): shared from here
        if entry is None:
            entry = next((e for e in entries if e.graphs == 0), None)
            if entry is not None:
                entry.key = key
        if entry is None:
            with torch.cuda.device(dev):
                entry = _GraphPool(torch.cuda.MemPool(_allocators[tag].allocator()), key)
            entries.append(entry)
        if graph is not None:
            try:
                weakref.finalize(graph, _graph_gone, entry)
                entry.graphs += 1
            except TypeError:  # no weak reference: counted as living for good
                entry.graphs += 1 << 30
        return entry.mp


def _graph_gone(entry):
    with _lock:
        entry.graphs -= 1


def _tag_pools(tag, device):
    """Every MemPool of `tag` on `device` this module made: its own, then its graph pools."""
    with _lock:
        own = _pools.get((tag, device))
        pools = [own] if own is not None else []
        pools += [e.mp for e in _graph_pools.get((tag, device), ())]
    return pools


# Regions open in any thread: while one is, its MemPool context is active on the device,
# and PyTorch aborts the process when a pool is destroyed or its cache emptied then.
_open_regions = 0


def open_regions():
    """How many region() blocks are open, over all threads."""
    return _open_regions


@contextlib.contextmanager
def region(tag, policy="discard", *, all_threads=False, device=None):
    """Allocations of this thread inside go to `tag`'s MemPool (policy "discard" or
    "backup"). all_threads=True routes every thread and stream of the process (autograd's
    backward threads included) while inside. Nests; the innermost region wins."""
    torch = _torch()
    dev = _device_index(torch, device)
    mp = pool(tag, policy, dev)
    previous = _api.current_tag()
    if previous == "default":  # not nested: PyTorch's current pool is its own
        warm_blas_workspaces(device=dev)
    _api.set_current_tag(tag)  # global mode and C++ callers route by the thread's tag
    global _open_regions
    with _lock:
        _open_regions += 1
    try:
        if all_threads:
            with routing(tag, dev, all_threads=True):
                torch._C._cuda_beginAllocateToPool(dev, mp.id)
                try:
                    yield mp
                finally:
                    torch._C._cuda_endAllocateToPool(dev, mp.id)
                    torch._C._cuda_releasePool(dev, mp.id)
        else:
            with routing(tag, dev), torch.cuda.use_mem_pool(mp, device=dev):
                yield mp
    finally:
        _api.set_current_tag(previous)
        with _lock:
            _open_regions -= 1


# Note [Hints and Routing]
#   A pause's liveness hint (live_ranges) is PyTorch's view of the tag's pool when the hint
#   is taken. A block PyTorch hands out after that, before the library's copy, would be
#   written and not kept. PyTorch hands a pool's blocks out only to allocations routed to
#   the pool: a region, a graph capture into it. So the routings are counted per
#   (tag, device) and thread (all_threads: every thread), and a pause (hint_session) takes
#   the hint of a tag on a device only when no other thread has a routing into the pool
#   open there; else that device pauses without a hint (every live block copied whole:
#   slower, nothing written lost). A routing opened while a pause holds the pool's hint (by
#   another thread, or by a before-pause hook on the pausing thread) is not made to wait —
#   a hook may hand work to another thread and wait for it, and a wait would then never
#   end — but the pause then warns (RuntimeWarning) that what was allocated there may not
#   be kept: allocating in a tag while it pauses is the program's race. A pool context the
#   program enters itself (torch.cuda.use_mem_pool(vmstash.pool(tag))) is not seen: pause
#   such a tag only while no other thread allocates into it.
_ALL_THREADS = "all threads"  # the owner of an all_threads routing: never a pausing thread
_routes = {}  # (tag, device) -> Counter of open routings by thread ident (or _ALL_THREADS)
_hinting = {}  # (tag, device) -> Counter of the hint sessions holding its hint, by thread
_opened_while_hinted = collections.Counter()  # (tag, device) -> routings opened meanwhile


@contextlib.contextmanager
def routing(tag, device, all_threads=False):
    """Counts a routing of allocations into the MemPool of `tag` on `device` while inside
    (Note [Hints and Routing])."""
    key = (tag, device)
    owner = _ALL_THREADS if all_threads else threading.get_ident()
    with _lock:
        if key in _hinting:
            _opened_while_hinted[key] += 1
        _routes.setdefault(key, collections.Counter())[owner] += 1
    try:
        yield
    finally:
        with _lock:
            _uncount(_routes, key, owner)


def _uncount(table, key, owner):
    counts = table[key]
    counts[owner] -= 1
    if counts[owner] == 0:
        del counts[owner]
        if not counts:
            del table[key]


@contextlib.contextmanager
def hint_session(keys):
    """Inside, a pause takes the hints of the pools `keys` ((tag, device) pairs) and makes
    its C call (Note [Hints and Routing]). Yields those of `keys` whose hints may be taken
    (no other thread routes into them); at the end, warns for a routing opened into one of
    them meanwhile."""
    me = threading.get_ident()
    with _lock:
        held = [key for key in dict.fromkeys(keys) if all(t == me for t in _routes.get(key, ()))]
        for key in held:
            _hinting.setdefault(key, collections.Counter())[me] += 1
    try:
        yield held
    finally:
        with _lock:
            opened = []
            for key in held:
                _uncount(_hinting, key, me)
                if key not in _hinting and _opened_while_hinted.pop(key, 0):
                    opened.append(key)
        for tag, device in opened:
            warnings.warn(f"vmstash: a region or graph capture into tag {tag!r} on device {device} was opened "
                          "while its pause ran (in another thread, or in a before-pause hook): what it allocated "
                          "there may not have been kept, and it lies in paused memory "
                          "(_torch.py, Note [Hints and Routing])", RuntimeWarning, stacklevel=4)


# Note [Library Workspaces]
#   PyTorch keeps one cuBLAS (and cuBLASLt) workspace per (handle, stream), allocated at
#   the first matmul on that stream from whatever pool is current then, and kept for the
#   life of the process. A model's first matmul inside region("kv_cache") (a prefill)
#   would put that stream's workspace in the tag's pool; after a pause of the tag the next
#   matmul on that stream, outside any region, runs on unmapped memory and the CUDA
#   context is lost (CUBLAS_STATUS_EXECUTION_FAILED). So region() first creates the
#   current stream's workspaces in PyTorch's own pool (a few tiny matmuls, once per
#   stream). A stream first used for a matmul inside a region (a torch.cuda.stream(s)
#   block within it) is not covered: call warm_blas_workspaces(s) before entering.
#   Graph captures are meant to put their capture stream's workspace in the graph pool
#   (cuda_graph below gives each tag its own capture stream for that reason).
_warm_streams = set()


def warm_blas_workspaces(stream=None, device=None):
    """Creates PyTorch's cuBLAS and cuBLASLt workspaces of `stream` (default: the current
    stream) in PyTorch's own pool, so that a later first matmul inside a vmstash region
    cannot put them in a pausable pool (Note [Library Workspaces]). Once per stream;
    a no-op during a graph capture."""
    torch = _torch()
    dev = _device_index(torch, device) if stream is None else stream.device.index
    if stream is None:
        stream = torch.cuda.current_stream(dev)
    key = (dev, stream.cuda_stream)
    if key in _warm_streams:
        return
    with torch.cuda.device(dev), torch.cuda.stream(stream):
        if torch.cuda.is_current_stream_capturing():
            return
        torch.cuda.current_blas_handle()  # the cuBLAS workspace of this stream
        for dtype in (torch.bfloat16, torch.float32):
            a = torch.ones(32, 32, device=torch.device("cuda", dev), dtype=dtype)
            torch.nn.functional.linear(a, a, a[0])  # addmm with a bias: cuBLASLt
            torch.mm(a, a)
            del a
    _warm_streams.add(key)


@contextlib.contextmanager
def cuda_graph(graph, tag="cuda_graph", policy="backup", *, device=None, mem_pool=None, **graph_kwargs):
    """torch.cuda.graph(graph, pool=<tag's MemPool>): the graph's private memory is in
    `tag` and pauses with it, no LD_PRELOAD needed. Extra keyword arguments go to
    torch.cuda.graph (stream, capture_error_mode). `mem_pool` (a MemPool of `tag`:
    graph_pool) replaces the tag's own pool (torch_memory_saver's cuda_graph(pool=...))."""
    torch = _torch()
    if "pool" in graph_kwargs:
        raise ValueError("vmstash.cuda_graph chooses the pool (the tag's MemPool); do not pass pool=")
    mp = pool(tag, policy, device) if mem_pool is None else mem_pool
    if graph_kwargs.get("stream") is None:
        # A capture stream per tag: PyTorch keeps one cuBLAS workspace per stream, made in
        # whatever pool is current at its first use, and torch.cuda.graph's default capture
        # stream is shared by every graph. Graphs of different tags would then share a
        # workspace living in the first tag's pool, and replaying one while the other tag is
        # paused would read unmapped memory.
        graph_kwargs["stream"] = _capture_stream(torch, tag, _device_index(torch, device))
    # A capture routes the allocations of its stream, whichever thread makes them.
    with routing(tag, _device_index(torch, device), all_threads=True), \
            torch.cuda.graph(graph, pool=mp.id, **graph_kwargs):
        yield graph


_capture_streams = {}


def _capture_stream(torch, tag, device):
    key = (tag, device)
    stream = _capture_streams.get(key)
    if stream is None:
        stream = _capture_streams[key] = torch.cuda.Stream(device=device)
    return stream


def install(tag="default"):
    """Makes vmstash PyTorch's CUDA allocator for the whole process (global mode). Must run
    before the first CUDA allocation. torch.cuda.memory_stats() and snapshots stop working
    in this mode (PyTorch's rule); use vmstash.stats() / vmstash.snapshot()."""
    torch = _torch()
    with _lock:
        if _allocators.get(None) is not None:
            return
        alloc = torch.cuda.memory.CUDAPluggableAllocator(_lib.library_path(), "vmstash_malloc", "vmstash_free")
        try:
            torch.cuda.memory.change_current_allocator(alloc)
        except RuntimeError as e:
            raise _lib.Error("vmstash.install() must run before the process's first CUDA allocation "
                             f"(PyTorch: {e})", _lib.FAILED_PRECONDITION) from e
        _allocators[None] = alloc
    warm_blas_workspaces()  # in the "default" tag, before any other tag is current
    if tag != "default":
        _api.set_current_tag(tag)


# The last hint range runs up to here: the largest size a uint64 holds (the last byte of
# the 64-bit address space is no allocation's). 1 << 64 would wrap to a size of 0 in the
# C call, and a range of size 0 keeps nothing.
_ADDRESS_SPACE_END = (1 << 64) - 1


def hint_from_segments(segments, device=None):
    """The liveness hint (vmstash.h, Note [Liveness Hints]) of a tag on one device, from its
    MemPool's own segments (MemPool.snapshot(), torch.cuda.memory_snapshot(pool id)): the
    blocks PyTorch holds active in them (any state but "inactive", whose bytes are cached
    and free), and every byte outside them — the gaps between the segments, from 0 up to
    the end of the address space — so that the tag's live allocations that are no segment
    of the pool (global mode, C++ callers) are copied whole by the library, which knows
    them. Segments of other devices (a segment's "device") are left out.

    A list of (address, size). No C call: the pool's segments say all."""
    mine = sorted((s for s in segments if device is None or s.get("device", device) == device),
                  key=lambda s: s["address"])
    ranges = []
    below = 0  # the first byte not yet covered by a segment or a gap
    for seg in mine:
        start, end = seg["address"], seg["address"] + seg["total_size"]
        if start > below:
            ranges.append((below, start - below))
        for b in seg["blocks"]:
            if b["state"] != "inactive":
                ranges.append((b["address"], b["size"]))
        below = max(below, end)
    if below < _ADDRESS_SPACE_END:
        ranges.append((below, _ADDRESS_SPACE_END - below))
    return ranges


def live_ranges(tag, device):
    """The liveness hint of `tag` on `device` from its MemPools there, its own and its
    graph pools' (hint_from_segments over all their segments); None without one."""
    pools = _tag_pools(tag, device)
    if not pools:
        return None
    segments = []
    for mp in pools:
        try:
            segments += mp.snapshot(include_traces=False)
        except TypeError:
            segments += mp.snapshot()
    return hint_from_segments(segments, device)


def take_pool(tag, device):
    """Removes the MemPool of `tag` on `device` from this module and returns it (None when
    there is none): once its last reference goes, PyTorch gives its segments back to the
    tag (torch_memory_saver's _impl._mem_pools.pop). The tag's next region makes a new one."""
    with _lock:
        return _pools.pop((tag, device), None)


def pool_devices(tag):
    with _lock:
        return [d for (t, d) in _pools if t == tag]


def _release_pools():
    # Pools before their allocators; errors at exit are not worth a traceback.
    with _lock:
        _pools.clear()
        _graph_pools.clear()
    try:
        import gc
        gc.collect()
    except Exception:
        pass


atexit.register(_release_pools)
_api.live_ranges_provider = live_ranges
_api.pool_devices_provider = pool_devices
_api.hint_session_provider = hint_session
