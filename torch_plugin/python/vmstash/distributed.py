"""One phase switch for the whole job: on every rank of a process group, or on none.

    import vmstash.distributed as vd
    vd.switch(pause=["train"], resume=["weights", "kv"], timeout=60)   # every rank calls it
    vd.pause("kv"); vd.resume("kv")

Each rank's own switch is all or nothing on its device (Note [Switch Protocol]); this module
makes the ranks' switches one transaction, in two exchanges over a CPU process group (gloo,
so that a broken GPU state cannot block them), with torch.distributed:

  1. The request: every rank's tag lists. Ranks that asked for different lists: ValueError
     on every rank, nothing changed.
  2. Every rank runs its switch up to the commit (vmstash.switch with an agreement, Note
     [Agreed Switch] in allocator/switch.h: all copies done, a rollback still possible),
     then the ranks exchange their outcomes: all prepared, every rank commits; any failure,
     every rank rolls back, and each raises vmstash.Error naming the ranks that failed and
     why (ABORTED on the ranks that were ready; their own error on the ranks that failed).
  A rank that dies or hangs: the others' exchange fails (at once for a dead rank, whose
  connections close; after `timeout` for a hung one), and they roll back and raise
  (DEADLINE_EXCEEDED). A rank already in the requested state is prepared at once (its
  switch moves nothing), so a retry after a failure converges. While a rank waits in
  exchange 2, its tags of the switch are held (pausing/resuming): the exchange should be
  the only thing the other ranks are waiting for.

Note [Exchange Generations]
A gloo group whose collective timed out is dead for good (gloo closes the pair: "Application
timeout caused pair closure"; measured with torch's gloo), so a retry on it could never meet
the others. The exchanges therefore run in generations: the job's store (torch.distributed's
TCPStore) holds a generation number per group of ranks; each call reads it, and (re)connects a
gloo group of its own for a generation it has not joined yet. Any failed exchange abandons
its generation (compare-and-set to the next), so every later call, on every rank, meets in a
fresh group: a retry converges once the ranks call together again, and a late rank's call
meets the others' retry or fails, but never acts on a stale message (every message carries
its generation, switch and step; what a completed vote means is Note [Switch Decision]).
Joining a generation is a count in the store: the rank that
brings it to the group's size says "joined", a rank that gives up first cancels it
(atomically: a large add), so no rank waits for a peer that has left. Each exchange is one
all-gather of the group (1 KiB slots; a second one for larger objects).

Note [Switch Decision]
The vote alone cannot decide: its exchange may complete on one rank and fail on another at
the same instant (a timeout, a peer or a store connection lost). So the decision is recorded
once in the store, and every rank that voted yes learns it there rather than deciding
alone: each rank marks the switch's decision key "open" before it sends its request (so
every mark precedes every decision: no vote completes before every request was sent); a
rank that saw every vote yes proposes "commit", a rank whose vote exchange failed (having
voted yes) proposes "abort", each by compare-and-set from "open", and each does what the
store then holds — the first proposal wins, for every rank. A rank that saw a no vote (or
voted no) rolls back without the store: no rank can have seen every vote yes. A store that
cannot be reached is asked again until `timeout`; still unreachable, the rank does not know
the job's decision: it rolls back and raises vmstash.Error (UNKNOWN) saying so and that its
tags are as before the switch (other ranks may have committed; a retry by every rank
converges, as a rank in the requested state moves nothing). A rank never rejoins a
generation it gave up, even when the store refused to move the counter on (its next call
moves it first), so a retry never acts on an old vote. Every decision is per (generation,
switch of the generation), which every message's stamp also carries.

The group: `group` (None: torch.distributed's default group); a rank's index in it is its
rank in the exchange. Every rank of a switch passes the same `timeout` (each timeout has its
own generations and gloo groups: ranks with different ones never meet, and time out). Ray: call it from each actor's rank with its group (docs/usage.md).
`exchange` replaces torch.distributed (tests, another collective engine): an object with
`rank`, `size` and all_gather(obj) -> list that raises on a failure or timeout; `begin()`
(optional) is called at the start of every switch; `decide(proposal, timeout)` (optional,
Note [Switch Decision]) returns the job's decision, "commit" or "abort" (without it, a vote
that completed decides). Threads of one rank switch one at a time
through its Generations (Generations.one_switch): each switch's request and vote are
consecutive in the group; a vote must be one (a (bool, str) pair) to count.
"""
import contextlib
import datetime
import pickle
import threading
import time

