"""Megatron-LM's training state through RL phase switches, with megatron-core's own classes.

    python3 -m vmstash.demo.megatron_training [--world 1|2] [--cycles 2] [--steps 3] [--json OUT]

A small GPT (local layer spec, no Transformer Engine) in Megatron's DistributedDataParallel
with its distributed optimizer (bf16, Adam), one process per GPU (`--world`, data parallel),
its state placed in vmstash tags by vmstash.compat.megatron.place_training_state. Training
steps alternate with rollout phases in verl's order: switch the optimizer state, gradients
and scratch out and the rollout weights in; copy the weights; switch the parameters out and
the KV cache and decode graph in; decode (the graph, captured in the first rollout, against
eager); switch the rollout out and the training state back. With several ranks every switch
is vmstash.distributed.switch: on every rank or on none.

A twin job (the same ranks, seeds and data) trains the same steps and never switches. The
run passes when, on every rank: the losses and the final state's bytes (SHA-256 per tensor)
equal the twin's; across each switch every byte of the training state (against a host
copy) and every address of its buffers, main parameters and Adam's state are unchanged;
every training tag is paused during the rollout; the device memory in use during a rollout
is the pre-training baseline plus the rollout's tags, within MARGIN; the decode graph
matches eager. It prints what it measured (memory, each switch's time) and PASSED or
FAILED; exit status 0 or 1. megatron-core must be importable.
"""
import argparse
import gc
import hashlib
import json
import os
import socket
import sys
import tempfile
import time
import traceback

MiB = 1 << 20
# Megatron's small non-parameter buffers and PyTorch's, made after the baseline (38-40 MiB
# measured at world size 1).
MARGIN = 128 * MiB
ROLLOUT_TAGS = ["rollout_weights", "rollout_kv", "rollout_graph"]
GRAPH_TOLERANCE = 2e-2  # graph against eager, relative (bf16)


def _used(torch):
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


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


def megatron_step(ddp, opt, x, pos):
    """One training step of a GPT in Megatron's DDP with its optimizer, on tokens `x` at
    positions `pos` (labels: the tokens); the loss as float hex."""
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = ddp(x, pos, None, labels=x).mean()
    loss.backward()
    ddp.finish_grad_sync()
    opt.step()
    return loss.item().hex()


