"""Shared by the RL phase-switch demo (rl_phase_switch.py, vmstash) and its peer run
(tms_peer.py, any module with torch_memory_saver's API): the same-run pinned copy
bandwidth, the memory timeline, and the per-switch line and summary both print, so the two
report the same figures the same way, and judge() and final_verdict(): the one place that
decides the criteria, for vmstash's switches and for every peer's alike. torch is imported
where it is used, so the criteria, the verdict, the summary and the plot are tested without
it (tests/test_demo_common.py)."""
import json
import math
import statistics
import sys
import time

GiB = float(1 << 30)


def pinned_bandwidth(device):
    """(D2H, H2D) bytes/s of 1 GiB pinned copies, best of 3."""
    import torch
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    best = [1e9, 1e9]
    for _ in range(3):
        for i, (dst, s) in enumerate(((host, src), (src, host))):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(s, non_blocking=True)
            torch.cuda.synchronize()
            best[i] = min(best[i], time.perf_counter() - t0)
    del src, host
    return (1 << 30) / best[0], (1 << 30) / best[1]


def host_rate(device_index=0, gib=4, timeout=300):
    """What the host allows a pause into backup memory handed back to the OS after the last
    resume (vmstash.demo.host_rate, in a process of its own without vmstash's preload
    library): {"inline", "staged", "rate"} in bytes/s, or {"error": why}. Never raises."""
    import os
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    cmd = [sys.executable, "-m", "vmstash.demo.host_rate", "--device", str(device_index), "--gib", str(gib)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    lines = p.stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1]) if lines else None
    except ValueError:
        out = None
    if not isinstance(out, dict) or ("rate" not in out and "error" not in out):
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or [f"exit status {p.returncode}"]
        return {"error": f"vmstash.demo.host_rate printed no result: {tail[0]}"}
    return out


# A direction fails on speed only when its median switch is over this multiple of its
# bound: one slow switch on a shared machine is named, not failed on.
SPEED_MARGIN = 1.5
# A switch over this multiple of its bound is named as an outlier in the summary.
OUTLIER = 1.1


def switch_record(label, paused, resumed, reserved, freed, backed, restored, d2h, h2d, time_s, pause_s=None,
                  resume_s=None, sync_s=None):
    """One phase switch. `time_s` is its whole time; `pause_s` and `resume_s` are given
    only where the two sides ran one after the other (a switch() moves both directions in
    one transaction, so it has no separate sides). `bound`: backed-up bytes / same-run D2H
    + restored bytes / same-run H2D + 10 ms; for a backup whose memory goes back to the OS
    after every resume, `d2h` is the lower of the D2H rate and host_rate()'s."""
    return {"label": label, "paused": list(paused), "resumed": list(resumed), "reserved": reserved,
            "freed": freed, "time": time_s, "pause": pause_s, "resume": resume_s, "backed": backed,
            "restored": restored, "bound": backed / d2h + restored / h2d + 0.010, "sync": sync_s}


def _rate(nbytes, seconds):
    return f"{nbytes / GiB / seconds:.1f} GiB/s" if nbytes and seconds > 0 else "-"


def switch_line(r):
    """What moved each way, what was released, and the switch's own time against its bound."""
    t = r["time"]
    if r["pause"] is None:
        how = f"one switch() transaction, {_rate(r['backed'] + r['restored'], t)} both ways together"
    else:
        how = (f"pause {1e3 * r['pause']:.1f} ms ({_rate(r['backed'], r['pause'])}) then resume "
               f"{1e3 * r['resume']:.1f} ms ({_rate(r['restored'], r['resume'])})")
    line = (f"  switch to {r['label']}: out {'+'.join(r['paused']) or '-'} ({r['backed'] / GiB:.2f} GiB backed up), "
            f"in {'+'.join(r['resumed']) or '-'} ({r['restored'] / GiB:.2f} GiB restored); released "
            f"{r['freed'] / GiB:.2f} of {r['reserved'] / GiB:.2f} GiB reserved "
            f"({100 * r['freed'] / max(r['reserved'], 1):.1f}%); {1e3 * t:.1f} ms vs bound "
            f"{1e3 * r['bound']:.1f} ms ({t / r['bound']:.2f}x): {how}")
    if r.get("sync") is not None:
        line += f"; weight sync {1e3 * r['sync']:.1f} ms (not counted)"
    return line