from . import _api, _lib
from ._codes import DEADLINE_EXCEEDED, UNKNOWN

DEFAULT_TIMEOUT = datetime.timedelta(seconds=60)
_exchanges = {}  # (ranks, this rank, timeout) -> Generations (made anew with a new store)
_exchanges_lock = threading.Lock()
_CANCEL = 1 << 30  # added to a generation's join count by the rank that gives up on it


class UnknownDecision(Exception):
    """The store could not tell this rank the job's decision (Note [Switch Decision])."""


class Generations:
    """The exchanges of one group of ranks, a generation at a time (Note [Exchange
    Generations]). `store`: torch.distributed Store operations add / compare_set / set /
    get / wait(keys, timeout) (the job's store, or a stand-in); `connect(store, prefix,
    index, size, timeout)`: a CPU group whose rendezvous keys start with `prefix`, with
    all_gather(obj) -> list (gloo by default)."""

    def __init__(self, store, ranks, index, timeout, connect=None, prefix="vmstash.distributed"):
        self._store, self.rank, self.size, self._timeout = store, index, len(ranks), timeout
        # One generation counter and one set of groups per (ranks, timeout): the callers of
        # one Generations never share a key with another's (its joins, its groups' rendezvous).
        self._key = f"{prefix}/{'_'.join(map(str, ranks))}/{timeout // datetime.timedelta(microseconds=1)}us"
        self.store = store
        # One switch at a time through this object: two threads of a rank would otherwise
        # interleave their steps, and one switch could take another's message for its own.
        self._lock, self._holder = threading.Lock(), None
        self._connect = connect if connect is not None else _GlooGroup
        self._generation, self._group, self._step = None, None, 0
        self._switch = 0  # this switch's number in the generation (every rank counts alike)
        self._left = None  # the last generation this rank gave up: never joined again

    @contextlib.contextmanager
    def one_switch(self, timeout):
        """Held for a whole switch. A switch started from inside another of this exchange
        (a hook) is refused; a thread waits for another's switch up to `timeout`."""
        if self._holder == threading.get_ident():
            raise RuntimeError("vmstash.distributed: a switch of a group from inside another switch of the same "
                               "group (a hook?) would wait for itself")
        if not self._lock.acquire(timeout=timeout.total_seconds()):
            raise _lib.error(f"vmstash.distributed.switch: another switch of this rank's group did not end within "
                             f"{timeout.total_seconds():g} s; nothing changed", DEADLINE_EXCEEDED)
        self._holder = threading.get_ident()
        try:
            yield
        finally:
            self._holder = None
            self._lock.release()

    def begin(self):
        """Joins the current generation (a new one: a fresh group), never one this rank gave
        up, and marks this switch's decision open (Note [Switch Decision]). Raises when the
        others do not join within the timeout; the generation is then abandoned."""
        self._step = 0
        key = self._key + "/generation"
        g = int(self._store.add(key, 0))
        if self._left is not None and g <= self._left:  # given up while the store refused the move
            self._store.compare_set(key, str(g), str(self._left + 1))
            g = int(self._store.add(key, 0))
            if g <= self._left:
                raise RuntimeError(f"generation {self._left} was given up, and the store's counter stays at {g}")
        if g == self._generation and self._group is not None:
            self._switch += 1
        else:
            self._generation, self._group, self._switch = g, None, 0
            prefix = f"{self._key}/{g}"
            try:
                self._join(prefix)
                self._group = self._connect(self._store, prefix + "/group", self.rank, self.size, self._timeout)
            except Exception:
                self.abandon()
                raise
        try:
            self._store.set(self._decision_key(), "open")
        except Exception:
            self.abandon()
            raise

    def _decision_key(self):
        return f"{self._key}/{self._generation}/{self._switch}/decision"

    def decide(self, proposal, timeout=None):
        """The job's decision on this switch, "commit" or "abort" (Note [Switch Decision]):
        `proposal`, recorded unless a rank recorded one first, or that one. The store is
        asked again until `timeout` (default: the exchange's) passes; then UnknownDecision.
        A decision to abort gives the generation up."""
        if proposal not in ("commit", "abort"):
            raise ValueError(f"decide: proposal is 'commit' or 'abort', got {proposal!r}")
        timeout = self._timeout if timeout is None else timeout
        until, pause, last = time.monotonic() + timeout.total_seconds(), 0.01, None
        while True:
            try:
                got = self._store.compare_set(self._decision_key(), "open", proposal)
                got = got.decode() if isinstance(got, (bytes, bytearray)) else str(got)
                if got not in ("commit", "abort"):
                    raise RuntimeError(f"the decision key holds {got!r}")
                break
            except Exception as e:  # noqa: BLE001 - asked again until the timeout
                last = e
            if time.monotonic() + pause > until:
                self._leave()
                raise UnknownDecision(f"the store did not answer within {timeout.total_seconds():g} s "
                                      f"({type(last).__name__}: {last})") from last
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
        if got == "abort":
            self.abandon()
        return got

    def _join(self, prefix):
        count, done = prefix + "/joined", prefix + "/done"
        n = int(self._store.add(count, 1))
        if n >= _CANCEL:
            raise TimeoutError(f"generation {self._generation} was given up by a rank that waited longer")
        if n == self.size:
            self._store.set(done, "joined")
        else:
            try:
                self._store.wait([done], self._timeout)
            except Exception:  # noqa: BLE001 - cancel, unless the last rank joined meanwhile
                if int(self._store.add(count, _CANCEL)) % _CANCEL != self.size:  # not every rank joined
                    self._store.set(done, "cancelled")
                    raise TimeoutError(f"not every rank joined within {self._timeout.total_seconds():g} s") from None
                self._store.wait([done], self._timeout)
        if self._store.get(done) != b"joined":
            raise TimeoutError(f"generation {self._generation} was given up by a rank that waited longer")

    def all_gather(self, obj):
        """Every rank's `obj`, in rank order; raises (and abandons the generation) on a
        failure, a timeout, or a message of another generation or step. From the second
        exchange of a switch on (the vote: a decision follows from it) it also fails when a
        rank gave the generation up meanwhile (one more read of the store; a store that
        cannot be read fails it too, as on every rank that reads it then, so that the ranks
        left agree). A stale request needs no such check: the vote after it cannot complete."""
        if self._group is None:
            raise RuntimeError("vmstash.distributed: all_gather before begin()")
        self._step += 1
        stamp = (self._generation, self._switch, self._step)
        try:
            out = self._group.all_gather((stamp, obj))
            strays = [r for r, (s, _) in enumerate(out) if s != stamp]
            if strays:
                raise RuntimeError(f"ranks {strays} sent messages of another exchange (generation, switch, step "
                                   f"{[out[r][0] for r in strays]}, expected {stamp})")
        except Exception:
            self.abandon()
            raise
        return [o for _, o in out]

    def _leave(self):
        """This rank is done with its generation: its later calls join a newer one."""
        self._group = None
        if self._generation is not None:
            self._left = self._generation if self._left is None else max(self._left, self._generation)

    def abandon(self):
        """Moves every later call on to a fresh generation (idempotent). Where the store
        cannot be reached, this rank's next begin() moves the counter on first."""
        self._leave()
        g = self._generation
        if g is not None:
            try:
                self._store.compare_set(self._key + "/generation", str(g), str(g + 1))
            except Exception:  # noqa: BLE001 - a store that is gone: begin() tries again
                pass


