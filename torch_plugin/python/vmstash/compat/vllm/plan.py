"""What a vLLM sleep, discard or wake does to vmstash's tags: pure decisions.

No torch, no library, no state: each function takes the tags' present states and the call's
arguments and returns one Step, the single vmstash switch that carries the call out (the
allocator, allocator.py, executes it). Bad input raises ValueError before anything changes.

Note [vLLM Sleep Semantics] (vLLM 0.33's MemAllocator protocol, vllm/device_allocator)
  - sleep(offload_tags): every awake tag goes to sleep; those in offload_tags keep their
    bytes (a vmstash pause with the MemPool's liveness hint), the others lose them (a pause
    with an empty hint: nothing copied). A tag already asleep stays as it is, even when the
    call asks for the other policy (a "conflict", reported, not an error, as in vLLM).
  - discard(tags): those awake tags go to sleep without their bytes.
  - wake_up(tags): tags=None wakes every tag; otherwise the tags named, and every asleep
    tag that is not deferrable (DEFERRABLE_TAGS: only weights and kv_cache may stay
    asleep). A tag slept without its bytes comes back with undefined contents.
  - Exchange (vmstash's addition): a set of the caller's own vmstash tags (e.g. a trainer's
    optimizer state) may be exchanged with vLLM's: they go out in the same switch as a wake
    that brings in one of the trigger tags (None: any wake that brings something in), and
    come back in the same switch as the next sleep. Both copy directions then run at once
    and physical memory goes from the outgoing tags to the incoming ones.
  - Tags of policy "discard" (no host backup is ever prepared for them) cannot be asked to
    keep their bytes: sleep refuses before anything changes.
"""
from dataclasses import dataclass, field

# vllm/device_allocator/__init__.py of vLLM 0.33: the tags a selective wake may defer.
DEFERRABLE_TAGS = ("weights", "kv_cache")


@dataclass(frozen=True)
class TagState:
    policy: str  # "backup" or "discard": fixed when the tag is made
    asleep: bool = False
    kept: bool = False  # asleep with its bytes (the last sleep backed it up)
    has_memory: bool = True  # a tag that never allocated needs no transition


@dataclass(frozen=True)
class Exchange:
    tags: tuple  # the caller's vmstash tag names
    triggers: tuple = None  # vLLM tags whose wake sends them out (None: any wake)
    out: bool = False  # out now (paused by a wake of this allocator)


@dataclass(frozen=True)
class Step:
    keep: tuple = ()  # vLLM tags paused with their bytes
    drop: tuple = ()  # vLLM tags paused without them
    wake: tuple = ()  # vLLM tags resumed
    exchange_out: bool = False  # the exchange tags pause in the same switch
    exchange_in: bool = False  # the exchange tags resume in the same switch
    conflicts: tuple = ()  # asleep tags whose requested policy differs from their sleep
    unknown: tuple = field(default=())  # named tags this allocator never made (ignored)

    def empty(self):
        return not (self.keep or self.drop or self.wake or self.exchange_out or self.exchange_in)


def normalize_tags(tags, what, default=None):
    """A tuple of tag names from None (-> default), one str, or an iterable of str."""
    if tags is None:
        return default
    if isinstance(tags, str):
        return (tags,)
    try:
        out = tuple(tags)
    except TypeError:
        raise ValueError(f"{what}: expected a tag name or a sequence of tag names, got {tags!r}") from None
    bad = [t for t in out if not isinstance(t, str) or not t]
    if bad:
        raise ValueError(f"{what}: tag names are non-empty strings, got {bad[0]!r}")
    return out


def plan_sleep(states, offload_tags, exchange=None):
    """sleep(offload_tags): `states` {tag: TagState}; `offload_tags` a tuple of names."""
    refused = sorted(t for t in offload_tags
                     if t in states and states[t].policy == "discard" and not states[t].asleep
                     and states[t].has_memory)
    if refused:
        raise ValueError(
            f"sleep: tag(s) {refused} cannot keep their bytes: vmstash made them with policy 'discard' "
            "(no host backup is prepared for them); list them in VMSTASH_VLLM_DISCARD_TAGS only if "
            "they never need a backup")
    keep, drop, conflicts = [], [], []
    for tag, s in states.items():
        wanted = tag in offload_tags
        if s.asleep:
            if s.kept != wanted and s.has_memory:
                conflicts.append(tag)
            continue
        if s.has_memory:
            (keep if wanted else drop).append(tag)
    exchange_in = exchange is not None and exchange.out
    return Step(keep=tuple(keep), drop=tuple(drop), exchange_in=exchange_in, conflicts=tuple(conflicts),
                unknown=tuple(t for t in offload_tags if t not in states))


def plan_discard(states, tags):
    """discard(tags): those awake tags lose their memory and their bytes."""
    drop, conflicts = [], []
    for t in tags:
        s = states.get(t)
        if s is None or not s.has_memory:
            continue
        if s.asleep:
            if s.kept:
                conflicts.append(t)
            continue
        drop.append(t)
    return Step(drop=tuple(drop), conflicts=tuple(conflicts), unknown=tuple(t for t in tags if t not in states))


def plan_wake(states, tags, exchange=None):
    """wake_up(tags): tags None wakes all; else the named and every non-deferrable tag."""
    wake = tuple(t for t, s in states.items()
                 if s.asleep and (tags is None or t in tags or t not in DEFERRABLE_TAGS))
    exchange_out = False
    if exchange is not None and not exchange.out and wake:
        exchange_out = exchange.triggers is None or any(t in exchange.triggers for t in wake)
    unknown = () if tags is None else tuple(t for t in tags if t not in states)
    return Step(wake=wake, exchange_out=exchange_out, unknown=unknown)


def state_after(states, step):
    """The tags' states once `step` is done."""
    out = dict(states)
    for t in step.keep:
        out[t] = TagState(states[t].policy, asleep=True, kept=True, has_memory=states[t].has_memory)
    for t in step.drop:
        out[t] = TagState(states[t].policy, asleep=True, kept=False, has_memory=states[t].has_memory)
    for t in step.wake:
        out[t] = TagState(states[t].policy, asleep=False, kept=False, has_memory=states[t].has_memory)
    return out
