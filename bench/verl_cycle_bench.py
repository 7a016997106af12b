"""verl's rollout cycle at sleep level 2, side by side in one run: vmstash's vLLM backend and
vLLM's CuMemAllocator.

    python3 bench/verl_cycle_bench.py [--cycles 5] [--settle 3] [--json out.json]
                                      [--peers vmstash,vmstash_verl,cumem]

verl sleeps its vLLM engines at level 2 (the weights are dropped, then re-synced from the
trainer) and wakes them in stages. Each cycle here is verl's order, through the peer's
SleepModeBackend (vLLM 0.33's own code paths, as in vllm_sleep_bench.py):
  sleep      suspend(level=2): every tag dropped (the graph pool kept, as vLLM keeps it)
  weights    resume(["weights"]): the weights tag's memory back, contents undefined
  load       the trainer's new weights copied in (verl's load_weights: a device copy per
             tensor from the trainer's gathered parameters, here a second set of tensors
             outside the engine's pools), checked bit for bit
  kv_cache   resume(["kv_cache"])
The tags, as vLLM's worker makes them: weights 8 GiB in 512 tensors, kv_cache 16 GiB,
cudagraph 1 GiB (a CUDA graph's output captured into the allocator's graph pool, kept
at both levels, its graph replayed after each cycle). Peers:
  vmstash       sleep_mode_backend "vmstash" with the default VMSTASH_VLLM_PREPARE_TAGS
                (weights, runtime and cudagraph backups prepared ahead: what a level-1 user wants)
  vmstash_verl  the same with VMSTASH_VLLM_PREPARE_TAGS=runtime,cudagraph (docs/frameworks.md's
                verl recipe: the weights are never kept, so no backup is made for them)
  cumem         vLLM's CuMemAllocator
Per cycle: each step's wall time (the device synchronized) and the whole cycle; the device
memory the sleep gave back to the driver (cudaMemGetInfo) and host MemAvailable after it
(pinned backups held). The bound of the load: its bytes over
the device-to-device copy rate of the same run.
"""
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tms_backup_bench import GiB, meminfo, run_peers, timed_ms, workload_args  # noqa: E402
from vllm_sleep_bench import backend_for, engine_tags, prepared_bytes, vllm_env  # noqa: E402

PEERS = ("vmstash", "vmstash_verl", "cumem")
STEPS = ("sleep", "weights", "load", "kv_cache")


