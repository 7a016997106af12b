"""vmstash.distributed's exchanges, case by case, on the simulated driver: a store in memory
(MemStore) and scripted groups stand in for torch.distributed's store and gloo where the case
needs a precise order (threads of one rank, a vote of the wrong shape, cancels arriving late);
torch's own store and gloo where torch is importable (the slot boundary of the gloo all-gather,
two ranks' edge cases, a process group made anew with a replacement rank). The multi-process
sweep is in test_distributed.py."""
import datetime
import os
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest

MiB = 1 << 20


class MemStore:
    """torch.distributed Store operations Generations uses, in memory (thread-safe)."""

    def __init__(self, data=None, cv=None, prefix=""):
        self.data = {} if data is None else data
        self.cv = cv or threading.Condition()
        self.prefix = prefix
        self.log = []  # (op, key, arg)

    def add(self, key, n):
        with self.cv:
            v = int(self.data.get(self.prefix + key, b"0")) + n
            self.data[self.prefix + key] = str(v).encode()
            self.log.append(("add", self.prefix + key, n))
            self.cv.notify_all()
            return v

    def set(self, key, value):
        with self.cv:
            self.data[self.prefix + key] = value if isinstance(value, bytes) else str(value).encode()
            self.cv.notify_all()

    def get(self, key):
        self.wait([key], datetime.timedelta(seconds=30))
        with self.cv:
            return self.data[self.prefix + key]

    def compare_set(self, key, expected, desired):
        with self.cv:
            cur = self.data.get(self.prefix + key)
            if cur == expected.encode():
                self.data[self.prefix + key] = desired.encode()
                return desired.encode()
            return cur

    def wait(self, keys, timeout):
        with self.cv:
            ok = self.cv.wait_for(lambda: all(self.prefix + k in self.data for k in keys), timeout.total_seconds())
            if not ok:
                raise TimeoutError(f"{keys} not set within {timeout}")

    def prefixed(self, prefix):
        return MemStore(self.data, self.cv, self.prefix + prefix + "/")


class Dummy:
    def __init__(self, *a):
        pass

    def all_gather(self, obj):
        return [obj]


def rank_zero_of_two(group, timeout=5):
    """Rank 0's exchange of a two-rank group whose rank 1 already joined generation 0; the
    group: `group`'s all_gather, given rank 0's stamped message, returns both ranks'."""
    import vmstash.distributed as vd

    class Group:
        def __init__(self, *a):
            pass

        def all_gather(self, obj):
            return group(obj)

    store = MemStore()
    ex = vd.Generations(store, [0, 1], 0, datetime.timedelta(seconds=timeout), connect=Group)
    store.add(f"{ex._key}/0/joined", 1)
    return ex


def mirror_recording(sent):
    """A group whose rank 1 sends what rank 0 sends; each of rank 0's messages into `sent`."""
    def group(obj):
        sent.append(obj[1])
        return [obj, obj]
    return group


def test_an_exchange_of_the_documented_interface_with_begin(sim):
    import vmstash
    import vmstash.distributed as vd

    class Exchange:  # the module docstring's interface, with begin()
        rank, size = 0, 1

        def begin(self):
            pass

        def all_gather(self, obj):
            return [obj]

    vmstash.create_tag("rv_doc", "backup")
    p = sim.malloc("rv_doc", 4 * MiB)
    try:
        assert vd.pause("rv_doc", exchange=Exchange()) is True
    finally:
        vmstash.resume("rv_doc")
        sim.free(p, 4 * MiB)