class _GlooGroup:
    """All-gather of Python objects over a gloo ProcessGroup of its own (not registered with
    torch.distributed's default world): one all-gather of fixed-size slots (the length, then
    the pickled object); a second, padded to the longest, only when an object is larger."""

    SLOT = 1024  # bytes per rank in the first all-gather; requests and votes fit

    def __init__(self, store, prefix, rank, size, timeout):
        import torch
        import torch.distributed as dist
        self._torch, self._size = torch, size
        self._pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, timeout)

    def all_gather(self, obj):
        torch = self._torch
        data = pickle.dumps(obj)
        head = len(data).to_bytes(8, "little")
        mine = torch.zeros(self.SLOT, dtype=torch.uint8)
        body = data if len(data) <= self.SLOT - 8 else b""
        mine[:8 + len(body)] = torch.frombuffer(bytearray(head + body), dtype=torch.uint8)
        slots = [torch.empty(self.SLOT, dtype=torch.uint8) for _ in range(self._size)]
        self._pg.allgather([slots], [mine]).wait()
        raw = [bytes(t.numpy()) for t in slots]
        lengths = [int.from_bytes(r[:8], "little") for r in raw]
        longest = max(lengths)
        if longest <= self.SLOT - 8:
            return [pickle.loads(r[8:8 + n]) for r, n in zip(raw, lengths)]
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self._size)]
        self._pg.allgather([out], [padded]).wait()
        return [pickle.loads(bytes(t[:n].numpy())) for t, n in zip(out, lengths)]


