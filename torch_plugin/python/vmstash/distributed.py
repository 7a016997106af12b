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
  A rank that dies or hangs: the others' exchange fails after `timeout` (the CPU group's),
  and they roll back and raise (DEADLINE_EXCEEDED). A rank already in the requested state
  is prepared at once (its switch moves nothing), so a retry after a failure converges.
  While a rank waits in exchange 2, its tags of the switch are held (pausing/resuming):
  the exchange should be the only thing the other ranks are waiting for.

The group: `group` (None: torch.distributed's default group); when its backend is not gloo,
a gloo group over the same ranks is made once per group and timeout (by the group's ranks
only, in the same order, as they all call switch). Ray: call it from each
actor's rank with its group (docs/usage.md). `exchange` replaces torch.distributed (tests,
another collective engine): an object with `rank`, `size` and all_gather(obj) -> list that
raises on a timeout.
"""
import datetime

from . import _api, _lib
from ._codes import DEADLINE_EXCEEDED

DEFAULT_TIMEOUT = datetime.timedelta(seconds=60)
_groups = {}  # (ranks, timeout seconds) -> gloo group


class _TorchExchange:
    """all_gather_object over a gloo group of the given group's ranks."""

    def __init__(self, group, timeout):
        import torch.distributed as dist
        if not dist.is_initialized():
            raise RuntimeError("vmstash.distributed: torch.distributed is not initialized (init_process_group)")
        self._dist = dist
        ranks = tuple(range(dist.get_world_size())) if group is None else tuple(dist.get_process_group_ranks(group))
        seconds = timeout.total_seconds()
        if group is not None and dist.get_backend(group) == "gloo":
            self._group = group
        elif group is None and dist.get_backend() == "gloo":
            self._group = None
        else:
            key = (ranks, seconds)
            if key not in _groups:
                # Only the group's ranks make it (not every rank of the job, as new_group
                # otherwise requires): a tensor-parallel group switches on its own.
                _groups[key] = dist.new_group(list(ranks), backend="gloo", timeout=timeout,
                                              use_local_synchronization=True)
            self._group = _groups[key]
        self.rank = dist.get_rank(self._group) if self._group is not None else dist.get_rank()
        self.size = len(ranks)

    def all_gather(self, obj):
        out = [None] * self.size
        self._dist.all_gather_object(out, obj, group=self._group)
        return out


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
    ex = exchange if exchange is not None else _TorchExchange(group, timeout)
    request = (sorted(pause), sorted(resume))
    requests = _gather(ex, request, timeout, "the request")
    differ = [r for r, q in enumerate(requests) if q != request]
    if differ:
        listed = "; ".join(f"rank {r}: pause {q[0]}, resume {q[1]}" for r, q in enumerate(requests))
        raise ValueError(f"vmstash.distributed.switch: the ranks asked for different switches, nothing changed "
                         f"({listed})")
    outcomes = []
    unanswered = []  # the exchange of outcomes failed (a dead or hung rank)

    def agree(local):
        mine = (True, "") if local is None else (False, str(local))
        try:
            outcomes.extend(ex.all_gather(mine))
        except Exception as e:  # noqa: BLE001 - a dead or hung rank, or a broken group
            unanswered.append(e)
            return (f"no agreement: the ranks did not all answer within {timeout.total_seconds():g} s "
                    f"({type(e).__name__}: {e}); every rank rolls back")
        failed = [(r, m) for r, (ok, m) in enumerate(outcomes) if not ok]
        if not failed:
            return None
        return "; ".join(f"rank {r} of {ex.size} failed: {m}" for r, m in failed) + "; every rank rolls back"

    try:
        return _api.switch(pause, resume, device, agree=agree)
    except _lib.Error as e:
        if unanswered and e.code == _lib.ABORTED:  # this rank was ready; the others did not answer
            raise _lib.error(str(e), DEADLINE_EXCEEDED) from e
        raise


def pause(tag, group=None, timeout=DEFAULT_TIMEOUT, device=None, *, exchange=None):
    """Pauses `tag` on every rank of the group, or on none."""
    return switch([tag], [], group, timeout, device, exchange=exchange)


def resume(tag, group=None, timeout=DEFAULT_TIMEOUT, device=None, *, exchange=None):
    """Resumes `tag` on every rank of the group, or on none."""
    return switch([], [tag], group, timeout, device, exchange=exchange)


def _gather(ex, obj, timeout, what):
    try:
        return ex.all_gather(obj)
    except Exception as e:  # noqa: BLE001 - nothing has changed yet
        raise _lib.error(f"vmstash.distributed.switch: {what} was not exchanged within {timeout.total_seconds():g} s "
                         f"({type(e).__name__}: {e}); nothing changed", DEADLINE_EXCEEDED) from e