def scenario(rank, world, port, switch, cycles, steps):
    """One rank's run: trains (steps) x (cycles + 1) steps; with `switch`, a rollout phase
    between each group. Returns the losses (float hex), the final state's SHA-256 per tensor
    and what was measured; an assertion names a broken check."""
    import torch
    import torch.distributed as dist
    import vmstash
    import vmstash.compat.megatron as vm_megatron
    import vmstash.distributed as vd
    torch.use_deterministic_algorithms(True, warn_only=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig
    ps.initialize_model_parallel(1, 1)  # every rank data parallel
    # Large enough that each rank's training state dwarfs the memory check's margin at world
    # size 2 too (about 51 M parameters: 14 bytes each at world size 1, 8 at 2, where the
    # distributed optimizer's fp32 state is sharded).
    cfg = TransformerConfig(num_layers=4, hidden_size=1024, num_attention_heads=16, bf16=True,
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
        return megatron_step(ddp, opt, x, pos)

    def phase_switch(pause, resume, label):
        """One switch, on every rank (vmstash.distributed) or this process's; its time."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if world > 1:
            vd.switch(pause, resume, timeout=120)
        else:
            vmstash.switch(pause=pause, resume=resume)
        measured["switch_ms"].append([label, (time.perf_counter() - t0) * 1e3])

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
    data = torch.randint(0, vocab, (cycles + 1, steps, world, batch, seq), generator=gen, device="cuda")

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

    losses = []
    measured = {"rollout_used_over_baseline": [], "rollout_tag_bytes": [], "graph_vs_eager": [], "switch_ms": []}
    rollout = None
    for cycle in range(cycles + 1):
        losses += [train_step(ddp, opt, data[cycle, i, rank]) for i in range(steps)]
        if not switch or cycle == cycles:
            continue
        vm_megatron.prepare_switch_out([ddp], opt)
        saved, addresses = [t.detach().cpu() for t in state()], [t.data_ptr() for t in state()]
        grads = [b.grad_data.data_ptr() for b in ddp.buffers]
        # verl's order: the optimizer state, gradients and scratch out, the rollout weights in
        keep_params = [vm_megatron.OPTIM_TAG, vm_megatron.GRADS_TAG, vm_megatron.GMB_TAG]
        phase_switch(keep_params, ["rollout_weights"] if rollout else [], "optimizer, grads, scratch out")
        if rollout is None:
            rollout = Rollout(torch, vmstash, model, vocab)
        rollout.sync(model)
        phase_switch([vm_megatron.PARAMS_TAG], ["rollout_kv", "rollout_graph"] if cycle else [], "params out")
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
        phase_switch(ROLLOUT_TAGS, vm_megatron.TRAINING_TAGS, "rollout out, training in")
        assert [t.data_ptr() for t in state()] == addresses, "the training state moved"
        assert [b.grad_data.data_ptr() for b in ddp.buffers] == grads, "the gradient buffers moved"
        assert all(torch.equal(t.cpu(), c) for t, c in zip(state(), saved)), "the training state changed"
    final = [hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
             for t in state()]
    dist.destroy_process_group()
    return dict(rank=rank, device=torch.cuda.get_device_name(rank), losses=losses, final=final,
                nccl_and_warmup_bytes=baseline - before, **measured)


def _die_with_parent():
    """Linux: this process is killed when the process that started it ends (a killed demo
    or test leaves no rank holding a GPU)."""
    try:
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _rank_main(rank, world, port, switch, cycles, steps, out):
    """A rank's process: its record (or the error) into out/<rank>.json; exit status 0 or 1.
    The record is written before the process ends: run_job takes a rank with a record as
    done (should the interpreter's teardown wait on NCCL, the rank is killed, record kept)."""
    _die_with_parent()
    try:
        record, code = scenario(rank, world, port, switch, cycles, steps), 0
    except Exception:  # the record says what failed
        record, code = {"rank": rank, "error": traceback.format_exc()[-3000:]}, 1
    with open(os.path.join(out, f"{rank}.json.tmp"), "w") as f:
        json.dump(record, f)
    os.replace(os.path.join(out, f"{rank}.json.tmp"), os.path.join(out, f"{rank}.json"))
    sys.stdout.flush()
    raise SystemExit(code)  # multiprocessing makes it the exit status


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(world, switch, cycles, steps, timeout=300, grace=20):
    """`world` ranks (spawned, one per GPU); every rank's record, in rank order (a rank that
    wrote none: {"rank": r, "error": ...}). Once a rank has failed, the others get `grace`
    seconds (they may wait in a collective for it) and are then killed; every rank is
    killed after `timeout` seconds."""
    import multiprocessing
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS: the twin must match
    ctx, port = multiprocessing.get_context("spawn"), _free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = [ctx.Process(target=_rank_main, args=(r, world, port, switch, cycles, steps, out))
                 for r in range(world)]
        try:
            return _watch(procs, out, world, timeout, grace)
        finally:  # whatever went wrong here, no rank outlives the job (nor blocks the interpreter's exit)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()


def _watch(procs, out, world, timeout, grace):
    """run_job's loop: starts the ranks, waits, kills the late ones, reads the records."""
    for p in procs:
        p.start()
    paths = [os.path.join(out, f"{r}.json") for r in range(world)]
    start, settled_at, why = time.monotonic(), None, {}
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        # Settled: a rank failed (the others may wait for it in a collective), or every
        # rank wrote its record (a rank still alive is only ending).
        failed = any(p.exitcode not in (None, 0) for p in procs) or any(
            os.path.exists(path) and "error" in _read(path) for path in paths)
        if settled_at is None and (failed or all(os.path.exists(path) for path in paths)):
            settled_at = now
        late = now - start > timeout
        if late or (settled_at is not None and now - settled_at > grace):
            for r, p in enumerate(procs):
                if p.is_alive():
                    p.kill()
                    why[r] = (f"killed after the {timeout:g} s timeout" if late else
                              f"killed {grace:g} s after another rank failed")
            break
        time.sleep(0.2)
    records = []
    for r, p in enumerate(procs):
        p.join()
        records.append(_read(paths[r]) if os.path.exists(paths[r]) else
                       {"rank": r, "error": why.get(r, f"exited with {p.exitcode} and no record")})
    return records


def _read(path):
    with open(path) as f:
        return json.load(f)


def judge(ours, twin):
    """The failed checks (empty: passed) of the switched job against the twin, per rank."""
    failures = []
    for rec, tw in zip(ours, twin):
        r = rec["rank"]
        for job, x in (("switched", rec), ("twin", tw)):
            if "error" in x:
                failures.append(f"rank {r}, {job} job: {x['error'].strip().splitlines()[-1]}")
        if "error" in rec or "error" in tw:
            continue
        if rec["losses"] != tw["losses"]:
            failures.append(f"rank {r}: losses differ from the twin's")
        if rec["final"] != tw["final"]:
            failures.append(f"rank {r}: the final training state differs from the twin's")
        if rec["training_state_bytes"] <= 2 * MARGIN:
            failures.append(f"rank {r}: the training state ({rec['training_state_bytes'] / MiB:.0f} MiB) is too "
                            f"small for the memory check's margin")
        for used, tags in zip(rec["rollout_used_over_baseline"], rec["rollout_tag_bytes"]):
            if used > tags + MARGIN:
                failures.append(f"rank {r}: during a rollout {used / MiB:.1f} MiB over the baseline, the rollout's "
                                f"tags {tags / MiB:.1f} MiB (margin {MARGIN / MiB:.0f} MiB)")
        if not all(x < GRAPH_TOLERANCE for x in rec["graph_vs_eager"]):
            failures.append(f"rank {r}: the decode graph differs from eager: {rec['graph_vs_eager']}")
    return failures


def report(ours, twin, world):
    """The lines that say what was measured, per rank."""
    lines = []
    for rec in ours:
        if "error" in rec:
            continue
        r = rec["rank"]
        lines.append(f"rank {r} of {world} ({rec['device']}): training state (parameter buffers, main parameters, "
                     f"Adam) {rec['training_state_bytes'] / MiB:.1f} MiB; held after a throwaway step (NCCL, cuBLAS; "
                     f"in the baseline) {rec['nccl_and_warmup_bytes'] / MiB:.1f} MiB")
        lines.append(f"  rollout: device memory in use over the pre-training baseline "
                     f"{', '.join(f'{x / MiB:.1f}' for x in rec['rollout_used_over_baseline'])} MiB, of which "
                     f"the rollout's tags {', '.join(f'{x / MiB:.1f}' for x in rec['rollout_tag_bytes'])} MiB "
                     f"(margin {MARGIN / MiB:.0f} MiB)")
        by_label = {}
        for label, ms in rec["switch_ms"]:
            by_label.setdefault(label, []).append(ms)
        for label, times in by_label.items():
            lines.append(f"  switch {label}: {', '.join(f'{t:.1f}' for t in times)} ms")
        same = "equal" if twin[r].get("losses") == rec["losses"] else "DIFFERENT"
        lines.append(f"  losses {[round(float.fromhex(x), 4) for x in rec['losses']]} ({same} to the twin's); "
                     f"graph vs eager {[round(x, 5) for x in rec['graph_vs_eager']]}")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=1, help="ranks, one per GPU (default 1)")
    ap.add_argument("--cycles", type=int, default=2, help="rollout phases (default 2)")
    ap.add_argument("--steps", type=int, default=3, help="training steps between them (default 3)")
    ap.add_argument("--json", default=None, help="write what was measured here")
    args = ap.parse_args(argv)
    if args.world < 1 or args.cycles < 1 or args.steps < 1:
        ap.error("--world, --cycles and --steps must be at least 1")
    try:
        import megatron.core.distributed  # noqa: F401
        import torch
    except ImportError as e:
        print(f"megatron-core is not importable ({e}): python3 -m pip install --no-deps megatron-core==0.19.2",
              file=sys.stderr)
        return 1
    if torch.cuda.device_count() < args.world:
        print(f"--world {args.world}: {torch.cuda.device_count()} GPU(s) here", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    ours = run_job(args.world, True, args.cycles, args.steps)
    twin = run_job(args.world, False, args.cycles, args.steps)
    failures = judge(ours, twin)
    for job, records in (("switched", ours), ("twin", twin)):
        for rec in records:
            if "error" in rec:
                print(f"rank {rec['rank']}, {job} job:\n{rec['error']}", file=sys.stderr)
    print(f"Megatron training state through {args.cycles} rollout phases, world size {args.world} "
          f"({time.perf_counter() - t0:.0f} s with the twin):")
    print("\n".join(report(ours, twin, args.world)))
    for f in failures:
        print(f"  FAILED CHECK: {f}")
    print("PASSED" if not failures else "FAILED")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": args.world, "margin_bytes": MARGIN, "ranks": ours, "twin": twin,
                       "failures": failures}, f, indent=1)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
