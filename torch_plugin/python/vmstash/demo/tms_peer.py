"""The memory side of the RL phase switch under torch_memory_saver's API: the peer run of
the demo (rl_phase_switch.py), which starts it (inside the module's configure_subprocess()) with the
tag layout it measured.

    python3 -m vmstash.demo.tms_peer --module torch_memory_saver --layout JSON [--cycles 10]

JSON: [{"tag": "weights", "phase": "rollout", "backup": true, "bytes": N}, ...]. Each tag
gets its bytes as 256 MiB tensors allocated in `region(tag, enable_cpu_backup=backup)`;
backed-up tensors hold a pattern checked after every resume. Then the demo's switch order:
to training, pause the rollout tags and resume the training ones; to rollout, resume the
rollout tags and pause the training ones. Tags are paused/resumed one after another (the
API has no concurrent form). No graphs and no compute: this is the cost of the switch for
the same bytes, printed with the demo's figures. `--module vmstash.compat.torch_memory_saver`
runs the same through vmstash's drop-in module.

Judged by the demo's criteria (common.judge(), the same as vmstash's own switches): the
backup tags' bytes unchanged across every pause/resume, at least 95% of the paused tags'
reserved memory released by every switch, every direction's median switch within 1.5x its
bound (backed-up bytes / this run's pinned D2H + restored bytes / its H2D + 10 ms; a switch
over 1.1x is named, not failed on; --speed-not-judged: speed reported, not judged). In
torch_memory_saver's default mode (retain_cpu_backup off) the backup's host memory goes
back to the OS after every resume and must be pinned again by the next pause, so the pause's
rate in the bound is the lower of the D2H link and what the host allows for that (same run:
vmstash.demo.host_rate, the faster of registering that memory again and staging through a
pinned ring; where it cannot be measured, the link alone, said so). Exit
status 0 when it meets them, 1 when it misses them.
Whether that fails the demo is the demo's call (rl_phase_switch.py, --judge-peer).
"""
import argparse
import importlib
import json
import sys
import time

import torch

from vmstash.demo.common import (PEER_CHECKS, SPEED_MARGIN, GiB, host_rate, judge, pinned_bandwidth, summarize,
                                 switch_line, switch_record, verdict_line, write_json)

PIECE = 256 << 20


def pattern(n, seed, device):
    """Deterministic int64 contents (cheap to regenerate for the check)."""
    return torch.arange(n, dtype=torch.int64, device=device).mul_(2654435761).add_(seed)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--module", default="torch_memory_saver")
    ap.add_argument("--layout", required=True)
    ap.add_argument("--cycles", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--speed-not-judged", action="store_true", help="report the speed criteria, not judge them")
    args = ap.parse_args()
    layout = json.loads(args.layout)
    if not isinstance(layout, list) or not all({"tag", "phase", "backup", "bytes"} <= set(t) for t in layout):
        raise SystemExit("--layout: a JSON list of {tag, phase, backup, bytes}")
    tms = importlib.import_module(args.module).torch_memory_saver
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    d2h, h2d = pinned_bandwidth(dev)
    print(f"{args.module} on {torch.cuda.get_device_name(0)}: pinned copy D2H {d2h / GiB:.1f} GiB/s, "
          f"H2D {h2d / GiB:.1f} GiB/s (same run)", flush=True)
    out_rate, host = d2h, None
    if not getattr(tms, "retain_cpu_backup", False):
        host = host_rate(dev.index or 0)
        if "rate" in host:
            out_rate = min(d2h, host["rate"])
            print(f"  default mode (retain_cpu_backup off): a D2H into memory handed back after the last resume "
                  f"{host['rate'] / GiB:.1f} GiB/s (registered again {host['inline'] / GiB:.1f}, staged "
                  f"{host['staged'] / GiB:.1f}; same run, vmstash.demo.host_rate); a pause's bound uses "
                  f"{out_rate / GiB:.1f} GiB/s", flush=True)
        else:
            print(f"  default mode (retain_cpu_backup off): the host's rate into memory handed back could not be "
                  f"measured ({host['error']}); a pause's bound uses the link", flush=True)

    free, total = torch.cuda.mem_get_info()
    baseline = total - free  # the context and whatever else runs on the GPU; not counted below
    tensors = {}
    for i, t in enumerate(layout):
        pieces, left = [], int(t["bytes"])
        with tms.region(tag=t["tag"], enable_cpu_backup=bool(t["backup"])):
            while left > 0:
                n = min(left, PIECE) // 8 or 1
                pieces.append(pattern(n, 1000 * i + len(pieces), dev) if t["backup"]
                              else torch.empty(n, dtype=torch.int64, device=dev))
                left -= n * 8
        tensors[t["tag"]] = pieces
    torch.cuda.synchronize()
    size = {t["tag"]: sum(p.numel() * 8 for p in tensors[t["tag"]]) for t in layout}
    backup = {t["tag"]: bool(t["backup"]) for t in layout}
    rollout = [t["tag"] for t in layout if t["phase"] == "rollout"]
    training = [t["tag"] for t in layout if t["phase"] == "training"]
    failures, switches, used = [], [], {}

    def verify(tags, label):
        for i, t in enumerate(layout):
            if t["tag"] in tags and t["backup"]:
                for j, p in enumerate(tensors[t["tag"]]):
                    if not torch.equal(p, pattern(p.numel(), 1000 * i + j, dev)):
                        failures.append(f"{label}: tag {t['tag']} piece {j} changed across pause/resume")

    def switch(label, pause_first, resume_first):
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        for tag in pause_first:
            tms.pause(tag)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        for tag in resume_first:
            tms.resume(tag)
        torch.cuda.synchronize()  # whatever the resume left queued counts as resume time
        t2 = time.perf_counter()
        later = training if label == "rollout" else []
        for tag in later:
            tms.pause(tag)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        paused = list(pause_first) + later
        resumed_bytes = sum(size[t] for t in resume_first)
        freed = torch.cuda.mem_get_info()[0] - free0 + resumed_bytes
        r = switch_record(label, paused, resume_first, sum(size[t] for t in paused), freed,
                          sum(size[t] for t in paused if backup[t]), sum(size[t] for t in resume_first if backup[t]),
                          out_rate, h2d, t3 - t0, (t1 - t0) + (t3 - t2), t2 - t1)
        switches.append(r)
        print(switch_line(r), flush=True)
        verify(resume_first, f"to {label}")
        free, total = torch.cuda.mem_get_info()
        used[label] = total - free - baseline

    for tag in training:  # start in the rollout phase, as the demo does
        tms.pause(tag)
    for cycle in range(args.cycles):
        switch("training", rollout, training)
        switch("rollout", [], rollout)
        print(f"cycle {cycle}: rollout used {used['rollout'] / GiB:.2f} GiB, training {used['training'] / GiB:.2f} "
              f"GiB", flush=True)
    lines, summary = summarize(args.module, switches, used, "above this process's start")
    print("\n".join(lines))
    verdict = judge(args.module, switches, failures, checks=PEER_CHECKS, judge_speed=not args.speed_not_judged)
    head = (f"{args.module} (same tag bytes, no compute, tags one after another): {len(failures)} data mismatches, "
            f"{len(verdict['memory'])} switches releasing < 95%, {len(verdict['speed'])} directions with a median "
            f"over {SPEED_MARGIN:g}x their bound")
    summary.update(lines=[head] + lines, d2h=d2h, h2d=h2d, host_rate=host, failures=failures,
                   switch_log=switches, verdict=verdict)
    if args.json:
        write_json(args.json, summary)
    print(verdict_line(verdict))
    return 0 if verdict["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
