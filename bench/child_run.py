"""How the engine benchmarks (vllm_engine_cycle.py, megatron_engine_cycle.py) and the report
(report.py, each benchmark) run a child process and keep what it said: the child in a process group of its own, killed with everything it
started when its time is up (an engine's workers hold tens of GiB of device memory, which the
next run needs), its output as text; and what goes into a committed JSON with this machine's
paths replaced by names."""
import os
import signal
import subprocess
import time


class Deadline:
    """The seconds a run has left; a child gets at most its own limit, and never past the run's end."""

    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def left(self, limit):
        return max(0.0, min(float(limit), self.end - time.monotonic()))


def _text(data):
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def _kill_group(p):
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _finish(p):
    """What `p` said, once its group is killed: its pipes are waited for 5 s more at most (a
    process that left the group, as a daemon does, may hold them), then closed."""
    try:
        return p.communicate(timeout=5)
    except subprocess.TimeoutExpired as e:
        out, err = _text(e.stdout), _text(e.stderr)
        for f in (p.stdout, p.stderr):
            try:
                f.close()
            except OSError:
                pass
        p.wait()
        return out, err + "\n(a process outside its group still held its output)"


def run_child(cmd, env, timeout, cwd=None):
    """(exit status, or None when it was killed at `timeout` s; stdout; stderr). A child that
    ended while processes it started still held its output is given its own exit status,
    those processes killed. Interrupted (Ctrl-C), the child's group is killed too."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, cwd=cwd)
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err
    except subprocess.TimeoutExpired:
        ended = p.poll()
        _kill_group(p)
        out, err = _finish(p)
        if ended is None:
            return None, _text(out), _text(err) + f"\n(killed after {timeout:.0f} s with its process group)"
        return ended, _text(out), _text(err) + (f"\n(it ended, but processes it started still held its output "
                                                f"at {timeout:.0f} s: killed with its process group)")
    except BaseException:
        _kill_group(p)
        p.wait()
        raise


def is_running(pid):
    """Whether `pid` runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def scrub(text, names):
    """`text` with each path of `names` ({path: name}) replaced by its name, longest first."""
    for path in sorted(names, key=len, reverse=True):
        if path:
            text = text.replace(path, names[path])
    return text
