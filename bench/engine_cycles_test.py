"""The engine benchmarks' CPU side (bench/vllm_engine_cycle.py, bench/megatron_engine_cycle.py,
bench/child_run.py) and scripts/vllm_engine_site.py: without the staged engine both benchmarks
stop with exit status 2 and say how to make it, before starting anything; bad arguments
(unknown or repeated names, no cycle) are refused before anything runs; a child past its time
is killed with the processes it started, and what it said comes back as text; machine paths
are scrubbed; the site's package list is pinned and a folder in use is never overwritten."""
import contextlib
import io
import os
import shutil
import signal
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "scripts"))
import child_run  # noqa: E402
import megatron_engine_cycle  # noqa: E402
import vllm_engine_cycle  # noqa: E402
import vllm_engine_site  # noqa: E402


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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
        for main, argv in ((vllm_engine_cycle.main, ["--engines", "vmstash,sglang"]),
                           (vllm_engine_cycle.main, ["--engines", "vmstash,vmstash"]),
                           (vllm_engine_cycle.main, ["--engines", ""]),
                           (vllm_engine_cycle.main, ["--cycles", "0"]),
                           (vllm_engine_cycle.main, ["--zero-kv-cycles", "0"]),
                           (vllm_engine_cycle.main, ["--zero-kv-cycles", "one"]),
                           (megatron_engine_cycle.main, ["--peers", "dropin,tsm"]),
                           (megatron_engine_cycle.main, ["--modes", "offload,offload"]),
                           (megatron_engine_cycle.main, ["--peers", ""]),
                           (megatron_engine_cycle.main, ["--cycles", "0"]),
                           (megatron_engine_cycle.main, ["--child", "nobody"])):
            with contextlib.redirect_stderr(io.StringIO()), self.assertRaises(SystemExit) as e:
                main(argv + ["--site", self.dir])
            self.assertEqual(e.exception.code, 2, argv)

    def _parent(self, name, then, own_session=False):
        """A child script that starts a sleeping process of its own (in the child's group,
        or in a session of its own), writes that process's pid to a file, then runs `then`;
        and the file."""
        pid_file = os.path.join(self.dir, name)
        script = ("import subprocess, sys, time\n"
                  "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
                  f"start_new_session={own_session})\n"
                  f"open({pid_file!r}, 'w').write(str(p.pid))\n" + then)
        return [sys.executable, "-c", script], pid_file

    def _started(self, pid_file):
        with open(pid_file) as f:
            pid = int(f.read())
        self.addCleanup(_kill, pid)
        return pid

    def _assert_gone(self, pid, what):
        for _ in range(100):
            if not child_run.is_running(pid):
                return
            time.sleep(0.05)
        self.fail(what)

    def test_a_child_past_its_time_is_killed_with_what_it_started(self):
        cmd, pid_file = self._parent("grandchild", "print('started', flush=True)\ntime.sleep(60)\n")
        rc, out, err = child_run.run_child(cmd, dict(os.environ), 3)
        self.assertIsNone(rc)
        self.assertIn("started", out)
        self.assertIn("killed after 3 s", err)
        self._assert_gone(self._started(pid_file), "the child's own child outlived the kill")
        rc, out, err = child_run.run_child([sys.executable, "-c", "import sys; print('x'); sys.exit(3)"],
                                           dict(os.environ), 30)
        self.assertEqual((rc, out), (3, "x\n"))

    def test_an_interrupt_kills_the_child_with_what_it_started(self):
        cmd, pid_file = self._parent("interrupted", "time.sleep(60)\n")

        def interrupt(signum, frame):
            raise KeyboardInterrupt

        before = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.alarm(5)
            with self.assertRaises(KeyboardInterrupt):
                child_run.run_child(cmd, dict(os.environ), 60)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, before)
        self._assert_gone(self._started(pid_file), "the child's group outlived the interrupt")

    def test_a_child_that_ended_while_what_it_started_holds_its_output(self):
        # In its group: killed, the child's own exit status kept. Out of its group (a
        # daemon's setsid): its pipes are given up on, not waited on until it ends.
        for own_session in (False, True):
            cmd, pid_file = self._parent(f"holder{own_session}", "print('done', flush=True)\n", own_session)
            rc, out, err = child_run.run_child(cmd, dict(os.environ), 2)
            holder = self._started(pid_file)
            self.assertEqual(rc, 0, err)
            self.assertIn("done", out)
            self.assertIn("it ended, but processes it started still held its output", err)
            if own_session:
                self.assertIn("a process outside its group still held its output", err)
            else:
                self._assert_gone(holder, "the process in the child's group outlived the kill")

    def test_deadline_and_scrub(self):
        d = child_run.Deadline(100)
        self.assertLessEqual(d.left(30), 30)
        self.assertGreater(child_run.Deadline(100).left(1000), 90)
        self.assertEqual(child_run.Deadline(-5).left(30), 0.0)
        text = "/a/b/site/vllm and /a/b and /tmp/x/model"
        self.assertEqual(child_run.scrub(text, {"/a/b": "<repo>", "/a/b/site": "<site>", "/tmp/x": "<tmp>"}),
                         "<site>/vllm and <repo> and <tmp>/model")

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
