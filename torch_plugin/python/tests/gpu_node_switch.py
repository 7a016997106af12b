"""A switch across two PyTorch processes on one GPU (label gpu; vmstash.node.switch, Note [Node
Switch] in node/node_switch.h): a "trainer" and a "rollout" process, each with weights in a
backup tag, scratch memory in a discard tag and a CUDA graph captured over them, take turns
through node switches made by this process (which takes no part): after every switch the
process switched in replays its graph, with outputs equal to its first replay's. A switch that
fails in one process (a tag it does not have) rolls both back, and both graphs still replay.
With share_chunks:1 the scratch tags' chunks change process at each switch (Note [Node Switch
Handover]): the graph switched in computes in the other process's physical memory. On a GPU
filled up to leave less free memory than one phase's weights, the weights' chunks change process
too (their restore copies wait for the other process's backup copies through CUDA interprocess
events): the switch goes through with the handover, and is refused without it.

    python3 -m pytest -m gpu gpu_node_switch.py   (VMSTASH_DAEMON: vmstashd; else it is looked for)
"""
import os
import tempfile

import pytest

from node_helpers import ScriptProcess, daemon_binary, stop_daemons

pytestmark = pytest.mark.gpu

# One process: weights (backup), scratch (discard) and a CUDA graph over them; steps from stdin.
SIDE = r'''
import json, os, sys, torch
import vmstash
role, seed = sys.argv[1], int(sys.argv[2])
dev = torch.device("cuda", 0)
torch.manual_seed(seed)
n = 4096
with vmstash.region(f"{role}_weights", policy="backup"):
    layers = [torch.randn(n, n, device=dev) / n ** 0.5 for _ in range(64)]  # 4 GiB
with vmstash.region(f"{role}_scratch"):
    scratch = torch.empty(64, n, device=dev)
x = torch.randn(64, n, device=dev)
def forward():
    y = x
    for w in layers:
        torch.matmul(y, w, out=scratch)
        y = torch.tanh(scratch)
    return y
stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    forward()
torch.cuda.current_stream().wait_stream(stream)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    y = forward()
graph.replay()
torch.cuda.synchronize()
first = y.clone()
def say(**kw):
    print(json.dumps(kw), flush=True)
if sys.argv[3] == "paused":
    vmstash.pause(f"{role}_weights")
    vmstash.pause(f"{role}_scratch")
say(step="ready", pid=os.getpid())
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "replay":
        y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        say(step="replay", equal=bool(torch.equal(y, first)))
    elif cmd == "state":
        say(step="state", **{t: vmstash.tag_stats(t, 0)["state"] for t in (f"{role}_weights", f"{role}_scratch")})
    elif cmd == "imports":
        calls = vmstash.stats(0)["driver_calls"]
        say(step="imports", n=calls.get("import_chunk_fd", 0), events=calls.get("open_ipc_event", 0))
    elif cmd == "quit":
        break
say(step="end")
'''


class _Side(ScriptProcess):
    def __init__(self, env, role, seed, state):
        super().__init__(SIDE, env, role, str(seed), state)
        self.role = role
        self.pid = self.read()["pid"]

    def tags(self):
        return [(self.pid, f"{self.role}_weights"), (self.pid, f"{self.role}_scratch")]


