"""Backups through torch_memory_saver's API, side by side in one run (issue 33's workload).

    python3 bench/tms_backup_bench.py [--cycles 5] [--settle 3] [--json out.json]
                                      [--peers native,dropin,dropin_retain,tms,dropin_mmap,tms_mmap]

Each peer runs in its own process with the same tags:
  weights  8 GiB backed up, in 512 tensors
  kv       16 GiB discarded
  opt      4 GiB backed up, of which half is freed before the first pause (2 GiB live)
then, `--settle` seconds after the tags stop growing (what a framework does between loading
and its first pause), `--cycles` times: pause every tag, resume every tag. The backed-up
tensors are checked bit for bit after every resume.

  native         vmstash's own API (vmstash.region / pause / resume), pinned store
  dropin         vmstash.compat.torch_memory_saver, torch_memory_saver's default mode
                 (retain_cpu_backup off: host memory handed back after every resume)
  dropin_retain  the same with retain_cpu_backup on (the backup stays pinned)
  tms            torch_memory_saver itself (its wheel importable as torch_memory_saver),
                 default mode
  dropin_mmap    the drop-in with cpu_backup_backend="mmap" (vmstash's pageable store: copies
                 through its staging ring, pages given back after the resume)
  tms_mmap       torch_memory_saver itself with cpu_backup_backend="mmap"
The TMS-API peers use torch_memory_saver's torch hook mode (its pluggable allocator, in
process).

Per cycle: pause and resume wall time (the device synchronized); host memory available
(MemAvailable, relative to the process's start), the host bytes vmstash's arenas hold and
the process's RSS after the pause, after the resume and, for the drop-in, once its
background thread has given the memory back (and how long after the resume that was).
MemAvailable counts memory handed back lazily (MADV_FREE) as available, and keeps counting
it when it is reused until the kernel next scans it; RSS counts it until the kernel takes
it. --gap seconds pass between cycles (a training step). The
pinned link of the same run (a 2 GiB pinned copy each way) bounds every pause and resume:
bytes backed up / link rate. A resume here follows its pause at once, right after the device
released every tag's bytes; the driver's work after such a release slows the copies queued
in the next ~50-100 ms, so the same run also times the backed-up bytes copied in right after
the device released as much (torch's cudaFree): the ceiling of such a resume. Prints a table
and the ratios; --json writes everything.
"""
import argparse
import json
import os
import subprocess
import sys
import time

GiB = 1 << 30
MiB = 1 << 20
PEERS = ("native", "dropin", "dropin_retain", "tms", "dropin_mmap", "tms_mmap")


def timed_ms(torch, call):
    """call()'s wall time in ms, the device synchronized before and after."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def meminfo(key):
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def pinned_link(torch, dev, nbytes=2 * GiB):
    """Best of 3 pinned copies each way, bytes/s."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    rates = []
    for copy in (lambda: host.copy_(d, non_blocking=True), lambda: d.copy_(host, non_blocking=True)):
        best = 1e9
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        rates.append(nbytes / best)
    del host, d
    return rates


OPT_TENSORS = 64  # of which every other one is freed before the first pause


def elements(args):
    """int64 elements per weights tensor and per opt tensor: the one place the workload's
    sizes are derived from the arguments (the child allocates them, the parent's ceiling
    copies as many bytes)."""
    return int(args.weights_gib * GiB) // args.tensors // 8, int(args.opt_gib * GiB) // OPT_TENSORS // 8


