"""Two processes on one GPU taking turns, through torch_memory_saver's API, while other processes
take the host's memory (issue "vmstashd"'s workload), side by side in one run.

    python3 bench/node_pool_bench.py [--cycles 4] [--weights-gib 8] [--tensors 512] [--discard-gib 16]
                                     [--pool-gib 18] [--ballast-free-gib 28] [--keep-free-gib 6] [--settle 8]
                                     [--json out.json] [--peers dropin,dropin_node,dropin_node_pin,tms]

Each peer runs two processes, A and B, each with the same tags (torch_memory_saver's torch
hook mode, in process): `weights` (--weights-gib backed up, in --tensors tensors) and `kv`
(--discard-gib discarded). They take turns: the active one pauses, then the other resumes
(checked bit for bit), --cycles times each way. Between turns a hog process touches all but
--keep-free-gib of the host's available memory and exits, as a data loader, a checkpoint or
the other phase's process would; for the whole run a ballast process holds all but
--ballast-free-gib of the host's available memory (so that the hog has little to touch: the
same pressure, in seconds rather than minutes).

  dropin       vmstash's torch_memory_saver drop-in, default mode: the host memory is handed
               back after every resume (each process its own)
  dropin_node  the same with VMSTASH_CONF=node:1: both processes lease from one node pool
               (vmstashd, started by the first process that asks); each part of the pool is
               pinned in a process by its first pause that leases it
  dropin_node_pin  the same with node_pin:1: each process pins the whole pool ahead, in the
               background, once its backup tag has grown (within --settle)
  tms          torch_memory_saver 0.0.10 itself, default mode

Per turn: the pause's and the resume's wall time, as a rate and as a share of the pinned link
measured in the same run (before the ballast) — the issue's target is >= 80% of the link for
every pause; the node pool's peak (the most it held at once). Prints a table; --json writes
everything.
"""
import argparse
import json
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import time
import ctypes

from tms_backup_bench import meminfo  # noqa: E402  (this folder is first on sys.path)

GiB = 1 << 30
PEERS = ("dropin", "dropin_node", "dropin_node_pin", "tms")


