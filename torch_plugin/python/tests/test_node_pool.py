"""The node pool from the processes that use it (simulated driver, real vmstashd): VMSTASH_CONF
node:1 starts the daemon on demand and every pinned backup leases from its pool
(allocator/host_lease.h, Note [Pool-Backed Backups]; runtime/node_leases.h, Note [Node
Leases]); two processes share the pool in turn; the daemon killed under a paused process loses
nothing, and the process falls back to its own memory until it connects again; no vmstashd, or a
pool too small, never fails a pause. Each case runs its processes fresh (a runtime reads its
VMSTASH_CONF once), in a private runtime directory of its own."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import SIM_CONF
from node_helpers import daemon_binary, daemon_pids, stop_daemons

MiB = 1 << 20

# A process that backs up `mib` MiB of tag `tag` and reports, as JSON lines on stdout, what the
# pool says at each step. Steps come as arguments: pause, resume, check, stats, connect, sleep:S,
# wait (reads a line from stdin).
CLIENT = r'''
import ctypes, json, sys, time
import vmstash
from vmstash import _lib
tag, mib = sys.argv[1], int(sys.argv[2])
vmstash.create_tag(tag, "backup")
vmstash.set_current_tag(tag)
n = mib << 20
p = _lib.lib().vmstash_malloc(n, 0, None)
vmstash.set_current_tag("default")
assert p, _lib.last_error()
ctypes.memset(p, 0x5A, n)
ctypes.memset(p + n - 4096, 0xA5, 4096)
def say(**kw):
    print(json.dumps(kw), flush=True)
for step in sys.argv[3:]:
    if step == "pause":
        t = time.perf_counter()
        vmstash.pause(tag)
        say(step="pause", ms=(time.perf_counter() - t) * 1e3)
    elif step == "resume":
        vmstash.resume(tag)
    elif step == "check":
        ok = ctypes.string_at(p, 4096) == b"\x5a" * 4096 and ctypes.string_at(p + n - 4096, 4096) == b"\xa5" * 4096
        mid = ctypes.string_at(p + n // 2, 4096) == b"\x5a" * 4096
        say(step="check", ok=ok and mid)
    elif step == "stats":
        try:
            say(step="stats", node=vmstash.node.stats(), arena=vmstash.tag_stats(tag, 0)["backup_arena_bytes"])
        except vmstash.Error as e:
            say(step="stats", error=e.code_name, message=str(e), arena=vmstash.tag_stats(tag, 0)["backup_arena_bytes"])
    elif step == "connect":
        try:
            vmstash.node.connect(start=False)
            say(step="connect", ok=True)
        except vmstash.Error as e:
            say(step="connect", error=e.code_name, message=str(e))
    elif step.startswith("sleep:"):
        time.sleep(float(step[6:]))
    elif step == "wait":
        sys.stdin.readline()
say(step="end")
'''


@pytest.fixture
def node_dir():
    d = tempfile.mkdtemp(prefix="vmstash-node-test-")
    os.chmod(d, 0o700)
    yield d
    stop_daemons(d)


def daemon_pid(d):
    """The pid of the last daemon that logged serving in `d`, or None."""
    pids = daemon_pids(d)
    return pids[-1] if pids else None


def env_for(d, conf_extra="node:1,node_capacity:64M", daemon=None):
    env = dict(os.environ)
    env["VMSTASH_CONF"] = f"{SIM_CONF},{conf_extra}" if conf_extra else SIM_CONF
    env["VMSTASH_RUNTIME_DIR"] = d
    env["VMSTASH_DAEMON"] = daemon if daemon is not None else daemon_binary()
    return env


def start(env, tag, mib, *steps):
    return subprocess.Popen([sys.executable, "-c", CLIENT, tag, str(mib), *steps], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_until(proc, step):
    """Lines of `proc` up to and including the first of `step`."""
    lines = []
    while True:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"the process ended before '{step}': {proc.stderr.read()}")
        lines.append(json.loads(line))
        if lines[-1]["step"] == step:
            return lines


def run(env, tag, mib, *steps):
    out = subprocess.run([sys.executable, "-c", CLIENT, tag, str(mib), *steps], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [json.loads(l) for l in out.stdout.splitlines()], out.stderr


def test_node_1_starts_the_daemon_and_a_pause_leases_from_the_pool(node_dir):
    lines, err = run(env_for(node_dir), "np_a", 8, "stats", "pause", "stats", "resume", "check", "stats", "pause",
                     "resume", "check")
    assert daemon_pid(node_dir), "vmstashd started on demand and logged in the runtime directory"
    before, paused, after = [l for l in lines if l["step"] == "stats"]
    assert before["node"]["capacity_bytes"] == 64 * MiB
    assert before["node"]["process_leases"] == 0 and before["arena"] == 0
    assert paused["node"]["process_leases"] == 1
    assert paused["node"]["leased_bytes"] >= 8 * MiB and paused["arena"] == paused["node"]["process_leased_bytes"]
    assert paused["node"]["process_registered_bytes"] >= 8 * MiB
    assert after["node"]["leased_bytes"] == 0 and after["arena"] == 0, "the lease goes back after the resume"
    assert all(l["ok"] for l in lines if l["step"] == "check")
    assert "cannot hold" not in err


def test_two_processes_take_turns_in_one_pool(node_dir):
    # A pool of 16 MiB holds one 12 MiB backup at a time: the two processes use the same bytes in turn,
    # and a pause while the other's backup is in the pool falls back to the process's own memory.
    env = env_for(node_dir, "node:1,node_capacity:16M")
    a = start(env, "np_turn_a", 12, "pause", "stats", "wait", "resume", "check", "wait", "pause", "stats", "resume",
              "check")
    b = start(env, "np_turn_b", 12, "wait", "pause", "stats", "resume", "check", "wait", "pause", "stats", "resume",
              "check")
    a_paused = read_until(a, "stats")[-1]
    assert a_paused["node"]["process_leases"] == 1 and a_paused["node"]["leased_bytes"] >= 12 * MiB

    def go(p, until):
        p.stdin.write("\n")
        p.stdin.flush()
        return read_until(p, until)

    b_lines = go(b, "check")  # B pauses while A's backup fills the pool: its own memory
    assert b_lines[1]["node"]["process_leases"] == 0 and b_lines[1]["arena"] >= 12 * MiB
    assert b_lines[2]["ok"]
    assert go(a, "check")[0]["ok"]  # A resumes: its lease goes back
    b_lines = go(b, "check")  # B's turn: the pool's bytes now back B
    assert b_lines[1]["node"]["process_leases"] == 1 and b_lines[1]["node"]["clients"] == 1
    assert b_lines[1]["arena"] == b_lines[1]["node"]["process_leased_bytes"]
    assert b_lines[2]["ok"]
    a_lines = go(a, "end")  # and A's again
    assert a_lines[1]["node"]["process_leases"] == 1 and a_lines[2]["ok"]
    read_until(b, "end")
    assert a.wait(30) == 0 and b.wait(30) == 0
    assert "cannot hold" in b.stderr.read() and "cannot hold" not in a.stderr.read()


def test_the_daemon_killed_under_a_paused_process_loses_nothing(node_dir):
    env = env_for(node_dir)
    a = start(env, "np_kill", 8, "pause", "stats", "wait", "resume", "check", "pause", "stats", "resume", "check",
              "wait", "connect", "pause", "stats", "resume", "check")
    paused = read_until(a, "stats")[-1]
    assert paused["node"]["process_leases"] == 1
    pid = daemon_pid(node_dir)
    os.kill(pid, signal.SIGKILL)
    for _ in range(200):
        try:
            os.kill(pid, 0)
            time.sleep(0.01)
        except ProcessLookupError:
            break
    a.stdin.write("\n")
    a.stdin.flush()
    lines = read_until(a, "check")
    assert lines[0]["ok"], "the paused bytes stay in the mapping after the daemon died"
    lines = read_until(a, "check")
    fallback = lines[1]
    assert fallback["error"] == "UNAVAILABLE" and fallback["arena"] > 0, "its own memory held the backup"
    assert lines[2]["ok"]
    # A daemon again; connect() takes it at once.
    subprocess.Popen([daemon_binary(), "--capacity", "64M", "--dir", node_dir, "--detach"],
                     stdout=open(os.path.join(node_dir, "vmstashd.log"), "a"), stderr=subprocess.STDOUT).wait()
    for _ in range(500):
        if daemon_pid(node_dir) != pid:
            break
        time.sleep(0.01)
    a.stdin.write("\n")
    a.stdin.flush()
    lines = read_until(a, "end")
    assert lines[0] == {"step": "connect", "ok": True}
    assert lines[2]["node"]["process_leases"] == 1, "leasing again from the new daemon"
    assert lines[3]["ok"]
    assert a.wait(30) == 0
    err = a.stderr.read()
    assert err.count("cannot hold") >= 1 and "own pinned memory" in err, err


def test_a_daemon_that_hangs_costs_one_timeout_then_nothing(node_dir):
    env = env_for(node_dir)
    a = start(env, "np_hang", 8, "pause", "resume", "wait", "pause", "stats", "resume", "check", "pause", "resume",
              "check", "wait", "connect", "pause", "stats", "resume", "check")
    read_until(a, "pause")
    pid = daemon_pid(node_dir)
    os.kill(pid, signal.SIGSTOP)
    try:
        a.stdin.write("\n")
        a.stdin.flush()
        lines = read_until(a, "check")
        first, stats, check = lines[0], lines[1], lines[2]
        assert first["ms"] < 15_000, "a request to a stopped daemon times out (2 s), it does not hang the pause"
        assert stats["error"] == "UNAVAILABLE" and stats["arena"] > 0, "its own memory held the backup"
        assert check["ok"]
        lines = read_until(a, "check")
        assert lines[0]["ms"] < 15_000
        assert lines[1]["ok"]
    finally:
        os.kill(pid, signal.SIGCONT)
    a.stdin.write("\n")
    a.stdin.flush()
    lines = read_until(a, "end")
    assert lines[0] == {"step": "connect", "ok": True}
    assert lines[2]["node"]["process_leases"] == 1 and lines[2]["node"]["leases"] == 1, \
        "the stopped daemon's late lease went back with the old connection"
    assert lines[3]["ok"]
    assert a.wait(30) == 0
    # Within the retry time the pool is not asked again (no second timeout): the second
    # pause's fallback says so (judged by what it says, not by how long it took).
    err = a.stderr.read()
    assert "trying again in" in err, err


def test_no_vmstashd_and_a_pool_too_small_never_fail_a_pause(node_dir):
    lines, err = run(env_for(node_dir, daemon=os.path.join(node_dir, "no-such-vmstashd")), "np_none", 4, "stats",
                     "pause", "resume", "check")
    assert lines[0]["error"] == "UNAVAILABLE"
    assert lines[2]["ok"]
    assert "no node pool" in err and "vmstashd not found" in err, err
    lines, err = run(env_for(node_dir, "node:1,node_capacity:4M"), "np_small", 8, "pause", "stats", "resume", "check")
    assert lines[1]["node"]["refused"] >= 1 and lines[1]["node"]["process_leases"] == 0
    assert lines[1]["arena"] >= 8 * MiB
    assert lines[2]["ok"]
    assert "cannot hold" in err, err


def test_node_options_are_in_the_conf_table():
    import vmstash
    env = dict(os.environ, VMSTASH_CONF=f"{SIM_CONF},node_capacity:12X")
    out = subprocess.run([sys.executable, "-c", "import vmstash; vmstash.tags()"], env=env, capture_output=True,
                         text=True)
    assert out.returncode != 0 and "node_capacity" in out.stderr, out.stderr
    assert vmstash  # imported above: the package is importable here too
