"""A tag mapped across processes (vmstash.weights; Note [Mapped Tags] in runtime/tag_share.h)
end to end on the simulated driver: a real exporting process (its tag published through the
C ABI, as vmstash.weights.publish does), this process mapping it through
vmstash.weights.map_tag; the bytes this process writes reach the exporter, the view follows
the exporter's pauses, resumes and switches at the same addresses, and bad requests, a
re-published tag and the exporter's exit give clear errors. (Tensors over the mapping, and
sync, need CUDA: gpu_weights.py.)"""
import ctypes
import os
import subprocess
import sys
import tempfile

import pytest

import vmstash
from conftest import SIM_CONF
from node_helpers import ScriptProcess, daemon_binary, stop_daemons
from vmstash import _lib

MiB = 1 << 20

# The exporter: a backup tag "w" with two tensors (3 MiB, 1 MiB) filled with a pattern,
# published; then commands from stdin: "pause", "resume", "switch_out" / "switch_in" (a
# switch with the discard tag "kv"), "check SEED" (whether tensor 0 reads SEED), "republish",
# "exit".
EXPORTER = r'''
import ctypes, json, os, sys
import vmstash
from vmstash import _lib
L = _lib.lib()
vmstash.create_tag("w", "backup")
vmstash.create_tag("kv", "discard")
vmstash.set_current_tag("w")
sizes = [3 << 20, 1 << 20]
ptrs = [L.vmstash_malloc(n, 0, None) for n in sizes]
vmstash.set_current_tag("kv")
kv = L.vmstash_malloc(2 << 20, 0, None)
vmstash.set_current_tag("default")
vmstash.pause("kv")
for p, n in zip(ptrs, sizes):
    ctypes.memset(p, 7, n)
def publish():
    index = {"version": 1, "tensors": [{"name": f"t{i}", "address": p, "nbytes": n, "shape": [n // 2],
                                         "dtype": "bfloat16", "device": 0} for i, (p, n) in enumerate(zip(ptrs, sizes))]}
    g = ctypes.c_ulonglong(0)
    _lib.check(L.vmstash_share_tag(b"w", None, json.dumps(index).encode(), ctypes.byref(g)), "share")
    return g.value
def say(**kw):
    print(json.dumps(kw), flush=True)
say(ready=os.getpid(), generation=publish())
for line in sys.stdin:
    cmd = line.split()
    try:
        if cmd[0] == "pause":
            vmstash.pause("w")
        elif cmd[0] == "resume":
            vmstash.resume("w")
        elif cmd[0] == "switch_out":
            vmstash.switch(pause=["w"], resume=["kv"])
        elif cmd[0] == "switch_in":
            vmstash.switch(pause=["kv"], resume=["w"])
        elif cmd[0] == "check":
            say(same=ctypes.string_at(ptrs[0], sizes[0]) == bytes([int(cmd[1])]) * sizes[0])
            continue
        elif cmd[0] == "republish":
            say(generation=publish())
            continue
        elif cmd[0] == "exit":
            break
        say(ok=True)
    except vmstash.Error as e:
        say(error=e.code_name, message=str(e))
'''


class Exporter(ScriptProcess):
    def __init__(self, env):
        super().__init__(EXPORTER, env)
        first = self.read()
        self.pid, self.generation = first["ready"], first["generation"]


@pytest.fixture
def exporter(monkeypatch):
    d = tempfile.mkdtemp(prefix="vmstash-weights-test-")
    os.chmod(d, 0o700)
    monkeypatch.setenv("VMSTASH_RUNTIME_DIR", d)
    env = dict(os.environ, VMSTASH_CONF=f"{SIM_CONF},share_chunks:1", VMSTASH_RUNTIME_DIR=d)
    made = []

    def make(conf=""):
        e = Exporter(dict(env, VMSTASH_CONF=f"{env['VMSTASH_CONF']},{conf}", VMSTASH_DAEMON=daemon_binary())
                     if conf else env)
        made.append(e)
        return e
    yield make
    for e in made:
        e.close()
    stop_daemons(d)


def local(view, name):
    e = view.index[name]
    out = ctypes.c_ulonglong(0)
    _lib.check(_lib.lib().vmstash_mapped_local(view._handle, e["address"], e["nbytes"], ctypes.byref(out)), "local")
    return out.value, e["nbytes"]


