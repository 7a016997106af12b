"""Megatron-LM's training state through phase switches, with megatron-core 0.19.2's own classes (gpu).

A small GPT (local layer spec, no Transformer Engine) in Megatron's DistributedDataParallel
with its distributed optimizer, world size 1, its state placed in vmstash tags by
vmstash.compat.megatron.place_training_state. Training steps alternate with rollout phases
in verl's order: switch the optimizer state, gradients and scratch out and the rollout
weights in; copy the weights; switch the parameters out and the KV cache and decode graph
in; decode (graph against eager); switch the rollout out and the training state back. A
twin process (this file run as a script) trains the same steps and never switches: the
losses and the final state's bytes (SHA-256 per tensor) must be equal, and across each switch every byte of
the training state (compared with a host copy). Also checked: the addresses of
the buffers, the main parameters and Adam's state never change, and the device memory in
use during a rollout is the pre-training baseline plus the rollout's tags, within a margin.
Each test in a fresh process (conftest.py); megatron-core must be importable.
"""
import gc
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.gpu

MiB = 1 << 20
MARGIN = 128 * MiB  # Megatron's small non-parameter buffers and PyTorch's, made after the baseline (38-40 MiB measured)
ROLLOUT_TAGS = ["rollout_weights", "rollout_kv", "rollout_graph"]


def child_env(name, env):
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS: the twin must match
    return env


def _used(torch):
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def scenario(switch, port, cycles=2, steps=3):
    """Trains (steps) x (cycles + 1) steps; with `switch`, a rollout phase between each group.
    Returns the losses (as float hex), the final state's SHA-256 per tensor and what was measured."""
    import torch
    import torch.distributed as dist
    import vmstash
    import vmstash.compat.megatron as vm_megatron
    torch.use_deterministic_algorithms(True, warn_only=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig
    ps.initialize_model_parallel(1, 1)
    # Large enough that its training state (about 400 MiB: 4 layers of 512 made 183 MiB on an
    # H200) dwarfs the memory check's margin.
    cfg = TransformerConfig(num_layers=4, hidden_size=768, num_attention_heads=12, bf16=True,
                            params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0)
    vocab, seq, batch = 1024, 128, 4
    pos = torch.arange(seq, device="cuda")[None].expand(batch, seq)

    def build(place):
        model = Float16Module(cfg, GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=vocab,
                                            max_sequence_length=seq))
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                         grad_reduce_in_fp32=True), model)
        make = lambda: get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True,  # noqa: E731
                                                              use_distributed_optimizer=True), [ddp])
        return model, ddp, (vm_megatron.place_training_state([ddp], make) if place else make())

    def train_step(ddp, opt, x):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(x, pos, None, labels=x).mean()
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        return loss.item().hex()

    torch.cuda.empty_cache()
    before = _used(torch)
    # The baseline: what the process holds before training, once NCCL has made the
    # communicators of the groups a training step uses (they stay for the groups' life):
    # one step of a throwaway model, then everything of it dropped.
    model_parallel_cuda_manual_seed(1)  # Megatron's layers draw from its RNG tracker
    throwaway = build(place=False)
    train_step(throwaway[1], throwaway[2], torch.zeros(batch, seq, dtype=torch.long, device="cuda"))
    del throwaway
    ps.destroy_global_memory_buffer()  # a fresh one, for the tagged buffer
    ps._set_global_memory_buffer()
    gc.collect()
    torch.cuda.empty_cache()
    baseline = _used(torch)
    model_parallel_cuda_manual_seed(1)
    torch.manual_seed(1)
    model, ddp, opt = build(place=True)
    gen = torch.Generator(device="cuda").manual_seed(7)
    data = torch.randint(0, vocab, (cycles + 1, steps, batch, seq), generator=gen, device="cuda")

    def state():
        """The training state that must survive: parameter buffers, main params, Adam's state."""
        tensors = [b.param_data for b in ddp.buffers]
        for o in opt.chained_optimizers:
            inner = o.optimizer
            for g in inner.param_groups:
                for p in g["params"]:
                    tensors.append(p)
                    tensors += [v for v in inner.state.get(p, {}).values() if torch.is_tensor(v) and v.is_cuda]
        return tensors

    losses, measured = [], {"rollout_used_over_baseline": [], "rollout_tag_bytes": [], "graph_vs_eager": []}
    rollout = None
    for cycle in range(cycles + 1):
        losses += [train_step(ddp, opt, data[cycle, i]) for i in range(steps)]
        if not switch or cycle == cycles:
            continue
        vm_megatron.prepare_switch_out([ddp], opt)
        saved, addresses = [t.detach().cpu() for t in state()], [t.data_ptr() for t in state()]
        grads = [b.grad_data.data_ptr() for b in ddp.buffers]
        # verl's order: the optimizer state, gradients and scratch out, the rollout weights in
        keep_params = [vm_megatron.OPTIM_TAG, vm_megatron.GRADS_TAG, vm_megatron.GMB_TAG]
        vmstash.switch(pause=keep_params, resume=["rollout_weights"] if rollout else [])
        if rollout is None:
            rollout = Rollout(torch, vmstash, model, vocab)
        rollout.sync(model)
        vmstash.switch(pause=[vm_megatron.PARAMS_TAG], resume=["rollout_kv", "rollout_graph"] if cycle else [])
        if cycle == 0:
            rollout.capture()
        measured["graph_vs_eager"].append(rollout.check())
        torch.cuda.empty_cache()
        tag_bytes = sum((vmstash.tag_stats(t) or {}).get("reserved_bytes", {}).get("current", 0) for t in ROLLOUT_TAGS)
        measured["rollout_used_over_baseline"].append(_used(torch) - baseline)
        measured["rollout_tag_bytes"].append(tag_bytes)
        measured["training_state_bytes"] = sum(t.numel() * t.element_size() for t in saved)
        paused = {t: (vmstash.tag_stats(t) or {}).get("state") for t in vm_megatron.TRAINING_TAGS}
        assert set(paused.values()) == {"paused"}, f"training tags during the rollout: {paused}"
        vmstash.switch(pause=ROLLOUT_TAGS, resume=vm_megatron.TRAINING_TAGS)
        assert [t.data_ptr() for t in state()] == addresses, "the training state moved"
        assert [b.grad_data.data_ptr() for b in ddp.buffers] == grads, "the gradient buffers moved"
        assert all(torch.equal(t.cpu(), c) for t, c in zip(state(), saved)), "the training state changed"
    final = [hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
             for t in state()]
    dist.destroy_process_group()
    return dict(losses=losses, final=final, nccl_and_warmup_bytes=baseline - before, **measured)


