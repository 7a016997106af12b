"""CPU test of the benchmark report's writer (bench/report.py): what it keeps of each
output, what it scrubs, how it renders, and that every benchmark it names exists."""
import contextlib
import io
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402


def _read(path):
    with open(path) as f:
        return f.read()


class ReportTest(unittest.TestCase):
    def test_scrub_removes_machine_paths(self):
        text = (f"timeline: {report.ROOT}/bench/results/x.svg\n"
                "/opt/venv/lib/python3.12/site-packages/torch/autograd/graph.py:869: UserWarning: w\n"
                "/usr/lib/python3/dist-packages/numpy/core.py:1: note")
        out = report.scrub(text)
        self.assertIn("timeline: bench/results/x.svg", out)
        self.assertIn("<site-packages>/torch/autograd/graph.py:869", out)
        self.assertIn("<site-packages>/numpy/core.py:1", out)
        self.assertNotIn("/opt/", out)
        self.assertNotIn(report.ROOT, out)

    def test_headline_patterns_and_ranges(self):
        out = "noise\nSummary (GPU):\n  to rollout 1 ms\nPASSED\nafter\npinned D2H: 55 GB/s\n"
        self.assertEqual(report.headline(out, [r"^pinned"]), ["pinned D2H: 55 GB/s"])
        self.assertEqual(report.headline(out, (r"^Summary", r"^(PASSED|FAILED)")),
                         ["Summary (GPU):", "  to rollout 1 ms", "PASSED"])
        self.assertEqual(report.headline(out, (r"^nothing", r"^PASSED")), [])
        # No end marker (a run cut short): everything from the start marker.
        self.assertEqual(report.headline("Summary\nx", (r"^Summary", r"^PASSED")), ["Summary", "x"])

    def test_render_names_machine_commands_and_missing_runs(self):
        specs = report.benchmarks("build/cmake", True)
        results = {"vmm_bench": {"argv": ["build/cmake/bench/vmm_bench"], "env": {}, "rc": 0, "seconds": 6.2,
                                 "output": "     chunk   chunks\n       2MiB     8192\npinned D2H: 55.3 GB/s"},
                   "pause_bench": {"argv": ["build/cmake/bench/pause_bench", "16"],
                                   "env": {"VMSTASH_DRIVER": "cuda"}, "rc": "timeout", "seconds": 900.0,
                                   "output": "limit: x\n(cut off after 900 s)"}}
        info = {"gpu": "NVIDIA H200, 580, 143771 MiB", "commit": "abc1234"}
        md = report.render(results, specs, info)
        self.assertIn("| gpu | NVIDIA H200, 580, 143771 MiB |", md)
        self.assertIn("| commit | abc1234 |", md)
        self.assertIn("Command: `VMSTASH_DRIVER=cuda build/cmake/bench/pause_bench 16`; exit status timeout", md)
        self.assertIn("pinned D2H: 55.3 GB/s", md)
        self.assertIn("(cut off after 900 s)", md)
        for name in ("rl_phase_switch", "stash_bench", "moe_stash_bench"):
            self.assertIn(f"### {name}", md)
        self.assertIn("Not run", md)
        self.assertNotIn("GPU memory across the RL phase switches", md)  # no RL run, no plot

    def test_every_benchmark_exists(self):
        specs = report.benchmarks("build/cmake", True)
        names = [s[0] for s in specs]
        self.assertEqual(len(names), len(set(names)))
        for name, what, argv, env, head, needs_torch in specs:
            self.assertTrue(what and head, name)
            if argv[0] == "python3" and argv[1] == "-m":  # a module of the package
                module = os.path.join(report.ROOT, "torch_plugin", "python", *argv[2].split(".")) + ".py"
                self.assertTrue(os.path.exists(module), argv[2])
                self.assertTrue(needs_torch, name)
            elif argv[0].startswith("scripts/"):  # a script of this repository
                self.assertTrue(os.access(os.path.join(report.ROOT, argv[0]), os.X_OK), argv[0])
            elif argv[0] == "python3":
                self.assertTrue(os.path.exists(os.path.join(report.ROOT, argv[1])), argv[1])
                self.assertTrue(needs_torch, name)
            else:
                target = os.path.basename(argv[0])
                cmake = [os.path.join(report.ROOT, d, "CMakeLists.txt") for d in ("bench", "tools/demo")]
                self.assertTrue(any(f"add_executable({target} " in _read(c) for c in cmake), target)

    def test_a_benchmark_past_its_time_is_cut_off_keeping_what_it_said(self):
        # report.run runs it through child_run.run_child, whose kill takes the benchmark's
        # whole process group (engine_cycles_test checks that the group goes).
        script = "import time; print('measured so far', flush=True); time.sleep(60)"
        with contextlib.redirect_stdout(io.StringIO()):
            r = report.run("hung", [sys.executable, "-c", script], {}, 3)
        self.assertEqual(r["rc"], "timeout")
        self.assertIn("measured so far", r["output"])
        self.assertIn("cut off after 3 s", r["output"])
        with contextlib.redirect_stdout(io.StringIO()):
            r = report.run("fine", [sys.executable, "-c", "import sys; print('x'); sys.exit(3)"], {}, 30)
        self.assertEqual((r["rc"], r["output"]), (3, "x\n"))
        with tempfile.TemporaryDirectory() as d, contextlib.redirect_stdout(io.StringIO()):
            r = report.run("missing", [os.path.join(d, "no-such-program")], {}, 30)
        self.assertEqual(r["rc"], "not started")

    def test_unknown_benchmark_is_refused(self):
        sys.argv = ["report.py", "--build", "build/cmake", "--only", "no_such_bench"]
        with self.assertRaises(SystemExit) as e:
            report.main()
        self.assertEqual(e.exception.code, 2)


if __name__ == "__main__":
    unittest.main()