def _torch_exchange(group, timeout):
    import torch.distributed as dist
    if not dist.is_initialized():
        raise RuntimeError("vmstash.distributed: torch.distributed is not initialized (init_process_group)")
    ranks = tuple(range(dist.get_world_size())) if group is None else tuple(dist.get_process_group_ranks(group))
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"vmstash.distributed: rank {me} is not in the group (ranks {list(ranks)})")
    from torch.distributed import distributed_c10d as c10d
    store = c10d._get_default_store()
    key = (ranks, me, timeout)
    with _exchanges_lock:  # threads making their first switch at once share one
        ex = _exchanges.get(key)
        if ex is None or ex.store is not store:  # first use, or a process group made anew (a new store)
            ex = _exchanges[key] = Generations(store, ranks, ranks.index(me), timeout)
        return ex


def _as_timedelta(timeout):
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


def switch(pause=(), resume=(), group=None, timeout=DEFAULT_TIMEOUT, device=None, *, exchange=None):
    """Pauses `pause` and resumes `resume` on every rank of `group`, or on none (see the
    module's docstring). Returns True when this rank's tags changed, False when they were
    in the requested state already. `timeout` (seconds or a timedelta): how long a rank
    waits for the others in each exchange. `device`: this rank's device (None: the one
    holding these tags)."""
    if isinstance(pause, str) or isinstance(resume, str):
        raise TypeError("switch: pause and resume are lists of tag names, not a string")
    pause, resume = list(pause), list(resume)
    timeout = _as_timedelta(timeout)
    ex = exchange if exchange is not None else _torch_exchange(group, timeout)
    with ex.one_switch(timeout) if isinstance(ex, Generations) else contextlib.nullcontext():
        return _switch(ex, pause, resume, timeout, device)


