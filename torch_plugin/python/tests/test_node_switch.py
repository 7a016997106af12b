"""A switch over several processes of the node (node/node_switch.h, Note [Node Switch]) end to
end: real processes on the simulated driver, each with its control endpoint; vmstash.node.switch
(and the CLI's `switch --node`) from this process, which takes no part; the node daemon started
on demand. Every process commits, or every process is as before with its bytes — when one fails
its part (out of device memory), is killed in it, hangs in it, is killed after voting, or the
daemon is killed while the votes wait."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import vmstash
from conftest import SIM_CONF
from node_helpers import cli_binary, daemon_binary
from test_node_pool import daemon_pid, node_dir  # noqa: F401 (a fixture)

MiB = 1 << 20

# A participant: creates the tags given as NAME:POLICY:MIB:STATE (STATE active or paused; a
# backup tag's bytes are a pattern of its name), says {"ready": pid}, then serves commands
# from stdin: "check" (each tag's state, and for an active backup tag whether its bytes are
# intact), "stall NAME SECONDS" (NAME's before-pause hook says {"hook": NAME} and sleeps),
# "alloc NAME MIB" (more memory in NAME), "resume NAME", "node" (vmstash.node.stats()),
# "calls" (the driver calls on device 0), "zero NAME" (whether NAME's bytes all read 0),
# "fill NAME" (NAME's bytes set to its pattern again),
# "churn NAME" (a thread of this process allocates, writes, checks and frees in NAME until
# "unchurn", which says how many rounds it made and what went wrong),
# "switch PAUSE RESUME" (a node switch of PID:TAG lists, made by this process), "exit".
PART = r'''
import ctypes, json, os, sys, time
import vmstash
from vmstash import _lib
L = _lib.lib()
def fill_of(name):
    return sum(name.encode()) % 251 + 1
tags = {}
policies = {}
def alloc(name, mib):
    vmstash.set_current_tag(name)
    n = mib << 20
    p = L.vmstash_malloc(n, 0, None)
    vmstash.set_current_tag("default")
    assert p, _lib.last_error()
    ctypes.memset(p, fill_of(name), n)
    tags.setdefault(name, []).append((p, n))
for spec in sys.argv[1:]:
    name, policy, mib, state = spec.split(":")
    vmstash.create_tag(name, policy)
    policies[name] = policy
    alloc(name, int(mib))
    if state == "paused":
        vmstash.pause(name)
def say(**kw):
    print(json.dumps(kw), flush=True)
HOOK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p)
hooks = []
import threading
churning = {}
def churn(name, stop, report):
    vmstash.set_current_tag(name)
    i = 0
    while not stop.is_set():
        n = (i % 7 + 1) << 18
        p = L.vmstash_malloc(n, 0, None)
        if not p:
            report["errors"].append(_lib.last_error())
            break
        byte = i % 250 + 1
        ctypes.memset(p, byte, n)
        if ctypes.string_at(p, n) != bytes([byte]) * n:
            report["errors"].append(f"round {i}: bytes changed")
        L.vmstash_free(p, n, 0, None)
        i += 1
        report["rounds"] = i
say(ready=os.getpid())
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "check":
        out = {}
        for name, blocks in tags.items():
            st = vmstash.tag_stats(name, 0)["state"]
            ok = None
            if st == "active" and policies.get(name) == "backup":
                want = bytes([fill_of(name)]) * 4096
                ok = all(ctypes.string_at(p + off, 4096) == want for p, n in blocks for off in (0, n // 2, n - 4096))
            out[name] = {"state": st, "ok": ok}
        say(check=out)
    elif cmd[0] == "stall":
        name, seconds = cmd[1], float(cmd[2])
        def before(tag, device, user, name=name, seconds=seconds):
            say(hook=name)
            time.sleep(seconds)
            return 0
        f = HOOK(before)
        hooks.append(f)
        assert L.vmstash_register_hooks(name.encode(), f, ctypes.cast(None, HOOK), None) == 0, _lib.last_error()
        say(stalled=name)
    elif cmd[0] == "alloc":
        alloc(cmd[1], int(cmd[2]))
        say(allocated=cmd[1])
    elif cmd[0] == "resume":
        vmstash.resume(cmd[1])
        say(resumed=cmd[1])
    elif cmd[0] == "node":
        say(node=vmstash.node.stats())
    elif cmd[0] == "calls":
        say(calls=vmstash.stats(0)["driver_calls"])
    elif cmd[0] == "zero":
        say(zero=all(ctypes.string_at(p, n) == bytes(n) for p, n in tags[cmd[1]]))
    elif cmd[0] == "fill":
        for p, n in tags[cmd[1]]:
            ctypes.memset(p, fill_of(cmd[1]), n)
        say(filled=cmd[1])
    elif cmd[0] == "churn":
        stop, report = threading.Event(), {"rounds": 0, "errors": []}
        t = threading.Thread(target=churn, args=(cmd[1], stop, report), daemon=True)
        t.start()
        churning[cmd[1]] = (t, stop, report)
        say(churning=cmd[1])
    elif cmd[0] == "unchurn":
        t, stop, report = churning.pop(cmd[1])
        stop.set()
        t.join(60)
        say(churned=report, alive=t.is_alive())
    elif cmd[0] == "switch":  # switch PID:TAG,... PID:TAG,...: a node switch made by this process
        pairs = [[(int(p), t) for p, t in (e.split(":") for e in arg.split(",") if e)] for arg in cmd[1:3]]
        say(switched=vmstash.node.switch(pause=pairs[0], resume=pairs[1])["committed"])
    elif cmd[0] == "exit":
        break
'''


class Part:
    def __init__(self, env, *specs):
        self.proc = subprocess.Popen([sys.executable, "-c", PART, *specs], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.pid = self.read()["ready"]

    def read(self):
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"participant {self.proc.pid} ended: {self.proc.stderr.read()}")
        return json.loads(line)

    def ask(self, command):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def check(self, settle=False):
        """Each tag's state and bytes; settle: once no tag is pausing or resuming (a part
        still running in the process's control thread)."""
        deadline = time.time() + 20
        while True:
            c = self.ask("check")["check"]
            moving = any(t["state"] in ("pausing", "resuming") for t in c.values())
            if not (settle and moving) or time.time() > deadline:
                return c
            time.sleep(0.05)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def node(node_dir, monkeypatch):  # noqa: F811
    """Participants' environment; this process (the initiator) looks in the same directory."""
    monkeypatch.setenv("VMSTASH_RUNTIME_DIR", node_dir)
    monkeypatch.setenv("VMSTASH_DAEMON", daemon_binary())
    env = dict(os.environ)
    env["VMSTASH_CONF"] = SIM_CONF
    parts = []

    def make(*specs, conf=None):
        e = dict(env)
        if conf:
            e["VMSTASH_CONF"] = conf
        p = Part(e, *specs)
        parts.append(p)
        return p
    yield make
    for p in parts:
        if p.proc.poll() is None:
            try:
                os.kill(p.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        p.close()


def in_thread(fn):
    """Runs fn() in a thread; returns a function that joins it and returns or raises as fn did."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: B902 (re-raised in the caller)
            box["error"] = e
    t = threading.Thread(target=run)
    t.start()

    def join():
        t.join(120)
        assert not t.is_alive(), "the node switch did not return"
        if "error" in box:
            raise box["error"]
        return box["value"]
    return join


def test_a_switch_over_two_processes_moves_both_and_back(node):
    a = node("train:backup:8:active", "scratch:discard:4:active")
    b = node("rollout:backup:8:paused", "kv:discard:8:paused")
    r = vmstash.node.switch(pause=[(a.pid, "train"), (a.pid, "scratch")], resume=[(b.pid, "rollout"), (b.pid, "kv")])
    assert r["committed"] and {p["pid"] for p in r["processes"]} == {a.pid, b.pid}
    assert all(p["ok"] and p["changed"] for p in r["processes"])
    assert a.check() == {"train": {"state": "paused", "ok": None}, "scratch": {"state": "paused", "ok": None}}
    assert b.check() == {"rollout": {"state": "active", "ok": True}, "kv": {"state": "active", "ok": None}}
    # Back, through the CLI.
    out = subprocess.run([cli_binary(), "switch", "--node", "--pause", f"{b.pid}:rollout,{b.pid}:kv", "--resume",
                          f"{a.pid}:train,{a.pid}:scratch", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["committed"] is True
    assert a.check()["train"] == {"state": "active", "ok": True}
    assert b.check()["rollout"] == {"state": "paused", "ok": None}
    # Already there: nothing moves, still one committed transaction.
    r = vmstash.node.switch(pause=[(b.pid, "rollout")], resume=[(a.pid, "train")])
    assert r["committed"] and not any(p["changed"] for p in r["processes"])
    # Each decision is recorded (a process that loses the daemon reads it there).
    records = os.path.join(os.environ["VMSTASH_RUNTIME_DIR"], "vmstashd.switch")
    decisions = [open(os.path.join(records, n)).read().split("\n")[0] for n in os.listdir(records)]
    assert decisions == ["commit"] * 3


def test_a_participant_can_make_the_switch_itself(node):
    a = node("train:backup:8:active")
    b = node("rollout:backup:8:paused")
    assert a.ask(f"switch {a.pid}:train {b.pid}:rollout") == {"switched": True}
    assert a.check()["train"]["state"] == "paused"
    assert b.check()["rollout"] == {"state": "active", "ok": True}
    assert b.ask(f"switch {b.pid}:rollout {a.pid}:train") == {"switched": True}
    assert a.check()["train"] == {"state": "active", "ok": True}


def test_processes_backed_up_in_the_node_pool_switch_through_it(node):
    pool = f"{SIM_CONF},node:1,node_capacity:64M"
    a = node("train:backup:8:active", conf=pool)
    b = node("rollout:backup:8:paused", conf=pool)  # its backup leased from the pool
    assert b.ask("node")["node"]["process_leases"] == 1
    for src, dst, src_tag, dst_tag in ((a, b, "train", "rollout"), (b, a, "rollout", "train")):
        r = vmstash.node.switch(pause=[(src.pid, src_tag)], resume=[(dst.pid, dst_tag)])
        assert r["committed"]
        assert dst.check()[dst_tag] == {"state": "active", "ok": True}
        # The paused side holds one lease, the resumed side gave its lease back.
        assert src.ask("node")["node"]["process_leases"] == 1
        after = dst.ask("node")["node"]
        assert after["process_leases"] == 0 and after["leases"] == 1, after


def test_discard_memory_changes_process_instead_of_being_made_again(node):
    # Note [Node Switch Handover]: the pausing process's chunks are mapped into the resuming
    # one's discard tag; nothing is created there, the bytes read zero, and back again.
    shared = f"{SIM_CONF},share_chunks:1"
    a = node("akv:discard:24:active", "aw:backup:8:active", conf=shared)
    b = node("bkv:discard:24:paused", "bw:backup:8:paused", conf=shared)
    before = b.ask("calls")["calls"]
    r = vmstash.node.switch(pause=[(a.pid, "akv"), (a.pid, "aw")], resume=[(b.pid, "bkv"), (b.pid, "bw")])
    assert r["committed"]
    after = b.ask("calls")["calls"]
    assert after.get("import_chunk_fd", 0) > before.get("import_chunk_fd", 0), after
    assert b.ask("zero bkv")["zero"] is True
    assert b.check()["bw"] == {"state": "active", "ok": True}
    assert b.ask("fill bkv")["filled"] == "bkv"
    back = vmstash.node.switch(pause=[(b.pid, "bkv"), (b.pid, "bw")], resume=[(a.pid, "akv"), (a.pid, "aw")])
    assert back["committed"]
    assert a.ask("zero akv")["zero"] is True
    assert a.check()["aw"] == {"state": "active", "ok": True}
    assert a.ask("calls")["calls"].get("import_chunk_fd", 0) > 0


# A device of 26 MiB: a 24 MiB tag fits, but not its covers and an eighth more
# (RestoresTakeForeignChunks, allocator/handoff_plan.h).
TIGHT = "driver:sim,sim_devices:1,sim_capacity:26M,auto_prepare:0,share_chunks:1"


def test_backed_up_memory_changes_process_and_the_restore_copies_go_into_it(node):
    # The covers that receive restore copies take the pausing process's backed-up chunks
    # too, where the device is short of memory for them (b's holds 26 MiB: its 24 MiB of
    # covers and an eighth do not fit): the restores wait for its backup copies through
    # its interprocess events.
    shared = f"{SIM_CONF},share_chunks:1"
    a = node("aw:backup:24:active", conf=shared)
    b = node("bw:backup:24:paused", conf=TIGHT)
    before = b.ask("calls")["calls"]
    r = vmstash.node.switch(pause=[(a.pid, "aw")], resume=[(b.pid, "bw")])
    assert r["committed"]
    after = b.ask("calls")["calls"]
    assert after.get("import_chunk_fd", 0) > before.get("import_chunk_fd", 0), after
    assert after.get("open_ipc_event", 0) > before.get("open_ipc_event", 0), after
    assert after.get("create_chunk", 0) < before.get("create_chunk", 0) + 3, after  # 24 MiB made fresh: 3 chunks
    assert a.ask("calls")["calls"].get("create_ipc_event", 0) > 0
    assert b.check()["bw"] == {"state": "active", "ok": True}
    back = vmstash.node.switch(pause=[(b.pid, "bw")], resume=[(a.pid, "aw")])
    assert back["committed"]
    assert a.check()["aw"] == {"state": "active", "ok": True}
    assert b.check()["bw"]["state"] == "paused"


def test_an_abort_after_the_other_process_restored_into_this_ones_memory_restores_its_bytes(node):
    # a and b do their parts (b's restore copies write a's chunks) and vote; c never does:
    # the switch aborts, a waits for b to be done writing, then puts its own bytes back
    # from the backup the switch made; b stays paused with its backup whole.
    shared = f"{SIM_CONF},share_chunks:1"
    a = node("aw:backup:24:active", conf=shared)
    b = node("bw:backup:24:paused", conf=TIGHT)
    c = node("cw:backup:4:paused", conf=shared)
    os.kill(c.pid, signal.SIGSTOP)
    before = b.ask("calls")["calls"]
    with pytest.raises(vmstash.Error) as e:
        vmstash.node.switch(pause=[(a.pid, "aw")], resume=[(b.pid, "bw"), (c.pid, "cw")], timeout=2)
    os.kill(c.pid, signal.SIGCONT)
    assert e.value.code_name == "ABORTED" and f"process {c.pid} did not vote" in str(e.value), str(e.value)
    assert b.ask("calls")["calls"].get("open_ipc_event", 0) > before.get("open_ipc_event", 0)
    assert a.check()["aw"] == {"state": "active", "ok": True}
    assert b.check()["bw"]["state"] == "paused"
    r = vmstash.node.switch(pause=[(a.pid, "aw")], resume=[(b.pid, "bw")])
    assert r["committed"] and b.check()["bw"] == {"state": "active", "ok": True}


def test_the_pausing_process_memory_is_shared_among_the_processes_that_resume(node):
    # One process pauses two discard tags; two others resume one each. Each resuming
    # process takes the chunks that fit its own covers (base/chunk_fit.h), so both map
    # memory of the first instead of making their own: the first to ask no longer takes all.
    shared = f"{SIM_CONF},share_chunks:1,min_chunk:2M"  # chunks of 8 MiB, as the tags
    a = node("akv1:discard:8:active", "akv2:discard:8:active", conf=shared)
    b = node("bkv:discard:8:paused", conf=shared)
    c = node("ckv:discard:8:paused", conf=shared)
    before = {p.pid: p.ask("calls")["calls"] for p in (b, c)}
    r = vmstash.node.switch(pause=[(a.pid, "akv1"), (a.pid, "akv2")], resume=[(b.pid, "bkv"), (c.pid, "ckv")])
    assert r["committed"]
    for p, tag in ((b, "bkv"), (c, "ckv")):
        after = p.ask("calls")["calls"]
        assert after.get("import_chunk_fd", 0) > before[p.pid].get("import_chunk_fd", 0), (tag, after)
        assert after.get("create_chunk", 0) == before[p.pid].get("create_chunk", 0), (tag, after)
        assert p.ask(f"zero {tag}")["zero"] is True
        assert p.check()[tag] == {"state": "active", "ok": None}
    assert a.check() == {"akv1": {"state": "paused", "ok": None}, "akv2": {"state": "paused", "ok": None}}
    # And back: the first process gets its memory from the two others.
    a_before = a.ask("calls")["calls"]
    back = vmstash.node.switch(pause=[(b.pid, "bkv"), (c.pid, "ckv")], resume=[(a.pid, "akv1"), (a.pid, "akv2")])
    assert back["committed"]
    a_after = a.ask("calls")["calls"]
    assert a_after.get("create_chunk", 0) == a_before.get("create_chunk", 0), a_after
    assert a.ask("zero akv1")["zero"] is True and a.ask("zero akv2")["zero"] is True


def test_threads_allocating_in_both_processes_during_node_switches(node):
    # Another thread of each process allocates, writes, checks and frees in a tag of its own
    # while node switches (chunks handed over) move the others: every switch commits, no
    # byte of theirs or of the switched tags changes, and the allocator stays whole.
    shared = f"{SIM_CONF},share_chunks:1"
    a = node("akv:discard:16:active", "aw:backup:8:active", "awork:discard:1:active", conf=shared)
    b = node("bkv:discard:16:paused", "bw:backup:8:paused", "bwork:discard:1:active", conf=shared)
    assert a.ask("churn awork") == {"churning": "awork"} and b.ask("churn bwork") == {"churning": "bwork"}
    out, into = [(a.pid, "akv"), (a.pid, "aw")], [(b.pid, "bkv"), (b.pid, "bw")]
    for i in range(6):
        r = vmstash.node.switch(pause=out, resume=into)
        assert r["committed"], r
        out, into = into, out
    for part, tag in ((a, "awork"), (b, "bwork")):
        done = part.ask(f"unchurn {tag}")
        assert done["alive"] is False and done["churned"]["errors"] == [], done
        assert done["churned"]["rounds"] > 0, done
    assert a.check()["aw"] == {"state": "active", "ok": True}  # six switches: back where they began
    assert b.check()["bw"]["state"] == "paused"


def test_a_failed_map_of_the_other_process_memory_rolls_back_both(node):
    shared = f"{SIM_CONF},share_chunks:1"
    a = node("akv:discard:24:active", conf=shared)
    # Its first map made its own tag; the switch's first map is of a's chunk.
    b = node("bkv:discard:24:paused", conf=f"{shared},sim_fail:map@2x1=internal")
    with pytest.raises(vmstash.Error) as e:
        vmstash.node.switch(pause=[(a.pid, "akv")], resume=[(b.pid, "bkv")])
    assert e.value.code_name == "ABORTED" and f"process {b.pid}: " in str(e.value), str(e.value)
    assert a.check()["akv"]["state"] == "active" and b.check()["bkv"]["state"] == "paused"
    r = vmstash.node.switch(pause=[(a.pid, "akv")], resume=[(b.pid, "bkv")])  # and then it goes through
    assert r["committed"] and b.ask("zero bkv")["zero"] is True


def test_a_process_out_of_device_memory_rolls_back_every_process(node):
    a = node("train:backup:8:active")
    b = node("rollout:backup:16:paused", conf="driver:sim,sim_devices:1,sim_capacity:32M,auto_prepare:0")
    assert b.ask("alloc filler 20")["allocated"] == "filler"  # the rollout no longer fits
    with pytest.raises(vmstash.Error) as e:
        vmstash.node.switch(pause=[(a.pid, "train")], resume=[(b.pid, "rollout")])
    assert e.value.code_name == "ABORTED"
    assert f"process {b.pid}: " in str(e.value) and "rolled back" in str(e.value)
    assert e.value.result["committed"] is False
    assert a.check()["train"] == {"state": "active", "ok": True}
    assert b.check()["rollout"] == {"state": "paused", "ok": None}


@pytest.mark.parametrize("fault", ["copy_to_device@1x1000=internal", "create_chunk@2x1000=oom",
                                   "map@2x1000=internal", "set_access@2x1000=internal"])
def test_a_driver_failure_in_the_resuming_process_rolls_back_every_process(node, fault):
    # The first create/map/set_access made the resuming process's tag; the switch's are the next.
    a = node("train:backup:8:active")
    b = node("rollout:backup:8:paused", conf=f"{SIM_CONF},sim_fail:{fault}")
    with pytest.raises(vmstash.Error) as e:
        vmstash.node.switch(pause=[(a.pid, "train")], resume=[(b.pid, "rollout")])
    assert e.value.code_name == "ABORTED" and f"process {b.pid}: " in str(e.value), str(e.value)
    assert a.check()["train"] == {"state": "active", "ok": True}
    assert b.check()["rollout"] == {"state": "paused", "ok": None}


def test_a_driver_failure_in_the_pausing_process_rolls_back_every_process(node):
    a = node("train:backup:8:active", conf=f"{SIM_CONF},sim_fail:copy_to_host@1x1000=internal")
    b = node("rollout:backup:8:paused")
    with pytest.raises(vmstash.Error) as e:
        vmstash.node.switch(pause=[(a.pid, "train")], resume=[(b.pid, "rollout")])
    assert e.value.code_name == "ABORTED" and f"process {a.pid}: " in str(e.value)
    assert a.check()["train"] == {"state": "active", "ok": True}
    assert b.check()["rollout"] == {"state": "paused", "ok": None}
    # A second switch at once over the same process is refused until the first is decided.
    c = node("ref:backup:4:active")
    c.ask("stall ref 1.0")
    join = in_thread(lambda: vmstash.node.switch(pause=[(c.pid, "ref")]))
    assert c.read() == {"hook": "ref"}
    with pytest.raises(vmstash.Error) as e:
        vmstash.node.switch(pause=[(c.pid, "ref")])
    assert e.value.code_name == "FAILED_PRECONDITION" and f"process {c.pid} takes part in switch" in str(e.value)
    assert join()["committed"]


def test_a_process_killed_in_its_part_rolls_back_the_others(node):
    a = node("train:backup:8:active")
    b = node("rollout:backup:8:paused")
    a.ask("stall train 30")
    join = in_thread(lambda: vmstash.node.switch(pause=[(a.pid, "train")], resume=[(b.pid, "rollout")]))
    assert a.read() == {"hook": "train"}
    time.sleep(0.3)  # b has voted and waits
    a.proc.kill()
    a.proc.wait()
    with pytest.raises(vmstash.Error) as e:
        join()
    assert e.value.code_name == "ABORTED"
    assert f"process {a.pid} exited before it voted" in str(e.value)
    assert b.check()["rollout"] == {"state": "paused", "ok": None}
    assert b.ask("resume rollout") == {"resumed": "rollout"}
    assert b.check()["rollout"] == {"state": "active", "ok": True}


def test_a_hung_process_is_decided_abort_and_rolls_back_when_it_runs_again(node):
    a = node("train:backup:8:active")
    b = node("rollout:backup:8:paused")
    a.ask("stall train 0.2")
    join = in_thread(lambda: vmstash.node.switch(pause=[(a.pid, "train")], resume=[(b.pid, "rollout")],
                                                 timeout=1.5))
    assert a.read() == {"hook": "train"}
    os.kill(a.pid, signal.SIGSTOP)
    with pytest.raises(vmstash.Error) as e:
        join()
    assert e.value.code_name == "ABORTED"
    assert f"process {a.pid} did not vote by the deadline" in str(e.value)
    assert b.check()["rollout"] == {"state": "paused", "ok": None}
    os.kill(a.pid, signal.SIGCONT)  # it finishes its part, votes, learns the abort, rolls back
    assert a.check(settle=True)["train"] == {"state": "active", "ok": True}


def test_a_process_killed_after_voting_does_not_undo_the_commit(node):
    a = node("train:backup:8:active")
    b = node("rollout:backup:8:paused")
    c = node("ref:backup:4:paused")
    os.kill(c.pid, signal.SIGSTOP)  # c does its part late: a and b vote first
    join = in_thread(lambda: vmstash.node.switch(pause=[(a.pid, "train")],
                                                 resume=[(b.pid, "rollout"), (c.pid, "ref")]))
    time.sleep(0.6)  # a and b have voted and wait for c
    b.proc.kill()
    b.proc.wait()
    os.kill(c.pid, signal.SIGCONT)
    with pytest.raises(vmstash.Error) as e:
        join()
    assert e.value.result["committed"] is True
    assert "committed, but not every process confirmed it" in str(e.value) and f"process {b.pid}" in str(e.value)
    assert a.check()["train"]["state"] == "paused"
    assert c.check()["ref"]["state"] == "active"


@pytest.mark.parametrize("shared", [False, True])
def test_a_daemon_killed_while_the_votes_wait_means_abort_everywhere(node, shared):
    # shared: a and c offer their backed-up chunks, b is short of memory (it would take them
    # into its restoring covers). The daemon dies before any is taken: a and c find no taker
    # noted on disk, and restore their own bytes.
    conf = f"{SIM_CONF},share_chunks:1" if shared else None
    a = node("train:backup:8:active", conf=conf)
    b = node("rollout:backup:8:paused", conf=TIGHT if shared else None)
    c = node("ref:backup:4:active", conf=conf)
    c.ask("stall ref 1.5")
    join = in_thread(lambda: vmstash.node.switch(pause=[(a.pid, "train"), (c.pid, "ref")],
                                                 resume=[(b.pid, "rollout")]))
    assert c.read() == {"hook": "ref"}
    time.sleep(0.4)
    os.kill(daemon_pid(os.environ["VMSTASH_RUNTIME_DIR"]), signal.SIGKILL)
    with pytest.raises(vmstash.Error) as e:
        join()
    assert e.value.code_name == "ABORTED" and "the node daemon died before deciding" in str(e.value)
    assert a.check()["train"] == {"state": "active", "ok": True}
    assert b.check()["rollout"] == {"state": "paused", "ok": None}
    assert c.check()["ref"] == {"state": "active", "ok": True}


def test_bad_requests_are_refused_clearly(node):
    a = node("train:backup:4:active")
    with pytest.raises(vmstash.Error) as e:
        vmstash.node.switch(pause=[(a.pid, "train")], resume=[(1, "x")])
    assert e.value.code_name == "NOT_FOUND" and "process 1" in str(e.value)
    with pytest.raises(vmstash.Error) as e:
        vmstash.node.switch(pause=[(a.pid, "no_such_tag")])
    assert e.value.code_name == "ABORTED" and f"process {a.pid}: " in str(e.value)
    assert "no_such_tag" in str(e.value)
    with pytest.raises(vmstash.Error) as e:
        vmstash.node.switch()
    assert e.value.code_name == "INVALID_ARGUMENT"
    with pytest.raises(TypeError):
        vmstash.node.switch(pause=[a.pid])
    with pytest.raises(ValueError):
        vmstash.node.switch(pause=[(a.pid, "a,b")])
    with pytest.raises(ValueError):
        vmstash.node.switch(pause=[(a.pid, "train")], timeout=0)
    assert a.check()["train"] == {"state": "active", "ok": True}
