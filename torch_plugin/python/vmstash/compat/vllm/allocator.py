"""vLLM's sleep-mode allocator on vmstash: vLLM 0.33's MemAllocator protocol.

    from vmstash.compat.vllm import VmstashMemAllocator
    allocator = VmstashMemAllocator.get_instance()
    with allocator.use_memory_pool("weights"):
        model = load()                                   # in vmstash tag "vllm.weights"
    allocator.sleep(offload_tags=("weights",))           # weights kept, the rest dropped
    allocator.wake_up(["weights"])                       # same addresses: graphs replay

What vLLM's worker calls (use_memory_pool, sleep, discard, wake_up, get_current_usage,
cudagraph_pool) with vLLM's semantics (plan.py, Note [vLLM Sleep Semantics]), and vLLM's
per-tag hooks where the installed vLLM has them (Note [vLLM Tag Hooks] below). Each vLLM tag
is the vmstash tag "vllm.<tag>" with one MemPool per entry of use_memory_pool, as vLLM has
(region(), _torch.py): a pool entered again leaves its predecessor, whose free cached
segments go back (after a device synchronize) once no region is open. Tags named in
VMSTASH_VLLM_DISCARD_TAGS (comma-separated; default "kv_cache,workspace", the tags vLLM's
backends never keep) have policy "discard": no host backup is ever prepared for them.
The others have policy "backup". The pinned backup of those named in
VMSTASH_VLLM_PREPARE_TAGS (comma-separated; default "weights,runtime,cudagraph", the tags
vLLM's level-1 sleep keeps) is prepared ahead of the first sleep (vmstash.set_prepare_ahead);
any other's is made by the first sleep that keeps its bytes, and prepared ahead from then on
while its sleeps keep it, so a tag that is only ever dropped (a LoRA pool at level 2, a
user's own) never holds pinned host memory and costs its sleep nothing to give back. Every
call is one vmstash switch: all or nothing, including the device memory that a wake cannot
find (vmstash.OutOfMemoryError, a torch.OutOfMemoryError and a
RuntimeError, with every tag as it was). A sleep that drops a backup tag (level 2's
weights) first gives that tag's prepared host memory back.

Differences from vLLM's CuMemAllocator, by design: memory is freed and restored per tag in
one transaction, not per allocation; allocations of a tag that is asleep fail (vmstash
refuses new memory in a paused tag) where CuMemAllocator would make them awake; the
`pointer_to_data` view (one entry per segment of the tag's pools, as CuMemAllocator keeps
one per allocation) has no `cpu_backup_tensor` (the bytes lie in vmstash's backup arena,
vmstash.read_backup); expandable segments are left as the user set them; sleep and wake_up
run no full garbage collection (CuMemAllocator's gc.collect() took 65-82 ms per call in a
process with PyTorch loaded on the H100 machine: a third of a whole sleep), so memory that
only unreachable reference cycles hold is freed at Python's next automatic collection.
"""
import contextlib
import logging
import os
import sys
import threading
from dataclasses import dataclass

from ... import _api, _lib, _torch
from . import plan as _plan

logger = logging.getLogger("vmstash.compat.vllm")

TAG_PREFIX = "vllm."
_DEFAULT_DISCARD_TAGS = ("kv_cache", "workspace")
_DEFAULT_PREPARE_TAGS = ("weights", "runtime", "cudagraph")


_MAX_TAG = 64 - len(TAG_PREFIX)  # vmstash tag names: 1..64 printable ASCII characters


def _check_tag(tag):
    if not isinstance(tag, str) or not 1 <= len(tag) <= _MAX_TAG or not all("!" <= c <= "~" for c in tag):
        raise ValueError(f"use_memory_pool: a tag is 1..{_MAX_TAG} printable ASCII characters, no space, got {tag!r}")


@dataclass
class _Tag:
    name: str  # the vmstash tag
    policy: str
    pool_ids: set  # (device, MemPool id) of every pool made for it
    devices: set
    asleep: bool = False
    kept: bool = False


@dataclass(frozen=True)
class AllocationView:
    """One segment of a tag's pools, shaped as CuMemAllocator's AllocationData."""
    handle: tuple  # (device, size, address, None)
    tag: str
    is_asleep: bool
    cpu_backup_tensor: object = None


