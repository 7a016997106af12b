"""What the node's Python tests share (test_node_pool.py, test_node_switch.py,
gpu_node_pool.py, gpu_node_switch.py, test_weights.py, gpu_weights.py; conftest.py): which
vmstash package the tests run against, where vmstashd and the CLI are, stopping the daemons
a test's runtime directory saw, and a scripted process answering in JSON lines."""
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def installed_package():
    """The folder of the vmstash package these tests import when it is an installed one (the
    wheel's, when the tests run against the wheel), else None (this tree's)."""
    spec = importlib.util.find_spec("vmstash")
    if spec is None or spec.origin is None:
        return None
    package = os.path.dirname(os.path.realpath(spec.origin))
    return None if package == os.path.realpath(os.path.join(ROOT, "torch_plugin", "python", "vmstash")) else package


def _program(variable, in_package, in_tree):
    """$`variable`, else the installed package's `in_package`, else the first of the tree's
    builds `in_tree` (CMake, Bazel) that is there; a test fails (never skips) without one."""
    path = os.environ.get(variable)
    if path:
        return os.path.abspath(path)
    package = installed_package()
    candidates = [os.path.join(package, in_package)] if package else [os.path.join(ROOT, p) for p in in_tree]
    for candidate in candidates:
        if os.access(candidate, os.X_OK):
            return candidate
    pytest.fail(f"{os.path.basename(in_package)} is not there (looked at {', '.join(candidates)}): set {variable}")


def daemon_binary():
    """vmstashd: $VMSTASH_DAEMON, else the installed package's, else a build of this tree's."""
    return _program("VMSTASH_DAEMON", "bin/vmstashd",
                    ["build/cmake/tools/vmstashd/vmstashd", "bazel-bin/tools/vmstashd/vmstashd"])


def cli_binary():
    """The CLI: $VMSTASH_CLI, else the installed package's, else a build of this tree's."""
    return _program("VMSTASH_CLI", "bin/vmstash_cli",
                    ["build/cmake/tools/cli/vmstash_cli", "bazel-bin/tools/cli/vmstash_cli"])


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