def backed_up_bytes(args):
    n_w, n_o = elements(args)
    return 8 * (n_w * args.tensors + n_o * (OPT_TENSORS // 2))


def child(args):
    import torch
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    peer = args.child
    if peer == "native":
        import vmstash
        region = lambda tag, backup: vmstash.region(tag, policy="backup" if backup else "discard")  # noqa: E731
        tags = ["weights", "kv", "opt"]
        pause = lambda: [vmstash.pause(t) for t in tags]  # noqa: E731
        resume = lambda: [vmstash.resume(t) for t in tags]  # noqa: E731
    else:
        import importlib
        real = peer.startswith("tms")
        module = importlib.import_module("torch_memory_saver" if real else "vmstash.compat.torch_memory_saver")
        tms = module.torch_memory_saver
        tms.hook_mode = "torch"  # in process: no LD_PRELOAD needed
        tms.retain_cpu_backup = peer == "dropin_retain"
        backend = "mmap" if peer.endswith("_mmap") else None

        def region(tag, backup):
            if backup and backend:
                return tms.region(tag=tag, enable_cpu_backup=True, cpu_backup_backend=backend)
            return tms.region(tag=tag, enable_cpu_backup=backup)
        pause = lambda: tms.pause()  # noqa: E731
        resume = lambda: tms.resume()  # noqa: E731

    def held():
        """Host bytes vmstash's backup arenas hold (None for torch_memory_saver itself)."""
        if peer.startswith("tms"):
            return None
        import vmstash
        return sum(vmstash.tag_stats(t).get("backup_arena_bytes", 0) for t in vmstash.tags())

    def pattern(n, seed):
        return torch.arange(n, dtype=torch.int64, device=dev).mul_(2654435761).add_(seed)

    baseline = meminfo("MemAvailable")
    weights, opt = [], []
    n_w, n_o = elements(args)
    with region("weights", True):
        for i in range(args.tensors):
            weights.append(pattern(n_w, i))
    with region("kv", False):
        kv = [torch.empty(int(args.discard_gib * GiB) // 4 // 8, dtype=torch.int64, device=dev) for _ in range(4)]
    with region("opt", True):
        for i in range(OPT_TENSORS):
            opt.append(pattern(n_o, 10_000 + i))
        del opt[1::2]  # half of it freed: 2 GiB live
    torch.cuda.synchronize()
    live = [(t, i) for i, t in enumerate(weights)] + [(t, 10_000 + 2 * i) for i, t in enumerate(opt)]
    backed_up = sum(t.numel() * 8 for t, _ in live)
    time.sleep(args.settle)
    rows = []
    for cycle in range(args.cycles):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pause()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        a1, r1, h1 = meminfo("MemAvailable"), rss(), held()
        t2 = time.perf_counter()
        resume()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        a2, r2, h2 = meminfo("MemAvailable"), rss(), held()
        # The drop-in gives the memory back on a background thread: wait for it (5 s at most).
        given = None
        if peer in ("dropin", "dropin_mmap"):
            while held() > 0 and time.perf_counter() - t3 < 5:
                time.sleep(0.005)
            given = (time.perf_counter() - t3) * 1e3 if held() == 0 else None
        a3, r3, h3 = meminfo("MemAvailable"), rss(), held()
        bad = sum(0 if torch.equal(t, pattern(t.numel(), seed)) else 1 for t, seed in live)
        rows.append(dict(cycle=cycle + 1, pause_ms=(t1 - t0) * 1e3, resume_ms=(t3 - t2) * 1e3, given_back_ms=given,
                         avail_paused=a1 - baseline, avail_resumed=a2 - baseline, avail_after=a3 - baseline,
                         rss_paused=r1, rss_resumed=r2, rss_after=r3, held_paused=h1, held_resumed=h2, held_after=h3,
                         mismatches=bad))
        print(json.dumps(dict(peer=peer, **rows[-1])), file=sys.stderr, flush=True)
        if args.gap > 0:
            time.sleep(args.gap)
    print(json.dumps(dict(peer=peer, backed_up=backed_up, rows=rows)), flush=True)
    os._exit(0)  # no teardown: torch_memory_saver's torch mode refuses frees outside a region


def h2d_after_release(torch, dev, nbytes, released):
    """Best of 3: seconds of an H2D pinned copy of `nbytes` queued right after the device
    released `released` bytes (torch's cudaFree). The driver's work after a release slows copies
    queued in the next ~50-100 ms (about 2 ms per GiB released on an H200), so this bounds a
    resume that follows its pause at once, as every cycle here does."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    best = 1e9
    for _ in range(3):
        chunks = [torch.empty(min(GiB, released - k), dtype=torch.uint8, device=dev) for k in range(0, released, GiB)]
        torch.cuda.synchronize()
        time.sleep(0.3)  # a settled start, as the pause's tags
        del chunks
        torch.cuda.empty_cache()
        t = time.perf_counter()
        d.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
        time.sleep(0.3)
    del host, d
    torch.cuda.empty_cache()
    return best


def run_peer(peer, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", peer, "--cycles", str(args.cycles),
           "--settle", str(args.settle), "--tensors", str(args.tensors), "--weights-gib", str(args.weights_gib),
           "--discard-gib", str(args.discard_gib), "--opt-gib", str(args.opt_gib), "--gap", str(args.gap)]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return dict(peer=peer, error=(p.stderr or p.stdout)[-2000:], seconds=time.perf_counter() - t)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["seconds"] = time.perf_counter() - t
    return out


def gib(x):
    return "-" if x is None else f"{x / GiB:.2f}"


def link_line(d2h, h2d):
    return f"pinned link (same run): D2H {d2h / 1e9:.1f} GB/s, H2D {h2d / 1e9:.1f} GB/s"


def failure_line(result, width):
    """The table's line for a peer whose process failed: its last line naming an error (a
    warning printed at exit may follow it), else its last line of output."""
    tail = result["error"].strip().splitlines()
    errors = [line for line in tail if "Error" in line or "error:" in line]
    return f"{result['peer']:<{width}} failed: {(errors or tail or ['?'])[-1]}"


def peer_rows(results, lines, width, bytes_key, d2h, h2d):
    """(result, row, bound out, bound in) for each row of each peer that ran (the bounds: the
    result's `bytes_key` bytes at the link's rate, in ms); a failed peer's line goes into
    `lines`."""
    for r in results:
        if "error" in r:
            lines.append(failure_line(r, width))
            continue
        out, into = r[bytes_key] / d2h * 1e3, r[bytes_key] / h2d * 1e3
        for row in r["rows"]:
            yield r, row, out, into


def table(results, d2h, h2d, after=None):
    """`after`: (released bytes, copied bytes, seconds) of h2d_after_release, or None."""
    lines = [link_line(d2h, h2d),
             "MemAvailable and held (vmstash's arenas) in GiB, MemAvailable relative to the process's start;",
             "'after': once the drop-in's background thread gave the memory back (-: not waited for)",
             f"{'peer':<14} {'cycle':>5} {'pause ms (x bound)':>19} {'resume ms (x bound)':>20} {'given back ms':>13} "
             f"{'avail paused/resumed/after':>27} {'held paused/resumed/after':>26} {'RSS after':>9} bad"]
    for r, row, bp, br in peer_rows(results, lines, 14, "backed_up", d2h, h2d):
        given = "-" if row["given_back_ms"] is None else f"{row['given_back_ms']:.0f}"
        lines.append(
            f"{r['peer']:<14} {row['cycle']:>5} {row['pause_ms']:9.1f} ({row['pause_ms'] / bp:5.2f}x) "
            f"{row['resume_ms']:10.1f} ({row['resume_ms'] / br:5.2f}x) {given:>13} "
            f"{gib(row['avail_paused']):>8} / {gib(row['avail_resumed'])} / {gib(row['avail_after']):<6} "
            f"{gib(row['held_paused']):>7} / {gib(row['held_resumed'])} / {gib(row['held_after']):<6} "
            f"{gib(row['rss_after']):>9} {row['mismatches']}")
    ok = [r for r in results if "error" not in r]
    if ok:
        lines.append(f"bound: the backed-up bytes ({ok[0]['backed_up'] / GiB:.2f} GiB) at the link's rate: "
                     f"{ok[0]['backed_up'] / d2h * 1e3:.1f} ms out, {ok[0]['backed_up'] / h2d * 1e3:.1f} ms in")
    if ok and after is not None:
        released, copied, seconds = after
        lines.append(f"ceiling of a resume that follows its pause at once: {copied / GiB:.2f} GiB copied in right "
                     f"after the device released {released / GiB:.2f} GiB took {seconds * 1e3:.1f} ms "
                     f"({copied / seconds / 1e9:.1f} GB/s, {copied / h2d / seconds * 100:.0f}% of the link)")
        for r in ok:
            lines.append(f"{r['peer']:<14} resume / that ceiling per cycle: "
                         + " ".join(f"{row['resume_ms'] / (seconds * 1e3):.2f}x" for row in r["rows"]))
    by = {r["peer"]: r for r in ok}
    for ref, peers in (("tms", ("native", "dropin", "dropin_retain")), ("tms_mmap", ("dropin_mmap",))):
        for peer in peers:
            if ref not in by or peer not in by:
                continue
            for what in ("pause_ms", "resume_ms"):
                ratios = [t[what] / m[what] for t, m in zip(by[ref]["rows"], by[peer]["rows"])]
                lines.append(f"{'torch_memory_saver' + ref[3:]:<23} / {peer:<13} {what[:-3]:<6} per cycle: "
                             + " ".join(f"{x:.1f}x" for x in ratios))
    return lines


def workload_args(doc, peers):
    """The command line of a side-by-side benchmark of this workload (this one and
    vllm_sleep_bench.py): peers, cycles, the settle time, the tags' sizes, the output."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=peers, help=argparse.SUPPRESS)
    ap.add_argument("--peers", default=",".join(peers))
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--tensors", type=int, default=512)
    ap.add_argument("--weights-gib", type=float, default=8)
    ap.add_argument("--discard-gib", type=float, default=16)
    ap.add_argument("--gap", type=float, default=0.5, help="seconds between cycles")
    ap.add_argument("--json", default=None)
    return ap


def main():
    ap = workload_args(__doc__, PEERS)
    ap.add_argument("--opt-gib", type=float, default=4)
    args = ap.parse_args()
    if args.child:
        return child(args)
    import torch
    dev = torch.device("cuda", 0)
    d2h, h2d = pinned_link(torch, dev)
    # The same bytes as every peer's resume, right after the release of every tag's bytes.
    copied = backed_up_bytes(args)
    released = int((args.weights_gib + args.discard_gib + args.opt_gib) * GiB)
    after = (released, copied, h2d_after_release(torch, dev, copied, released))
    results = run_peers(args.peers, PEERS, lambda peer: run_peer(peer, args))
    return report(torch, results, table(results, d2h, h2d, after), args.json, d2h, h2d,
                  extra=dict(after_release=dict(released=after[0], copied=after[1], seconds=after[2])))


def run_peers(names, known, run):
    """run(peer) for each of the comma-separated `names`, in order (each in its own process)."""
    results = []
    for peer in names.split(","):
        if peer not in known:
            raise SystemExit(f"--peers: {peer!r} is not one of {', '.join(known)}")
        print(f"running {peer} ...", flush=True)
        results.append(run(peer))
    return results


def report(torch, results, lines, json_path, d2h, h2d, extra=None):
    """Prints the table, writes the JSON (with `extra`'s keys); the exit status: 1 when a peer
    failed or a byte differed."""
    print("\n".join(lines))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(0), d2h=d2h, h2d=h2d, results=results, **(extra or {})), f,
                      indent=1)
    return 1 if any("error" in r or any(row["mismatches"] for row in r["rows"]) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
