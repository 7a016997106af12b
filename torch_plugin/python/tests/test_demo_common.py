"""CPU test of what the RL demo and its peer run decide and print (vmstash/demo/common.py):
the memory and speed verdicts at their edges, the switch lines, the per-direction summary
with its outliers, and the timeline plot."""
import os
import sys
import tempfile
import unittest
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vmstash.demo import common as c  # noqa: E402

GiB = 1 << 30


def record(label="rollout", freed=10 * GiB, reserved=10 * GiB, time_s=0.15, pause=None, resume=None, sync=None):
    # 4 GiB backed up at 40 GiB/s and 1 GiB restored at 50 GiB/s: bound 0.1 + 0.02 + 0.01 = 0.13 s.
    return c.switch_record(label, ["optimizer"], ["weights"], reserved, freed, 4 * GiB, 1 * GiB, 40 * GiB, 50 * GiB,
                           time_s, pause, resume, sync_s=sync)


def direction(times, label="rollout"):
    _, out = c.summarize("vmstash", [record(label, time_s=t) for t in times], {})
    return out


class VerdictTest(unittest.TestCase):
    def test_bound_is_bytes_over_bandwidth_plus_10_ms(self):
        self.assertAlmostEqual(record()["bound"], 0.13)

    def test_memory_released_edge(self):
        self.assertEqual(c.memory_failures(record(freed=0.95 * 10 * GiB)), [])
        failures = c.memory_failures(record(freed=0.94 * 10 * GiB))
        self.assertEqual(len(failures), 1)
        self.assertIn("95%", failures[0])

    def test_speed_fails_only_on_the_median_past_the_margin(self):
        self.assertEqual(c.SPEED_MARGIN, 1.5)
        self.assertEqual(c.speed_failures(direction([0.15, 0.19, 0.195])), [])  # median 1.46x
        failures = c.speed_failures(direction([0.15, 0.196, 0.2]))               # median 1.51x
        self.assertEqual(len(failures), 1)
        self.assertIn("to rollout", failures[0])
        self.assertIn("1.5 x bound 130.0 ms", failures[0])

    def test_one_slow_switch_is_named_not_failed(self):
        times = [0.12] * 9 + [0.5]  # one switch at 3.8x its bound on a busy machine
        out = direction(times)
        self.assertEqual(c.speed_failures(out), [])
        self.assertEqual(out["directions"]["rollout"]["outliers"], [(10, 500.0)])
        lines, _ = c.summarize("vmstash", [record(time_s=t) for t in times], {})
        self.assertIn("over 1.1x bound: #10 500.0 ms", lines[0])

    def test_each_direction_is_judged_on_its_own(self):
        switches = [record("training", time_s=0.12)] * 3 + [record("rollout", time_s=0.3)] * 3
        _, out = c.summarize("vmstash", switches, {})
        failures = c.speed_failures(out)
        self.assertEqual(len(failures), 1)
        self.assertIn("to rollout", failures[0])


class LineTest(unittest.TestCase):
    def test_a_switch_reports_its_own_time_and_both_directions(self):
        line = c.switch_line(record(time_s=0.15, sync=0.0011))
        for part in ("switch to rollout", "out optimizer (4.00 GiB backed up)", "in weights (1.00 GiB restored)",
                     "(100.0%)", "150.0 ms vs bound 130.0 ms (1.15x)", "one switch() transaction",
                     "33.3 GiB/s both ways together", "weight sync 1.1 ms"):
            self.assertIn(part, line)
        self.assertNotIn("resume", line)  # no side of a transaction is made up

    def test_sequential_sides_have_their_own_times_and_rates(self):
        line = c.switch_line(record(time_s=0.15, pause=0.1, resume=0.05))
        self.assertIn("150.0 ms vs bound", line)
        self.assertIn("pause 100.0 ms (40.0 GiB/s) then resume 50.0 ms (20.0 GiB/s)", line)

    def test_no_rate_without_bytes_or_time(self):
        r = c.switch_record("rollout", ["kv"], [], GiB, GiB, 0, 0, 40 * GiB, 50 * GiB, 0.001, 0.001, 0.0)
        line = c.switch_line(r)
        self.assertIn("pause 1.0 ms (-) then resume 0.0 ms (-)", line)
        self.assertNotIn("GiB/s)", line)


class SummaryTest(unittest.TestCase):
    def test_per_direction_median_p90_max(self):
        switches = [record("rollout", time_s=t) for t in (0.11, 0.12, 0.14, 0.10, 0.13)]
        switches.append(record("training", freed=9.6 * GiB, time_s=0.07))
        lines, out = c.summarize("vmstash", switches, {"rollout": 3 * GiB, "training": 18 * GiB})
        r = out["directions"]["rollout"]
        self.assertEqual(r["switches"], 5)
        self.assertAlmostEqual(r["median_ms"], 120.0)
        self.assertAlmostEqual(r["p90_ms"], 140.0)
        self.assertAlmostEqual(r["max_ms"], 140.0)
        self.assertEqual(r["outliers"], [])
        self.assertAlmostEqual(out["directions"]["training"]["min_freed_share"], 0.96)
        self.assertEqual(len(lines), 3)
        self.assertIn("median 120.0 ms (0.92x bound), p90 140.0 ms, max 140.0 ms vs bound 130.0 ms", lines[0])
        self.assertIn("over 1.1x bound: none", lines[0])
        self.assertIn("rollout 3.00 GiB, training 18.00 GiB", lines[-1])

    def test_percentile_is_nearest_rank(self):
        self.assertEqual(c.percentile([5], 0.9), 5)
        self.assertEqual(c.percentile(list(range(1, 11)), 0.9), 9)
        self.assertEqual(c.percentile(list(range(1, 21)), 0.9), 18)
        self.assertEqual(c.percentile([3, 1, 2], 1.0), 3)


class SpeedupTest(unittest.TestCase):
    def test_switch_against_the_sequential_path_per_direction(self):
        switches = [record("rollout", time_s=t) for t in (0.10, 0.12, 0.11)]
        switches += [record("rollout (sequential)", time_s=0.1 + r, pause=0.1, resume=r) for r in (0.05, 0.06, 0.07)]
        switches.append(record("training", time_s=0.1))  # no sequential cycle: left out
        out = c.switch_speedups(switches)
        self.assertEqual(set(out), {"rollout"})
        seq_ms, sw_ms = out["rollout"]
        self.assertAlmostEqual(seq_ms, 160.0)
        self.assertAlmostEqual(sw_ms, 110.0)


class TimelineTest(unittest.TestCase):
    def test_svg_is_xml_with_one_point_per_phase(self):
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
        self.assertEqual(len(root.findall(f"{ns}circle")), 6)
        xs = [float(p.split(",")[0]) for p in root.find(f"{ns}polyline").get("points").split()]
        self.assertEqual(len(xs), 12)
        self.assertAlmostEqual(xs[0], 60.0)  # time starts at the first mark, not at the set-up
        self.assertEqual(xs, sorted(xs))


if __name__ == "__main__":
    unittest.main()