# Note [vLLM Tag Hooks]
#   A vLLM whose vllm.device_allocator has register_tag_hooks lets a subscriber (the KV
#   cache's transport registrations, say) tie state to a tag's mapping, and expects the
#   sleep-mode allocator to run the hooks: before_unmap before a sleep or discard unmaps a
#   tag that is mapped, and the idempotent after_map after every wake_up, for every tag with
#   nothing asleep. This allocator runs them through that module's run_before_unmap_hooks
#   and run_after_map_hooks, with one record per tag (tag, is_asleep), when the installed
#   vLLM has them (0.33 has not: then nothing runs). The module is looked up among the
#   imported ones only: a subscriber imported it to register. A transition that fails with
#   nothing changed after the before_unmap hooks ran (a hook raised, the switch failed) runs
#   the after_map hooks, so that what a hook took down comes back.
def _tag_hooks():
    """(run_before_unmap_hooks, run_after_map_hooks) of the installed vLLM, or None."""
    module = sys.modules.get("vllm.device_allocator")
    before = getattr(module, "run_before_unmap_hooks", None)
    after = getattr(module, "run_after_map_hooks", None)
    return (before, after) if callable(before) and callable(after) else None


def _tags_from_env(variable, default):
    raw = os.environ.get(variable)
    if raw is None:
        return default
    return tuple(t.strip() for t in raw.split(",") if t.strip())