class Rollout:
    """The rollout phase's memory: a bf16 copy of the embedding in "rollout_weights", a KV
    cache in "rollout_kv", a decode step's graph in "rollout_graph"."""

    def __init__(self, torch, vmstash, model, vocab):
        self.torch, self.vmstash = torch, vmstash
        emb = self._embedding(model)
        with vmstash.region("rollout_weights", policy="backup"):
            self.w = torch.empty_like(emb)
        with vmstash.region("rollout_kv"):
            self.kv = torch.zeros(512, emb.shape[1], device="cuda", dtype=torch.bfloat16)
        self.tok = torch.zeros(8, dtype=torch.long, device="cuda")
        self.vocab = vocab

    @staticmethod
    def _embedding(model):
        for name, p in model.named_parameters():
            if "word_embeddings" in name:
                return p
        raise AssertionError("no word embedding in the model")

    def sync(self, model):
        with self.torch.no_grad():
            self.w.copy_(self._embedding(model))

    def step(self):
        F = self.torch.nn.functional
        h = self.w[self.tok]                         # [8, hidden]
        self.kv[:8].copy_(h)
        a = F.softmax(h.float() @ self.kv.float().T, dim=-1).to(h.dtype) @ self.kv
        return (h + a) @ self.w.T                    # logits [8, vocab]

    def capture(self):
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with self.vmstash.cuda_graph(self.graph, tag="rollout_graph", policy="discard"):
            self.logits = self.step()

    def check(self):
        torch = self.torch
        self.kv.zero_()
        self.tok.copy_(torch.arange(8, device="cuda") * 97 % self.vocab)
        self.graph.replay()
        got = self.logits.clone()
        self.kv.zero_()
        eager = self.step()
        torch.cuda.synchronize()
        return ((got.float() - eager.float()).abs().max() / eager.float().abs().max().clamp(min=1e-12)).item()


def _megatron_missing():
    try:
        import megatron.core.distributed  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def test_training_state_through_switches_equals_a_twin_that_never_switched():
    missing = _megatron_missing()
    if missing:
        pytest.fail(f"megatron-core is not importable: {missing}", pytrace=False)
    ours = scenario(switch=True, port=29611)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "twin.json")
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "twin", path], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        twin = json.load(open(path))
    print(f"losses: {[float.fromhex(x) for x in ours['losses']]}")
    print(f"held after a throwaway training step (NCCL's communicators, cuBLAS): "
          f"{ours['nccl_and_warmup_bytes'] / MiB:.1f} MiB (in the baseline)")
    print(f"training state (parameter buffers, main parameters, Adam): {ours['training_state_bytes'] / MiB:.1f} MiB")
    print(f"rollout: device memory in use over the pre-training baseline "
          f"{[round(x / MiB, 1) for x in ours['rollout_used_over_baseline']]} MiB, rollout tags "
          f"{[round(x / MiB, 1) for x in ours['rollout_tag_bytes']]} MiB; graph vs eager {ours['graph_vs_eager']}")
    assert ours["losses"] == twin["losses"], (ours["losses"], twin["losses"])
    assert ours["final"] == twin["final"], "the training state differs from the twin's"
    assert ours["training_state_bytes"] > 2 * MARGIN, "the model is too small for the memory check to see its state"
    for used, tags in zip(ours["rollout_used_over_baseline"], ours["rollout_tag_bytes"]):
        assert used <= tags + MARGIN, f"during the rollout {used / MiB:.1f} MiB over the baseline, tags {tags / MiB:.1f}"
    assert all(x < 2e-2 for x in ours["graph_vs_eager"]), ours["graph_vs_eager"]


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "twin":
    result = scenario(switch=False, port=29612)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)