def test_two_threads_of_a_rank_switch_one_after_the_other(sim):
    """One switch at a time through a rank's exchange: each switch's request and vote are
    consecutive, never interleaved with another thread's (which could pair one switch's
    vote with another's request)."""
    import vmstash
    import vmstash.distributed as vd
    vmstash.create_tag("rv_a", "backup")
    vmstash.create_tag("rv_b", "backup")
    pa, pb = sim.malloc("rv_a", 8 * MiB), sim.malloc("rv_b", 8 * MiB)
    guard, order = threading.Lock(), []

    def mirror(obj):  # rank 1 sends what rank 0 sends
        with guard:
            order.append(threading.current_thread().name)
        time.sleep(0.05)
        return [obj, obj]

    ex = rank_zero_of_two(mirror)
    out = {}

    def run(tag):
        try:
            out[tag] = vd.pause(tag, exchange=ex)
        except Exception as e:  # noqa: BLE001
            out[tag] = e

    threads = [threading.Thread(target=run, args=(t,), name=t) for t in ("rv_a", "rv_b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert out == {"rv_a": True, "rv_b": True}, out
        assert order in (["rv_a", "rv_a", "rv_b", "rv_b"], ["rv_b", "rv_b", "rv_a", "rv_a"]), order
    finally:
        for t in ("rv_a", "rv_b"):
            vmstash.resume(t)
        sim.free(pa, 8 * MiB)
        sim.free(pb, 8 * MiB)


def test_a_vote_that_is_not_a_vote_rolls_back(sim):
    """A peer's answer to the vote in its right place (generation, step) but not of a vote's
    shape (a request, say) is no yes: every tag stays as it was."""
    import vmstash
    import vmstash.distributed as vd
    vmstash.create_tag("rv_c", "backup")
    p = sim.malloc("rv_c", 4 * MiB)

    def odd(obj):  # rank 1's answer to the vote: a request
        stamp, body = obj
        return [obj, (stamp, (["rv_c"], []) if stamp[-1] == 2 else body)]

    ex = rank_zero_of_two(odd)
    try:
        with pytest.raises(vmstash.Error, match="something else than a vote"):
            vd.pause("rv_c", exchange=ex)
        assert vmstash.tag_stats("rv_c")["state"] == "active"
    finally:
        sim.free(p, 4 * MiB)


def test_a_second_cancel_leaves_a_generation_every_rank_joined():
    import vmstash.distributed as vd

    class SlowCancelStore(MemStore):
        """The store's cancel adds arrive after C's join (network latency)."""
        def add(self, key, n):
            if n == vd._CANCEL:
                with self.cv:
                    self.cv.wait_for(lambda: sum(1 for op, k, m in self.log if m == 1 and k.endswith("/joined")) == 3, 10)
            return super().add(key, n)

    store = SlowCancelStore()
    timeout = datetime.timedelta(seconds=0.3)
    gens = [vd.Generations(store, [0, 1, 2], r, timeout, connect=Dummy) for r in range(3)]
    errors = {}

    def run(r):
        try:
            gens[r].begin()
        except Exception as e:  # noqa: BLE001
            errors[r] = e

    ts = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    time.sleep(0.6)  # A and B timed out; their cancel adds are in flight
    run(2)
    for t in ts:
        t.join(10)
    count = int(store.data[f"{gens[0]._key}/0/joined"])
    assert count % vd._CANCEL == 3  # every rank joined generation 0
    not_joined = {r: e for r, e in errors.items() if "not every rank joined" in str(e)}
    assert not not_joined, f"every rank joined, yet {not_joined} (all errors: {errors})"


def test_two_timeouts_have_two_keys():
    import vmstash.distributed as vd
    a = vd.Generations(MemStore(), [0, 1], 0, datetime.timedelta(seconds=1000000))
    b = vd.Generations(MemStore(), [0, 1], 0, datetime.timedelta(seconds=1000001))
    assert a._key != b._key, a._key


def test_the_gloo_all_gather_at_its_slot_boundary_and_non_ascii_text(gloo_pair):
    pytest.importorskip("torch.distributed")
    import pickle
    # pickles of exactly 1016 and 1017 bytes (the slot's body), non-ASCII text
    objs = {}
    for target in (1015, 1016, 1017):
        s = "x" * (target - 18)
        assert len(pickle.dumps(s)) == target
        objs[target] = s
    text = "échec: mémoire épuisée ✗"
    out = gloo_pair("b", lambda g, r: [g.all_gather(objs[1016] if r == 0 else objs[1017]),
                                       g.all_gather(objs[1016]), g.all_gather(objs[1015] if r else objs[1017]),
                                       g.all_gather((False, text * r))])
    for r in range(2):
        assert out[r][0] == [objs[1016], objs[1017]]
        assert out[r][1] == [objs[1016]] * 2
        assert out[r][2] == [objs[1017], objs[1015]]
        assert out[r][3] == [(False, ""), (False, text)]


def test_a_late_rank_finds_its_generation_given_up_and_moves_nothing():
    import vmstash.distributed as vd
    store = MemStore()
    t = datetime.timedelta(seconds=0.2)
    a = vd.Generations(store, [0, 1], 0, t, connect=Dummy)
    b = vd.Generations(store, [0, 1], 1, t, connect=Dummy)
    with pytest.raises(TimeoutError):
        a.begin()  # b never comes: cancelled, generation 0 -> 1
    key = f"{a._key}/generation"
    assert store.data[key] == b"1"
    b._generation = 0  # b read generation 0 before a's abandon
    with pytest.raises(TimeoutError, match="given up"):
        b._join(f"{a._key}/0")
    b.abandon()  # compare_set(0 -> 1): no-op, generation stays 1
    assert store.data[key] == b"1"


RANK = textwrap.dedent(r"""
    import ctypes, datetime, json, sys, time
    import torch.distributed as dist
    import vmstash, vmstash.distributed as vd
    from vmstash import _lib
    folder, rank, scenario = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank, world_size=2)
    def malloc(tag, n):
        vmstash.set_current_tag(tag); p = _lib.lib().vmstash_malloc(n, 0, None); vmstash.set_current_tag("default")
        assert p
        return p
    LONG = ["a_rather_long_tag_name_so_that_the_request_needs_two_gathers_%02d" % i for i in range(20)]  # a request > 1 KiB: the second all-gather
    out = {}
    def call(name, fn):
        t0 = time.monotonic()
        try:
            out[name] = {"ok": True, "value": fn()}
        except ValueError as e:
            out[name] = {"ok": False, "code": "ValueError", "msg": str(e)[:300]}
        except vmstash.Error as e:
            out[name] = {"ok": False, "code": e.code_name, "msg": str(e)[:300]}
        out[name]["s"] = round(time.monotonic() - t0, 2)
    for t in ["x", "y"] + LONG:
        if not (rank == 1 and t != "y"):
            vmstash.create_tag(t, "backup")
    malloc("y", 4 << 20) if rank == 0 else None
    if rank == 0:
        malloc("x", 4 << 20); [malloc(t, 2 << 20) for t in LONG[:2]]
    call("missing", lambda: vd.pause("x", timeout=5))
    out["x_state"] = vmstash.tag_stats("x")["state"] if rank == 0 else None
    call("long", lambda: vd.switch(LONG, [], timeout=5))
    out["long_state"] = vmstash.tag_stats(LONG[0])["state"] if rank == 0 else None
    call("empty", lambda: vd.switch([], [], timeout=5))
    call("nomem", lambda: vd.pause("y", timeout=5))
    out["y_state"] = (vmstash.tag_stats("y") or {}).get("state")
    call("timeouts", lambda: vd.resume("y", timeout=3 + rank))
    out["y_after_timeouts"] = (vmstash.tag_stats("y") or {}).get("state")
    call("retry", lambda: vd.resume("y", timeout=5))
    print(json.dumps(out)); sys.stdout.flush()
    import os; os._exit(0)
""")


def test_two_gloo_ranks_edge_cases(tmp_path):
    pytest.importorskip("torch.distributed")
    env = dict(os.environ, VMSTASH_CONF="driver:sim,sim_devices:1,sim_capacity:256M,auto_prepare:0")
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path), str(r), "all"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    import json
    res = []
    for p in procs:
        o, e = p.communicate(timeout=120)
        assert p.returncode == 0, e[-3000:]
        res.append(json.loads(o.strip().splitlines()[-1]))
    r0, r1 = res
    assert r1["missing"]["code"] == "NOT_FOUND" and r0["missing"]["code"] == "ABORTED" and r0["x_state"] == "active"
    assert r1["long"]["code"] == "NOT_FOUND" and r0["long"]["code"] == "ABORTED" and r0["long_state"] == "active"
    assert not r0["empty"]["ok"] and not r1["empty"]["ok"]
    assert r0["nomem"] == {"ok": True, "value": True, "s": r0["nomem"]["s"]} and r1["nomem"]["value"] is False
    assert r0["y_state"] == "paused"
    assert r0["timeouts"]["code"] == r1["timeouts"]["code"] == "DEADLINE_EXCEEDED" and r0["y_after_timeouts"] == "paused"
    assert r0["retry"]["ok"] and r0["retry"]["value"] is True and r1["retry"]["ok"]


REINIT = textwrap.dedent(r"""
    import json, os, sys, time
    import torch.distributed as dist
    import vmstash, vmstash.distributed as vd
    from vmstash import _lib
    folder, who = sys.argv[1], sys.argv[2]
    def wait_for(name):
        while not os.path.exists(os.path.join(folder, name)):
            time.sleep(0.01)
    def mark(name):
        open(os.path.join(folder, name), "w").close()
    vmstash.create_tag("w", "backup")
    vmstash.set_current_tag("w"); assert _lib.lib().vmstash_malloc(4 << 20, 0, None); vmstash.set_current_tag("default")
    out = {}
    def attempt(name, fn):
        try:
            out[name] = fn()
        except vmstash.Error as e:
            out[name] = e.code_name + ": " + str(e)[:160]
    if who == "A":   # the surviving process, rank 0 in both worlds
        dist.init_process_group("gloo", init_method=f"file://{folder}/store1", rank=0, world_size=2)
        attempt("first_world", lambda: vd.pause("w", timeout=3))
        mark("a_done1"); wait_for("b1_gone")
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"file://{folder}/store2", rank=0, world_size=2)
    elif who == "B1":  # the peer that goes away
        dist.init_process_group("gloo", init_method=f"file://{folder}/store1", rank=1, world_size=2)
        attempt("first_world", lambda: vd.pause("w", timeout=3))
        wait_for("a_done1"); print(json.dumps(out)); sys.stdout.flush(); mark("b1_gone"); os._exit(0)
    else:            # its replacement, a fresh process
        wait_for("b1_gone")
        dist.init_process_group("gloo", init_method=f"file://{folder}/store2", rank=1, world_size=2)
    for i in range(2):  # the new world's switch, and a retry
        attempt(f"second_world_{i}", lambda: vd.resume("w", timeout=3))
        dist.barrier()
    print(json.dumps(out)); sys.stdout.flush()
    os._exit(0)
""")


def test_a_process_group_made_anew_meets_a_replacement_rank(tmp_path):
    pytest.importorskip("torch.distributed")
    import json
    env = dict(os.environ, VMSTASH_CONF="driver:sim,sim_devices:1,sim_capacity:256M,auto_prepare:0")
    procs = {w: subprocess.Popen([sys.executable, "-c", REINIT, str(tmp_path), w], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env) for w in ("A", "B1", "B2")}
    res = {}
    for w, p in procs.items():
        o, e = p.communicate(timeout=120)
        assert p.returncode == 0, (w, e[-2000:])
        res[w] = json.loads(o.strip().splitlines()[-1])
    assert res["A"]["first_world"] is True and res["B1"]["first_world"] is True, res
    # The new world: A's tag is paused, B2's (fresh) too; resume must succeed, at least on the retry.
    assert res["A"]["second_world_1"] is True or res["A"]["second_world_0"] is True, json.dumps(res, indent=1)


def test_a_rank_that_fails_before_its_switch_starts_still_votes(sim):
    """An argument refused before the switch reaches the library (a bad device) still sends
    this rank's no, so the other ranks roll back at once instead of waiting out the timeout."""
    import vmstash
    import vmstash.distributed as vd
    vmstash.create_tag("rv_d", "backup")
    p = sim.malloc("rv_d", 4 * MiB)
    sent = []
    ex = rank_zero_of_two(mirror_recording(sent))
    try:
        with pytest.raises(ValueError):
            vd.pause("rv_d", device="not a device", exchange=ex)
        assert len(sent) == 2 and sent[1][0] is False and "device" in sent[1][1], sent
        assert vmstash.tag_stats("rv_d")["state"] == "active"
    finally:
        sim.free(p, 4 * MiB)


def test_a_vmstash_error_before_the_library_still_votes_no(sim, monkeypatch):
    """_api.switch raises vmstash.Error (a bad liveness hint) before the library: no vote is sent."""
    import vmstash
    import vmstash.distributed as vd
    from vmstash import _api
    vmstash.create_tag("rv_lh", "backup")
    p = sim.malloc("rv_lh", 4 * MiB)
    monkeypatch.setattr(_api, "pool_devices_provider", lambda tag: [0])
    monkeypatch.setattr(_api, "live_ranges_provider", lambda tag, d: [(-1, 5)])
    sent = []
    ex = rank_zero_of_two(mirror_recording(sent))
    try:
        with pytest.raises(vmstash.Error):
            vd.pause("rv_lh", exchange=ex)
        assert len(sent) == 2, f"only the request was sent, no vote: {sent}"
    finally:
        sim.free(p, 4 * MiB)


def test_threads_making_their_first_switch_at_once_share_one_exchange(monkeypatch):
    import vmstash.distributed as vd
    store = object()
    dist = types.ModuleType("torch.distributed")
    dist.is_initialized = lambda: True
    dist.get_world_size = lambda: 2
    dist.get_rank = lambda: 0
    c10d = types.ModuleType("torch.distributed.distributed_c10d")
    c10d._get_default_store = lambda: store
    dist.distributed_c10d = c10d
    torch = types.ModuleType("torch")
    torch.distributed = dist
    for name, m in (("torch", torch), ("torch.distributed", dist), ("torch.distributed.distributed_c10d", c10d)):
        monkeypatch.setitem(sys.modules, name, m)
    real = vd.Generations.__init__

    def slow(self, *a, **k):
        time.sleep(0.05)  # a thread switch inside the check-then-set
        real(self, *a, **k)

    monkeypatch.setattr(vd.Generations, "__init__", slow)
    monkeypatch.setattr(vd, "_exchanges", {})
    got = []
    ts = [threading.Thread(target=lambda: got.append(vd._torch_exchange(None, vd.DEFAULT_TIMEOUT))) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert got[0] is got[1], "two Generations (two locks) for one group: the threads' switches interleave"


def test_a_switch_from_inside_a_switch_of_the_same_group_is_refused_and_a_waiting_thread_gives_up(sim):
    """one_switch: the same thread again (a hook) is refused at once; another thread waits for
    the switch in progress only up to its timeout (DEADLINE_EXCEEDED, nothing changed)."""
    import vmstash
    import vmstash.distributed as vd
    ex = vd.Generations(MemStore(), [0, 1], 0, datetime.timedelta(seconds=5), connect=Dummy)
    outcome = {}
    with ex.one_switch(datetime.timedelta(seconds=1)):
        with pytest.raises(RuntimeError, match="inside another switch"):
            with ex.one_switch(datetime.timedelta(seconds=1)):
                pass

        def other():
            t0 = time.monotonic()
            try:
                vd.pause("nowhere", timeout=0.2, exchange=ex)
            except vmstash.Error as e:
                outcome["code"], outcome["seconds"] = e.code_name, time.monotonic() - t0

        t = threading.Thread(target=other)
        t.start()
        t.join(10)
    assert outcome["code"] == "DEADLINE_EXCEEDED" and outcome["seconds"] < 5, outcome
    with ex.one_switch(datetime.timedelta(seconds=1)):  # released
        pass
