"""Weights from a trainer process to a rollout process on one GPU (vmstash.weights; Note [Mapped
Tags] in runtime/tag_share.h), side by side in one run against torch's CUDA IPC path and a copy
inside one process.

    python3 bench/weights_sync_bench.py [--steps 5] [--sizes 8:512,4:2048] [--json out.json]

For each size (GiB of bf16 weights : tensors), a rollout process holds the weights (in a
backup tag, published with vmstash.weights.publish, its chunks exportable) and a trainer
process holds its own copy to send (plain torch memory). Cases, each --steps times:

  vmstash      the trainer maps the rollout's tag once (vmstash.weights.map_tag), makes a
               vmstash.weights.SyncPlan of its tensors once, and each step runs it: one
               batched copy (torch._foreach_copy_) into the mapping, waited for; the first
               step counts the map and the plan
  vmstash_unplanned  vmstash.weights.sync(tensors, view) each step: the same copy, with the
               per-tensor checks made again every step (a trainer whose tensors change)
  ipc          as SGLang's update_weights_from_tensor: each step the trainer sends every
               tensor through torch.multiprocessing's reductions (CUDA IPC handles, pickled),
               the rollout opens them, copies each into its weights and waits, then drops them
  same_process the trainer copies the same tensors into another set of its own with the same
               batched copy: what the mapping aims at (>= 85%)
  flat_copy    one copy of all the bytes in one call, in the trainer: the device's limit
  vmstash_paused  the rollout paused (its backup in the node pool: the rollout runs with
               node:1), the same plan's run writes into that backup (device to host, through
               the trainer's own mapping of the pool); the rollout's resume then restores
               them (checked, not timed); the first step counts registering the pool here
  pinned_link  one device-to-host copy of all the bytes into pinned memory of the trainer's
               own, in one call: the link's limit, what vmstash_paused aims at (>= 80%)

Each case's time is the wall clock from the trainer's call to the copies being complete
(for ipc: until the rollout says it has copied). The rollout checks the bytes it holds after
each case (not timed). Prints a table; --json writes the figures and the ratios the issue
asks for (vmstash against same_process and ipc, per step and first step; vmstash_paused
against pinned_link). vmstashd is $VMSTASH_DAEMON, else the CMake build's.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

GiB = 1 << 30
HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


def rollout(args):
    import torch
    import vmstash
    import pickle
    dev = torch.device("cuda", 0)
    n = args.gib * GiB // args.tensors // 2
    with vmstash.region("weights", policy="backup"):
        weights = {f"w{i}": torch.zeros(n, device=dev, dtype=torch.bfloat16) for i in range(args.tensors)}
    generation = vmstash.weights.publish("weights", weights)
    say(ready=os.getpid(), generation=generation)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "check":  # every tensor i holds the value the trainer wrote: i % 7 + step
            step = int(cmd[1])
            bad = [name for i, (name, t) in enumerate(weights.items())
                   if not bool((t == float(i % 7 + step)).all())]
            say(bad=len(bad))
        elif cmd[0] == "ipc":  # the pickled reductions of every tensor, on stdin as one hex line
            payload = pickle.loads(bytes.fromhex(sys.stdin.readline().strip()))
            for name, (fn, fargs) in payload:
                t = fn(*fargs)
                weights[name].copy_(t)
                del t
            torch.cuda.synchronize()
            say(ok=True)
        elif cmd[0] in ("pause", "resume"):
            torch.cuda.synchronize()
            (vmstash.pause if cmd[0] == "pause" else vmstash.resume)("weights")
            say(ok=True)
        elif cmd[0] == "exit":
            break


def trainer(args):
    import pickle
    import torch
    import vmstash
    from torch.multiprocessing.reductions import reduce_tensor
    dev = torch.device("cuda", 0)
    n = args.gib * GiB // args.tensors // 2
    src = {f"w{i}": torch.empty(n, device=dev, dtype=torch.bfloat16) for i in range(args.tensors)}
    own = {f"w{i}": torch.empty(n, device=dev, dtype=torch.bfloat16) for i in range(args.tensors)}
    flat_src = torch.empty(args.gib * GiB // 2, device=dev, dtype=torch.bfloat16)
    flat_dst = torch.empty_like(flat_src)

    def fill(step):
        for i, t in enumerate(src.values()):
            t.fill_(float(i % 7 + step))
        torch.cuda.synchronize()

    def timed(fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    pid = int(args.rollout_pid)
    out = {"vmstash": [], "vmstash_unplanned": [], "ipc": [], "same_process": [], "flat_copy": [],
           "vmstash_paused": [], "pinned_link": []}
    # Warm the copy kernels (not timed, not a step of any case).
    torch._foreach_copy_(list(own.values()), list(src.values()))
    flat_dst.copy_(flat_src)
    torch.cuda.synchronize()
    view = plan = None
    for step in range(args.steps):
        fill(step)
        if view is None:
            t0 = time.perf_counter()
            view = vmstash.weights.map_tag(pid, "weights")
            plan = vmstash.weights.SyncPlan(src, view)
            plan.run()
            out["vmstash"].append((time.perf_counter() - t0) * 1e3)
        else:
            out["vmstash"].append(timed(plan.run))
        say(ask=f"check {step}")
        if json.loads(sys.stdin.readline())["bad"] != 0:
            raise SystemExit(f"vmstash step {step}: the rollout's weights are wrong")
    for step in range(args.steps):
        fill(step + 50)
        out["vmstash_unplanned"].append(timed(lambda: vmstash.weights.sync(src, view)))
        say(ask=f"check {step + 50}")
        if json.loads(sys.stdin.readline())["bad"] != 0:
            raise SystemExit(f"vmstash_unplanned step {step}: the rollout's weights are wrong")
    for step in range(args.steps):
        fill(step + 100)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        payload = pickle.dumps([(name, reduce_tensor(t)) for name, t in src.items()])
        say(ask="ipc", payload=payload.hex())
        json.loads(sys.stdin.readline())
        out["ipc"].append((time.perf_counter() - t0) * 1e3)
        say(ask=f"check {step + 100}")
        if json.loads(sys.stdin.readline())["bad"] != 0:
            raise SystemExit(f"ipc step {step}: the rollout's weights are wrong")
    def ask(what):
        say(ask=what)
        return json.loads(sys.stdin.readline())

    for step in range(args.steps):
        fill(step + 200)
        if not ask("pause").get("ok"):
            raise SystemExit("the rollout could not pause")
        got = {}
        out["vmstash_paused"].append(timed(lambda: got.update(plan.run())))
        if got.get("into") != "backup":
            raise SystemExit(f"vmstash_paused step {step}: the sync went to {got.get('into')}, not the backup "
                             f"(view {view.info()})")
        if not ask("resume").get("ok"):
            raise SystemExit("the rollout could not resume")
        if ask(f"check {step + 200}")["bad"] != 0:
            raise SystemExit(f"vmstash_paused step {step}: the rollout's weights are wrong after its resume")
    dsts, srcs = list(own.values()), list(src.values())
    del own
    host = torch.empty(flat_src.numel(), dtype=flat_src.dtype, pin_memory=True)
    host.copy_(flat_src, non_blocking=True)  # warm (not a step)
    for _ in range(args.steps):
        out["same_process"].append(timed(lambda: torch._foreach_copy_(dsts, srcs)))
        out["flat_copy"].append(timed(lambda: flat_dst.copy_(flat_src)))
        out["pinned_link"].append(timed(lambda: host.copy_(flat_src, non_blocking=True)))
    view.close()
    say(done=out)


def say(**kw):
    print(json.dumps(kw), flush=True)


def stop_daemon(runtime_dir):
    """SIGTERM to the daemon the rollout started in `runtime_dir` (its log names its pid)."""
    import re
    import signal
    try:
        with open(os.path.join(runtime_dir, "vmstashd.log")) as f:
            pids = re.findall(r"\(pid (\d+)\)", f.read())
    except FileNotFoundError:
        return
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGTERM)
        except ProcessLookupError:
            pass


def run_size(gib, tensors, args):
    d = tempfile.mkdtemp(prefix="vmstash-weights-bench-")
    os.chmod(d, 0o700)
    daemon = os.environ.get("VMSTASH_DAEMON") or os.path.join(ROOT, "build", "cmake", "tools", "vmstashd", "vmstashd")
    env = dict(os.environ, VMSTASH_RUNTIME_DIR=d, VMSTASH_DAEMON=daemon)
    env.pop("VMSTASH_CONF", None)
    common = ["--gib", str(gib), "--tensors", str(tensors), "--steps", str(args.steps)]
    # On the node pool (its chunks exportable too), sized for the backup and some slack.
    conf = f"node:1,node_capacity:{gib + 2}G"
    r = subprocess.Popen([sys.executable, HERE, "--role", "rollout", *common], env=dict(env, VMSTASH_CONF=conf),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    t = None
    try:
        first = r.stdout.readline()
        if not first:
            raise SystemExit(f"the rollout ended before it was ready (exit {r.wait()})")
        ready = json.loads(first)
        t = subprocess.Popen([sys.executable, HERE, "--role", "trainer", "--rollout-pid", str(ready["ready"]), *common],
                             env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        while True:  # relay the trainer's requests to the rollout
            line = t.stdout.readline()
            if not line:
                raise SystemExit(f"the trainer ended (exit {t.wait()})")
            msg = json.loads(line)
            if "done" in msg:
                return msg["done"]
            r.stdin.write(msg["ask"] + "\n")
            if "payload" in msg:
                r.stdin.write(msg["payload"] + "\n")
            r.stdin.flush()
            answer = r.stdout.readline()
            if not answer:
                raise SystemExit(f"the rollout ended (exit {r.wait()})")
            t.stdin.write(answer)
            t.stdin.flush()
    finally:
        for p in (t, r):
            if p is not None and p.poll() is None:
                try:
                    p.stdin.write("exit\n")
                    p.stdin.flush()
                    p.wait(timeout=60)
                except (BrokenPipeError, subprocess.TimeoutExpired):
                    p.kill()
        stop_daemon(d)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["rollout", "trainer"])
    ap.add_argument("--rollout-pid")
    ap.add_argument("--gib", type=int)
    ap.add_argument("--tensors", type=int)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--sizes", default="8:512,4:2048")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.role == "rollout":
        return rollout(args)
    if args.role == "trainer":
        return trainer(args)
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step and the steady ones)")
    import torch
    report = {"device": torch.cuda.get_device_name(0), "steps": args.steps, "sizes": []}
    print(f"device: {report['device']}")
    for spec in args.sizes.split(","):
        gib, tensors = (int(x) for x in spec.split(":"))
        ms = run_size(gib, tensors, args)
        nbytes = gib * GiB
        row = {"gib": gib, "tensors": tensors, "ms": ms}
        steady = {k: statistics.median(v[1:]) for k, v in ms.items()}
        row["steady_ms"] = steady
        row["first_ms"] = {k: v[0] for k, v in ms.items()}
        row["gbps"] = {k: nbytes / (v * 1e-3) / 1e9 for k, v in steady.items()}
        row["vmstash_vs_same_process"] = steady["same_process"] / steady["vmstash"]
        row["vmstash_vs_ipc"] = steady["ipc"] / steady["vmstash"]
        row["vmstash_vs_ipc_first"] = row["first_ms"]["ipc"] / row["first_ms"]["vmstash"]
        row["vmstash_vs_flat_copy"] = steady["flat_copy"] / steady["vmstash"]
        row["vmstash_unplanned_vs_same_process"] = steady["same_process"] / steady["vmstash_unplanned"]
        row["vmstash_paused_vs_pinned_link"] = steady["pinned_link"] / steady["vmstash_paused"]
        report["sizes"].append(row)
        print(f"{gib} GiB in {tensors} tensors (median of steps 2..{args.steps}; first step in brackets):")
        for k in ("vmstash", "vmstash_unplanned", "ipc", "same_process", "flat_copy", "vmstash_paused",
                  "pinned_link"):
            print(f"  {k:17s} {steady[k]:9.2f} ms  {row['gbps'][k]:7.1f} GB/s   [first {row['first_ms'][k]:9.2f} ms]")
        print(f"  vmstash / same_process bandwidth {row['vmstash_vs_same_process']:.3f}; ipc / vmstash time "
              f"{row['vmstash_vs_ipc']:.2f}x (first step {row['vmstash_vs_ipc_first']:.2f}x); vmstash / flat copy "
              f"bandwidth {row['vmstash_vs_flat_copy']:.3f}; unplanned / same_process bandwidth "
              f"{row['vmstash_unplanned_vs_same_process']:.3f}; paused / pinned link bandwidth "
              f"{row['vmstash_paused_vs_pinned_link']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