def touch(nbytes, hold):
    """Faults in nbytes of anonymous memory with 16 threads (MADV_POPULATE_WRITE), then holds it
    until stdin closes (hold) or exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    step = (nbytes // 16) & ~((2 << 20) - 1)

    def populate(k):
        n = step if k < 15 else nbytes - 15 * step
        libc.madvise(base + k * step, n, 14)  # MADV_HUGEPAGE
        libc.madvise(base + k * step, n, 23)  # MADV_POPULATE_WRITE

    threads = [threading.Thread(target=populate, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("ready", flush=True)
    if hold:
        sys.stdin.read()
    os._exit(0)


def child(args):
    import importlib
    import torch
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    real = args.child == "tms"
    tms = importlib.import_module("torch_memory_saver" if real else "vmstash.compat.torch_memory_saver").torch_memory_saver
    tms.hook_mode = "torch"

    def pattern(n, seed):
        return torch.arange(n, dtype=torch.int64, device=dev).mul_(2654435761).add_(seed)

    n = int(args.weights_gib * GiB) // args.tensors // 8
    with tms.region(tag="weights", enable_cpu_backup=True):
        weights = [pattern(n, args.seed + i) for i in range(args.tensors)]
    with tms.region(tag="kv", enable_cpu_backup=False):
        kv = torch.empty(int(args.discard_gib * GiB) // 8, dtype=torch.int64, device=dev)  # noqa: F841
    torch.cuda.synchronize()
    backed_up = sum(t.numel() * 8 for t in weights)
    print(json.dumps(dict(ready=True, backed_up=backed_up)), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        out = dict(cmd=cmd)
        if cmd in ("pause", "resume"):
            torch.cuda.synchronize()
            t = time.perf_counter()
            tms.pause() if cmd == "pause" else tms.resume()
            torch.cuda.synchronize()
            out["ms"] = (time.perf_counter() - t) * 1e3
            if cmd == "resume":
                out["bad"] = sum(0 if torch.equal(w, pattern(n, args.seed + i)) else 1 for i, w in enumerate(weights))
        elif cmd == "node":
            import vmstash
            try:
                out["node"] = vmstash.node.stats()
            except vmstash.Error as e:
                out["error"] = str(e)
        elif cmd == "quit":
            print(json.dumps(out), flush=True)
            os._exit(0)
        print(json.dumps(out), flush=True)


class Proc:
    def __init__(self, cmd, env):
        self.p = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, cmd=None):
        if cmd is not None:
            self.p.stdin.write(cmd + "\n")
            self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"the process ended (exit {self.p.wait()})")
        return json.loads(line)


def hog(keep_free):
    n = meminfo("MemAvailable") - keep_free
    if n <= GiB:
        return 0.0
    t = time.perf_counter()
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--touch", str(n)], stdout=subprocess.PIPE,
                         text=True)
    p.stdout.readline()
    p.wait()
    return n


def run_peer(peer, args, d2h, h2d):
    env = dict(os.environ)
    runtime_dir = tempfile.mkdtemp(prefix="vmstash-node-bench-")
    os.chmod(runtime_dir, 0o700)
    env["VMSTASH_RUNTIME_DIR"] = runtime_dir
    if peer.startswith("dropin_node"):
        env["VMSTASH_CONF"] = f"node:1,node_capacity:{int(args.pool_gib)}G,node_pin:{int(peer.endswith('_pin'))}"
    else:
        env.pop("VMSTASH_CONF", None)
    procs = []
    try:
        for seed in (0, 1_000_000):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", peer, "--seed", str(seed), "--tensors",
                   str(args.tensors), "--weights-gib", str(args.weights_gib), "--discard-gib", str(args.discard_gib)]
            procs.append(Proc(cmd, env))
        backed_up = [p.ask()["backed_up"] for p in procs][0]
        time.sleep(args.settle)  # what a framework does between loading and its first pause
        active, other = procs
        other.ask("pause")  # B starts paused: A's phase
        turns = []
        for turn in range(2 * args.cycles):
            squeezed = hog(int(args.keep_free_gib * GiB))
            pause = active.ask("pause")
            resume = other.ask("resume")
            turns.append(dict(turn=turn + 1, who="AB"[procs.index(active)], squeezed=squeezed, pause_ms=pause["ms"],
                              resume_ms=resume["ms"], bad=resume["bad"],
                              pause_link=backed_up / (pause["ms"] / 1e3) / d2h,
                              resume_link=backed_up / (resume["ms"] / 1e3) / h2d))
            print(json.dumps(dict(peer=peer, **turns[-1])), file=sys.stderr, flush=True)
            active, other = other, active
        node = procs[0].ask("node").get("node") if peer.startswith("dropin_node") else None
        return dict(peer=peer, backed_up=backed_up, turns=turns, node=node)
    except Exception as e:  # noqa: BLE001  (a peer that fails is reported, the others still run)
        return dict(peer=peer, error=str(e))
    finally:
        for p in procs:
            try:
                p.p.stdin.write("quit\n")
                p.p.stdin.flush()
            except Exception:  # noqa: BLE001
                pass
            try:
                p.p.wait(30)
            except subprocess.TimeoutExpired:
                p.p.kill()
        if peer.startswith("dropin_node"):
            stop_daemon(runtime_dir, env)


def stop_daemon(runtime_dir, env):
    """Stops the node daemon of `runtime_dir` (`vmstash daemon stop`, then SIGTERM to every
    daemon its log names, in case the CLI is missing)."""
    subprocess.run([sys.executable, "-m", "vmstash._cli", "daemon", "stop"], env=env, capture_output=True)
    log = os.path.join(runtime_dir, "vmstashd.log")
    import re
    for pid in set(re.findall(r"\(pid (\d+)\)", open(log).read() if os.path.exists(log) else "")):
        try:
            os.kill(int(pid), 15)
        except ProcessLookupError:
            pass


def pinned_link():
    """D2H and H2D bytes/s of the same run (tms_backup_bench's measure), and the card's name."""
    import torch
    from tms_backup_bench import pinned_link as measure  # this folder is first on sys.path
    d2h, h2d = measure(torch, torch.device("cuda", 0))
    torch.cuda.empty_cache()
    return d2h, h2d, torch.cuda.get_device_name(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--touch", type=int)
    ap.add_argument("--hold", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cycles", type=int, default=4)
    ap.add_argument("--weights-gib", type=float, default=8)
    ap.add_argument("--tensors", type=int, default=512)
    ap.add_argument("--discard-gib", type=float, default=16)
    ap.add_argument("--pool-gib", type=float, default=18)
    ap.add_argument("--ballast-free-gib", type=float, default=28)
    ap.add_argument("--settle", type=float, default=8)
    ap.add_argument("--keep-free-gib", type=float, default=6)
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.touch:
        return touch(args.touch, args.hold)
    if args.child:
        return child(args)
    d2h, h2d, card = pinned_link()
    ballast = None
    n = meminfo("MemAvailable") - int(args.ballast_free_gib * GiB)
    if n > GiB:
        ballast = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--touch", str(n), "--hold"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ballast.stdout.readline()
    results = []
    try:
        for peer in args.peers.split(","):
            results.append(run_peer(peer, args, d2h, h2d))
    finally:
        if ballast is not None:
            ballast.stdin.close()
            ballast.wait()
    print(f"{card}: pinned link D2H {d2h / 1e9:.1f} GB/s, H2D {h2d / 1e9:.1f} GB/s; ballast {n / GiB:.1f} GiB, "
          f"the hog keeps {args.keep_free_gib} GiB free; {args.weights_gib} GiB backed up per turn")
    print(f"{'peer':<12} {'turns':>5} {'pause ms (min/med/max)':>26} {'pause % link (min)':>19} "
          f"{'resume ms (med)':>16} {'bad':>4}  node pool peak")
    for r in results:
        if "error" in r:
            print(f"{r['peer']:<12} FAILED: {r['error'][-300:]}")
            continue
        p = sorted(t["pause_ms"] for t in r["turns"])
        q = sorted(t["resume_ms"] for t in r["turns"])
        worst = min(t["pause_link"] for t in r["turns"])
        peak = f"{r['node']['peak_bytes'] / GiB:.1f} GiB" if r.get("node") else "-"
        print(f"{r['peer']:<12} {len(p):>5} {p[0]:>8.1f}/{p[len(p) // 2]:>8.1f}/{p[-1]:>8.1f} {worst * 100:>18.1f}% "
              f"{q[len(q) // 2]:>16.1f} {sum(t['bad'] for t in r['turns']):>4}  {peak}")
    by = {r["peer"]: r for r in results if "error" not in r}
    if "dropin_node" in by:
        med = lambda r: sorted(t["pause_ms"] for t in r["turns"])[len(r["turns"]) // 2]  # noqa: E731
        for other in ("dropin", "tms"):
            if other in by:
                print(f"pause, median: dropin_node is {med(by[other]) / med(by['dropin_node']):.2f}x {other}")
    for name, r in by.items():
        worst = min(t["pause_link"] for t in r["turns"])
        print(f"{name}: every pause at >= 80% of the link: {'yes' if worst >= 0.8 else 'no'} (worst {worst * 100:.1f}%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(card=card, d2h=d2h, h2d=h2d, ballast=n, args=vars(args), results=results), f, indent=1)


if __name__ == "__main__":
    main()