def test_writes_reach_the_exporter_across_pauses_and_switches(exporter):
    e = exporter()
    view = vmstash.weights.map_tag(e.pid, "w", device=0)
    assert view.info()["state"] == "mapped"
    assert view.generation == e.generation == 1
    assert sorted(view.names) == ["t0", "t1"]
    assert view.index["t0"]["shape"] == [3 * MiB // 2]
    p, n = local(view, "t0")
    for seed, transition in ((11, ("pause", "resume")), (12, ("switch_out", "switch_in")), (13, ("pause", "resume"))):
        with view.use():
            ctypes.memset(p, seed, n)
        assert e.ask(f"check {seed}") == {"same": True}
        assert e.ask(transition[0]) == {"ok": True}
        assert view.state == "paused"
        with pytest.raises(vmstash.Error) as err:
            with view.use():
                pass
        assert err.value.code_name == "FAILED_PRECONDITION" and "paused" in str(err.value)
        assert "node:1" in str(err.value)  # why its backup cannot be written from here
        assert e.ask(transition[1]) == {"ok": True}
        assert view.state == "mapped"
        assert local(view, "t0") == (p, n)  # the same address after every resume
        assert ctypes.string_at(p, n) == bytes([seed]) * n
    info = view.info()
    assert info["revokes"] == 3 and info["grants"] == 4
    view.close()
    with pytest.raises(vmstash.Error):
        with view.use():
            pass


def test_a_republished_tag_and_an_exiting_exporter_are_errors(exporter):
    e = exporter()
    view = vmstash.weights.map_tag(e.pid, "w", device=0)
    assert e.ask("republish") == {"generation": 2}
    with pytest.raises(vmstash.Error) as err:
        with view.use():
            pass
    assert "published tag 'w' again" in str(err.value) and "map it again" in str(err.value)
    again = vmstash.weights.map_tag(e.pid, "w", device=0)
    assert again.generation == 2
    with again.use():
        pass
    e.close()
    for _ in range(500):
        if again.state == "gone":
            break
        import time
        time.sleep(0.01)
    assert again.state == "gone"
    with pytest.raises(vmstash.Error) as err:
        with again.use():
            pass
    assert err.value.code_name == "FAILED_PRECONDITION" and "exited" in str(err.value)
    again.close()
    view.close()


def test_bad_requests(exporter):
    e = exporter()
    with pytest.raises(vmstash.Error) as err:
        vmstash.weights.map_tag(e.pid, "kv", device=0)
    assert err.value.code_name == "NOT_FOUND" and "does not share tag 'kv'" in str(err.value)
    with pytest.raises(vmstash.Error) as err:
        vmstash.weights.map_tag(os.getpid(), "w", device=0)  # this process shares nothing
    assert err.value.code_name == "NOT_FOUND"
    with pytest.raises(ValueError):
        vmstash.weights.map_tag(-1, "w", device=0)
    with pytest.raises(ValueError):
        vmstash.weights.map_tag(e.pid, "w", device=-2)
    with pytest.raises(vmstash.Error) as err:
        vmstash.weights.map_tag(e.pid, "w", device=9)
    assert err.value.code_name == "INVALID_ARGUMENT"
    view = vmstash.weights.map_tag(e.pid, "w", device=0)
    u64s = ctypes.c_ulonglong * 2
    t0, t1 = view.index["t0"], view.index["t1"]
    l = _lib.lib()
    _lib.check(l.vmstash_mapped_check(view._handle, u64s(t0["address"], t1["address"]),
                                      u64s(t0["nbytes"], t1["nbytes"]), None, 2), "check")
    at = u64s(local(view, "t0")[0], local(view, "t1")[0])
    _lib.check(l.vmstash_mapped_check(view._handle, u64s(t0["address"], t1["address"]),
                                      u64s(t0["nbytes"], t1["nbytes"]), at, 2), "check")
    with pytest.raises(vmstash.Error) as err:  # a local address that is not where it is mapped
        _lib.check(l.vmstash_mapped_check(view._handle, u64s(t0["address"], t1["address"]),
                                          u64s(t0["nbytes"], t1["nbytes"]), u64s(at[0], at[0]), 2), "check")
    assert err.value.code_name == "FAILED_PRECONDITION" and "map the tag again" in str(err.value)
    out = u64s()
    _lib.check(l.vmstash_mapped_locals(view._handle, u64s(t0["address"], t1["address"]),
                                       u64s(t0["nbytes"], t1["nbytes"]), out, 2), "locals")
    assert list(out) == list(at)
    state, generation = ctypes.c_int(-1), ctypes.c_ulonglong(0)
    _lib.check(l.vmstash_mapped_state(view._handle, ctypes.byref(state), ctypes.byref(generation)), "state")
    assert (state.value, generation.value) == (0, 1)
    with pytest.raises(vmstash.Error) as err:
        _lib.check(l.vmstash_mapped_check(view._handle, u64s(t0["address"], t1["address"]),
                                          u64s(t0["nbytes"], 1 << 40), None, 2), "check")
    with pytest.raises(vmstash.Error) as err:
        _lib.check(_lib.lib().vmstash_mapped_local(view._handle, view.index["t0"]["address"], 64 * MiB,
                                                   ctypes.byref(ctypes.c_ulonglong())), "local")
    assert err.value.code_name in ("INVALID_ARGUMENT", "FAILED_PRECONDITION")
    with pytest.raises(KeyError):
        view.tensor("nope")
    with pytest.raises(vmstash.Error) as err:
        _lib.check(_lib.lib().vmstash_mapped_release(view._handle), "release")
    assert err.value.code_name == "FAILED_PRECONDITION"
    view.close()
    with pytest.raises(vmstash.Error) as err:
        _lib.check(_lib.lib().vmstash_mapped_acquire(view._handle or 12345), "acquire")
    assert err.value.code_name == "NOT_FOUND"


def test_resolve_tag_names_the_integrations_tags():
    vmstash.create_tag("vllm.rt_weights", "backup")
    assert vmstash.weights.resolve_tag("rt_weights") == "vllm.rt_weights"
    vmstash.create_tag("rt_plain", "backup")
    assert vmstash.weights.resolve_tag("rt_plain") == "rt_plain"
    name = _lib.lib().vmstash_tms_tag(b"rt_tms", b"pinned")  # what the drop-in's region("rt_tms") declares
    assert name
    assert vmstash.weights.resolve_tag("rt_tms") == name.decode()
    with pytest.raises(vmstash.Error) as err:
        vmstash.weights.resolve_tag("rt_nowhere")
    assert err.value.code_name == "NOT_FOUND" and "vllm.rt_nowhere" in str(err.value)


def test_share_refuses_chunks_that_cannot_be_exported():
    vmstash.create_tag("rt_unshared", "backup")  # this process runs without share_chunks
    with pytest.raises(vmstash.Error) as err:
        _lib.check(_lib.lib().vmstash_share_tag(b"rt_unshared", None, b"[]", None), "share")
    assert err.value.code_name == "FAILED_PRECONDITION" and "share_chunks:1" in str(err.value)


def test_close_and_shutdown_wait_for_no_use(exporter):
    """A use in progress is never unmapped under it: close() and vmstash_shutdown refuse
    (FAILED_PRECONDITION) until it ends, and then go through."""
    e = exporter()
    view = vmstash.weights.map_tag(e.pid, "w", device=0)
    l = _lib.lib()
    _lib.check(l.vmstash_mapped_acquire(view._handle), "acquire")  # as another thread's use() would
    with pytest.raises(vmstash.Error) as err:
        view.close()
    assert err.value.code_name == "FAILED_PRECONDITION" and "in progress" in str(err.value)
    _lib.check(l.vmstash_mapped_release(view._handle), "release")
    view.close()
    script = r'''
import ctypes, sys
import vmstash
from vmstash import _lib
l = _lib.lib()
view = vmstash.weights.map_tag(int(sys.argv[1]), "w", device=0)
_lib.check(l.vmstash_mapped_acquire(view._handle), "acquire")
l.vmstash_shutdown.restype = ctypes.c_int
first = l.vmstash_shutdown()
print(_lib.last_error() if first else "shut down under a use", flush=True)
_lib.check(l.vmstash_mapped_release(view._handle), "release")
view._handle = None
print(l.vmstash_shutdown(), flush=True)
# A release is never refused by the runtime's phase (a use always ends): after the shutdown
# it still answers for itself.
print(l.vmstash_mapped_release(1), _lib.last_error(), flush=True)
'''
    out = subprocess.run([sys.executable, "-c", script, str(e.pid)], env=dict(os.environ), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    first, second, third = out.stdout.splitlines()
    assert "FAILED_PRECONDITION" in first and "is in progress" in first, first
    assert second == "0"
    assert "has no use acquired" in third, third


def write_backup(view, name, src, n):
    e = view.index[name]
    arr = ctypes.c_ulonglong * 1
    return _lib.lib().vmstash_mapped_write_backup(view._handle, arr(e["address"]), arr(src), arr(n), 1, None)


def test_a_paused_tags_backup_is_written_from_here(exporter):
    """Both processes on the node pool (the exporter with node:1; this one reaches the same
    daemon): while the exporter's tag is paused its backup is writable from here, the
    resume restores what was written, pauses and switches alike; bad writes write nothing."""
    e = exporter("node:1,node_capacity:64M")
    view = vmstash.weights.map_tag(e.pid, "w", device=0)
    l = _lib.lib()
    n = view.index["t0"]["nbytes"]
    src = l.vmstash_malloc(n, 0, None)  # this process's (simulated) device memory
    assert src
    try:
        for seed, transition in ((31, ("pause", "resume")), (32, ("switch_out", "switch_in"))):
            assert e.ask(transition[0]) == {"ok": True}
            info = view.info()
            assert info["state"] == "backup" and info["backup_bytes"] == 4 * MiB, info
            ctypes.memset(src, seed, n)
            with pytest.raises(vmstash.Error) as err:  # nothing is mapped: a plain use is refused
                with view.use():
                    pass
            assert "backup is writable" in str(err.value)
            with view._scope(None, backup=True) as (state, _):
                assert state == 3
                _lib.check(write_backup(view, "t0", src, n), "write_backup")
                # Past the tensor's bytes: refused, nothing written.
                assert write_backup(view, "t1", src, n) != 0
                assert "is not in its backup" in _lib.last_error()
            assert write_backup(view, "t0", src, n) != 0  # outside a use
            assert e.ask(transition[1]) == {"ok": True}
            assert e.ask(f"check {seed}") == {"same": True}
            assert view.state == "mapped"
            with view.use():
                assert write_backup(view, "t0", src, n) != 0  # mapped: nothing to write into
                assert "it is mapped" in _lib.last_error()
    finally:
        l.vmstash_free(src, n, 0, None)
