"""vmstash.distributed on the simulated driver: several processes (ranks), each with its own
vmstash runtime, switch together or not at all. The ranks exchange through files in a shared
folder: FileStore below stands in for torch.distributed's store and FileGroup for a gloo group,
under vmstash.distributed.Generations, the module's own generation logic (Note [Exchange
Generations]). Where torch is importable, one test uses torch.distributed's own gloo (the GPU
tests in gpu_two_ranks.py use it over NCCL ranks). The sweep fails each rank at each step (it
dies or hangs at each exchange, runs out of device memory, dies after the vote): the surviving
ranks always end in one state (zero mixed states), bytes intact, and a retry by every rank
converges."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

WORKER = textwrap.dedent(r'''
    import ctypes, datetime, fcntl, json, os, pickle, sys, time
    import vmstash, vmstash.distributed as vd
    from vmstash import _lib

    MiB = 1 << 20
    folder, rank, size, scenario = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    # storefail "<rank>:<op>:<count>": in the first call, that rank's store fails from its
    # first <op> (read: the generation read at the request; open: the decision marked open;
    # decide: the decision's compare-and-set after the vote; abandon: giving the generation
    # up) on, every operation, <count> times (a connection lost for a moment, or for good).
    storefail = sys.argv[5] if len(sys.argv) > 5 else ""
    TIMEOUT = 2.0
    # scenario: "ok", or "<what>:<rank>[@<exchange>]" (the first call's exchange 1 is the
    # request, 2 the outcome): die, hang (TIMEOUT + 0.5 s), dieafter (dies once the exchange
    # is done), oom (out of device memory in its switch), differ (another tag list); with
    # "torch+" before it, over torch.distributed's store and gloo instead of files.
    torch = scenario.startswith("torch+")
    what, _, where = scenario.removeprefix("torch+").partition(":")
    victim, _, at = where.partition("@")
    victim = int(victim) if victim else -1
    at = int(at) if at else 0
    mine = rank == victim

    class FileStore:
        """torch.distributed's Store operations that vmstash.distributed uses, on files."""
        def __init__(self, root, prefix=""):
            self.root, self.prefix = root, prefix
        def _path(self, key):
            return os.path.join(self.root, (self.prefix + key).replace("/", "%"))
        def _locked(self, fn):
            with open(os.path.join(self.root, ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                return fn()
        def _read(self, key):
            try:
                with open(self._path(key), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None
        def set(self, key, value):
            value = value if isinstance(value, bytes) else str(value).encode()
            tmp = self._path(key) + f".{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(value)
            os.rename(tmp, self._path(key))
        def add(self, key, n):
            def op():
                v = int(self._read(key) or b"0") + n
                self.set(key, v)
                return v
            return self._locked(op)
        def compare_set(self, key, expected, desired):
            def op():
                cur = self._read(key)
                if cur == expected.encode():
                    self.set(key, desired)
                    return desired.encode()
                return cur
            return self._locked(op)
        def wait(self, keys, timeout):
            until = time.monotonic() + timeout.total_seconds()
            while not all(os.path.exists(self._path(k)) for k in keys):
                if time.monotonic() > until:
                    raise TimeoutError(f"keys {keys} not set within {timeout}")
                time.sleep(0.002)
        def get(self, key):
            self.wait([key], datetime.timedelta(seconds=30))
            return self._read(key)
        def prefixed(self, prefix):
            return FileStore(self.root, self.prefix + prefix + "/")

    class FailingStore(FileStore):
        """storefail's store: ConnectionError for this rank's operations as the spec says."""
        armed, left = True, 0
        def __init__(self, root, prefix="", op="", count=0):
            super().__init__(root, prefix)
            self.op, FailingStore.left = op, count
        def _fail(self, op):
            if FailingStore.armed and op == self.op and FailingStore.left > 0:
                FailingStore.armed = "failing"
            if FailingStore.armed == "failing" and FailingStore.left > 0:
                FailingStore.left -= 1
                raise ConnectionError(f"store connection lost (storefail at {op})")
        def add(self, key, n):
            if key.endswith("/generation") and n == 0:
                self._fail("read")
            else:
                self._fail("other")
            return super().add(key, n)
        def set(self, key, value):
            self._fail("open" if key.endswith("/decision") else "other")
            return super().set(key, value)
        def compare_set(self, key, expected, desired):
            self._fail("decide" if key.endswith("/decision") else "abandon")
            return super().compare_set(key, expected, desired)
        def wait(self, keys, timeout):
            self._fail("other")
            return super().wait(keys, timeout)

    exchanges = [0]  # this rank's all-gathers so far, over every generation

    def failing(gather):
        """This scenario's failure around one all-gather of this rank (counted over every
        generation): die or hang before it, die after it."""
        def all_gather(self, obj):
            exchanges[0] += 1
            first = mine and exchanges[0] == at
            if first and what == "die":
                os._exit(3)
            if first and what == "hang":
                time.sleep(TIMEOUT + 0.5)
            out = gather(self, obj)
            if first and what == "dieafter":
                os._exit(4)
            return out
        return all_gather

    class FileGroup:
        """A CPU group's all-gather over a FileStore."""
        def __init__(self, store, prefix, index, n, timeout):
            self.store, self.index, self.n, self.timeout, self.round = store.prefixed(prefix), index, n, timeout, 0
        def all_gather(self, obj):
            self.round += 1
            self.store.set(f"{self.round}/{self.index}", pickle.dumps(obj))
            keys = [f"{self.round}/{r}" for r in range(self.n)]
            self.store.wait(keys, self.timeout)
            return [pickle.loads(self.store.get(k)) for k in keys]
    FileGroup.all_gather = failing(FileGroup.all_gather)

    def malloc(tag, n, byte):
        vmstash.set_current_tag(tag)
        p = _lib.lib().vmstash_malloc(n, 0, None)
        vmstash.set_current_tag("default")
        assert p, _lib.last_error()
        ctypes.memset(p, byte, n)
        return p

    def holds(p, n, byte):
        return ctypes.string_at(p, n) == bytes([byte]) * n

    def barrier(name):
        """Every rank's first call over before any retries (as a driver that waits for every
        actor's answer, then retries): only the ranks that are alive."""
        open(os.path.join(folder, f"{name}.{rank}"), "w").close()
        until = time.monotonic() + 60
        while not all(os.path.exists(os.path.join(folder, f"{name}.{r}")) for r in range(size)):
            assert time.monotonic() < until, "barrier"
            time.sleep(0.01)

    vmstash.create_tag("train", "backup")
    vmstash.create_tag("roll", "backup")
    vmstash.create_tag("extra", "backup")
    train = malloc("train", 96 * MiB, 0x10 + rank)
    roll = malloc("roll", 200 * MiB, 0x50 + rank)
    assert vmstash.pause("roll")
    result = {"rank": rank, "calls": []}
    timeout = TIMEOUT
    if torch:  # torch.distributed's own store and gloo, no stand-in
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank, world_size=size)
        vd._GlooGroup.all_gather = failing(vd._GlooGroup.all_gather)
        ex = None
    else:
        fail_rank, _, fail = storefail.partition(":")
        fail_op, _, fail_count = fail.partition(":")
        store = (FailingStore(folder, op=fail_op, count=int(fail_count)) if storefail and int(fail_rank) == rank
                 else FileStore(folder))
        ex = vd.Generations(store, list(range(size)), rank, datetime.timedelta(seconds=TIMEOUT), connect=FileGroup)
    pause, resume = ["train"], ["roll"]
    if what == "differ" and mine:
        pause = ["train", "extra"]
    hog = None
    if what == "oom" and mine:
        hog = malloc("default", 400 * MiB, 0x77)  # roll's 200 MiB no longer fit in train's 96 and the rest
    barrier("ready")  # every rank set up (as a job's ranks are after init_process_group), then the timed calls
    if what == "ok":  # first a switch with another timeout: its exchanges are its own
        ex2 = None if torch else vd.Generations(store, list(range(size)), rank, datetime.timedelta(seconds=5),
                                                connect=FileGroup)
        result["other_timeout"] = vd.switch(["extra"], [], timeout=5.0, exchange=ex2)
    for attempt in range(3 if storefail else 2):
        if attempt == 1:
            FailingStore.armed = False  # the store is back for the retries
        t0 = time.monotonic()
        try:
            changed = vd.switch(pause, resume, timeout=timeout, exchange=ex)
            call = {"ok": True, "changed": changed}
        except ValueError as e:
            call = {"ok": False, "type": "ValueError", "message": str(e)}
        except vmstash.Error as e:
            call = {"ok": False, "type": type(e).__name__, "code": e.code_name, "message": str(e)}
        call["seconds"] = time.monotonic() - t0
        call["train"] = vmstash.tag_stats("train")["state"]
        call["roll"] = vmstash.tag_stats("roll")["state"]
        call["train_bytes"] = call["train"] != "active" or holds(train, 96 * MiB, 0x10 + rank)
        call["roll_bytes"] = call["roll"] != "active" or holds(roll, 200 * MiB, 0x50 + rank)
        result["calls"].append(call)
        print(json.dumps(result))
        sys.stdout.flush()
        if what in ("die", "dieafter"):
            break  # a dead rank's peers cannot switch without it
        if hog is not None:  # the retry, once the memory is free
            _lib.lib().vmstash_free(hog, 400 * MiB, 0, None)
            vmstash.empty_cache()
            hog = None
        pause = ["train"]
        barrier(f"attempt{attempt}")
    os._exit(0)
''')


def run_ranks(tmp_path, scenario, size=2, storefail=""):
    folder = tmp_path / (scenario + storefail).replace(":", "_").replace("@", "_").replace("+", "_")
    folder.mkdir()
    env = dict(os.environ, VMSTASH_CONF="driver:sim,sim_devices:1,sim_capacity:512M,auto_prepare:0")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(folder), str(r), str(size), scenario, storefail],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(size)]
    results = []
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        lines = [line for line in out.splitlines() if line.startswith("{")]
        r = json.loads(lines[-1]) if lines else {"calls": []}
        r.update(rank=rank, returncode=p.returncode, stderr=err[-2000:])
        results.append(r)
    return results


def states(call):
    return call["train"], call["roll"]


BEFORE, AFTER = ("active", "paused"), ("paused", "active")


def test_every_rank_switches_and_a_retry_is_a_no_op(tmp_path):
    for r in run_ranks(tmp_path, "ok", size=3):
        first, again = r["calls"]
        assert first["ok"] and first["changed"], first
        assert states(first) == AFTER
        assert first["train_bytes"] and first["roll_bytes"]
        assert again["ok"] and not again["changed"], again


def test_one_rank_out_of_memory_rolls_every_rank_back_and_the_retry_converges(tmp_path):
    ranks = run_ranks(tmp_path, "oom:1")
    for r in ranks:
        failed, retry = r["calls"]
        assert not failed["ok"], failed
        assert states(failed) == BEFORE and failed["train_bytes"], failed
        assert retry["ok"] and retry["changed"], retry
        assert states(retry) == AFTER and retry["train_bytes"] and retry["roll_bytes"]
    ready, oom = ranks[0]["calls"][0], ranks[1]["calls"][0]
    assert ready["code"] == "ABORTED"
    assert "rank 1 of 2 failed" in ready["message"]
    assert oom["type"] == "OutOfMemoryError"


def test_a_rank_that_dies_before_the_vote_rolls_the_others_back_within_the_timeout(tmp_path):
    ranks = run_ranks(tmp_path, "die:1@2")
    assert ranks[1]["returncode"] == 3
    call = ranks[0]["calls"][0]
    assert not call["ok"] and call["code"] == "DEADLINE_EXCEEDED", call
    # Bounded by the timeout (2 s), not the rank's death: no hang. (How close to the timeout
    # it gets is a figure for a quiet machine, not for this test.)
    assert call["seconds"] < 2.0 + 10.0
    assert states(call) == BEFORE and call["train_bytes"]


@pytest.mark.parametrize("at", [1, 2])
def test_a_rank_that_hangs_fails_the_switch_everywhere_and_the_retry_converges(tmp_path, at):
    ranks = run_ranks(tmp_path, f"hang:1@{at}")
    for r in ranks:
        failed, retry = r["calls"]
        assert not failed["ok"], (r["rank"], failed)
        assert states(failed) == BEFORE and failed["train_bytes"], failed
        assert retry["ok"] and retry["changed"], (r["rank"], retry)
        assert states(retry) == AFTER and retry["train_bytes"] and retry["roll_bytes"]
    call = ranks[0]["calls"][0]
    assert call["code"] == "DEADLINE_EXCEEDED" and call["seconds"] < 2.0 + 10.0, call
    if at == 1:
        assert "nothing changed" in call["message"]


def test_ranks_asking_for_different_switches_are_refused_before_anything_changes(tmp_path):
    for r in run_ranks(tmp_path, "differ:1"):
        call = r["calls"][0]
        assert call["type"] == "ValueError" and "different switches" in call["message"], call
        assert states(call) == BEFORE and call["train_bytes"]


# Each rank fails at each step of the first call: the surviving ranks end in one state,
# the one the step implies (a rank that dies once every vote is in: the others commit).
SWEEP = [(what, victim, at) for victim in (0, 2)
         for what, at in (("die", 1), ("hang", 1), ("oom", 0), ("die", 2), ("hang", 2), ("dieafter", 2))]


@pytest.mark.parametrize("what,victim,at", SWEEP, ids=[f"{w}:{v}@{a}" for w, v, a in SWEEP])
def test_sweep_no_mixed_states(tmp_path, what, victim, at):
    ranks = run_ranks(tmp_path, f"{what}:{victim}" + (f"@{at}" if at else ""), size=3)
    dead = what in ("die", "dieafter")
    survivors = [r for r in ranks if not (dead and r["rank"] == victim)]
    for r in survivors:
        assert r["returncode"] == 0 and r["calls"], r
    firsts = [r["calls"][0] for r in survivors]
    expected = AFTER if what == "dieafter" else BEFORE
    assert {states(c) for c in firsts} == {expected}, firsts
    assert all(c["train_bytes"] and c["roll_bytes"] for c in firsts)
    assert all(c["ok"] == (what == "dieafter") for c in firsts), firsts
    if not dead:  # every rank retries: the switch converges
        for r in survivors:
            retry = r["calls"][1]
            assert retry["ok"] and states(retry) == AFTER and retry["train_bytes"] and retry["roll_bytes"], retry


# Note [Switch Decision]: one rank's store fails at each step of the first call, for a
# moment (2 operations) or for good (every operation of that call): a rank that voted yes
# never decides alone. In each call a rank that fails is as before the call (one that says
# it does not know the job's decision, UNKNOWN, included), and where a rank commits a change
# every rank that knows the decision commits; the retries never act on the first call's vote and converge (a rank that could not move the
# generation on costs at most one more retry: the others may meet in the old group first,
# and that retry fails everywhere with nothing changed, the ranks still apart).
STORE_SWEEP = [(victim, op, count, hang) for victim in (0, 1) for op, count, hang in
               (("read", 2, ""), ("open", 2, ""), ("decide", 2, ""), ("decide", 1000, ""),
                ("abandon", 1000, "hang:{other}@2"))]


@pytest.mark.parametrize("victim,op,count,hang", STORE_SWEEP,
                         ids=[f"{op}x{count}:{v}{'+hang' if h else ''}" for v, op, count, h in STORE_SWEEP])
def test_store_failures_at_each_step_never_decide_alone(tmp_path, victim, op, count, hang):
    other = 1 - victim
    scenario = hang.format(other=other) or "none"  # no other failure (and no first switch of "ok")
    ranks = run_ranks(tmp_path, scenario, storefail=f"{victim}:{op}:{count}")
    for r in ranks:
        assert r["returncode"] == 0 and len(r["calls"]) == 3, r
    before = [BEFORE] * len(ranks)  # each rank's state before the call
    for attempt in range(3):
        calls = [r["calls"][attempt] for r in ranks]
        for c, was in zip(calls, before):
            if c.get("code") == "UNKNOWN":
                assert "outcome unknown" in c["message"], c
                assert "rolled back: its tags are as before the switch" in c["message"], c
            if c["ok"]:
                assert states(c) == AFTER, (attempt, c)
            else:  # failed: as before the call (an earlier UNKNOWN may have left the ranks apart)
                assert states(c) == was, (attempt, c)
        # No rank moved alone: where one committed a change, every rank that knows the
        # decision committed (or was in the requested state already).
        known = [c for c in calls if c.get("code") != "UNKNOWN"]
        if any(c["ok"] and c["changed"] for c in known):
            assert all(c["ok"] for c in known), (attempt, calls)
        assert all(c["train_bytes"] and c["roll_bytes"] for c in calls), calls
        before = [states(c) for c in calls]
    last = [r["calls"][2] for r in ranks]
    assert all(c["ok"] and states(c) == AFTER for c in last), last
    first = [r["calls"][0] for r in ranks]
    if op == "decide" and count == 2:  # a moment's loss after the vote: asked again, every rank commits
        assert all(c["ok"] and c["changed"] and states(c) == AFTER for c in first), first
    if op == "decide" and count == 1000:  # lost for good after the vote: the victim says it does not know
        assert first[victim]["code"] == "UNKNOWN", first
        assert first[other]["ok"] and states(first[other]) == AFTER, first
    if op in ("read", "open"):  # before anything moved: nothing changed anywhere
        assert all(not c["ok"] and states(c) == BEFORE for c in first), first


TORCH = ["ok", "oom:1", "hang:1@1", "hang:0@2", "die:1@2", "dieafter:0@2"]


@pytest.mark.parametrize("scenario", TORCH)
def test_torch_distributed_gloo_no_mixed_states(tmp_path, scenario):
    """The same over torch.distributed's own store and gloo groups (where torch is importable)."""
    pytest.importorskip("torch.distributed")
    what, _, where = scenario.partition(":")
    victim = int(where.partition("@")[0]) if where else -1
    ranks = run_ranks(tmp_path, "torch+" + scenario)
    dead = what in ("die", "dieafter")
    survivors = [r for r in ranks if not (dead and r["rank"] == victim)]
    for r in survivors:
        assert r["returncode"] == 0 and r["calls"], r
        first = r["calls"][0]
        assert states(first) == (BEFORE if what not in ("ok", "dieafter") else AFTER), first
        assert first["ok"] == (what in ("ok", "dieafter")), first
        assert first["train_bytes"] and first["roll_bytes"]
        if not dead:
            retry = r["calls"][1]
            assert retry["ok"] and states(retry) == AFTER and retry["changed"] == (what != "ok"), retry
    if what == "oom":
        assert "rank 1 of 2 failed" in ranks[0]["calls"][0]["message"]
    if what in ("hang", "die"):
        call = survivors[0]["calls"][0]
        assert call["code"] == "DEADLINE_EXCEEDED" and call["seconds"] < 2.0 + 10.0, call


def test_the_gloo_all_gather_carries_objects_larger_than_its_slots(gloo_pair):
    """vmstash.distributed's gloo all-gather: small objects in one all-gather, larger ones
    in a second (two ranks, threads, torch's own HashStore and gloo)."""
    pytest.importorskip("torch.distributed")
    out = gloo_pair("t", lambda g, r: (g.all_gather(("small", r)),
                                       g.all_gather(["tag%d" % i for i in range(400 + r)]), g.all_gather(r)))
    for r in range(2):
        small, large, again = out[r]
        assert small == [("small", 0), ("small", 1)]
        assert [len(x) for x in large] == [400, 401] and large[1][-1] == "tag400"
        assert again == [0, 1]


def test_switch_refuses_a_string_and_needs_torch_distributed_without_an_exchange():
    import vmstash.distributed as vd
    with pytest.raises(TypeError):
        vd.switch("train", [])
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError):
            vd.switch(["train"], [])