def _switch(ex, pause, resume, timeout, device):
    request = (sorted(pause), sorted(resume))
    requests = _gather(ex, request, timeout, "the request", begin=True)
    differ = [r for r, q in enumerate(requests) if q != request]
    if differ:
        listed = "; ".join(f"rank {r}: pause {q[0]}, resume {q[1]}" for r, q in enumerate(requests))
        raise ValueError(f"vmstash.distributed.switch: the ranks asked for different switches, nothing changed "
                         f"({listed})")
    outcomes = []
    unanswered = []  # the exchange of outcomes failed (a dead or hung rank)
    unknown = []  # the job's decision could not be learned (Note [Switch Decision])
    voted = []
    decide = getattr(ex, "decide", None)

    def learn(proposal):
        """The job's decision where the exchange records one, else `proposal`."""
        if decide is None:
            return proposal
        try:
            return decide(proposal, timeout)
        except UnknownDecision as e:
            unknown.append(e)
            return "unknown"

    def agree(local):
        voted.append(True)
        mine = (True, "") if local is None else (False, str(local))
        try:
            outcomes.extend(ex.all_gather(mine))
            bad = [r for r, o in enumerate(outcomes) if not (isinstance(o, tuple) and len(o) == 2
                                                             and isinstance(o[0], bool) and isinstance(o[1], str))]
            if bad:
                raise RuntimeError(f"ranks {bad} sent something else than a vote: {[outcomes[r] for r in bad]}")
        except Exception as e:  # noqa: BLE001 - a dead or hung rank, or a broken group
            # A rank that voted yes never decides alone: another may have seen every vote.
            decision = learn("abort") if local is None else "abort"
            if decision == "commit":
                return None
            if decision == "unknown":
                return _unknown_reason(unknown[0], e)
            unanswered.append(e)
            return (f"no agreement: the ranks did not all answer within {timeout.total_seconds():g} s "
                    f"({type(e).__name__}: {e}); every rank rolls back")
        failed = [(r, m) for r, (ok, m) in enumerate(outcomes) if not ok]
        if failed:
            return "; ".join(f"rank {r} of {ex.size} failed: {m}" for r, m in failed) + "; every rank rolls back"
        decision = learn("commit")
        if decision == "commit":
            return None
        if decision == "unknown":
            return _unknown_reason(unknown[0], None)
        unanswered.append(RuntimeError("a rank gave the vote up first"))
        return ("no agreement: every rank voted yes, but a rank gave the vote up before it learned every vote "
                f"(within {timeout.total_seconds():g} s); every rank rolls back")

    try:
        return _api.switch(pause, resume, device, agree=agree)
    except Exception as e:
        if not voted:  # failed before the library could vote (bad arguments): vote no, so no rank waits
            agree(e)
        if isinstance(e, _lib.Error) and e.code == _lib.ABORTED and unknown:
            raise _lib.error(str(e), UNKNOWN) from e  # this rank rolled back without knowing the job's decision
        if isinstance(e, _lib.Error) and unanswered and e.code == _lib.ABORTED:
            raise _lib.error(str(e), DEADLINE_EXCEEDED) from e  # this rank was ready; the others did not answer
        raise


def _unknown_reason(cause, exchange_error):
    """The message of a switch whose job-wide decision this rank could not learn."""
    lost = "" if exchange_error is None else (f"its vote exchange failed ({type(exchange_error).__name__}: "
                                              f"{exchange_error}), and ")
    return (f"outcome unknown: {lost}the job's decision could not be read from the store ({cause}); other ranks "
            "may have committed. This rank rolled back: its tags are as before the switch. Call the switch again "
            "on every rank: ranks already in the requested state move nothing, so the retry converges")


def pause(tag, group=None, timeout=DEFAULT_TIMEOUT, device=None, *, exchange=None):
    """Pauses `tag` on every rank of the group, or on none."""
    return switch([tag], [], group, timeout, device, exchange=exchange)


def resume(tag, group=None, timeout=DEFAULT_TIMEOUT, device=None, *, exchange=None):
    """Resumes `tag` on every rank of the group, or on none."""
    return switch([], [tag], group, timeout, device, exchange=exchange)


def _gather(ex, obj, timeout, what, begin=False):
    try:
        if begin and hasattr(ex, "begin"):
            ex.begin()
        return ex.all_gather(obj)
    except Exception as e:  # noqa: BLE001 - nothing has changed yet
        raise _lib.error(f"vmstash.distributed.switch: {what} was not exchanged (a rank left, or did not answer "
                         f"within {timeout.total_seconds():g} s: {type(e).__name__}: {e}); nothing changed",
                         DEADLINE_EXCEEDED) from e


