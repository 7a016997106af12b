"""RL phase switch on one GPU with vmstash: rollout (CUDA-graph decode over a static KV
cache) and training (forward/backward with the MoE expert activations in the paged stash,
captured once in a CUDA graph) alternate; each phase pauses the other's memory.

    python3 -m vmstash.demo [--cycles 10] [--plot memory.svg] [--json out.json] [--peer MODULE]
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
Both graphs are captured once and replayed in every phase; every replay is checked
against the same computation run eagerly (training: without the stash). Prints, per
phase switch, GPU memory in use, bytes released by the pause, pause/resume times and
GiB/s; exits non-zero on a mismatch or when a done-criterion of issue 8 fails (memory
freed >= 95% of the paused tags' reserved bytes; a backup switch within 10% of
bytes / same-run pinned copy bandwidth + 10 ms), and ends with a short summary.

Peers: when torch_memory_saver is importable (or for each --peer MODULE with its API, e.g.
vmstash.compat.torch_memory_saver), the same tags' bytes then go through the same switches
under that module in a child process (vmstash.demo.tms_peer), whose figures are
printed beside ours.
"""
import argparse
import concurrent.futures
import importlib.util
import math
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import vmstash
from vmstash.demo.common import (GiB, Timeline, criteria_failures, pinned_bandwidth, summarize, switch_line,
                                 switch_record, switch_speedups, write_json)


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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=10)
    ap.add_argument("--sequential-cycles", type=int, default=3,
                    help="then this many cycles through the path before switch() (pauses, then resumes)")
    ap.add_argument("--plot", default=None, help="write the memory timeline here (SVG)")
    ap.add_argument("--json", default=None, help="write the switches and the summary here")
    ap.add_argument("--peer", action="append", default=None, metavar="MODULE",
                    help="run the same switches' memory under this module's torch_memory_saver API in a child "
                         "process (default: torch_memory_saver when importable; repeatable)")
    args = ap.parse_args()
    if args.peer is None:
        args.peer = ["torch_memory_saver"] if importlib.util.find_spec("torch_memory_saver") else []
    if not torch.cuda.is_available():
        print("no CUDA device: run the C++ demo instead (scripts/run_demo.sh)", file=sys.stderr)
        return 2
    cfg, dev = Config(), torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    # The capture warm-up runs on a side stream and the eager reference on the default one, so
    # autograd warns that the leaves' AccumulateGrad nodes change streams: intended here.
    if hasattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch"):
        torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(False)
    d2h, h2d = pinned_bandwidth(dev)
    print(f"vmstash RL phase switch on {torch.cuda.get_device_name(0)}: pinned copy D2H {d2h / GiB:.1f} GiB/s, "
          f"H2D {h2d / GiB:.1f} GiB/s (same run)")
    if not args.peer:
        print("torch_memory_saver: not importable here, no comparison")
    timeline = Timeline()
    gen = torch.Generator(device=dev).manual_seed(0)

    with vmstash.region("optimizer", policy="backup"):
        master = {k: v.requires_grad_() for k, v in make_params(cfg, torch.float32, gen, dev).items()}
    with vmstash.region("adam", policy="backup"):
        opt = torch.optim.Adam(master.values(), lr=1e-4, fused=True)
        for v in master.values():  # Adam's state is created here, inside the tag (a zero step)
            v.grad = torch.zeros_like(v)
        opt.step()
        opt.zero_grad(set_to_none=True)
    with vmstash.region("weights", policy="backup"):
        weights = {k: v.detach().to(torch.bfloat16) for k, v in master.items()}
    with vmstash.region("kv_cache"):
        kv = torch.zeros(cfg.layers, 2, cfg.batch, cfg.max_len, cfg.heads, cfg.d // cfg.heads, device=dev,
                         dtype=torch.bfloat16)
    train_tokens = cfg.train_batch * cfg.train_len
    capacity = math.ceil(cfg.cf * train_tokens * cfg.topk / cfg.experts)
    pages = cfg.layers * cfg.experts * math.ceil(capacity / 64)
    arenas = [vmstash.stash.Arena(row_bytes=cfg.d * 2, device_pages=pages),
              vmstash.stash.Arena(row_bytes=cfg.ffn * 2, device_pages=2 * pages)]
    for a in arenas:
        a.reserve_handles(3 * cfg.layers * cfg.experts, capacity)
    tok = torch.zeros(cfg.batch, dtype=torch.long, device=dev)
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    tokens = torch.zeros(cfg.train_batch, cfg.train_len, dtype=torch.long, device=dev)
    targets = torch.zeros_like(tokens)
    flags = torch.zeros(2, 48, dtype=torch.uint8, device=dev)

    def train_step(stash):
        if stash is not None:
            for a in stash:
                a.reset()
        p = {k: v.to(torch.bfloat16) for k, v in master.items()}
        logits = train_forward(cfg, p, tokens, stash)
        loss = F.cross_entropy(logits.view(-1, cfg.vocab).float(), targets.view(-1))
        grads = torch.autograd.grad(loss, list(master.values()))
        if stash is not None:
            for i, a in enumerate(stash):
                a.write_flags(flags[i])
        return loss, grads

    # Capture both graphs once (after a warm-up on a side stream, as CUDA graphs need).
    decode_graph, train_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            decode_step(cfg, weights, kv, tok, pos)
            train_step(arenas)
    torch.cuda.current_stream().wait_stream(side)
    with vmstash.cuda_graph(decode_graph, tag="decode_graph", policy="discard"):
        static_logits = decode_step(cfg, weights, kv, tok, pos)
    with vmstash.cuda_graph(train_graph, tag="train_graph", policy="discard"):
        static_loss, static_grads = train_step(arenas)
    torch.cuda.synchronize()

    rollout_tags = ["weights", "kv_cache", "decode_graph"]
    train_tags = ["optimizer", "adam", "stash", "train_graph"]
    # Weights are synced when both sides are resident (the master weights and the rollout
    # copy). Each phase switch is a list of steps: (pause_tags, resume_tags) transitions, and
    # "sync" where the weight sync runs (timed apart: not a vmstash cost).
    switch_path = {
        "training": [(rollout_tags, train_tags)],
        "rollout": [(["adam", "stash", "train_graph"], ["weights"]), "sync",
                    (["optimizer"], ["kv_cache", "decode_graph"])],
    }
    # The path before switch(): the rollout tags come back before the training tags go,
    # since memory allows it here (a resume right after a large release waits on the driver).
    sequential_path = {
        "training": [(rollout_tags, []), ([], train_tags)],
        "rollout": [([], rollout_tags), "sync", (train_tags, [])],
    }
    failures, exact, checks = [], 0, 0
    switches = []

    workers = concurrent.futures.ThreadPoolExecutor(max_workers=4)

    def each(fn, tags):
        """Tags pause/resume concurrently (a backup tag's copies overlap a discard tag's
        unmap/release or create/map); the first error is raised."""
        for f in [workers.submit(fn, t) for t in tags]:
            f.result()

    def phase_switch(label, steps, sequential, sync=None):
        """Runs `steps` (see switch_path); a step with tags on both sides is one
        vmstash.switch() unless `sequential` (then its pauses, then its resumes, each tag in
        its own thread as before switch()). Checks memory released and the time against the
        same-run bound."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the eager references' memory goes back to the driver
        transitions = [st for st in steps if st != "sync"]
        all_paused = [t for p, _ in transitions for t in p]
        all_resumed = [t for _, r in transitions for t in r]
        reserved = sum(vmstash.tag_stats(t)["reserved_bytes"]["current"] for t in all_paused)
        restored = sum(vmstash.tag_stats(t)["backed_up_bytes"] for t in all_resumed)
        free0 = torch.cuda.mem_get_info()[0]
        pause_s = resume_s = sync_s = 0.0
        for st in steps:
            t0 = time.perf_counter()
            if st == "sync":
                sync()
                torch.cuda.synchronize()
                sync_s += time.perf_counter() - t0
                continue
            pause_tags, resume_tags = st
            if sequential or not (pause_tags and resume_tags):
                each(vmstash.pause, pause_tags)  # (pause and resume return with their copies done)
                t1 = time.perf_counter()
                each(vmstash.resume, resume_tags)
                torch.cuda.synchronize()
                pause_s += t1 - t0
                resume_s += time.perf_counter() - t1
            else:
                vmstash.switch(pause=pause_tags, resume=resume_tags)
                torch.cuda.synchronize()
                pause_s += time.perf_counter() - t0  # one transaction: both directions at once
        backed = sum(vmstash.tag_stats(t)["backed_up_bytes"] for t in all_paused)
        # Released by the pauses: free memory now vs before, plus what the resumes took.
        resumed_reserved = sum(vmstash.tag_stats(t)["reserved_bytes"]["current"] for t in all_resumed)
        freed = torch.cuda.mem_get_info()[0] - free0 + resumed_reserved
        name = label + (" (sequential)" if sequential else "")
        timeline.mark(f"switched to {label}")
        r = switch_record(name, all_paused, all_resumed, reserved, freed, pause_s, resume_s, backed, restored,
                          d2h, h2d, sync_s if sync else None)
        switches.append(r)
        print(switch_line(r))
        failures.extend(criteria_failures(r))

    def check(name, a, b):
        nonlocal exact, checks
        ok, rel = same(a, b)
        checks += 1
        exact += ok
        if rel > 2e-2:
            failures.append(f"{name}: replay differs from eager by {rel:.3g} (relative)")

    # Start in the rollout phase: the training tags are paused.
    for t in train_tags:
        vmstash.pause(t)
    data = torch.Generator(device=dev).manual_seed(1)
    last_sums = None
    for cycle in range(args.cycles + args.sequential_cycles):
        sequential = cycle >= args.cycles
        # Rollout: the weights must have survived the pause; then decode with the graph.
        sums = torch.stack([w.float().sum() for w in weights.values()])
        if cycle > 0 and not torch.equal(sums, last_sums):
            failures.append(f"cycle {cycle}: rollout weights changed across pause/resume")
        tok.copy_(torch.randint(0, cfg.vocab, (cfg.batch,), device=dev, generator=data))
        for step in range(cfg.decode_steps):
            pos.fill_(step)
            decode_graph.replay()
            got = static_logits.clone()
            check(f"cycle {cycle} decode {step}", decode_step(cfg, weights, kv, tok, pos), got)
            tok.copy_(got.argmax(-1))
        used_rollout = timeline.mark(f"rollout {cycle}")
        if cycle == 0:
            # What a peer run allocates per tag (the training tags are paused here).
            layout = [{"tag": t, "phase": phase, "backup": st["policy"] == "backup",
                       "bytes": max(st["reserved_bytes"]["current"], st["paused_bytes"])}
                      for phase, tags in (("rollout", rollout_tags), ("training", train_tags))
                      for t, st in ((t, vmstash.tag_stats(t)) for t in tags)]
        phase_switch("training", (sequential_path if sequential else switch_path)["training"], sequential)
        # Training: one step through the captured graph, checked against eager without the stash.
        # The eager reference runs first, so that its activations go back to the driver here and
        # not right before the switch (memory created right after a large release waits on the
        # driver; pause_bench measures it). Its gradients are freed after the switch.
        tokens.copy_(torch.randint(0, cfg.vocab, tokens.shape, device=dev, generator=data))
        targets.copy_(torch.randint(0, cfg.vocab, tokens.shape, device=dev, generator=data))
        loss_e, grads_e = train_step(None)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        train_graph.replay()
        if flags[:, 0].any().item():
            failures.append(f"cycle {cycle}: stash overflow")
        used_train = timeline.mark(f"train {cycle}")
        check(f"cycle {cycle} loss", loss_e, static_loss)
        for i, (ge, gg) in enumerate(zip(grads_e, static_grads)):
            check(f"cycle {cycle} grad {i}", ge, gg)
        for p, g in zip(master.values(), static_grads):
            p.grad = g
        opt.step()  # fused: no temporaries for torch to cache and release at the switch
        opt.zero_grad(set_to_none=True)
        print(f"cycle {cycle}: rollout used {used_rollout / GiB:.2f} GiB, training {used_train / GiB:.2f} GiB; "
              f"loss {static_loss.item():.4f}")

        def sync():
            with torch.no_grad():
                for k, w in weights.items():
                    w.copy_(master[k])  # the trained master weights to the rollout copy

        phase_switch("rollout", (sequential_path if sequential else switch_path)["rollout"], sequential, sync=sync)
        del grads_e, loss_e
        torch.cuda.empty_cache()  # now, a rollout phase before the next switch
        last_sums = torch.stack([w.float().sum() for w in weights.values()])
    if args.plot:
        timeline.svg(args.plot)
        print(f"memory timeline: {args.plot}")
    print(f"{checks} replay checks against eager: {exact} bit-exact, the rest within bf16 rounding; "
          f"{len(switches)} phase switches, no re-capture")
    speedups = switch_speedups(switches)
    used = {"rollout": used_rollout, "training": used_train}
    lines, summary = summarize("vmstash", switches, used)
    summary.update(checks=checks, exact=exact, d2h=d2h, h2d=h2d, device=torch.cuda.get_device_name(0),
                   failures=failures, switch_log=switches, speedups=speedups)
    if args.peer:  # the peer runs in a child process: leave it the GPU
        for t in rollout_tags:
            vmstash.pause(t)
        torch.cuda.empty_cache()
    peers = [run_peer(m, layout, args.cycles) for m in args.peer]
    for m, peer in zip(args.peer, peers):
        # Another module's lost data or crash is its result; vmstash's drop-in module's is ours.
        if m.startswith("vmstash") and (peer.get("error") or peer.get("exit_code") or peer.get("failures")):
            failures.append(f"peer {m}: {peer.get('error') or peer.get('failures') or 'exit ' + str(peer['exit_code'])}")
    print(f"\nSummary ({torch.cuda.get_device_name(0)}, pinned D2H {d2h / GiB:.1f} GiB/s, H2D {h2d / GiB:.1f} GiB/s):")
    print(f"vmstash: {args.cycles} rollout/training cycles, both CUDA graphs captured once; {checks} replays "
          f"checked against eager ({exact} bit-exact), {len(failures)} failures")
    print("\n".join(lines))
    for label, (seq_ms, sw_ms) in speedups.items():
        print(f"  to {label:9s} switch() median {sw_ms:.1f} ms vs the sequential path {seq_ms:.1f} ms in this run: "
              f"{seq_ms / sw_ms:.2f}x")
    for peer in peers:
        print("\n".join(peer.get("lines", [f"{peer['name']}: {peer.get('error')}"])))
    if args.json:
        write_json(args.json, {"vmstash": summary, "peers": peers, "layout": layout,
                               "timeline": [{"s": t, "gib": m, "at": label} for t, m, label in timeline.points]})
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures[:20]))
        return 1
    print("PASSED")
    return 0


def run_peer(module, layout, cycles):
    """The same tags' memory (sizes from this run, same backup settings, same switch order)
    under `module`'s torch_memory_saver API, in a child process started inside the module's
    configure_subprocess() (its preload library, as SGLang starts its workers)."""
    import json
    import tempfile
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [sys.executable, "-m", "vmstash.demo.tms_peer", "--module", module, "--cycles",
               str(cycles), "--layout", json.dumps(layout), "--json", out.name]
        print(f"\npeer: the same switches under {module} (vmstash.demo.tms_peer)", flush=True)
        try:
            configure = importlib.import_module(module).configure_subprocess
        except (ImportError, AttributeError) as e:
            return {"name": module, "error": f"cannot start: {e}"}
        with configure():
            rc = subprocess.call(cmd)
        text = out.read()
    if not text:
        return {"name": module, "error": f"the child exited with {rc} before writing its figures"}
    result = json.loads(text)
    result["exit_code"] = rc
    return result

