"""Shared by the RL phase-switch demo (rl_phase_switch.py, vmstash) and its peer run
(tms_peer.py, any module with torch_memory_saver's API): the same-run pinned copy
bandwidth, the memory timeline, and the per-switch line and summary both print, so the two
report the same figures the same way. torch is imported where it is used, so the criteria,
the summary and the plot are tested without it (tests/test_demo_common.py)."""
import json
import statistics
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


def switch_record(label, paused, resumed, reserved, freed, pause_s, resume_s, backed, restored, d2h, h2d,
                  sync_s=None):
    """One phase switch; `bound` is issue 8's criterion: backed-up bytes / same-run D2H +
    restored bytes / same-run H2D + 10 ms."""
    return {"label": label, "paused": list(paused), "resumed": list(resumed), "reserved": reserved,
            "freed": freed, "pause": pause_s, "resume": resume_s, "backed": backed, "restored": restored,
            "bound": backed / d2h + restored / h2d + 0.010, "sync": sync_s}


def switch_line(r):
    line = (f"  switch to {r['label']}: paused {'+'.join(r['paused']) or '-'}: released {r['freed'] / GiB:.2f} of "
            f"{r['reserved'] / GiB:.2f} GiB reserved ({100 * r['freed'] / max(r['reserved'], 1):.1f}%), pause "
            f"{1e3 * r['pause']:.1f} ms ({r['backed'] / GiB:.2f} GiB backed up, "
            f"{r['backed'] / GiB / max(r['pause'], 1e-9):.1f} GiB/s); resume {'+'.join(r['resumed']) or '-'} "
            f"{1e3 * r['resume']:.1f} ms ({r['restored'] / GiB:.2f} GiB restored, "
            f"{r['restored'] / GiB / max(r['resume'], 1e-9):.1f} GiB/s); switch {1e3 * (r['pause'] + r['resume']):.1f} "
            f"ms vs bound {1e3 * r['bound']:.1f} ms")
    if r.get("sync") is not None:
        line += f"; weight sync {1e3 * r['sync']:.1f} ms"
    return line


def switch_speedups(switches):
    """Per direction with both paths in the log: (median sequential ms, median switch() ms),
    the sequential path's records being labelled "<direction> (sequential)"."""
    out = {}
    for label in sorted({r["label"] for r in switches if not r["label"].endswith(" (sequential)")}):
        fast = [r["pause"] + r["resume"] for r in switches if r["label"] == label]
        slow = [r["pause"] + r["resume"] for r in switches if r["label"] == label + " (sequential)"]
        if fast and slow:
            out[label] = (1e3 * statistics.median(slow), 1e3 * statistics.median(fast))
    return out


def criteria_failures(r):
    """Issue 8's two done-criteria for one switch, as failure messages."""
    out = []
    if r["freed"] < 0.95 * r["reserved"]:
        out.append(f"{r['label']}: freed {r['freed']} < 95% of {r['reserved']} reserved bytes")
    if r["pause"] + r["resume"] > 1.10 * r["bound"]:
        out.append(f"{r['label']}: switch {r['pause'] + r['resume']:.4f} s > 1.1 x bound {r['bound']:.4f} s")
    return out


def summarize(name, switches, used, used_note=""):
    """Per direction: median/max switch time, the bound, the ratio and the share released;
    `used` maps a phase to GPU bytes in use during it. Returns (lines, dict)."""
    lines, out = [], {"name": name, "used": used, "directions": {}}
    for label in sorted({r["label"] for r in switches}):
        rs = [r for r in switches if r["label"] == label]
        total = [r["pause"] + r["resume"] for r in rs]
        ratio = max(t / r["bound"] for t, r in zip(total, rs))
        freed = min(r["freed"] / max(r["reserved"], 1) for r in rs)
        d = {"switches": len(rs), "median_ms": 1e3 * statistics.median(total), "max_ms": 1e3 * max(total),
             "bound_ms": 1e3 * statistics.median(r["bound"] for r in rs), "worst_ratio": ratio,
             "min_freed_share": freed, "reserved_gib": rs[0]["reserved"] / GiB,
             "backed_gib": rs[0]["backed"] / GiB, "restored_gib": rs[0]["restored"] / GiB}
        out["directions"][label] = d
        lines.append(f"  to {label:9s} {d['switches']:3d} switches: median {d['median_ms']:.1f} ms, max "
                     f"{d['max_ms']:.1f} ms vs bound {d['bound_ms']:.1f} ms (worst {d['worst_ratio']:.2f}x); "
                     f"{d['backed_gib']:.2f} GiB backed up, {d['restored_gib']:.2f} GiB restored; "
                     f"released >= {100 * freed:.1f}% of {d['reserved_gib']:.2f} GiB reserved")
    lines.append(f"  GPU memory in use{' ' + used_note if used_note else ''}: " +
                 ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in used.items()))
    return lines, out


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