class VmstashMemAllocator:
    """A process-wide allocator (get_instance()), as vLLM's worker expects."""

    instance = None
    default_tag = "default"
    _instance_lock = threading.Lock()

    @staticmethod
    def get_instance():
        with VmstashMemAllocator._instance_lock:
            if VmstashMemAllocator.instance is None:
                VmstashMemAllocator.instance = VmstashMemAllocator()
            return VmstashMemAllocator.instance

    def __init__(self, discard_tags=None, prepare_tags=None):
        self.current_tag = VmstashMemAllocator.default_tag
        self._discard_tags = tuple(discard_tags) if discard_tags is not None else \
            _tags_from_env("VMSTASH_VLLM_DISCARD_TAGS", _DEFAULT_DISCARD_TAGS)
        self._prepare_tags = tuple(prepare_tags) if prepare_tags is not None else \
            _tags_from_env("VMSTASH_VLLM_PREPARE_TAGS", _DEFAULT_PREPARE_TAGS)
        self._tags = {}  # vLLM tag -> _Tag
        self._retired = []  # MemPools left by a new entry of their tag, dropped when no region is open
        self._exchange = None  # plan.Exchange
        self._lock = threading.RLock()  # one transition at a time; state read under it

    # -- allocation ---------------------------------------------------------------------------

    def _tag(self, tag):
        t = self._tags.get(tag)
        if t is None:
            policy = "discard" if tag in self._discard_tags else "backup"
            name = TAG_PREFIX + tag
            if policy == "backup":  # declared before its first byte, so that nothing is prepared early
                _api.create_tag(name, policy)
                _api.set_prepare_ahead(name, tag in self._prepare_tags)
            t = self._tags[tag] = _Tag(name, policy, set(), set())
        return t

    def _prepare_as_slept(self, step):
        """After a sleep: a backup tag not named in prepare_tags is prepared ahead while its
        sleeps keep its bytes, and not once one dropped them."""
        for tags, ahead in ((step.keep, True), (step.drop, False)):
            for tag in tags:
                t = self._tags[tag]
                if t.policy == "backup" and tag not in self._prepare_tags:
                    try:
                        _api.set_prepare_ahead(t.name, ahead)
                    except _lib.Error as e:
                        logger.warning("vmstash vLLM allocator: could not change the preparation of %s: %s", t.name, e)

    @contextlib.contextmanager
    def use_memory_pool(self, tag=None):
        """Allocations of this thread inside go to `tag` (None: "default")."""
        if tag is None:
            tag = VmstashMemAllocator.default_tag
        _check_tag(tag)
        torch = _torch._torch()
        dev = torch.cuda.current_device()
        with self._lock:
            t = self._tag(tag)
            old_pool = _torch.take_pool(t.name, dev)  # a new pool per entry, as vLLM has
            if old_pool is not None:
                self._retired.append((dev, old_pool))
        old_tag = self.current_tag
        self.current_tag = tag
        try:
            self._drop_retired()
            with _torch.region(t.name, t.policy, device=dev) as mp:
                with self._lock:
                    t.pool_ids.add((dev, mp.id))
                    t.devices.add(dev)
                yield
        finally:
            self.current_tag = old_tag
            self._drop_retired()

    @contextlib.contextmanager
    def cudagraph_pool(self):
        """Graph captures inside allocate in tag "cudagraph" (one pool for every graph, kept
        with its bytes at both sleep levels); yields the pool id for torch.cuda.graph."""
        torch = _torch._torch()
        dev = torch.cuda.current_device()
        with self._lock:
            t = self._tag("cudagraph")
            mp = _torch.pool(t.name, t.policy, dev)
            t.pool_ids.add((dev, mp.id))
            t.devices.add(dev)
        old_tag = self.current_tag
        self.current_tag = "cudagraph"
        try:
            # The captures inside route into the pool (_torch.py, Note [Hints and Routing]).
            with _torch.routing(t.name, dev, all_threads=True):
                yield mp.id
        finally:
            self.current_tag = old_tag

    def _drop_retired(self):
        """Drops the pools left by new entries once no region is open (PyTorch refuses to
        empty a pool's cache while any pool context is active): their free cached segments
        go back, after a synchronize, since kernels may still be reading them."""
        if not self._retired:
            return
        torch = _torch._torch()
        # This allocator's lock, then _torch's (the order of sleep, discard, wake_up and
        # use_memory_pool); a region entered meanwhile waits: its count is taken under it.
        with self._lock, _torch._lock:
            if _torch.open_regions():
                return
            retired, self._retired = self._retired, []
            for dev in sorted({d for d, _ in retired}):
                torch.accelerator.synchronize(dev)
            del retired  # the pools go with their last reference (no cycles hold them)
            torch.cuda.memory.empty_cache()  # a dropped pool's cached segments are freeable now

    # -- what is there --------------------------------------------------------------------------

    def _segments(self):
        """(tag, segment) for every segment of this allocator's pools, live or retired."""
        torch = _torch._torch()
        owner = {}
        with self._lock:
            for tag, t in self._tags.items():
                for dev, pid in t.pool_ids:
                    owner[(dev, tuple(pid))] = tag
        if not owner:
            return []
        out = []
        for seg in torch.cuda.memory._snapshot()["segments"]:
            tag = owner.get((seg.get("device"), tuple(seg.get("segment_pool_id", ()))))
            if tag is not None:
                out.append((tag, seg))
        return out

    @property
    def pointer_to_data(self):
        """{address: AllocationView} for every segment of this allocator's pools (a snapshot)."""
        with self._lock:
            asleep = {tag: t.asleep for tag, t in self._tags.items()}
            segments = self._segments()
        return {s["address"]: AllocationView((s["device"], s["total_size"], s["address"], None), tag, asleep[tag])
                for tag, s in segments}

    def get_current_usage(self):
        """Bytes of every segment of this allocator's pools, asleep or not (as vLLM counts)."""
        return sum(s["total_size"] for _, s in self._segments())

    def mapped_bytes(self, tag=None):
        """Bytes of the awake tags' segments (or of `tag`'s, when awake)."""
        with self._lock:
            return sum(s["total_size"] for t, s in self._segments()
                       if not self._tags[t].asleep and (tag is None or t == tag))

    def asleep_tags(self):
        with self._lock:
            return sorted(tag for tag, t in self._tags.items() if t.asleep)

    def tag_names(self):
        """{vLLM tag: vmstash tag} of every tag this allocator made."""
        with self._lock:
            return {tag: t.name for tag, t in self._tags.items()}

    def _states(self):
        return {tag: _plan.TagState(t.policy, t.asleep, t.kept, bool(t.devices)) for tag, t in self._tags.items()}

    # -- transitions ----------------------------------------------------------------------------

    def exchange_with(self, tags, when_waking=("kv_cache",)):
        """Exchanges the caller's own vmstash `tags` (declared, e.g. a trainer's state) with
        vLLM's memory: they pause in the same switch as a wake that brings in one of
        `when_waking` (None: any wake), and resume in the same switch as the next sleep
        (plan.py, Note [vLLM Sleep Semantics]). tags=() ends the exchange (not while out)."""
        names = tuple(dict.fromkeys(_plan.normalize_tags(tags, "exchange_with", ())))  # each once
        triggers = None if when_waking is None else _plan.normalize_tags(when_waking, "exchange_with")
        with self._lock:
            if self._exchange is not None and self._exchange.out:
                raise _lib.Error("exchange_with: the exchanged tags are paused by this allocator; "
                                 "sleep() first", _lib.FAILED_PRECONDITION)
            clash = [n for n in names if n.startswith(TAG_PREFIX)]
            if clash:
                raise ValueError(f"exchange_with: {clash} are this allocator's own tags")
            missing = [n for n in names if _api.policy_of(n) is None]
            if missing:
                raise _lib.Error(f"exchange_with: {missing} are not vmstash tags of this process",
                                 _lib.NOT_FOUND)
            self._exchange = _plan.Exchange(names, triggers) if names else None

    def sleep(self, offload_tags=None):
        """Every awake tag sleeps; those in `offload_tags` (None: ("default",)) keep their
        bytes, the others lose them. One switch; then PyTorch's cache is emptied."""
        offload = _plan.normalize_tags(offload_tags, "sleep", (VmstashMemAllocator.default_tag,))
        self._drop_retired()
        torch = _torch._torch()
        with self._lock:
            step = _plan.plan_sleep(self._states(), offload, self._exchange)
            if step.exchange_in:  # the exchanged tags come back: PyTorch's cached memory first
                torch.cuda.memory.empty_cache()
            self._run(step, "sleep")
        torch.accelerator.empty_cache()

    def discard(self, tags):
        """The awake tags of `tags` lose their memory and their bytes."""
        names = _plan.normalize_tags(tags, "discard")
        with self._lock:
            self._run(_plan.plan_discard(self._states(), names), "discard")

    def wake_up(self, tags=None):
        """Wakes `tags` (None: all) and every asleep tag that is not deferrable."""
        names = _plan.normalize_tags(tags, "wake_up")
        self._drop_retired()
        _torch._torch().accelerator.empty_cache()  # PyTorch's cached memory first: the wake needs room
        with self._lock:
            try:
                self._run(_plan.plan_wake(self._states(), names, self._exchange), "wake_up")
            except _lib.Error as e:
                if e.done:  # every tag is awake; only an after-resume hook failed (Note [vLLM Tag Hooks])
                    self._run_after_map_hooks(after=e)
                raise
            self._run_after_map_hooks()

    def _run(self, step, what):
        """Executes `step` as one vmstash switch, then records the new states."""
        for t in step.conflicts:
            logger.warning("vmstash vLLM allocator: %s cannot change the policy of the already-asleep tag %r; "
                           "it was kept", what, t)
        if step.empty():
            return
        ex = self._exchange
        pause = [self._tags[t].name for t in step.keep + step.drop]
        resume = [self._tags[t].name for t in step.wake]
        if step.exchange_out:
            pause += list(ex.tags)
        if step.exchange_in:
            resume += list(ex.tags)
        # Dropped backup tags (level 2's weights): their prepared host memory goes back first
        # (not possible once paused). A switch that then fails has changed nothing else; the
        # backup is made again at the tag's next pause that keeps bytes, or by preparation.
        for t in step.drop:
            if self._tags[t].policy == "backup":
                self._release_backup(self._tags[t].name)
        dropped = [(self._tags[t].name, d) for t in step.drop if self._tags[t].policy == "backup"
                   for d in sorted(self._tags[t].devices)]
        hooks = _tag_hooks() if step.keep + step.drop else None
        try:
            if hooks:  # Note [vLLM Tag Hooks]
                hooks[0]([AllocationView(None, t, False) for t in step.keep + step.drop], None)
            _api.switch(pause, resume, keep_nothing=dropped)
        except BaseException as e:
            if isinstance(e, _lib.Error) and e.done:  # done on every device; only after-resume hooks
                self._record(step)                    # failed: record it, then say so
                self._prepare_as_slept(step)
            elif hooks:
                self._run_after_map_hooks(after=e)
            raise
        self._record(step)
        self._prepare_as_slept(step)

    def _run_after_map_hooks(self, after=None):
        """vLLM's after_map hooks of every tag with nothing asleep (Note [vLLM Tag Hooks]).
        `after`: the failure this follows, which stays the one raised (a hook's failure is
        logged then)."""
        hooks = _tag_hooks()
        if not hooks:
            return
        try:
            hooks[1]([AllocationView(None, t, s.asleep) for t, s in self._tags.items()])
        except Exception as e:  # noqa: BLE001 - the first failure is the one raised
            if after is None:
                raise
            logger.warning("vmstash vLLM allocator: an after_map hook failed after %s: %s", after, e)

    def _record(self, step):
        for tag, s in _plan.state_after(self._states(), step).items():
            self._tags[tag].asleep, self._tags[tag].kept = s.asleep, s.kept
        ex = self._exchange
        if step.exchange_out or step.exchange_in:
            self._exchange = _plan.Exchange(ex.tags, ex.triggers, out=step.exchange_out)

    @staticmethod
    def _release_backup(name):
        try:
            _api.release_backup(name)
        except _lib.Error as e:
            logger.warning("vmstash vLLM allocator: could not give back the host backup of %s: %s", name, e)

    def release_pools(self):
        """Drops this allocator's references to its retired pools (vLLM's shutdown call)."""
        self._drop_retired()

    close = release_pools