def switch_speedups(switches):
    """Per direction with both paths in the log: (median sequential ms, median switch() ms),
    the sequential path's records being labelled "<direction> (sequential)"."""
    out = {}
    for label in sorted({r["label"] for r in switches if not r["label"].endswith(" (sequential)")}):
        fast = [r["time"] for r in switches if r["label"] == label]
        slow = [r["time"] for r in switches if r["label"] == label + " (sequential)"]
        if fast and slow:
            out[label] = (1e3 * statistics.median(slow), 1e3 * statistics.median(fast))
    return out


def memory_failures(r):
    """A switch that released less than 95% of the paused tags' reserved bytes."""
    if r["freed"] < 0.95 * r["reserved"]:
        return [f"{r['label']}: released {r['freed']} < 95% of {r['reserved']} reserved bytes"]
    return []


def percentile(values, q):
    """Nearest-rank percentile (q in (0, 1]) of a non-empty list: always one of the values."""
    v = sorted(values)
    return v[max(0, math.ceil(q * len(v)) - 1)]


def speed_failures(summary, margin=SPEED_MARGIN):
    """Directions whose median switch is over `margin` x their bound: speed clearly broken.
    Each names the direction, its median (and its multiple of the bound), the bound, p90, max."""
    return [f"to {label}: median switch {d['median_ms']:.1f} ms ({d['median_ms'] / d['bound_ms']:.2f}x) > "
            f"{margin:g} x bound {d['bound_ms']:.1f} ms (p90 {d['p90_ms']:.1f} ms, max {d['max_ms']:.1f} ms, "
            f"{d['switches']} switches)"
            for label, d in summary["directions"].items() if d["median_ms"] > margin * d["bound_ms"]]


def directions(switches):
    """Per direction (a switch's label): its switches, median, p90 and max time and the median
    bound (ms), the outliers by number (over OUTLIER x their own bound), bytes moved and the
    least share released."""
    out = {}
    for label in sorted({r["label"] for r in switches}):
        rs = [r for r in switches if r["label"] == label]
        total = [r["time"] for r in rs]
        outliers = [(i + 1, 1e3 * r["time"]) for i, r in enumerate(rs) if r["time"] > OUTLIER * r["bound"]]
        out[label] = {"switches": len(rs), "median_ms": 1e3 * statistics.median(total),
                      "p90_ms": 1e3 * percentile(total, 0.9), "max_ms": 1e3 * max(total),
                      "bound_ms": 1e3 * statistics.median(r["bound"] for r in rs), "outliers": outliers,
                      "min_freed_share": min(r["freed"] / max(r["reserved"], 1) for r in rs),
                      "reserved_gib": rs[0]["reserved"] / GiB, "backed_gib": rs[0]["backed"] / GiB,
                      "restored_gib": rs[0]["restored"] / GiB}
    return out


def summarize(name, switches, used, used_note=""):
    """Per direction (directions()): median, p90 and max switch time against the bound, the
    outliers, bytes moved and the share released; `used` maps a phase to GPU bytes in use
    during it. Returns (lines, dict)."""
    lines, out = [], {"name": name, "used": used, "directions": directions(switches)}
    for label, d in out["directions"].items():
        outliers = d["outliers"]
        named = ", ".join(f"#{i} {ms:.1f} ms" for i, ms in outliers) or "none"
        lines.append(f"  to {label:9s} {d['switches']:3d} switches: median {d['median_ms']:.1f} ms "
                     f"({d['median_ms'] / d['bound_ms']:.2f}x bound), p90 {d['p90_ms']:.1f} ms, max "
                     f"{d['max_ms']:.1f} ms vs bound {d['bound_ms']:.1f} ms; over {OUTLIER:g}x bound: {named}; "
                     f"{d['backed_gib']:.2f} GiB backed up, {d['restored_gib']:.2f} GiB restored; released >= "
                     f"{100 * d['min_freed_share']:.1f}% of {d['reserved_gib']:.2f} GiB reserved")
    lines.append(f"  GPU memory in use{' ' + used_note if used_note else ''}: " +
                 ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in used.items()))
    return lines, out


