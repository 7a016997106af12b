"""Weights from a trainer process to a rollout process on one GPU through a mapped tag (label
gpu; vmstash.weights, Note [Mapped Tags] in runtime/tag_share.h), as an RL job runs them: the
rollout process keeps its weights in a backup tag and decodes with a CUDA graph captured over
them; each of 20 steps it is resumed, the trainer (another process, its master weights in
fp32) updates them and syncs them into the rollout's tag (bf16: converted in the copy), the
rollout decodes 32 tokens greedily by replaying its graph, and is paused again. The tokens
equal those of one process doing the same thing (its own weights, its own graph). Between
steps the trainer's view is paused and a sync raises; the rollout exiting leaves it gone.
With the node pool (the rollout on node:1) the trainer syncs while the rollout is paused
instead: into its backup, which the rollout's resume restores.

    python3 -m pytest -m gpu gpu_weights.py
"""
import json
import os
import subprocess
import sys
import tempfile

import pytest

from node_helpers import ScriptProcess, daemon_binary, stop_daemons

pytestmark = pytest.mark.gpu

STEPS = 20
TOKENS = 32

# What both the rollout and the reference build: the decoder, its weights' shapes, the graph.
MODEL = r'''
import torch
V, D, H, LAYERS = 2048, 512, 4096, 12
SHAPES = {"emb": (V, D), "up": (D, H), "down": (H, V)}
SHAPES.update({f"layer{i}": (H, H) for i in range(LAYERS)})  # 12 x 32 MiB in bf16
def build(dev, region=None):
    import contextlib
    ctx = region if region is not None else contextlib.nullcontext()
    with ctx:
        w = {name: torch.zeros(shape, device=dev, dtype=torch.bfloat16) for name, shape in SHAPES.items()}
    tok = torch.zeros(1, dtype=torch.long, device=dev)
    out = torch.zeros(1, dtype=torch.long, device=dev)
    def step():
        h = torch.tanh(w["emb"][tok] @ w["up"])
        for i in range(LAYERS):
            h = torch.tanh(h @ w[f"layer{i}"])
        out.copy_((h @ w["down"]).argmax(-1))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    def decode(start, n):
        tok.fill_(start)
        got = []
        for _ in range(n):
            graph.replay()
            got.append(int(out.item()))
            tok.copy_(out)
        return got
    return w, decode
def master_weights(dev):
    g = torch.Generator(device=dev).manual_seed(1234)
    return {name: torch.randn(shape, device=dev, generator=g) * (1.0 / shape[0] ** 0.5)
            for name, shape in SHAPES.items()}
def train_step(master, step, dev):
    g = torch.Generator(device=dev).manual_seed(step)
    for name, t in master.items():
        t.add_(torch.randn(t.shape, device=dev, generator=g), alpha=0.05 / t.shape[0] ** 0.5)
'''

ROLLOUT = MODEL + r'''
import json, os, sys
import vmstash
dev = torch.device("cuda", int(os.environ.get("WEIGHTS_DEVICE", "0")))
torch.cuda.set_device(dev)
mode = sys.argv[1]
if mode == "region":  # vmstash's own API
    w, decode = build(dev, vmstash.region("weights", policy="backup"))
    pause, resume = (lambda: vmstash.pause("weights")), (lambda: vmstash.resume("weights"))
elif mode == "tms":  # torch_memory_saver's API (SGLang), on the drop-in
    from vmstash.compat.torch_memory_saver import torch_memory_saver as tms
    w, decode = build(dev, tms.region(tag="weights", enable_cpu_backup=True))
    pause, resume = (lambda: tms.pause("weights")), (lambda: tms.resume("weights"))
else:  # vLLM's sleep mode (verl), on vmstash's backend
    from vmstash.compat.vllm import VmstashMemAllocator
    allocator = VmstashMemAllocator.get_instance()
    w, decode = build(dev, allocator.use_memory_pool("weights"))
    pause, resume = (lambda: allocator.sleep(offload_tags=("weights",))), (lambda: allocator.wake_up(["weights"]))
generation = vmstash.weights.publish("weights", w)  # by the framework's name for the tag
def say(**kw):
    print(json.dumps(kw), flush=True)
say(ready=os.getpid(), generation=generation)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "resume":
        resume()
        say(ok=True)
    elif cmd[0] == "pause":
        torch.cuda.synchronize()
        pause()
        say(ok=True, free=torch.cuda.mem_get_info()[0])
    elif cmd[0] == "decode":
        say(tokens=decode(int(cmd[1]), int(cmd[2])))
    elif cmd[0] == "exit":
        break
'''

TRAINER = MODEL + r'''
import json, sys
import vmstash
dev = torch.device("cuda", 0)
master = master_weights(dev)
view = vmstash.weights.map_tag(int(sys.argv[1]), "weights")
def say(**kw):
    print(json.dumps(kw), flush=True)
say(ready=True, names=sorted(view.names), info=view.info())
for line in sys.stdin:
    cmd = line.split()
    try:
        if cmd[0] == "train":
            train_step(master, int(cmd[1]), dev)
            say(ok=True)
        elif cmd[0] == "sync":
            out = vmstash.weights.sync(master, view)
            same = None
            if out["into"] == "device":  # read back through the view's own tensor
                with view.use():
                    same = bool(torch.equal(view.tensor("emb"), master["emb"].to(torch.bfloat16)))
            say(ok=True, **out, same=same, info=view.info())
        elif cmd[0] == "state":
            say(state=view.state)
        elif cmd[0] == "exit":
            break
    except vmstash.Error as e:
        say(error=e.code_name, message=str(e))
'''

