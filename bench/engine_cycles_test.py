"""The engine benchmarks' CPU side (bench/vllm_engine_cycle.py, bench/megatron_engine_cycle.py) and
scripts/vllm_engine_site.py: without the staged engine both benchmarks stop with exit status 2
and say how to make it, before starting anything; bad arguments are refused; the site's
package list is pinned and a folder in use is never overwritten."""
import contextlib
import io
import os
import shutil
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "scripts"))
import megatron_engine_cycle  # noqa: E402
import vllm_engine_cycle  # noqa: E402
import vllm_engine_site  # noqa: E402


class EngineCyclesTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="engine_cycles_test_")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def run_main(self, main, argv):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
        return code, err.getvalue()

    def test_without_the_staged_engine_both_stop_with_status_2_saying_how_to_make_it(self):
        code, err = self.run_main(vllm_engine_cycle.main, ["--site", self.dir])
        self.assertEqual(code, 2)
        self.assertIn("scripts/vllm_engine_site.py", err)
        self.assertIn("stage_to_gpu.py", err)
        code, err = self.run_main(megatron_engine_cycle.main, ["--site", self.dir])
        self.assertEqual(code, 2)
        self.assertIn("FlashAttention 3", err)
        self.assertIn("scripts/vllm_engine_site.py", err)

    def test_bad_arguments_are_refused(self):
        with contextlib.redirect_stderr(io.StringIO()), self.assertRaises(SystemExit) as e:
            vllm_engine_cycle.main(["--engines", "vmstash,sglang", "--site", self.dir])
        self.assertEqual(e.exception.code, 2)
        with contextlib.redirect_stderr(io.StringIO()), self.assertRaises(SystemExit):
            megatron_engine_cycle.main(["--child", "nobody"])

    def test_the_site_is_pinned_and_a_folder_in_use_is_kept(self):
        for spec in (vllm_engine_site.VLLM,) + vllm_engine_site.DEPENDENCIES:
            self.assertRegex(spec, r"^[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.+]*$", spec)
        names = [s.split("==")[0].lower().replace("-", "_") for s in vllm_engine_site.DEPENDENCIES]
        self.assertEqual(len(names), len(set(names)), "a package listed twice")
        self.assertTrue(all(not os.path.isabs(p) and ".." not in p for p in vllm_engine_site.LEFT_OUT))
        with open(os.path.join(self.dir, "keep"), "w") as f:
            f.write("x")
        with self.assertRaisesRegex(SystemExit, "is not empty"):
            vllm_engine_site.main(["--out", self.dir])
        self.assertEqual(os.listdir(self.dir), ["keep"])


if __name__ == "__main__":
    unittest.main()