# --- The verdict: one set of criteria for vmstash and for every peer ------------------------
# What the vmstash run's data checks cover, and what a peer run's do (it has no compute).
VMSTASH_CHECKS = "replays, backup bytes across every switch, addresses, memory released"
PEER_CHECKS = "backup bytes across every switch, memory released"


def judge(name, switches, data_failures=(), errors=(), checks=VMSTASH_CHECKS, judge_speed=True):
    """The demo's criteria, the same for vmstash's switches and for a peer's: a run misses
    them on an error (it did not run, or recorded no switch), on wrong data (`data_failures`:
    what its own checks found), on memory (a switch that released less than 95% of the
    paused tags' reserved bytes: memory_failures) or on speed (a direction whose median
    switch is over SPEED_MARGIN x its bound: speed_failures; the bound is switch_record's).
    A switch over OUTLIER x its bound is named (`outliers`), never failed on. With
    `judge_speed` False (a test: it judges correctness, not the timing of a shared machine)
    the speed misses are reported, not failed on. Returns the verdict: a dict with `passed`
    and every reason in `failures`, each prefixed with `name`, and `met` (every criterion
    met, speed included, whether judged or not)."""
    errors = list(errors) or ([] if switches else ["no switch recorded"])
    per_direction = directions(switches)
    v = {"name": name, "checks": checks, "errors": errors, "data": list(data_failures),
         "memory": [m for r in switches for m in memory_failures(r)],
         "speed": speed_failures({"directions": per_direction}),
         "outliers": {label: d["outliers"] for label, d in per_direction.items() if d["outliers"]}}
    v["speed_judged"] = judge_speed
    v["failures"] = [f"{name}: {m}" for m in v["errors"] + v["data"] + v["memory"] + (v["speed"] if judge_speed else [])]
    v["passed"] = not v["failures"]
    v["met"] = v["passed"] and not v["speed"]
    return v


def served_by_vmstash(module_name, module=None):
    """Whether a peer module is vmstash's own code path: a vmstash module by name (e.g.
    vmstash.compat.torch_memory_saver), or a module whose torch_memory_saver object is
    vmstash's (the drop-in wheel installs one under the name torch_memory_saver)."""
    if module_name == "vmstash" or module_name.startswith("vmstash."):
        return True
    if module is None:
        return False
    if getattr(module, "served_by", None) == "vmstash":
        return True
    return type(getattr(module, "torch_memory_saver", None)).__module__.split(".")[0] == "vmstash"


def peer_verdict(peer, judge_foreign=False, judge_speed=True):
    """A peer run's verdict: judge() on its switch log and data failures (the tms_peer JSON),
    or its error. `judged`: whether it decides the run's verdict: always for vmstash's own
    code path (peer["vmstash"], served_by_vmstash), for another module only with
    `judge_foreign` (--judge-peer). A child that exits other than 0 (within the criteria)
    or 1 (outside them) after writing its figures is an error: the child judges as the
    parent does (`judge_speed`, judge()'s; the demo passes --speed-not-judged on)."""
    name, errors = peer["name"], []
    if peer.get("error"):
        errors.append(peer["error"])
    v = judge(f"peer {name}", peer.get("switch_log", []), peer.get("failures", []), errors, PEER_CHECKS, judge_speed)
    rc = peer.get("exit_code")
    if rc is not None and rc != (0 if v["passed"] else 1):
        v["errors"].append(f"the child exited with {rc}")
        v["failures"].append(f"peer {name}: the child exited with {rc}")
        v["passed"] = v["met"] = False
    own = peer.get("vmstash", served_by_vmstash(name))
    v.update(module=name, vmstash=own, judged=own or judge_foreign,
             role="vmstash's own code path, judged" if own else
             ("another module, judged (--judge-peer)" if judge_foreign else
              "another module: a comparison, not judged; --judge-peer judges it"))
    return v


def _reasons(items, most=3):
    return "; ".join(items[:most]) + (f"; +{len(items) - most} more" if len(items) > most else "")


