"""Weights from one process to another on the same GPU through a mapped tag (docs/weights.md).

The rollout process (the exporter) publishes the tag holding its weights once, when it has
loaded them; the trainer process (the importer) maps that tag once for the job, at its own
addresses, and copies its new weights into it at every step with one batched copy:

    # rollout process (vLLM's "weights" tag, the drop-in's weights region, or any tag)
    vmstash.weights.publish("weights", model.state_dict())

    # trainer process
    view = vmstash.weights.map_tag(rollout_pid, "weights")
    ...
    vmstash.weights.sync(trainer_model.state_dict(), view, name_map=rename)

The mapping follows the tag's pauses and resumes (Note [Mapped Tags] in
runtime/tag_share.h); after a resume it is mapped again at the same addresses. While the
rollout's tag is paused, the view is "backup" when the paused bytes are in the node pool
(both processes run with VMSTASH_CONF node:1): sync then writes them there, at the host
link's speed, and the rollout's resume brings the new weights in. Otherwise it is "paused"
and sync raises vmstash.Error (FAILED_PRECONDITION) saying why. The exporting process must
run with exportable chunks (VMSTASH_CONF share_chunks:1, or node:1).
"""
import contextlib
import ctypes
import json
import threading

from . import _lib

_INDEX_VERSION = 1
# vmstash_mapped_state's states.
_MAPPED, _BACKUP = 0, 3
# A sync into a backup converts (dtype, layout) and copies this many bytes at a time, so
# that the converted copies need at most this much device memory.
_STAGE_BYTES = 512 << 20


def _torch():
    import torch  # noqa: PLC0415 (imported on use: vmstash imports without torch)
    return torch


def _items(tensors, what):
    if hasattr(tensors, "items"):
        tensors = tensors.items()
    out = []
    for pair in tensors:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not isinstance(pair[0], str):
            raise TypeError(f"{what}: takes a dict of name -> tensor or (name, tensor) pairs, got {pair!r}")
        out.append((pair[0], pair[1]))
    return out


def resolve_tag(tag):
    """The vmstash tag that `tag` names in this process: a vmstash tag of that name; else
    the vLLM backend's tag for it (vmstash.compat.vllm: "weights" is "vllm.weights"); else
    the one vmstash tag torch_memory_saver's tag of that name has (the drop-in: its region
    "weights"). Raises vmstash.Error (NOT_FOUND) naming what was tried, or
    (INVALID_ARGUMENT) when the drop-in's tag has several (one per backup setting used)."""
    from . import _api
    if _api.policy_of(tag) is not None:
        return tag
    from .compat.vllm.allocator import TAG_PREFIX
    if _api.policy_of(TAG_PREFIX + tag) is not None:
        return TAG_PREFIX + tag
    l = _lib.lib()
    names = (ctypes.c_char_p * 8)()
    count = ctypes.c_size_t(0)
    _lib.check(l.vmstash_tms_targets(_lib.encode(tag), names, 8, ctypes.byref(count)), "vmstash.weights")
    if count.value == 1:
        return names[0].decode()
    if count.value > 1:
        found = ", ".join(repr(names[i].decode()) for i in range(min(count.value, 8)))
        raise _lib.error(f"vmstash.weights: torch_memory_saver's tag {tag!r} has several vmstash tags ({found}): "
                         "name one of them", _lib.INVALID_ARGUMENT)
    raise _lib.error(f"vmstash.weights: no tag {tag!r} in this process (nor {TAG_PREFIX + tag!r} of the vLLM "
                     f"backend, nor a torch_memory_saver region {tag!r})", _lib.NOT_FOUND)