# Note [NCCL Memory Across a Switch]
# What a switch does to NCCL, measured on two H100s (torch 2.11, its NCCL 2.28.9;
# gpu_two_ranks.py): eager collectives on tensors of a resumed tag, and a CUDA graph
# captured before the switches that holds an in-place all_reduce and an out-of-place
# all_gather on such tensors, give the right results after every switch out and back,
# under NCCL's defaults, NCCL_GRAPH_REGISTER=0, and torch's allocator hook
# (TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1, which ncclCommRegister's each segment).
# NCCL never maps a vmstash tag's memory into a peer: its graph (and hook) registration
# exports the buffer's physical memory as a POSIX file descriptor, and vmstash's chunks are
# created without a shareable handle type, so the export fails ("failed to IPC register
# userbuff ... type POSIX_FD" in NCCL's INFO log) and NCCL uses its own buffers instead. So
# no registration outlives a pause, and no hook needs to deregister one. (NVLS, on machines
# with multicast, binds buffers without an export; that machine had none: not measured.)
# NCCL's own device memory (its channels' buffers, ~9 MiB per channel and peer) is not
# vmstash's: 2.28.9 can release it only by destroying the communicator. NCCL >= 2.29.7 has
# ncclCommSuspend(comm, NCCL_SUSPEND_MEM) / ncclCommResume(comm): a collective (every rank
# of the communicator calls it) that releases its P2P transport buffers and maps them back
# at the same addresses (not its NVLS or network buffers). release_nccl_memory /
# restore_nccl_memory call them where the NCCL loaded in the process has them, and say so
# where it does not: call them on every rank, after a switch out of a phase that no longer
# communicates on `group`, and before it communicates again.

NCCL_SUSPEND_MEM = 0x01


def _nccl_comm(group):
    """(the NCCL library loaded in this process, this rank's ncclComm_t of `group`)."""
    import ctypes
    import torch
    import torch.distributed as dist
    if not dist.is_initialized():
        raise RuntimeError("vmstash.distributed: torch.distributed is not initialized (init_process_group)")
    pg = group if group is not None else dist.group.WORLD
    backend = pg._get_backend(torch.device("cuda", torch.cuda.current_device()))
    comm_ptr = getattr(backend, "_comm_ptr", None)
    if comm_ptr is None:
        raise RuntimeError(f"vmstash.distributed: the group's backend ({type(backend).__name__}) is not NCCL's")
    comm = comm_ptr()
    if not comm:
        raise RuntimeError("vmstash.distributed: the group has no NCCL communicator on this device yet "
                           "(run a collective first)")
    return ctypes.CDLL("libnccl.so.2"), ctypes.c_void_p(comm)


def nccl_suspend_supported():
    """(True, version) when the NCCL loaded in this process has ncclCommSuspend (>= 2.29.7);
    else (False, the reason)."""
    import ctypes
    import torch
    version = ".".join(map(str, torch.cuda.nccl.version()))
    try:
        lib = ctypes.CDLL("libnccl.so.2")
    except OSError as e:
        return False, f"NCCL is not loaded in this process ({e})"
    if not hasattr(lib, "ncclCommSuspend") or not hasattr(lib, "ncclCommResume"):
        return False, (f"NCCL {version} has no ncclCommSuspend (2.29.7 and later): its own device memory is "
                       "released only by destroying the communicator")
    return True, version


def _nccl_call(name, group, *args):
    import ctypes
    ok, why = nccl_suspend_supported()
    if not ok:
        return False, why
    lib, comm = _nccl_comm(group)
    fn = getattr(lib, name)
    fn.restype = ctypes.c_int
    rc = fn(comm, *args)
    if rc != 0:
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"vmstash.distributed: {name} failed: {lib.ncclGetErrorString(rc).decode()} ({rc})")
    return True, why


def release_nccl_memory(group=None):
    """ncclCommSuspend(NCCL_SUSPEND_MEM) on this rank's communicator of `group` (None: the
    default group), where the loaded NCCL has it (Note [NCCL Memory Across a Switch]). Every
    rank of the group calls it, with no collective of the group in flight. Returns (True,
    NCCL's version) when NCCL released its memory, (False, why not) when this NCCL cannot."""
    import torch
    torch.cuda.synchronize()
    return _nccl_call("ncclCommSuspend", group, NCCL_SUSPEND_MEM)


def restore_nccl_memory(group=None):
    """ncclCommResume on this rank's communicator of `group`: the memory release_nccl_memory
    released, back at its addresses. Every rank calls it before the group communicates
    again. Returns as release_nccl_memory does."""
    return _nccl_call("ncclCommResume", group)