def child(args):
    import torch
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    peer = args.child
    backend = backend_for("cumem" if peer == "cumem" else "vmstash")
    from vllm.device_allocator import get_mem_allocator_instance
    allocator = get_mem_allocator_instance()
    baseline = meminfo("MemAvailable")
    pattern, n_w, weights, kv = engine_tags(torch, dev, allocator, args)
    # A CUDA graph captured into the allocator's graph pool, as vLLM captures its graphs.
    base = pattern(int(args.graph_gib * GiB) // 8, 7)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (base * 3).add_(1)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    with allocator.cudagraph_pool() as pool_id, torch.cuda.graph(graph, pool=pool_id):
        graph_mem = (base * 3).add_(1)
    graph.replay()
    # The trainer's gathered parameters (outside the engine's pools), new values each cycle.
    sources = [torch.empty(n_w, dtype=torch.int64, device=dev) for _ in range(args.tensors)]
    torch.cuda.synchronize()
    time.sleep(args.settle)
    prepared = prepared_bytes("vmstash" if peer != "cumem" else peer)

    def timed(call):
        return timed_ms(torch, call)

    def load():
        for w, s in zip(weights, sources):
            w.copy_(s)

    copy_ms = []
    rows = []
    for cycle in range(args.cycles):
        for i, s in enumerate(sources):  # the trainer's step made new weights
            s.copy_(pattern(n_w, 1000 * (cycle + 1) + i))
        copy_ms.append(timed(lambda: [s.add_(0) for s in sources]))  # a device pass over the same bytes
        dev_before = torch.cuda.mem_get_info()[0]
        ms = {"sleep": timed(lambda: backend.suspend(level=2))}
        device_freed = torch.cuda.mem_get_info()[0] - dev_before
        avail_asleep = meminfo("MemAvailable") - baseline
        time.sleep(args.train)
        ms["weights"] = timed(lambda: backend.resume(["weights"]))
        ms["load"] = timed(load)
        ms["kv_cache"] = timed(lambda: backend.resume(["kv_cache"]))
        bad = sum(0 if torch.equal(w, pattern(n_w, 1000 * (cycle + 1) + i)) else 1 for i, w in enumerate(weights))
        bad += 0 if torch.equal(graph_mem, base * 3 + 1) else 1  # the graph's memory kept
        graph_mem.zero_()
        graph.replay()  # and its graph replays into it
        bad += 0 if torch.equal(graph_mem, base * 3 + 1) else 1
        kv[0].fill_(cycle)  # the KV cache is usable
        rows.append(dict(cycle=cycle + 1, ms=ms, total_ms=sum(ms.values()), device_freed=device_freed,
                         avail_asleep=avail_asleep,
                         mismatches=bad, state=backend.state()))
        print(json.dumps(dict(peer=peer, **rows[-1])), file=sys.stderr, flush=True)
        time.sleep(args.gap)
    loaded = sum(w.numel() * 8 for w in weights)
    print(json.dumps(dict(peer=peer, prepared=prepared, loaded=loaded, copy_ms=min(copy_ms), rows=rows)), flush=True)
    os._exit(0)


def run_peer(peer, args, env):
    env = dict(env)
    if peer == "vmstash_verl":
        env["VMSTASH_VLLM_PREPARE_TAGS"] = "runtime,cudagraph"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", peer, "--cycles", str(args.cycles),
           "--settle", str(args.settle), "--tensors", str(args.tensors), "--weights-gib", str(args.weights_gib),
           "--discard-gib", str(args.discard_gib), "--graph-gib", str(args.graph_gib), "--gap", str(args.gap),
           "--train", str(args.train)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        return dict(peer=peer, error=(p.stderr or p.stdout)[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def table(results):
    lines = ["verl's level-2 cycle: times in ms; device memory the sleep gave back (freed) and host MemAvailable "
             "after it relative to the start (avail), in GiB",
             f"{'peer':<13} {'cycle':>5} " + " ".join(f"{s:>9}" for s in STEPS) +
             f" {'cycle':>9} {'freed':>7} {'avail':>7} bad"]
    ok = {}
    for r in results:
        if "error" in r:
            lines.append(f"{r['peer']:<13} FAILED: {r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'}")
            continue
        ok[r["peer"]] = r
        for row in r["rows"]:
            lines.append(f"{r['peer']:<13} {row['cycle']:>5} " + " ".join(f"{row['ms'][s]:9.1f}" for s in STEPS) +
                         f" {row['total_ms']:9.1f} {row['device_freed'] / GiB:7.2f} {row['avail_asleep'] / GiB:7.2f} "
                         f"{row['mismatches']}")
        if r.get("prepared") is not None:
            lines.append(f"{r['peer']:<13} host backup prepared before the first sleep: {r['prepared'] / GiB:.2f} GiB")
        lines.append(f"{r['peer']:<13} load bound: {r['loaded'] / GiB:.0f} GiB at this run's device pass rate "
                     f"{r['copy_ms']:.1f} ms")
    cumem = ok.get("cumem")
    for peer in ("vmstash", "vmstash_verl"):
        if cumem is None or peer not in ok:
            continue
        pairs = list(zip(cumem["rows"], ok[peer]["rows"]))
        lines.append(f"CuMemAllocator / {peer}, whole cycle: " + " ".join(
            f"{c['total_ms'] / v['total_ms']:.2f}x" for c, v in pairs))
        for s in STEPS:
            lines.append(f"CuMemAllocator / {peer}, {s}: " + " ".join(
                f"{c['ms'][s] / v['ms'][s]:.2f}x" for c, v in pairs))
    return lines


def main():
    ap = workload_args(__doc__, PEERS)
    ap.add_argument("--graph-gib", type=float, default=1)
    ap.add_argument("--train", type=float, default=1.0, help="seconds between a sleep and its wake (training)")
    args = ap.parse_args()
    if args.child:
        return child(args)
    import shutil
    import torch
    where, env = vllm_env()
    try:
        results = run_peers(args.peers, PEERS, lambda peer: run_peer(peer, args, env))
    finally:
        shutil.rmtree(where, ignore_errors=True)
    print("\n".join(table(results)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(0), results=results), f, indent=1)
    return 1 if any("error" in r or any(row["mismatches"] for row in r["rows"]) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