def publish(tag, tensors):
    """In the exporting process: lets other processes map `tag` (vmstash.weights.map_tag)
    and publishes the index of `tensors` (a dict name -> tensor, or (name, tensor) pairs,
    e.g. model.state_dict()): each tensor's name, address, shape and dtype. `tag` is a
    vmstash tag, or the vLLM backend's or torch_memory_saver's name of one (resolve_tag);
    importers map it by that same name. The tensors must be contiguous CUDA tensors in
    the tag's memory, and the process must run with exportable chunks (VMSTASH_CONF
    share_chunks:1, or node:1). Call it again when the weights are re-created (a new
    generation: importers then map again). Returns the generation."""
    torch = _torch()
    vmstash_tag = resolve_tag(tag)
    entries = []
    seen = set()
    for name, t in _items(tensors, "vmstash.weights.publish"):
        if not isinstance(t, torch.Tensor) or not t.is_cuda:
            raise TypeError(f"vmstash.weights.publish: {name!r} is not a CUDA tensor")
        if not t.is_contiguous():
            raise ValueError(f"vmstash.weights.publish: {name!r} is not contiguous (publish contiguous tensors)")
        if name in seen:
            raise ValueError(f"vmstash.weights.publish: {name!r} is named twice")
        seen.add(name)
        entries.append({"name": name, "address": t.data_ptr(), "nbytes": t.numel() * t.element_size(),
                        "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                        "device": t.device.index})
    index = json.dumps({"version": _INDEX_VERSION, "tensors": entries})
    generation = ctypes.c_ulonglong(0)
    _lib.check(_lib.lib().vmstash_share_tag(_lib.encode(vmstash_tag), _lib.encode(tag), index.encode(),
                                            ctypes.byref(generation)), "vmstash.weights.publish")
    return generation.value


def unpublish(tag):
    """Stops sharing `tag` (resolve_tag): every importer's view of it is closed (it
    becomes "gone")."""
    _lib.check(_lib.lib().vmstash_unshare_tag(_lib.encode(resolve_tag(tag))), "vmstash.weights.unpublish")


def _synchronize(stream, device):
    """Waits for `stream`, or the current stream of `device` where CUDA is there (the
    simulated driver's tests run without it)."""
    if stream is not None:
        stream.synchronize()
        return
    try:
        torch = _torch()
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.current_stream(device).synchronize()


class _Array:
    """A CUDA array interface over raw device bytes (torch.as_tensor builds a tensor on it)."""

    def __init__(self, address, nbytes):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


class MappedWeights:
    """Another process's published tag, mapped in this one (vmstash.weights.map_tag)."""

    def __init__(self, pid, tag, device, timeout):
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise ValueError(f"vmstash.weights.map_tag: {pid!r} is not a process id")
        if device is None:
            device = _torch().cuda.current_device()
        if isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise ValueError(f"vmstash.weights.map_tag: {device!r} is not a device ordinal")
        self.device = device
        self.pid, self.tag = pid, tag
        l = _lib.lib()
        handle = ctypes.c_ulonglong(0)
        _lib.check(l.vmstash_map_tag(pid, _lib.encode(tag), self.device, int(timeout * 1000), ctypes.byref(handle)),
                   "vmstash.weights.map_tag")
        self._handle = handle.value
        self._lock = threading.Lock()
        self._tensors = {}
        try:
            doc = json.loads(_lib.string_call(l.vmstash_mapped_index_json, self._handle, "vmstash.weights.map_tag"))
            index = doc["index"]
            if not isinstance(index, dict) or index.get("version") != _INDEX_VERSION:
                raise _lib.error(f"vmstash.weights.map_tag: process {pid} published tag {tag!r} with an index this "
                                 "release cannot read (both processes must use the same vmstash)",
                                 _lib.FAILED_PRECONDITION)
            self.generation = doc["generation"]
            self.index = {e["name"]: e for e in index["tensors"]}
        except BaseException:
            self.close()
            raise

    @property
    def names(self):
        return list(self.index)

    def info(self):
        """{"state": "mapped" | "paused" | "gone" | "backup", "generation", "grants", "revokes",
        "pid", "tag", "device", "mapped_bytes", "backup_bytes"}."""
        return _lib.json_call(_lib.lib().vmstash_mapped_info_json, self._handle, "vmstash.weights.info")

    @property
    def state(self):
        return self.info()["state"]

    def _check_generation(self, generation):
        if generation != self.generation:
            raise _lib.error(f"vmstash.weights: process {self.pid} published tag {self.tag!r} again (generation "
                             f"{generation}, this view holds {self.generation}): map it again",
                             _lib.FAILED_PRECONDITION)

    @contextlib.contextmanager
    def use(self, stream=None):
        """A scope in which the mapped memory stays mapped (the exporter's pause waits for
        its end): work queued on the memory in it must be complete at its end, so it
        synchronizes `stream` (default: the current stream) on the way out. Raises
        vmstash.Error (FAILED_PRECONDITION) while the tag is paused or the exporter gone."""
        with self._scope(stream, backup=False):
            yield self

    @contextlib.contextmanager
    def _scope(self, stream, backup):
        """use()'s scope; with `backup`, also while the paused tag's backup is writable.
        Yields (state, grants) as the use holds them: _MAPPED or _BACKUP, and the grants
        taken so far (addresses checked under one count stay good while it stays)."""
        handle = self._handle  # the one this use releases, whatever close() does meanwhile
        if handle is None:
            raise _lib.error("vmstash.weights: this view is closed", _lib.FAILED_PRECONDITION)
        l = _lib.lib()
        state, generation, grants = ctypes.c_int(_MAPPED), ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)
        _lib.check(l.vmstash_mapped_acquire_any(handle, 1 if backup else 0, ctypes.byref(state),
                                                ctypes.byref(generation), ctypes.byref(grants)),
                   "vmstash.weights.use")
        try:
            self._check_generation(generation.value)
            yield state.value, grants.value
        finally:
            try:
                _synchronize(stream, self.device)
            finally:
                _lib.check(l.vmstash_mapped_release(handle), "vmstash.weights.use")

    def _tensors_at(self, names, at):
        """The exporter's tensors `names` at this process's addresses `at` (name -> address):
        those tensor() built already at the same address as they are, the others as views
        of one tensor spanning them (one CUDA array interface instead of one per tensor: a
        plan over thousands of tensors is built in milliseconds); cached as tensor() caches."""
        torch = _torch()
        with self._lock:
            cached = {n: self._tensors.get(n) for n in names}
        out = {n: c[1] for n, c in cached.items() if c is not None and c[0] == at.get(n, 0)}
        missing = [n for n in names if n not in out]
        placed = [(at[n], self.index[n]["nbytes"]) for n in missing if self.index[n]["nbytes"] > 0]
        base, lo = None, 0
        if placed:
            lo = min(a for a, _ in placed)
            hi = max(a + b for a, b in placed)
            base = torch.as_tensor(_Array(lo, hi - lo), device=f"cuda:{self.device}")
        for name in missing:
            e = self.index[name]
            dtype = getattr(torch, e["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise _lib.error(f"vmstash.weights: {name!r} has dtype {e['dtype']!r}, unknown here",
                                 _lib.INVALID_ARGUMENT)
            off = at.get(name, 0) - lo
            if e["nbytes"] == 0:
                t = torch.empty(e["shape"], dtype=dtype, device=f"cuda:{self.device}")
            elif off % dtype.itemsize == 0:
                t = base[off:off + e["nbytes"]].view(dtype).view(e["shape"])
            else:  # not aligned for its dtype from the base: a tensor of its own
                t = torch.as_tensor(_Array(at[name], e["nbytes"]), device=f"cuda:{self.device}").view(dtype).view(
                    e["shape"])
            with self._lock:
                self._tensors[name] = (at.get(name, 0), t)
            out[name] = t
        return [out[n] for n in names]

    def local(self, name):
        """This process's address of the exporter's tensor `name` now (raises while the tag
        is not mapped, or when that memory is not mapped here)."""
        e = self.index.get(name)
        if e is None:
            raise KeyError(f"vmstash.weights: {name!r} is not in the index process {self.pid} published for tag "
                           f"{self.tag!r}")
        if e["nbytes"] == 0:
            return 0
        if self._handle is None:
            raise _lib.error("vmstash.weights: this view is closed", _lib.FAILED_PRECONDITION)
        out = ctypes.c_ulonglong(0)
        _lib.check(_lib.lib().vmstash_mapped_local(self._handle, e["address"], e["nbytes"], ctypes.byref(out)),
                   f"vmstash.weights: {name!r}")
        return out.value

    def tensor(self, name, at=None):
        """The exporter's tensor `name` at this process's address (valid while mapped: use
        it inside use()). Built once, and again only if its address here changed (the
        exporter's reservation there was made anew): pauses and resumes keep it. `at`: its
        address here, when the caller has it (local())."""
        if at is None:
            at = self.local(name)
        return self._tensors_at([name], {name: at})[0]  # KeyError for a name not in the index

    def close(self):
        """Unmaps the tag here. Raises vmstash.Error (FAILED_PRECONDITION) while a use() is
        in progress in any thread (leave it first)."""
        handle = getattr(self, "_handle", None)
        if handle is None:
            return
        _lib.check(_lib.lib().vmstash_mapped_close(handle), "vmstash.weights.close")
        self._handle = None
        self._tensors = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown: the library may be gone)
            pass


def map_tag(pid, tag, device=None, timeout=10.0):
    """Maps tag `tag` of process `pid` (which published it: vmstash.weights.publish) on
    this process's `device` (default: the current one; the same GPU as the exporter's),
    read-write, at this process's own addresses, for as long as the returned
    MappedWeights lives. Raises vmstash.Error: NOT_FOUND (no such process, or it shares
    no such tag), PERMISSION_DENIED (another user's), the exporter's refusal, or the
    driver's error."""
    return MappedWeights(pid, tag, device, timeout)


class SyncPlan:
    """A sync made once and run each step (vmstash.weights.sync's checks done at
    construction): for a trainer that keeps the same source tensors from step to step (its
    parameters), so a step costs one batched copy and no per-tensor Python work. Build a
    new plan when the sources are new tensors, or the view was mapped again."""

    def __init__(self, src, dst, name_map=None):
        torch = _torch()
        self.dst = dst
        targets, srcs = [], []
        for name, t in _items(src, "vmstash.weights.sync"):
            target = name_map(name) if name_map is not None else name
            if target is None:
                continue
            e = dst.index.get(target)
            if e is None:
                raise KeyError(f"vmstash.weights.sync: {target!r} (from {name!r}) is not in the index process "
                               f"{dst.pid} published for tag {dst.tag!r}")
            if not isinstance(t, torch.Tensor) or not t.is_cuda or t.get_device() != dst.device:
                raise ValueError(f"vmstash.weights.sync: {name!r} is not a tensor on cuda:{dst.device}")
            if list(t.shape) != list(e["shape"]):
                raise ValueError(f"vmstash.weights.sync: {name!r} has shape {list(t.shape)}, {target!r} has "
                                 f"{list(e['shape'])}")
            targets.append(target)
            srcs.append(t)
        self.srcs = srcs
        self.targets = targets
        self.dsts = None  # built at the first run, inside a use (the tag mapped)
        self.nbytes = 0
        if len(set(targets)) != len(targets):
            twice = sorted({t for t in targets if targets.count(t) > 1})
            raise ValueError(f"vmstash.weights.sync: {twice[:3]} would be written by several sources")
        self._placed = [t for t in targets if dst.index[t]["nbytes"] > 0]
        placed = [dst.index[t] for t in self._placed]
        # Into a backup: (published entry, its dtype, the source) of each placed target.
        dtypes = {}
        for e in placed:
            dtype = getattr(torch, e["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"vmstash.weights.sync: {e['name']!r} has dtype {e['dtype']!r}, unknown here")
            dtypes[e["name"]] = dtype
        self._backup_items = [(dst.index[t], dtypes[t], s) for t, s in zip(targets, srcs)
                              if dst.index[t]["nbytes"] > 0]
        self._backup_arrays = None  # when no source needs converting: the C call's arrays, made once
        self._remotes = (ctypes.c_ulonglong * len(placed))(*(e["address"] for e in placed))
        self._sizes = (ctypes.c_ulonglong * len(placed))(*(e["nbytes"] for e in placed))
        self._locals = None  # where the destinations were built: checked after every new grant
        self._checked_grants = None  # the grant count they were last checked under

    def run(self, stream=None):
        """Copies the sources into the mapped weights on `stream` (default: the current
        stream, after its queued work); complete on return. Returns {"tensors", "bytes"}."""
        torch = _torch()
        current = torch.cuda.current_stream(self.dst.device)
        if stream is None:
            stream = current
        elif stream != current:
            stream.wait_stream(current)  # after the work that made the sources
        with self.dst._scope(stream, backup=True) as (state, grants):
            if state == _BACKUP:
                return self._run_into_backup(stream)
            # Every destination is in the memory mapped now, where it was built (one call,
            # again only after a new grant: none comes while the use is held): a tensor the
            # rollout freed, or memory its tag mapped after the grant, is an error here,
            # never a write to an unmapped address.
            if grants != self._checked_grants:
                _lib.check(_lib.lib().vmstash_mapped_check(self.dst._handle, self._remotes, self._sizes,
                                                           self._locals, len(self._remotes)),
                           "vmstash.weights.sync")
            if self.dsts is None:
                n = len(self._placed)
                locals_ = (ctypes.c_ulonglong * n)()
                _lib.check(_lib.lib().vmstash_mapped_locals(self.dst._handle, self._remotes, self._sizes, locals_, n),
                           "vmstash.weights.sync")
                self.dsts = self.dst._tensors_at(self.targets, dict(zip(self._placed, locals_)))
                self.nbytes = sum(d.numel() * d.element_size() for d in self.dsts)
                self._locals = locals_
            self._checked_grants = grants
            if self.dsts:
                with torch.cuda.stream(stream):
                    torch._foreach_copy_(self.dsts, self.srcs)
        return {"tensors": len(self.dsts), "bytes": self.nbytes, "into": "device"}

    def _write(self, items):
        """One C call: items' bytes (entry, source tensor) into the backup, on `stream`."""
        n = len(items)
        remotes = (ctypes.c_ulonglong * n)(*(e["address"] for e, _ in items))
        srcs = (ctypes.c_ulonglong * n)(*(t.data_ptr() for _, t in items))
        sizes = (ctypes.c_ulonglong * n)(*(e["nbytes"] for e, _ in items))
        return remotes, srcs, sizes, n

    def _run_into_backup(self, stream):
        """The exporter's tag is paused with its backup in the node pool: each source (its
        dtype converted, made contiguous, in groups of _STAGE_BYTES) is copied into the
        backup bytes of its destination (device to host, on `stream`), all checked by the
        library before any is written. The use() around it waits for the copies."""
        torch = _torch()
        l = _lib.lib()
        handle = self.dst._handle
        raw = ctypes.c_void_p(stream.cuda_stream)
        nbytes = sum(e["nbytes"] for e, _, _ in self._backup_items)
        direct = all(s.dtype == d and s.is_contiguous() for _, d, s in self._backup_items)
        if direct:
            # The destinations' arrays made once; the sources' addresses read at each run (a
            # parameter's .data may have been replaced since).
            if self._backup_arrays is None:
                self._backup_arrays = self._write([(e, s) for e, _, s in self._backup_items])
            remotes, srcs, sizes, n = self._backup_arrays
            for i, (e, _, s) in enumerate(self._backup_items):
                if s.numel() * s.element_size() != e["nbytes"]:  # its .data replaced by another size
                    raise ValueError(f"vmstash.weights.sync: the source of {e['name']!r} now holds "
                                     f"{s.numel() * s.element_size()} bytes, its destination {e['nbytes']}")
                srcs[i] = s.data_ptr()
            _lib.check(l.vmstash_mapped_write_backup(handle, remotes, srcs, sizes, n, raw), "vmstash.weights.sync")
            return {"tensors": len(self.targets), "bytes": nbytes, "into": "backup"}
        with torch.cuda.stream(stream):
            group, group_bytes = [], 0
            for i, (e, dtype, s) in enumerate(self._backup_items):
                if s.dtype != dtype or not s.is_contiguous():
                    s = s.to(dtype).contiguous()  # on `stream`: freed blocks are reused after these copies
                group.append((e, s))
                group_bytes += e["nbytes"]
                if group_bytes >= _STAGE_BYTES or i + 1 == len(self._backup_items):
                    remotes, srcs, sizes, n = self._write(group)
                    _lib.check(l.vmstash_mapped_write_backup(handle, remotes, srcs, sizes, n, raw),
                               "vmstash.weights.sync")
                    group, group_bytes = [], 0
        return {"tensors": len(self.targets), "bytes": nbytes, "into": "backup"}


def sync(src, dst, name_map=None, stream=None):
    """Copies the trainer's tensors `src` (a dict name -> tensor, or (name, tensor) pairs)
    into the mapped weights `dst` (map_tag), at device bandwidth: one batched copy
    (torch._foreach_copy_; dtypes may differ: converted). `name_map(name)` gives the
    published name of a source name, or None to skip it (fused layouts map their parts as
    frameworks do). Every source must match its destination's shape. The copies run on
    `stream` (default: the current stream, after the work queued there) and are complete
    when sync returns. While the exporter's tag is paused with its backup in the node pool
    (the view's state "backup"), the copies go into that backup instead, and the
    exporter's resume restores them. Raises KeyError for a name not in the index,
    ValueError for a shape mismatch or a source on another device, vmstash.Error
    (FAILED_PRECONDITION) while the exporter's tag is paused without a backup to write (or
    a destination is not in it), or the exporter is gone. Returns {"tensors", "bytes",
    "into": "device" | "backup"}.
    A trainer that syncs the same tensors every step makes a SyncPlan once instead."""
    return SyncPlan(src, dst, name_map).run(stream)
