"""RL phase switch on one GPU with vmstash: rollout (CUDA-graph decode over a static KV
cache) and training (forward/backward with the MoE expert activations in the paged stash,
captured once in a CUDA graph) alternate; each phase pauses the other's memory.

    python3 -m vmstash.demo [--cycles 10] [--plot memory.svg] [--json out.json] [--peer MODULE] [--judge-peer]
                            [--speed-not-judged]
    python3 examples/rl_phase_switch.py ...    (the same, from a source tree)

(scripts/run_demo.sh builds the library and runs it on a GPU machine.)

A small decoder-only transformer with random weights (no downloads); every layer has
causal attention and an MoE MLP (top-2 over 8 experts, static capacity). Tags:
  weights      (backup)   the rollout copy of the weights (bf16), synced after training
  kv_cache     (discard)  the static KV cache
  decode_graph (discard)  the decode graph's private pool
  optimizer    (backup)   fp32 master weights (the weight sync's source)
  adam         (backup)   Adam's state
  stash        (discard)  paged stash arenas for the expert activations
  train_graph  (discard)  the training graph's private pool
Phase switches go through vmstash.switch() (one transaction per step: the outgoing tags'
bytes go to host memory while the incoming tags' come back, and the outgoing physical
memory is handed to the incoming tags): to training, switch(rollout -> training tags); to
rollout, in the order verl and slime sync weights, switch(adam + stash + train_graph ->
weights), the weight sync, then switch(optimizer -> kv_cache + decode_graph). The last
--sequential-cycles cycles take the path before switch() (pauses, then resumes; the same
tags and bytes), so the summary compares the two in one run.

Both graphs are captured once and replayed in every phase. Each switch prints what moved
each way, the memory it released and its time against a same-run bound (bytes over the
measured pinned copy bandwidth, plus 10 ms); the summary gives each direction's median,
p90 and max against that bound and names the switches over 1.1x it. The verdict: FAILED
on wrong data (a replay that differs from the same computation run eagerly beyond bf16
rounding, a NaN or infinity, a backup tag's bytes changed between its pause and its
resume, a tensor's address moved, less than 95% of the paused tags' memory released) or
on speed clearly broken (a direction's median over 1.5x its bound); otherwise PASSED.
One slow switch on a shared machine is named, never failed on: speed claims belong to
the benchmarks (bench/).

Peers: when torch_memory_saver is importable (or for each --peer MODULE with its API, e.g.
vmstash.compat.torch_memory_saver), the same tags' bytes then go through the same switches
under that module in a child process (vmstash.demo.tms_peer), whose figures are printed
beside ours. Each peer is judged by exactly the criteria above (its bound from its own
measured pinned rate; its data checks: backup bytes and memory released, as it has no
compute) and gets its own verdict line. A peer that is vmstash's own code path (a vmstash
module, or the drop-in wheel's torch_memory_saver) decides the verdict as vmstash does:
when it misses the criteria or cannot run, the demo FAILS, naming the peer, the direction,
the figures and the bound. Another module (torch_memory_saver itself) is a comparison: its
verdict line says what it missed and the run still passes, unless --judge-peer is given.
With --speed-not-judged (the CTest test: a test judges correctness, not the timing of a
shared machine) the speed criteria are reported and the run fails only on data, memory or
an error; the benchmark report runs it without.
"""
import argparse
import concurrent.futures
import importlib.util
import math
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import vmstash
from vmstash.demo.common import (GiB, Timeline, final_verdict, judge, peer_verdict, pinned_bandwidth,
                                 served_by_vmstash, summarize, switch_line, switch_record, switch_speedups,
                                 write_json)

ROLLOUT_TAGS = ["weights", "kv_cache", "decode_graph"]
TRAIN_TAGS = ["optimizer", "adam", "stash", "train_graph"]
# Each phase switch is a list of steps: (pause_tags, resume_tags) transitions, and "sync"
# where the weight sync runs (timed apart: not a vmstash cost). Weights are synced when
# both sides are resident (the master weights and the rollout copy).
SWITCH_PATH = {
    "training": [(ROLLOUT_TAGS, TRAIN_TAGS)],
    "rollout": [(["adam", "stash", "train_graph"], ["weights"]), "sync", (["optimizer"], ["kv_cache", "decode_graph"])],
}
# The path before switch(): the rollout tags come back before the training tags go, since
# memory allows it here (a resume right after a large release waits on the driver).
SEQUENTIAL_PATH = {
    "training": [(ROLLOUT_TAGS, []), ([], TRAIN_TAGS)],
    "rollout": [([], ROLLOUT_TAGS), "sync", (TRAIN_TAGS, [])],
}


