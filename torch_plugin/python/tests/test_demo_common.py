"""CPU test of what the RL demo and its peer run decide and print (vmstash/demo/common.py):
issue 8's two criteria at their edges, the per-direction summary, and the timeline plot."""
import os
import sys
import tempfile
import unittest
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vmstash.demo import common as c  # noqa: E402

GiB = 1 << 30


def record(label="rollout", freed=10 * GiB, reserved=10 * GiB, pause=0.1, resume=0.05):
    # 4 GiB backed up at 40 GiB/s and 1 GiB restored at 50 GiB/s: bound 0.1 + 0.02 + 0.01 = 0.13 s.
    return c.switch_record(label, ["optimizer"], ["weights"], reserved, freed, pause, resume, 4 * GiB, 1 * GiB,
                           40 * GiB, 50 * GiB)


class CriteriaTest(unittest.TestCase):
    def test_bound_is_bytes_over_bandwidth_plus_10_ms(self):
        self.assertAlmostEqual(record()["bound"], 0.13)

    def test_memory_released_edge(self):
        self.assertEqual(c.criteria_failures(record(freed=0.95 * 10 * GiB, pause=0.05, resume=0.05)), [])
        failures = c.criteria_failures(record(freed=0.94 * 10 * GiB, pause=0.05, resume=0.05))
        self.assertEqual(len(failures), 1)
        self.assertIn("95%", failures[0])

    def test_switch_time_edge(self):
        self.assertEqual(c.criteria_failures(record(pause=0.143 - 0.05, resume=0.05)), [])  # 1.10 x 0.13
        failures = c.criteria_failures(record(pause=0.144 - 0.05, resume=0.05))
        self.assertEqual(len(failures), 1)
        self.assertIn("1.1 x bound", failures[0])

    def test_line_names_tags_times_and_bound(self):
        line = c.switch_line(dict(record(), sync=0.0011))
        for part in ("switch to rollout", "paused optimizer", "resume weights", "150.0 ms", "bound 130.0 ms",
                     "weight sync 1.1 ms", "(100.0%)"):
            self.assertIn(part, line)


class SummaryTest(unittest.TestCase):
    def test_per_direction_median_max_and_worst(self):
        switches = [record("rollout", pause=p, resume=0.05) for p in (0.06, 0.07, 0.09)]
        switches.append(record("training", freed=9.6 * GiB, pause=0.02, resume=0.05))
        lines, out = c.summarize("vmstash", switches, {"rollout": 3 * GiB, "training": 18 * GiB})
        r = out["directions"]["rollout"]
        self.assertEqual(r["switches"], 3)
        self.assertAlmostEqual(r["median_ms"], 120.0)
        self.assertAlmostEqual(r["max_ms"], 140.0)
        self.assertAlmostEqual(r["worst_ratio"], 0.14 / 0.13)
        self.assertAlmostEqual(out["directions"]["training"]["min_freed_share"], 0.96)
        self.assertEqual(len(lines), 3)
        self.assertIn("rollout 3.00 GiB, training 18.00 GiB", lines[-1])


class SpeedupTest(unittest.TestCase):
    def test_switch_against_the_sequential_path_per_direction(self):
        switches = [record("rollout", pause=p, resume=0.0) for p in (0.10, 0.12, 0.11)]
        switches += [record("rollout (sequential)", pause=0.1, resume=r) for r in (0.05, 0.06, 0.07)]
        switches.append(record("training", pause=0.1, resume=0.0))  # no sequential cycle: left out
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
