"""vLLM's sleep mode, side by side in one run: vmstash's backend and vLLM's CuMemAllocator.

    python3 bench/vllm_sleep_bench.py [--cycles 5] [--selective 3] [--settle 3] [--json out.json]
                                      [--peers vmstash,cumem]

Both peers are vLLM 0.33's own code paths (scripts/fetch_vllm.py: the wheel's
device_allocator/ and cumem_allocator.abi3.so, with the stand-ins of
torch_plugin/python/tests/vllm_standins for the vLLM modules they import), each in its own
process, with the allocator that vLLM's worker gets from get_mem_allocator_instance():
  vmstash   vmstash.compat.vllm's plugin registered and selected (sleep_mode_backend "vmstash")
  cumem     vLLM's CuMemAllocator
and the same tags, as vLLM's worker makes them:
  weights   8 GiB in 512 tensors, kept at level 1
  kv_cache  16 GiB, dropped
  runtime   4 GiB of which half is freed before the first sleep (2 GiB live), kept
`--settle` seconds after the tags stop growing (a framework loads, profiles and captures
between), `--cycles` times: sleep(level 1) through the peer's SleepModeBackend, then
resume(None) `--train` seconds later (the training phase between them); then `--selective` times: sleep(level 1), resume(["weights"]) (weights and
runtime), resume(["kv_cache"]). The kept tensors are checked bit for bit after every wake.
Per call: wall time (the device synchronized); host MemAvailable after sleep and after wake.
The pinned link of the same run (2 GiB each way) bounds each call: the live kept bytes
(10 GiB) at the link's rate. CuMemAllocator copies 12 GiB (whole allocations: the freed
runtime half too), vmstash the 10 GiB that PyTorch holds live.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tms_backup_bench import (GiB, link_line, meminfo, peer_rows, pinned_link, report, run_peers, timed_ms,  # noqa: E402
                              workload_args)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = ("vmstash", "cumem")


def backend_for(peer):
    from vllm.config import ModelConfig
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
    if peer == "vmstash":
        import vmstash.compat.vllm as vm
        vm.register()
        vm.select(True)
    return SleepModeBackendFactory.create_backend(ModelConfig(sleep_mode_backend="vmstash" if peer == "vmstash"
                                                              else "cumem"))


def prepared_bytes(peer):
    """vmstash: the host bytes its backup arenas of vLLM's tags hold (None for CuMemAllocator)."""
    if peer != "vmstash":
        return None
    import vmstash
    return sum((vmstash.tag_stats(t) or {}).get("backup_arena_bytes", 0) for t in vmstash.tags()
               if t.startswith("vllm."))


def pattern_of(torch, dev):
    """pattern(n, seed): n int64 values on `dev`, different for each seed."""
    def pattern(n, seed):
        return torch.arange(n, dtype=torch.int64, device=dev).mul_(2654435761).add_(seed)
    return pattern