class Config:
    vocab = 8192
    d = 2048
    heads = 16
    layers = 4
    experts = 8
    topk = 2
    ffn = 4096
    cf = 2.0            # expert capacity factor
    batch = 32          # decode batch
    max_len = 1024      # KV cache length
    decode_steps = 16   # per rollout phase
    train_batch = 8
    train_len = 256


def rmsnorm(x):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


def make_params(cfg, dtype, gen, device):
    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)
    p = {"emb": rnd(cfg.vocab, cfg.d, scale=0.02)}
    for l in range(cfg.layers):
        p[f"{l}.qkv"] = rnd(3 * cfg.d, cfg.d, scale=cfg.d ** -0.5)
        p[f"{l}.o"] = rnd(cfg.d, cfg.d, scale=cfg.d ** -0.5)
        p[f"{l}.router"] = rnd(cfg.experts, cfg.d, scale=cfg.d ** -0.5)
        p[f"{l}.w1"] = rnd(cfg.experts, cfg.ffn, cfg.d, scale=cfg.d ** -0.5)
        p[f"{l}.w2"] = rnd(cfg.experts, cfg.d, cfg.ffn, scale=cfg.ffn ** -0.5)
    return p


def moe(cfg, p, l, x, stash=None):
    """Top-k MoE with a static capacity per expert (tokens past it are dropped), so every
    shape is static and the row counts stay on the device (capturable)."""
    n = x.shape[0]
    capacity = math.ceil(cfg.cf * n * cfg.topk / cfg.experts)
    gates = F.softmax(F.linear(x, p[f"{l}.router"]).float(), dim=-1)
    weight, expert = gates.topk(cfg.topk, dim=-1)                       # [n, k]
    onehot = F.one_hot(expert.reshape(-1), cfg.experts)                 # [n*k, E]
    position = (onehot.cumsum(0) - 1).gather(1, expert.reshape(-1, 1)).reshape(-1)
    counts = onehot.sum(0).clamp(max=capacity)                          # [E], on the device
    slot = torch.where(position < capacity, position, torch.full_like(position, capacity))
    flat = expert.reshape(-1) * (capacity + 1) + slot                   # row `capacity`: dropped
    buf = x.new_zeros(cfg.experts * (capacity + 1), x.shape[1])
    buf = buf.index_put((flat,), x.repeat_interleave(cfg.topk, 0))
    buf = buf.view(cfg.experts, capacity + 1, -1)
    outs = []
    for e in range(cfg.experts):
        xe = buf[e, :capacity]
        if stash is None:
            h = F.linear(F.gelu(F.linear(xe, p[f"{l}.w1"][e])), p[f"{l}.w2"][e])
        else:
            with vmstash.stash.saved_tensors(stash, max_rows=capacity, rows=counts[e:e + 1], zero_tail=True):
                h = F.linear(F.gelu(F.linear(xe, p[f"{l}.w1"][e])), p[f"{l}.w2"][e])
        outs.append(torch.cat([h, h.new_zeros(1, h.shape[1])]))
    y = torch.stack(outs).view(cfg.experts * (capacity + 1), -1)[flat].view(n, cfg.topk, -1)
    return (y.float() * weight.unsqueeze(-1)).sum(1).to(x.dtype)