@pytest.mark.parametrize("share", [0, 1])
def test_two_processes_take_turns_through_node_switches_with_cuda_graphs(monkeypatch, share):
    import vmstash
    runtime_dir = tempfile.mkdtemp(prefix="vmstash-gpu-node-switch-")
    os.chmod(runtime_dir, 0o700)
    monkeypatch.setenv("VMSTASH_RUNTIME_DIR", runtime_dir)
    monkeypatch.setenv("VMSTASH_DAEMON", daemon_binary())
    env = dict(os.environ)
    env["VMSTASH_CONF"] = f"share_chunks:{share}"
    sides = []
    try:
        trainer = _Side(env, "trainer", 1, "active")
        rollout = _Side(env, "rollout", 2, "paused")
        sides = [trainer, rollout]
        active, other = trainer, rollout
        for turn in range(6):
            r = vmstash.node.switch(pause=active.tags(), resume=other.tags())
            assert r["committed"] and all(p["changed"] for p in r["processes"]), (turn, r)
            assert active.ask("state") == {"step": "state", f"{active.role}_weights": "paused",
                                           f"{active.role}_scratch": "paused"}
            assert other.ask("replay")["equal"], f"turn {turn}: the graph over the switched-in weights differs"
            active, other = other, active
        # A failure in one process rolls both back.
        with pytest.raises(vmstash.Error) as e:
            vmstash.node.switch(pause=active.tags(), resume=other.tags() + [(other.pid, "no_such_tag")])
        assert e.value.code_name == "ABORTED" and f"process {other.pid}" in str(e.value)
        assert active.ask("replay")["equal"], "the process rolled back replays its graph"
        assert other.ask("state")[f"{other.role}_weights"] == "paused"
        r = vmstash.node.switch(pause=active.tags(), resume=other.tags())
        assert other.ask("replay")["equal"]
        counts = [s.ask("imports") for s in sides]
        imports = [c["n"] for c in counts]
        assert (min(imports) > 0) if share else (max(imports) == 0), imports
        # The weights' covers restore into fresh memory: the GPU has room for them
        # (RestoresTakeForeignChunks), so no process waited on the other's events.
        assert max(c["events"] for c in counts) == 0, counts
        for s in sides:
            s.ask("quit")
            assert s.p.wait(60) == 0
    finally:
        for s in sides:
            if s.p.poll() is None:
                s.p.kill()
        stop_daemons(runtime_dir)


def test_a_switch_that_fits_the_gpu_only_when_the_memory_changes_process(monkeypatch):
    # Both phases' weights are 4 GiB, backed up. With under 2 GiB free, a switch that makes
    # the rollout's memory fresh runs out; one that maps the trainer's chunks into it needs
    # none, and the restored weights give the rollout's first outputs again.
    import torch
    import vmstash
    runtime_dir = tempfile.mkdtemp(prefix="vmstash-gpu-node-switch-")
    os.chmod(runtime_dir, 0o700)
    monkeypatch.setenv("VMSTASH_RUNTIME_DIR", runtime_dir)
    monkeypatch.setenv("VMSTASH_DAEMON", daemon_binary())
    sides = []
    filler = None
    try:
        for share in (0, 1):
            env = dict(os.environ)
            env["VMSTASH_CONF"] = f"share_chunks:{share}"
            trainer = _Side(env, "trainer", 1, "active")
            rollout = _Side(env, "rollout", 2, "paused")
            sides = [trainer, rollout]
            free, _ = torch.cuda.mem_get_info(0)
            filler = torch.empty(free - (3 << 29), dtype=torch.uint8, device="cuda:0")  # 1.5 GiB left
            if share == 0:
                with pytest.raises(vmstash.Error) as e:
                    vmstash.node.switch(pause=trainer.tags(), resume=rollout.tags())
                assert e.value.code_name == "ABORTED", str(e.value)
                assert trainer.ask("replay")["equal"], "rolled back: the trainer computes on"
            else:
                for active, other in ((trainer, rollout), (rollout, trainer)):
                    r = vmstash.node.switch(pause=active.tags(), resume=other.tags())
                    assert r["committed"], r
                    assert other.ask("replay")["equal"], f"{other.role}: the graph over the handed-over memory differs"
                    assert other.ask("imports")["events"] > 0
            del filler
            filler = None
            torch.cuda.empty_cache()
            for s in sides:
                s.ask("quit")
                assert s.p.wait(60) == 0
            sides = []
    finally:
        del filler
        for s in sides:
            if s.p.poll() is None:
                s.p.kill()
        stop_daemons(runtime_dir)