def engine_tags(torch, dev, allocator, args):
    """vLLM's tags as its worker makes them: weights (args.tensors tensors of a pattern,
    args.weights_gib in all) and kv_cache (4 tensors, args.discard_gib in all). Returns
    (pattern, elements per weight tensor, weights, kv)."""
    pattern = pattern_of(torch, dev)
    n_w = int(args.weights_gib * GiB) // args.tensors // 8
    with allocator.use_memory_pool("weights"):
        weights = [pattern(n_w, i) for i in range(args.tensors)]
    with allocator.use_memory_pool("kv_cache"):
        kv = [torch.empty(int(args.discard_gib * GiB) // 4 // 8, dtype=torch.int64, device=dev) for _ in range(4)]
    return pattern, n_w, weights, kv


def child(args):
    import torch
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    backend = backend_for(args.child)
    from vllm.device_allocator import get_mem_allocator_instance
    allocator = get_mem_allocator_instance()
    baseline = meminfo("MemAvailable")
    pattern, _, weights, kv = engine_tags(torch, dev, allocator, args)
    n_r = int(args.runtime_gib * GiB) // 64 // 8
    with allocator.use_memory_pool("runtime"):
        runtime = [pattern(n_r, 10_000 + i) for i in range(64)]
        del runtime[1::2]  # half of it freed: 2 GiB live
    torch.cuda.synchronize()
    live = [(t, i) for i, t in enumerate(weights)] + [(t, 10_000 + 2 * i) for i, t in enumerate(runtime)]
    kept = sum(t.numel() * 8 for t, _ in live)
    time.sleep(args.settle)
    prepared = prepared_bytes(args.child)  # host backup ready when the first sleep comes

    def timed(call):
        return timed_ms(torch, call)

    rows = []
    plan = ["full"] * args.cycles + ["selective"] * args.selective
    for cycle, kind in enumerate(plan):
        sleep_ms = timed(lambda: backend.suspend(level=1))
        avail_asleep = meminfo("MemAvailable") - baseline
        time.sleep(args.train)  # the training phase between sleep and wake
        if kind == "full":
            wake_ms = [timed(lambda: backend.resume(None))]
        else:
            wake_ms = [timed(lambda: backend.resume(["weights"])), timed(lambda: backend.resume(["kv_cache"]))]
        avail_awake = meminfo("MemAvailable") - baseline
        bad = sum(0 if torch.equal(t, pattern(t.numel(), seed)) else 1 for t, seed in live)
        rows.append(dict(cycle=cycle + 1, kind=kind, sleep_ms=sleep_ms, wake_ms=wake_ms, avail_asleep=avail_asleep,
                         avail_awake=avail_awake, mismatches=bad, state=backend.state()))
        print(json.dumps(dict(peer=args.child, **rows[-1])), file=sys.stderr, flush=True)
        time.sleep(args.gap)
    print(json.dumps(dict(peer=args.child, kept=kept, prepared=prepared, rows=rows)), flush=True)
    os._exit(0)


def run_peer(peer, args, env):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", peer, "--cycles", str(args.cycles),
           "--selective", str(args.selective), "--settle", str(args.settle), "--tensors", str(args.tensors),
           "--weights-gib", str(args.weights_gib), "--discard-gib", str(args.discard_gib),
           "--runtime-gib", str(args.runtime_gib), "--gap", str(args.gap), "--train", str(args.train)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        return dict(peer=peer, error=(p.stderr or p.stdout)[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def table(results, d2h, h2d):
    lines = [link_line(d2h, h2d),
             "times in ms (x the bound: kept bytes at the link's rate); MemAvailable in GiB relative to the start",
             f"{'peer':<8} {'cycle':>5} {'wake':<9} {'sleep ms (x bound)':>19} {'wake ms (x bound)':>28} "
             f"{'avail asleep/awake':>19} state     bad"]
    for r, row, bs, bw in peer_rows(results, lines, 8, "kept", d2h, h2d):
        wake = " + ".join(f"{w:.1f}" for w in row["wake_ms"])
        total = sum(row["wake_ms"])
        lines.append(f"{r['peer']:<8} {row['cycle']:>5} {row['kind']:<9} {row['sleep_ms']:9.1f} "
                     f"({row['sleep_ms'] / bs:5.2f}x) {wake:>19} ({total / bw:5.2f}x) "
                     f"{row['avail_asleep'] / GiB:8.2f} / {row['avail_awake'] / GiB:<8.2f} {row['state']:<9} "
                     f"{row['mismatches']}")
    ok = {r["peer"]: r for r in results if "error" not in r}
    if ok.get("vmstash", {}).get("prepared") is not None:
        lines.append(f"vmstash's host backup prepared when the first sleep came: {ok['vmstash']['prepared'] / GiB:.2f} GiB")
    if "vmstash" in ok:
        lines.append(f"bound: {ok['vmstash']['kept'] / GiB:.2f} GiB kept at the link's rate: "
                     f"{ok['vmstash']['kept'] / d2h * 1e3:.1f} ms out, {ok['vmstash']['kept'] / h2d * 1e3:.1f} ms in")
    if "vmstash" in ok and "cumem" in ok:
        pairs = list(zip(ok["cumem"]["rows"], ok["vmstash"]["rows"]))
        lines.append("CuMemAllocator / vmstash, sleep per cycle: " + " ".join(
            f"{c['sleep_ms'] / v['sleep_ms']:.1f}x" for c, v in pairs))
        lines.append("CuMemAllocator / vmstash, wake per cycle (all of it): " + " ".join(
            f"{sum(c['wake_ms']) / sum(v['wake_ms']):.1f}x" for c, v in pairs))
        sel = [(c, v) for c, v in pairs if c["kind"] == "selective"]
        if sel:
            lines.append("CuMemAllocator / vmstash, selective wake of weights: " + " ".join(
                f"{c['wake_ms'][0] / v['wake_ms'][0]:.1f}x" for c, v in sel))
    return lines


def vllm_env():
    """PYTHONPATH with vLLM's files and the stand-ins put together (a temporary folder)."""
    sys.path.insert(0, os.path.join(ROOT, "torch_plugin", "python", "tests", "vllm_standins"))
    import assemble
    where = assemble.assemble(tempfile.mkdtemp(prefix="vmstash_vllm_bench_"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (where, os.path.join(ROOT, "torch_plugin", "python"),
                                                    env.get("PYTHONPATH")) if p)
    return where, env


def main():
    ap = workload_args(__doc__, PEERS)
    ap.add_argument("--selective", type=int, default=3)
    ap.add_argument("--runtime-gib", type=float, default=4)
    ap.add_argument("--train", type=float, default=1.0, help="seconds between a sleep and its wake (training)")
    args = ap.parse_args()
    if args.child:
        return child(args)
    import shutil
    import torch
    d2h, h2d = pinned_link(torch, torch.device("cuda", 0))
    where, env = vllm_env()
    try:
        results = run_peers(args.peers, PEERS, lambda peer: run_peer(peer, args, env))
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return report(torch, results, table(results, d2h, h2d), args.json, d2h, h2d)


if __name__ == "__main__":
    sys.exit(main())
