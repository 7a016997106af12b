"""Megatron-RL's training-state offload through vmstash.compat.megatron.rl, on megatron-core
0.19.2's own classes (gpu; Note [Megatron-RL Offload] in vmstash/compat/megatron/rl.py).

Three jobs, each in its own process, one GPU: GPT (8 layers of 2048, bf16) in Megatron's
DistributedDataParallel with the distributed optimizer (fp32 gradients, Adam), built the way
setup_model_and_optimizer builds it (get_megatron_optimizer looked up in megatron.core.optimizer
at call time); 3 cycles of 2 training steps, then the RL loop's calls with
--rl-offload-optimizer-during-inference (rl_utils: model[0].offload_grad_buffers(),
optimizer.offload_to_cpu(); a rollout's log-probability pass with the training model;
model[0].restore_grad_buffers(), optimizer.restore_from_cpu()):
  vmstash   vmstash.compat.megatron.rl.install() first: the calls pause and resume tags
  megatron  Megatron's own methods
  twin      no offload at all
Checked: vmstash's losses and log-probabilities equal the twin's bit for bit, the device
memory the offload gives back is at least the gradients' and the optimizer state's bytes,
and every tensor of the training state keeps its address. Printed side by side: each job's
offload and restore times and the memory they gave back. Each test in a fresh process
(conftest.py); megatron-core must be importable.

    python3 -m pytest -m gpu gpu_megatron_rl.py -s
"""
import json
import os
import socket
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(mode, out):
    """One job (its own process): the records go to `out` as JSON."""
    import time
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    if mode == "vmstash":
        import vmstash.compat.megatron.rl as vm_rl
        vm_rl.install()  # the one line a Megatron-RL user adds
    import megatron.core.optimizer as core_optimizer
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig
    ps.initialize_model_parallel(1, 1)
    cfg = TransformerConfig(num_layers=8, hidden_size=2048, num_attention_heads=16, bf16=True,
                            params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0)
    vocab, seq, batch = 1024, 128, 4
    pos = torch.arange(seq, device="cuda")[None].expand(batch, seq)
    model_parallel_cuda_manual_seed(1)
    torch.manual_seed(1)
    model = Float16Module(cfg, GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=vocab, max_sequence_length=seq))
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                     grad_reduce_in_fp32=True), model)
    opt = core_optimizer.get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True,
                                                                use_distributed_optimizer=True), [ddp])
    gen = torch.Generator(device="cuda").manual_seed(7)
    data = torch.randint(0, vocab, (3, 3, batch, seq), generator=gen, device="cuda")

    from vmstash.demo.megatron_training import megatron_step

    def train_step(x):
        return megatron_step(ddp, opt, x, pos)

    def state():
        tensors = [b.param_data for b in ddp.buffers] + [b.grad_data for b in ddp.buffers]
        for o in opt.chained_optimizers:
            for g in o.optimizer.param_groups:
                for p in g["params"]:
                    tensors.append(p)
                    tensors += [v for v in o.optimizer.state.get(p, {}).values() if torch.is_tensor(v) and v.is_cuda]
        return tensors

    def free():
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    rec = dict(mode=mode, device=torch.cuda.get_device_name(0), losses=[], logprobs=[], offload_ms=[],
               restore_ms=[], freed=[], moved=[])
    for cycle in range(3):
        rec["losses"] += [train_step(data[cycle, i]) for i in range(2)]
        grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.buffers)
        optim = sum(t.numel() * t.element_size() for t in state()[2 * len(ddp.buffers):]
                    if t.dtype == torch.float32 and not any(t.data_ptr() == b.param_data.data_ptr()
                                                            for b in ddp.buffers))
        rec["state_bytes"] = dict(grads=grads, optimizer=optim)
        addresses = [t.data_ptr() for t in state()]
        before = free()
        t0 = time.perf_counter()
        if mode != "twin":  # rl_utils.get_environment_rollouts, --rl-offload-optimizer-during-inference
            ddp.offload_grad_buffers()
            opt.offload_to_cpu()
        torch.cuda.synchronize()
        rec["offload_ms"].append((time.perf_counter() - t0) * 1e3)
        rec["freed"].append(free() - before)
        with torch.no_grad():  # the rollout's log-probabilities with the training model
            logits = ddp(data[cycle, 2], pos, None)
            rec["logprobs"].append(torch.log_softmax(logits.float(), -1).sum().item().hex())
        t0 = time.perf_counter()
        if mode != "twin":  # get_grpo_data_iterator, before training
            ddp.restore_grad_buffers()
            opt.restore_from_cpu()
        torch.cuda.synchronize()
        rec["restore_ms"].append((time.perf_counter() - t0) * 1e3)
        rec["moved"].append(sum(1 for a, t in zip(addresses, state()) if a != t.data_ptr()))
    rec["losses"].append(train_step(data[0, 0]))
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(rec, f)


def _run(mode):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rec.json")
        r = subprocess.run([sys.executable, os.path.abspath(__file__), mode, out], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, f"{mode} job failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
        with open(out) as f:
            return json.load(f)


def test_megatron_rl_offload_through_vmstash_equals_a_twin_and_frees_the_state():
    try:
        import megatron.core.distributed  # noqa: F401
    except ImportError as e:
        pytest.fail(f"megatron-core is not importable: {e}", pytrace=False)
    recs = {mode: _run(mode) for mode in ("vmstash", "megatron", "twin")}
    ours, theirs, twin = recs["vmstash"], recs["megatron"], recs["twin"]
    print(f"\nMegatron-RL offload on {ours['device']}: gradients {ours['state_bytes']['grads'] / MiB:.0f} MiB, "
          f"optimizer state {ours['state_bytes']['optimizer'] / MiB:.0f} MiB")
    for r in (ours, theirs):
        print(f"  {r['mode']:<9} offload ms " + " ".join(f"{x:8.1f}" for x in r["offload_ms"]) +
              "   restore ms " + " ".join(f"{x:8.1f}" for x in r["restore_ms"]) +
              "   freed MiB " + " ".join(f"{x / MiB:6.0f}" for x in r["freed"]) +
              f"   tensors moved {r['moved']}")
    print("  Megatron / vmstash, offload + restore per cycle: " + " ".join(
        f"{(a + b) / (c + d):.1f}x" for a, b, c, d in zip(theirs["offload_ms"], theirs["restore_ms"],
                                                           ours["offload_ms"], ours["restore_ms"])))
    print(f"  Megatron's own losses equal the twin's: {theirs['losses'] == twin['losses']}")
    assert ours["losses"] == twin["losses"], (ours["losses"], twin["losses"])
    assert ours["logprobs"] == twin["logprobs"], "the rollout's log-probabilities differ"
    assert ours["moved"] == [0, 0, 0], "a tensor of the training state changed its address"
    need = ours["state_bytes"]["grads"] + ours["state_bytes"]["optimizer"]
    assert all(f >= need - 64 * MiB for f in ours["freed"]), (ours["freed"], need)


if __name__ == "__main__":  # a job: python3 gpu_megatron_rl.py MODE OUT
    job(sys.argv[1], sys.argv[2])
