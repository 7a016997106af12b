"""What the node's Python tests share (test_node_pool.py, test_node_switch.py,
gpu_node_pool.py, gpu_node_switch.py, test_weights.py, gpu_weights.py): where vmstashd is,
stopping the daemons a test's runtime directory saw, and a scripted process answering in
JSON lines."""
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def daemon_binary():
    """$VMSTASH_DAEMON, else the one of an installed vmstash package (the wheel's
    vmstash/bin/vmstashd, when the tests run against the wheel), else the vmstashd of a CMake or
    Bazel build of this tree; a test of the daemon fails (never skips) without one."""
    path = os.environ.get("VMSTASH_DAEMON")
    if path:
        return os.path.abspath(path)
    spec = importlib.util.find_spec("vmstash")
    if spec is not None and spec.origin is not None:
        package = os.path.dirname(os.path.abspath(spec.origin))
        if package != os.path.join(ROOT, "torch_plugin", "python", "vmstash"):
            candidate = os.path.join(package, "bin", "vmstashd")
            if os.access(candidate, os.X_OK):
                return candidate
    for candidate in (os.path.join(ROOT, "build", "cmake", "tools", "vmstashd", "vmstashd"),
                      os.path.join(ROOT, "bazel-bin", "tools", "vmstashd", "vmstashd")):
        if os.access(candidate, os.X_OK):
            return candidate
    pytest.fail("vmstashd is not built: set VMSTASH_DAEMON")


def daemon_pids(runtime_dir):
    """The pids of the daemons that logged serving in `runtime_dir`, in order."""
    try:
        with open(os.path.join(runtime_dir, "vmstashd.log")) as f:
            return [int(p) for p in re.findall(r"serving a pool of \d+ bytes on .* \(pid (\d+)\)", f.read())]
    except FileNotFoundError:
        return []


def stop_daemons(runtime_dir):
    """SIGTERM to every daemon that served `runtime_dir` and may still live."""
    for pid in daemon_pids(runtime_dir):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


class ScriptProcess:
    """`python3 -c script *args` in `env`, answering one JSON line per command on stdin."""

    def __init__(self, script, env, *args):
        self.p = subprocess.Popen([sys.executable, "-c", script, *args], env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def read(self):
        line = self.p.stdout.readline()
        if not line:
            raise AssertionError(f"the process ended (exit {self.p.wait()}): {self.p.stderr.read()[-3000:]}")
        return json.loads(line)

    def ask(self, cmd):
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self.read()

    def close(self):
        """Says "exit" (when still running) and waits; kills it after 60 s."""
        if self.p.poll() is None:
            try:
                self.p.stdin.write("exit\n")
                self.p.stdin.flush()
                self.p.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait()