def train_forward(cfg, p, tokens, stash=None):
    b, t = tokens.shape
    x = p["emb"][tokens]
    for l in range(cfg.layers):
        q, k, v = F.linear(rmsnorm(x), p[f"{l}.qkv"]).view(b, t, 3, cfg.heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + F.linear(a.transpose(1, 2).reshape(b, t, -1), p[f"{l}.o"])
        x = x + moe(cfg, p, l, rmsnorm(x).reshape(b * t, -1), stash).view(b, t, -1)
    return F.linear(rmsnorm(x), p["emb"])


def decode_step(cfg, p, kv, tok, pos):
    """One token per sequence: writes K/V at `pos` (a device tensor) and attends over the
    cache up to it; returns the logits. Static shapes; capturable."""
    b = tok.shape[0]
    x = p["emb"][tok]
    visible = torch.arange(cfg.max_len, device=tok.device) <= pos
    for l in range(cfg.layers):
        q, k, v = F.linear(rmsnorm(x), p[f"{l}.qkv"]).view(b, 3, cfg.heads, -1).unbind(1)
        kv[l, 0].index_copy_(1, pos, k.unsqueeze(1))
        kv[l, 1].index_copy_(1, pos, v.unsqueeze(1))
        a = F.scaled_dot_product_attention(q.unsqueeze(2), kv[l, 0].transpose(1, 2), kv[l, 1].transpose(1, 2),
                                           attn_mask=visible.view(1, -1))
        x = x + F.linear(a.reshape(b, -1), p[f"{l}.o"])
        x = x + moe(cfg, p, l, rmsnorm(x))
    return F.linear(rmsnorm(x), p["emb"])


def same(a, b):
    """(bit-exact, max relative difference); a NaN or infinity in either is an infinite
    difference (NaN != NaN would otherwise slip through every comparison)."""
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return False, math.inf
    if torch.equal(a, b):
        return True, 0.0
    scale = a.float().abs().max().item()
    return False, (a.float() - b.float()).abs().max().item() / max(scale, 1e-12)




def fingerprint(tensors):
    """Exact per-tensor checksums (the bits summed as integers): any changed byte pattern
    shows, NaN or not."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return torch.stack([x.detach().reshape(-1).view(ints[x.element_size()]).sum(dtype=torch.int64) for x in tensors])


class Model:
    """Step 1, build the model: each part of its memory in its tag (the table above), the
    stash arenas, and the static inputs the captured graphs read."""

    def __init__(self, cfg, dev):
        self.cfg = cfg
        gen = torch.Generator(device=dev).manual_seed(0)
        with vmstash.region("optimizer", policy="backup"):
            self.master = {k: v.requires_grad_() for k, v in make_params(cfg, torch.float32, gen, dev).items()}
        with vmstash.region("adam", policy="backup"):
            self.opt = torch.optim.Adam(self.master.values(), lr=1e-4, fused=True)
            for v in self.master.values():  # Adam's state is created here, inside the tag (a zero step)
                v.grad = torch.zeros_like(v)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        with vmstash.region("weights", policy="backup"):
            self.weights = {k: v.detach().to(torch.bfloat16) for k, v in self.master.items()}
        with vmstash.region("kv_cache"):
            self.kv = torch.zeros(cfg.layers, 2, cfg.batch, cfg.max_len, cfg.heads, cfg.d // cfg.heads, device=dev,
                                  dtype=torch.bfloat16)
        capacity = math.ceil(cfg.cf * cfg.train_batch * cfg.train_len * cfg.topk / cfg.experts)
        pages = cfg.layers * cfg.experts * math.ceil(capacity / 64)
        self.arenas = [vmstash.stash.Arena(row_bytes=cfg.d * 2, device_pages=pages),
                       vmstash.stash.Arena(row_bytes=cfg.ffn * 2, device_pages=2 * pages)]
        for a in self.arenas:
            a.reserve_handles(3 * cfg.layers * cfg.experts, capacity)
        self.tok = torch.zeros(cfg.batch, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.tokens = torch.zeros(cfg.train_batch, cfg.train_len, dtype=torch.long, device=dev)
        self.targets = torch.zeros_like(self.tokens)
        self.flags = torch.zeros(2, 48, dtype=torch.uint8, device=dev)

    def decode(self):
        return decode_step(self.cfg, self.weights, self.kv, self.tok, self.pos)

    def train_step(self, stash):
        """(loss, gradients of the master weights); the expert activations in `stash` when given."""
        if stash is not None:
            for a in stash:
                a.reset()
        p = {k: v.to(torch.bfloat16) for k, v in self.master.items()}
        logits = train_forward(self.cfg, p, self.tokens, stash)
        loss = F.cross_entropy(logits.view(-1, self.cfg.vocab).float(), self.targets.view(-1))
        grads = torch.autograd.grad(loss, list(self.master.values()))
        if stash is not None:
            for i, a in enumerate(stash):
                a.write_flags(self.flags[i])
        return loss, grads

    def optimizer_step(self, grads):
        for p, g in zip(self.master.values(), grads):
            p.grad = g
        self.opt.step()  # fused: no temporaries for torch to cache and release at the switch
        self.opt.zero_grad(set_to_none=True)

    def sync_weights(self):
        with torch.no_grad():
            for k, w in self.weights.items():
                w.copy_(self.master[k])  # the trained master weights to the rollout copy

    def training_state(self):
        """The backup training tags' tensors: master weights and Adam's state."""
        adam = [v for st in self.opt.state.values() for v in st.values() if torch.is_tensor(v) and v.is_cuda]
        return list(self.master.values()) + adam

    def tensors(self):
        """Every long-lived tensor by name: none may ever move."""
        out = {f"master {k}": v for k, v in self.master.items()}
        out.update({f"weights {k}": v for k, v in self.weights.items()})
        out.update({f"adam {i}": v for i, v in enumerate(self.training_state()[len(self.master):])})
        out.update(kv_cache=self.kv, tok=self.tok, pos=self.pos, tokens=self.tokens, flags=self.flags)
        return out


class Graphs:
    """Step 2, capture the graphs: both once (after a warm-up on a side stream, as CUDA
    graphs need), their pools in the tags decode_graph and train_graph."""

    def __init__(self, model):
        self.decode, self.train = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                model.decode()
                model.train_step(model.arenas)
        torch.cuda.current_stream().wait_stream(side)
        with vmstash.cuda_graph(self.decode, tag="decode_graph", policy="discard"):
            self.logits = model.decode()
        with vmstash.cuda_graph(self.train, tag="train_graph", policy="discard"):
            self.loss, self.grads = model.train_step(model.arenas)
        torch.cuda.synchronize()


class Verifier:
    """Step 4, verify: what the verdict rests on. Replays against eager, a backup tag's
    bytes between its pause and its resume, addresses; collects failures (the memory
    released and the speed are judged from the switch log: common.judge)."""

    def __init__(self, model):
        self.model, self.failures, self.checks, self.exact = model, [], 0, 0
        self.addresses = {k: v.data_ptr() for k, v in model.tensors().items()}
        self.prints = {}

    def replay(self, name, eager, replayed):
        ok, rel = same(eager, replayed)
        self.checks += 1
        self.exact += ok
        if rel > 2e-2:
            self.failures.append(f"{name}: replay differs from eager by {rel:.3g} (relative)")

    def remember(self, group, tensors):
        """Before `group`'s tags are paused."""
        self.prints[group] = fingerprint(tensors)

    def unchanged(self, group, tensors, when):
        """After they are back: every tensor's bits as remembered."""
        if group in self.prints:
            changed = (self.prints.pop(group) != fingerprint(tensors)).sum().item()
            if changed:
                self.failures.append(f"{when}: {changed} {group} tensors changed between pause and resume")

    def addresses_kept(self, when):
        moved = [k for k, v in self.model.tensors().items() if v.data_ptr() != self.addresses[k]]
        if moved:
            self.failures.append(f"{when}: {len(moved)} tensors moved ({', '.join(moved[:3])})")

    def switched(self, record):
        self.addresses_kept(f"switch to {record['label']}")


class PhaseSwitcher:
    """Step 3's transitions: runs one phase switch (SWITCH_PATH or SEQUENTIAL_PATH), times
    it, measures the memory it released, prints its line and hands it to the verifier."""

    def __init__(self, bandwidth, timeline, verifier):
        self.d2h, self.h2d = bandwidth
        self.timeline, self.verifier, self.switches = timeline, verifier, []
        self.workers = concurrent.futures.ThreadPoolExecutor(max_workers=4)

    def _each(self, fn, tags):
        """Tags pause/resume concurrently (a backup tag's copies overlap a discard tag's
        unmap/release or create/map); the first error is raised."""
        for f in [self.workers.submit(fn, t) for t in tags]:
            f.result()

    def _step(self, out, into, sequential):
        """One transition: (pause seconds, resume seconds), or None for one switch()."""
        t0 = time.perf_counter()
        if sequential or not (out and into):
            self._each(vmstash.pause, out)  # (pause and resume return with their copies done)
            t1 = time.perf_counter()
            self._each(vmstash.resume, into)
            torch.cuda.synchronize()
            return t1 - t0, time.perf_counter() - t1
        vmstash.switch(pause=out, resume=into)
        torch.cuda.synchronize()
        return None

    def run(self, label, steps, sequential, sync=None):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the eager references' memory goes back to the driver
        transitions = [st for st in steps if st != "sync"]
        paused = [t for p, _ in transitions for t in p]
        resumed = [t for _, r in transitions for t in r]
        reserved = sum(vmstash.tag_stats(t)["reserved_bytes"]["current"] for t in paused)
        restored = sum(vmstash.tag_stats(t)["backed_up_bytes"] for t in resumed)
        free0 = torch.cuda.mem_get_info()[0]
        total_s = sync_s = 0.0
        sides = [0.0, 0.0]  # pause, resume: only while no step is one switch()
        for st in steps:
            t0 = time.perf_counter()
            if st == "sync":
                sync()
                torch.cuda.synchronize()
                sync_s += time.perf_counter() - t0
                continue
            split = self._step(*st, sequential)
            total_s += time.perf_counter() - t0
            sides = [a + b for a, b in zip(sides, split)] if split and sides else None
        backed = sum(vmstash.tag_stats(t)["backed_up_bytes"] for t in paused)
        # Released by the pauses: free memory now vs before, plus what the resumes took.
        resumed_reserved = sum(vmstash.tag_stats(t)["reserved_bytes"]["current"] for t in resumed)
        freed = torch.cuda.mem_get_info()[0] - free0 + resumed_reserved
        self.timeline.mark(f"switched to {label}")
        r = switch_record(label + (" (sequential)" if sequential else ""), paused, resumed, reserved, freed, backed,
                          restored, self.d2h, self.h2d, total_s, *(sides or (None, None)),
                          sync_s=sync_s if sync else None)
        self.switches.append(r)
        print(switch_line(r))
        self.verifier.switched(r)


def rollout_phase(cycle, model, graphs, verifier, data):
    """Decode with the graph; every step checked against the same step run eagerly."""
    cfg = model.cfg
    model.tok.copy_(torch.randint(0, cfg.vocab, (cfg.batch,), device=model.tok.device, generator=data))
    for step in range(cfg.decode_steps):
        model.pos.fill_(step)
        graphs.decode.replay()
        got = graphs.logits.clone()
        verifier.replay(f"cycle {cycle} decode {step}", model.decode(), got)
        model.tok.copy_(got.argmax(-1))


def training_phase(cycle, model, graphs, verifier, data):
    """One step through the captured graph, checked against eager without the stash.
    The eager reference runs first, so that its activations go back to the driver here and
    not right before the switch (memory created right after a large release waits on the
    driver; pause_bench measures it). Returns the eager results: the caller frees them
    after the next switch."""
    for t in (model.tokens, model.targets):
        t.copy_(torch.randint(0, model.cfg.vocab, t.shape, device=t.device, generator=data))
    eager = model.train_step(None)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    graphs.train.replay()
    if model.flags[:, 0].any().item():
        verifier.failures.append(f"cycle {cycle}: stash overflow")
    verifier.replay(f"cycle {cycle} loss", eager[0], graphs.loss)
    for i, (ge, gg) in enumerate(zip(eager[1], graphs.grads)):
        verifier.replay(f"cycle {cycle} grad {i}", ge, gg)
    return eager


def peer_layout():
    """What a peer run allocates per tag (called while the training tags are paused)."""
    return [{"tag": t, "phase": phase, "backup": st["policy"] == "backup",
             "bytes": max(st["reserved_bytes"]["current"], st["paused_bytes"])}
            for phase, tags in (("rollout", ROLLOUT_TAGS), ("training", TRAIN_TAGS))
            for t, st in ((t, vmstash.tag_stats(t)) for t in tags)]


def phase_cycle(args, model, graphs, verifier, switcher, timeline):
    """Step 3, the phase cycle: rollout, switch to training, train, switch to rollout
    (syncing the weights), --cycles times through switch() and --sequential-cycles times
    through the path before it. Returns (GPU bytes in use per phase, the peer layout)."""
    verifier.remember("training state", model.training_state())
    torch.cuda.synchronize()
    for t in TRAIN_TAGS:  # start in the rollout phase
        vmstash.pause(t)
    data = torch.Generator(device=model.tok.device).manual_seed(1)
    used, layout = {}, None
    for cycle in range(args.cycles + args.sequential_cycles):
        sequential = cycle >= args.cycles
        path = SEQUENTIAL_PATH if sequential else SWITCH_PATH
        rollout_phase(cycle, model, graphs, verifier, data)
        used["rollout"] = timeline.mark(f"rollout {cycle}")
        layout = layout or peer_layout()
        verifier.remember("weights", model.weights.values())
        switcher.run("training", path["training"], sequential)
        verifier.unchanged("training state", model.training_state(), f"cycle {cycle}, to training")
        eager = training_phase(cycle, model, graphs, verifier, data)
        used["training"] = timeline.mark(f"train {cycle}")
        model.optimizer_step(graphs.grads)
        verifier.remember("training state", model.training_state())
        print(f"cycle {cycle}: rollout used {used['rollout'] / GiB:.2f} GiB, training {used['training'] / GiB:.2f} "
              f"GiB; loss {graphs.loss.item():.4f}")

        def sync():
            verifier.unchanged("weights", model.weights.values(), f"cycle {cycle}, to rollout")
            model.sync_weights()

        switcher.run("rollout", path["rollout"], sequential, sync=sync)
        del eager
        torch.cuda.empty_cache()  # now, a rollout phase before the next switch
    return used, layout


def run_peers(args, layout):
    """The peers run in child processes: leave them the GPU. Each is judged in report()."""
    if not args.peer:
        return []
    for t in ROLLOUT_TAGS:
        vmstash.pause(t)
    torch.cuda.empty_cache()
    return [run_peer(m, layout, args.cycles, args.speed_not_judged) for m in args.peer]


def report(args, verifier, switcher, used, peers, bandwidth, layout, timeline):
    """Step 5, report: the summary, the comparisons, the verdict (common.final_verdict:
    vmstash's switches and every peer's judged by the same criteria). Returns the exit code."""
    name = torch.cuda.get_device_name(0)
    lines, summary = summarize("vmstash", switcher.switches, used)
    speedups = switch_speedups(switcher.switches)
    own = judge("vmstash", switcher.switches, verifier.failures, judge_speed=not args.speed_not_judged)
    for peer in peers:
        peer["verdict"] = peer_verdict(peer, args.judge_peer, judge_speed=not args.speed_not_judged)
    verdict_lines, code, verdict = final_verdict(own, [peer["verdict"] for peer in peers])
    print(f"\nSummary ({name}, pinned D2H {bandwidth[0] / GiB:.1f} GiB/s, H2D {bandwidth[1] / GiB:.1f} GiB/s):")
    print(f"vmstash: {args.cycles} rollout/training cycles through switch() and {args.sequential_cycles} through "
          f"pauses then resumes, both CUDA graphs captured once; {verifier.checks} replays checked against eager "
          f"({verifier.exact} bit-exact, the rest within bf16 rounding)")
    print("\n".join(lines))
    for label, (seq_ms, sw_ms) in speedups.items():
        print(f"  to {label:9s} switch() median {sw_ms:.1f} ms vs the sequential path {seq_ms:.1f} ms in this run: "
              f"{seq_ms / sw_ms:.2f}x")
    for peer in peers:
        print("\n".join(peer.get("lines", [f"{peer['name']}: {peer.get('error')}"])))
    if args.plot:
        timeline.svg(args.plot)
        print(f"memory timeline: {args.plot}")
    if args.json:
        summary.update(checks=verifier.checks, exact=verifier.exact, d2h=bandwidth[0], h2d=bandwidth[1], device=name,
                       failures=verdict["failures"], switch_log=switcher.switches, speedups=speedups, verdict=own)
        write_json(args.json, {"vmstash": summary, "peers": peers, "layout": layout, "judge_peer": args.judge_peer,
                               "verdict": verdict,
                               "timeline": [{"s": t, "gib": m, "at": label} for t, m, label in timeline.points]})
    print("\n".join(verdict_lines))
    return code


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=10, help="rollout/training cycles through switch() (default 10)")
    ap.add_argument("--sequential-cycles", type=int, default=3,
                    help="then this many cycles through the path before switch(): pauses, then resumes (default 3)")
    ap.add_argument("--plot", default=None, help="write the memory timeline here (SVG)")
    ap.add_argument("--json", default=None,
                    help="write the switches, the summary and the verdicts (vmstash's and each peer's) here")
    ap.add_argument("--peer", action="append", default=None, metavar="MODULE",
                    help="run the same switches' memory under this module's torch_memory_saver API in a child "
                         "process, judged by the same criteria (default: torch_memory_saver when importable; "
                         "repeatable). A peer that is vmstash's own code path (vmstash.compat.torch_memory_saver, "
                         "the drop-in wheel's torch_memory_saver) fails the run when it misses them; another "
                         "module's verdict is reported only")
    ap.add_argument("--speed-not-judged", action="store_true",
                    help="report the speed criteria without failing on them (a test of correctness on a shared "
                         "machine; the data, memory and error criteria still decide)")
    ap.add_argument("--judge-peer", action="store_true",
                    help="judge every peer: the run also fails when another module (e.g. torch_memory_saver "
                         "itself) misses the criteria or cannot run")
    args = ap.parse_args(argv)
    if args.cycles < 1 or args.sequential_cycles < 0:
        ap.error("--cycles must be at least 1 and --sequential-cycles at least 0")
    if args.peer is None:
        args.peer = ["torch_memory_saver"] if importlib.util.find_spec("torch_memory_saver") else []
    return args


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: run the C++ demo instead (scripts/run_demo.sh)", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    # The capture warm-up runs on a side stream and the eager reference on the default one, so
    # autograd warns that the leaves' AccumulateGrad nodes change streams: intended here.
    if hasattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch"):
        torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(False)
    bandwidth = pinned_bandwidth(dev)
    print(f"vmstash RL phase switch on {torch.cuda.get_device_name(0)}: pinned copy D2H {bandwidth[0] / GiB:.1f} "
          f"GiB/s, H2D {bandwidth[1] / GiB:.1f} GiB/s (same run)")
    if not args.peer:
        print("torch_memory_saver: not importable here, no comparison")
    timeline = Timeline()
    model = Model(Config(), dev)
    graphs = Graphs(model)
    verifier = Verifier(model)
    switcher = PhaseSwitcher(bandwidth, timeline, verifier)
    used, layout = phase_cycle(args, model, graphs, verifier, switcher, timeline)
    peers = run_peers(args, layout)
    return report(args, verifier, switcher, used, peers, bandwidth, layout, timeline)