def verdict_line(v):
    """One run's verdict (vmstash's or a peer's): met or missed, its data and speed checks,
    the outliers named."""
    who = v["name"] + (f" ({v['role']})" if "role" in v else "")
    if v["errors"]:
        return f"verdict {who}: MISSED the criteria: {_reasons(v['errors'])}"
    bad = v["data"] + v["memory"]
    met = "meets the criteria" if v.get("met", v["passed"]) else "meets the judged criteria"
    line = (f"verdict {who}: {met if v['passed'] else 'MISSED the criteria'}: data ({v['checks']}: "
            f"{len(bad)} failures{': ' + _reasons(bad) if bad else ''}); speed (every direction's median within "
            f"{SPEED_MARGIN:g}x its bound: {'yes' if not v['speed'] else 'no: ' + _reasons(v['speed'])}"
            f"{'' if v.get('speed_judged', True) else '; reported, not judged'})")
    named = sum(len(o) for o in v["outliers"].values())
    if named:
        line += f"; {named} switches over {OUTLIER:g}x their bound (named, not failed on)"
    return line


def final_verdict(own, peers):
    """The run's verdict from vmstash's (judge()) and the peers' (peer_verdict()): it fails
    when vmstash misses the criteria or a judged peer does; a peer that is not judged is
    reported only. Returns (lines to print, exit code, the verdict for --json). The last line
    starts with PASSED or FAILED; FAILED names who missed what (direction, figures, bound)."""
    lines = [verdict_line(v) for v in [own] + peers]
    failures = own["failures"] + [f for p in peers if p["judged"] for f in p["failures"]]
    unjudged = [p["module"] for p in peers if not p["judged"] and not p["passed"]]
    out = {"passed": not failures, "exit_code": 1 if failures else 0, "failures": failures,
           "not_judged_missed": unjudged}
    if len(failures) > 1:
        lines.append(f"failures ({len(failures)}):\n  " + "\n  ".join(failures[:20]))
    if failures:
        lines.append(f"FAILED: {_reasons(failures)}")
    else:
        lines.append("PASSED" + (f" ({', '.join(unjudged)}: missed the criteria, a comparison, not judged)"
                                  if unjudged else ""))
    return lines, out["exit_code"], out


def write_json(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


class Timeline:
    """GPU memory in use (cudaMemGetInfo) at labelled points; drawn as an SVG polyline."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.points = []

    def mark(self, label):
        import torch
        free, total = torch.cuda.mem_get_info()
        self.points.append((time.perf_counter() - self.t0, (total - free) / GiB, label))
        return total - free

    def svg(self, path, title="GPU memory in use across RL phase switches (vmstash)"):
        """Time runs from the first mark (the first rollout phase), not from the set-up."""
        w, h, pad = 900, 360, 60
        t0 = min(p[0] for p in self.points)
        span = (max(p[0] for p in self.points) - t0) or 1
        ymax = max(p[1] for p in self.points) * 1.1 or 1
        xy = lambda t, y: (pad + (w - 2 * pad) * (t - t0) / span, h - pad - (h - 2 * pad) * y / ymax)
        pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(t, m) for t, m, _ in self.points))
        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
               f'font-size="11"><rect width="{w}" height="{h}" fill="white"/>',
               f'<text x="{pad}" y="20" font-size="14">{title}</text>',
               f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
               f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>']
        for i in range(5):
            y = ymax * i / 4
            _, py = xy(t0, y)
            out.append(f'<text x="5" y="{py + 4:.1f}">{y:.1f} GiB</text>'
                       f'<line x1="{pad}" y1="{py:.1f}" x2="{w - pad}" y2="{py:.1f}" stroke="#ddd"/>')
        for i in range(6):
            px, _ = xy(t0 + span * i / 5, 0)
            out.append(f'<text x="{px - 10:.1f}" y="{h - pad + 16}">{span * i / 5:.1f} s</text>')
        out.append(f'<text x="{w / 2 - 100:.0f}" y="{h - 12}">seconds from the first rollout phase</text>')
        out.append(f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{pts}"/>')
        for t, m, label in self.points:
            if label.startswith("train") or label.startswith("rollout"):
                x, y = xy(t, m)
                color = "#d62728" if label.startswith("train") else "#2ca02c"
                out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}"/>')
        out.append(f'<text x="{w - 260}" y="40" fill="#2ca02c">● rollout</text>'
                   f'<text x="{w - 180}" y="40" fill="#d62728">● training</text></svg>')
        with open(path, "w") as f:
            f.write("\n".join(out))
