"""CPU test of what the RL demo and its peer run decide and print (vmstash/demo/common.py):
the memory and speed verdicts at their edges, the switch lines, the per-direction summary
with its outliers, and the timeline plot."""
import os
import sys
import tempfile
import xml.etree.ElementTree as ET

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vmstash.demo import common as c  # noqa: E402

GiB = 1 << 30


def approx(expected):
    """unittest's assertAlmostEqual: equal to 7 decimal places."""
    return pytest.approx(expected, rel=0, abs=5e-8)


def record(label="rollout", freed=10 * GiB, reserved=10 * GiB, time_s=0.15, pause=None, resume=None, sync=None):
    # 4 GiB backed up at 40 GiB/s and 1 GiB restored at 50 GiB/s: bound 0.1 + 0.02 + 0.01 = 0.13 s.
    return c.switch_record(label, ["optimizer"], ["weights"], reserved, freed, 4 * GiB, 1 * GiB, 40 * GiB, 50 * GiB,
                           time_s, pause, resume, sync_s=sync)


def direction(times, label="rollout"):
    _, out = c.summarize("vmstash", [record(label, time_s=t) for t in times], {})
    return out


# --- Verdict --------------------------------------------------------------------------
def test_bound_is_bytes_over_bandwidth_plus_10_ms():
    assert record()["bound"] == approx(0.13)


def test_memory_released_edge():
    assert c.memory_failures(record(freed=0.95 * 10 * GiB)) == []
    failures = c.memory_failures(record(freed=0.94 * 10 * GiB))
    assert len(failures) == 1
    assert "95%" in failures[0]


def test_speed_fails_only_on_the_median_past_the_margin():
    assert c.SPEED_MARGIN == 1.5
    assert c.speed_failures(direction([0.15, 0.19, 0.195])) == []  # median 1.46x
    failures = c.speed_failures(direction([0.15, 0.196, 0.2]))  # median 1.51x
    assert len(failures) == 1
    assert "to rollout" in failures[0]
    assert "1.5 x bound 130.0 ms" in failures[0]


def test_one_slow_switch_is_named_not_failed():
    times = [0.12] * 9 + [0.5]  # one switch at 3.8x its bound on a busy machine
    out = direction(times)
    assert c.speed_failures(out) == []
    assert out["directions"]["rollout"]["outliers"] == [(10, 500.0)]
    lines, _ = c.summarize("vmstash", [record(time_s=t) for t in times], {})
    assert "over 1.1x bound: #10 500.0 ms" in lines[0]


def test_each_direction_is_judged_on_its_own():
    switches = [record("training", time_s=0.12)] * 3 + [record("rollout", time_s=0.3)] * 3
    _, out = c.summarize("vmstash", switches, {})
    failures = c.speed_failures(out)
    assert len(failures) == 1
    assert "to rollout" in failures[0]


# --- Line -----------------------------------------------------------------------------
def test_a_switch_reports_its_own_time_and_both_directions():
    line = c.switch_line(record(time_s=0.15, sync=0.0011))
    for part in ("switch to rollout", "out optimizer (4.00 GiB backed up)", "in weights (1.00 GiB restored)",
                 "(100.0%)", "150.0 ms vs bound 130.0 ms (1.15x)", "one switch() transaction",
                 "33.3 GiB/s both ways together", "weight sync 1.1 ms"):
        assert part in line
    assert "resume" not in line  # no side of a transaction is made up


def test_sequential_sides_have_their_own_times_and_rates():
    line = c.switch_line(record(time_s=0.15, pause=0.1, resume=0.05))
    assert "150.0 ms vs bound" in line
    assert "pause 100.0 ms (40.0 GiB/s) then resume 50.0 ms (20.0 GiB/s)" in line


def test_no_rate_without_bytes_or_time():
    r = c.switch_record("rollout", ["kv"], [], GiB, GiB, 0, 0, 40 * GiB, 50 * GiB, 0.001, 0.001, 0.0)
    line = c.switch_line(r)
    assert "pause 1.0 ms (-) then resume 0.0 ms (-)" in line
    assert "GiB/s)" not in line


# --- Summary --------------------------------------------------------------------------
def test_per_direction_median_p90_max():
    switches = [record("rollout", time_s=t) for t in (0.11, 0.12, 0.14, 0.10, 0.13)]
    switches.append(record("training", freed=9.6 * GiB, time_s=0.07))
    lines, out = c.summarize("vmstash", switches, {"rollout": 3 * GiB, "training": 18 * GiB})
    r = out["directions"]["rollout"]
    assert r["switches"] == 5
    assert r["median_ms"] == approx(120.0)
    assert r["p90_ms"] == approx(140.0)
    assert r["max_ms"] == approx(140.0)
    assert r["outliers"] == []
    assert out["directions"]["training"]["min_freed_share"] == approx(0.96)
    assert len(lines) == 3
    assert "median 120.0 ms (0.92x bound), p90 140.0 ms, max 140.0 ms vs bound 130.0 ms" in lines[0]
    assert "over 1.1x bound: none" in lines[0]
    assert "rollout 3.00 GiB, training 18.00 GiB" in lines[-1]


def test_percentile_is_nearest_rank():
    assert c.percentile([5], 0.9) == 5
    assert c.percentile(list(range(1, 11)), 0.9) == 9
    assert c.percentile(list(range(1, 21)), 0.9) == 18
    assert c.percentile([3, 1, 2], 1.0) == 3


# --- Speedup --------------------------------------------------------------------------
def test_switch_against_the_sequential_path_per_direction():
    switches = [record("rollout", time_s=t) for t in (0.10, 0.12, 0.11)]
    switches += [record("rollout (sequential)", time_s=0.1 + r, pause=0.1, resume=r) for r in (0.05, 0.06, 0.07)]
    switches.append(record("training", time_s=0.1))  # no sequential cycle: left out
    out = c.switch_speedups(switches)
    assert set(out) == {"rollout"}
    seq_ms, sw_ms = out["rollout"]
    assert seq_ms == approx(160.0)
    assert sw_ms == approx(110.0)


# --- Timeline -------------------------------------------------------------------------
def test_svg_is_xml_with_one_point_per_phase():
    t = c.Timeline.__new__(c.Timeline)
    t.points = []
    for k in range(3):
        at = 20.0 + k
        t.points += [(at, 3.8, f"rollout {k}"), (at + 0.2, 1.6, "switched to training"),
                     (at + 0.5, 18.8, f"train {k}"), (at + 0.9, 3.0, "switched to rollout")]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.svg")
        t.svg(path)
        root = ET.parse(path).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    assert len(root.findall(f"{ns}circle")) == 6
    xs = [float(p.split(",")[0]) for p in root.find(f"{ns}polyline").get("points").split()]
    assert len(xs) == 12
    assert xs[0] == approx(60.0)  # time starts at the first mark, not at the set-up
    assert xs == sorted(xs)