def run_peer(module, layout, cycles, speed_not_judged=False):
    """The same tags' memory (sizes from this run, same backup settings, same switch order)
    under `module`'s torch_memory_saver API, in a child process started inside the module's
    configure_subprocess() (its preload library, as SGLang starts its workers), judging speed
    as the demo does. `vmstash` in the result: whether the module is vmstash's own code path
    (served_by_vmstash)."""
    import json
    import tempfile
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [sys.executable, "-m", "vmstash.demo.tms_peer", "--module", module, "--cycles",
               str(cycles), "--layout", json.dumps(layout), "--json", out.name] + (
                   ["--speed-not-judged"] if speed_not_judged else [])
        print(f"\npeer: the same switches under {module} (vmstash.demo.tms_peer)", flush=True)
        try:
            loaded = importlib.import_module(module)
            configure = loaded.configure_subprocess
        except (ImportError, AttributeError) as e:
            return {"name": module, "error": f"cannot start: {e}", "vmstash": served_by_vmstash(module)}
        own = served_by_vmstash(module, loaded)
        with configure():
            rc = subprocess.call(cmd)
        text = out.read()
    if not text:
        return {"name": module, "error": f"the child exited with {rc} before writing its figures", "vmstash": own}
    result = json.loads(text)
    result.update(name=module, exit_code=rc, vmstash=own)
    return result