REFERENCE = MODEL + r'''
import json, sys
dev = torch.device("cuda", 0)
w, decode = build(dev)
master = master_weights(dev)
for step in range(int(sys.argv[1])):
    train_step(master, step, dev)
    for name, t in master.items():
        w[name].copy_(t)
    print(json.dumps({"tokens": decode(step % 97, int(sys.argv[2]))}), flush=True)
'''


def run_steps(mode, steps, into, rollout_env=None, trainer_env=None):
    """The rollout (`mode`'s API) and the trainer taking turns for `steps` steps, syncing
    `into` the rollout's device memory or its backup; the tokens checked against one
    process's (run with the trainer's environment)."""
    d = tempfile.mkdtemp(prefix="vmstash-weights-gpu-")
    os.chmod(d, 0o700)
    env = dict(os.environ, VMSTASH_RUNTIME_DIR=d, VMSTASH_DAEMON=daemon_binary())
    env.pop("VMSTASH_CONF", None)
    conf = "node:1,node_capacity:2G" if into == "backup" else "share_chunks:1"
    rollout = ScriptProcess(ROLLOUT, dict(env, VMSTASH_CONF=conf, **(rollout_env or {})), mode)
    trainer = None
    trainer_env = dict(env, **(trainer_env or {}))
    try:
        ready = rollout.read()
        assert ready["generation"] == 1
        trainer = ScriptProcess(TRAINER, trainer_env, str(ready["ready"]))
        t = trainer.read()
        assert t["info"]["state"] == "mapped" and t["info"]["mapped_bytes"] >= 12 * (32 << 20)
        assert rollout.ask("pause")["ok"]
        tokens = []
        for step in range(steps):
            assert trainer.ask(f"train {step}") == {"ok": True}  # trains while the rollout is paused
            paused = trainer.ask("sync")
            if into == "device":
                assert paused.get("error") == "FAILED_PRECONDITION" and "paused" in paused["message"], paused
                assert rollout.ask("resume") == {"ok": True}
                synced = trainer.ask("sync")
                assert synced.get("ok") and synced["tensors"] == 15, synced
                assert synced["into"] == "device" and synced["info"]["state"] == "mapped"
                assert synced["same"] is True, synced
            else:
                assert paused.get("ok") and paused["into"] == "backup" and paused["tensors"] == 15, paused
                assert paused["info"]["state"] == "backup" and paused["info"]["backup_bytes"] >= 12 * (32 << 20)
                assert rollout.ask("resume") == {"ok": True}
            tokens.append(rollout.ask(f"decode {step % 97} {TOKENS}")["tokens"])
            assert rollout.ask("pause")["ok"]
        info = trainer.ask("state")
        assert info["state"] == ("paused" if into == "device" else "backup"), info
        reference = subprocess.run([sys.executable, "-c", REFERENCE, str(steps), str(TOKENS)], env=trainer_env,
                                   capture_output=True, text=True, timeout=600)
        assert reference.returncode == 0, reference.stderr[-3000:]
        expected = [json.loads(line)["tokens"] for line in reference.stdout.splitlines()]
        assert len(expected) == steps
        assert tokens == expected
        assert len({tuple(t) for t in tokens}) > 1  # the updates changed what the rollout decodes
        rollout.close()
        for _ in range(100):
            if trainer.ask("state")["state"] == "gone":
                break
        gone = trainer.ask("sync")
        assert gone.get("error") == "FAILED_PRECONDITION" and "exited" in gone["message"], gone
    finally:
        rollout.close()
        if trainer is not None:
            trainer.close()
        stop_daemons(d)


@pytest.mark.parametrize("into", ["device", "backup"])
@pytest.mark.parametrize("mode,steps", [("region", STEPS), ("tms", 5), ("vllm", 5)])
def test_trainer_to_rollout_equals_one_process(mode, steps, into):
    """20 steps through vmstash's API; 5 through torch_memory_saver's (the drop-in) and
    vLLM's sleep mode (vmstash's backend), each publishing its framework's tag "weights".
    `into`: "device", the trainer syncs while the rollout is resumed; "backup", while it is
    paused (the rollout on the node pool: node:1)."""
    run_steps(mode, steps, into)


@pytest.mark.parametrize("into", ["device", "backup"])
def test_a_device_numbered_differently_in_each_process(into):
    """The rollout sees two GPUs and uses its device 1; the trainer sees only that GPU
    (CUDA_VISIBLE_DEVICES=1, its device 0), as per-worker CUDA_VISIBLE_DEVICES do: the map
    finds the device by UUID. Needs two GPUs."""
    from conftest import _cuda_devices
    if (_cuda_devices() or 0) < 2:
        pytest.skip(f"{_cuda_devices()} GPU(s) here, needs 2")
    run_steps("region", 3, into, rollout_env={"CUDA_VISIBLE_DEVICES": "0,1", "WEIGHTS_DEVICE": "1"},
              trainer_env={"CUDA_VISIBLE_DEVICES": "1"})
