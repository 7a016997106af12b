"""What the Python tests of this folder share (pytest; settings and the `gpu` marker in pytest.ini).

CPU tests (test_*.py) run in this process on the simulated driver: VMSTASH_CONF is set here,
before any test module calls into vmstash (the runtime starts from it on first use, once per
process, so every CPU test file shares these options), unless the caller set it. A test that uses the library takes the `sim` fixture:
the runtime started, and helpers that allocate, fill and check the simulated device's memory
(host memory, read and written with ctypes).

GPU tests (gpu_*.py, marked gpu) each run in a fresh Python process, so that no CUDA state
(the context, torch's caching allocator, vmstash's runtime, an LD_PRELOAD library) leaks from
one test into the next. pytest_pyfunc_call below re-runs such a test alone in a child
process, `python3 -m pytest FILE::NAME`, and passes, fails or skips as the child did; in the
child (VMSTASH_PYTEST_CHILD set) pytest calls it as any test. The child's environment is this
process's, less the CPU tests' VMSTASH_CONF, changed by the test module's
`child_env(name, env)` where the module has one (a preload library, a drop-in wheel's folder).
Where torch is not importable or sees no CUDA device, GPU tests skip without starting a child;
VMSTASH_TEST_REQUIRE_GPU=1 (set by CMake for the `gpu`-labelled tests) makes them fail instead.
"""
import ctypes
import importlib.util
import os
import subprocess
import sys
import tempfile

import pytest

from node_helpers import installed_package

# Two simulated devices of 1 GiB: what every CPU test file of this folder asks for.
SIM_CONF = "driver:sim,sim_devices:2,sim_capacity:1G,auto_prepare:0"
CHILD = "VMSTASH_PYTEST_CHILD"  # in a GPU test's child process: the file the child's outcome goes to

_caller_conf = os.environ.get("VMSTASH_CONF")
if CHILD not in os.environ:
    os.environ.setdefault("VMSTASH_CONF", SIM_CONF)

# Run from a checkout without the runners' environment (PYTHONPATH, VMSTASH_LIBRARY): the
# package from this tree (for the tests' own child processes too), the library of a Bazel
# build of it where there is one. Against an installed package (the wheel's), its own
# library, as a user's process loads it.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if importlib.util.find_spec("vmstash") is None:
    _package = os.path.join(ROOT, "torch_plugin", "python")
    sys.path.insert(0, _package)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_package, os.environ.get("PYTHONPATH")) if p)
_built = os.path.join(ROOT, "bazel-bin", "torch_plugin", "libvmstash.so")
if "VMSTASH_LIBRARY" not in os.environ and os.path.exists(_built) and installed_package() is None:
    os.environ["VMSTASH_LIBRARY"] = _built


class SimDevice:
    """Device memory of the simulated driver, through the C ABI (vmstash_malloc / vmstash_free)."""

    def malloc(self, tag, size):
        import vmstash
        from vmstash import _lib
        vmstash.set_current_tag(tag)
        try:
            p = _lib.lib().vmstash_malloc(size, 0, None)
        finally:
            vmstash.set_current_tag("default")
        if not p:
            raise vmstash.Error(_lib.last_error())
        return p

    def free(self, p, size):
        from vmstash import _lib
        _lib.lib().vmstash_free(p, size, 0, None)

    def fill(self, p, n, byte):
        ctypes.memset(p, byte, n)

    def holds(self, p, n, byte):
        return ctypes.string_at(p, n) == bytes([byte]) * n

    def churn(self, tag, done, errors, size=3 << 20):
        """A working thread's loop until `done` is set: allocate in `tag`, write, check, free;
        a changed byte or an exception goes into `errors` (the test asserts it stays empty)."""
        try:
            while not done.is_set():
                q = self.malloc(tag, size)
                self.fill(q, size, 0x11)
                if not self.holds(q, size, 0x11):
                    errors.append("worker's bytes changed")
                self.free(q, size)
        except Exception as e:  # reported by the test
            errors.append(repr(e))


@pytest.fixture(scope="session")
def sim():
    """The vmstash runtime on the simulated driver (VMSTASH_CONF), one for the whole session as
    in any process: tests keep to their own tags and give back what they allocate."""
    import vmstash
    vmstash.init()  # from VMSTASH_CONF; the same options again are accepted
    return SimDevice()


@pytest.fixture
def gloo_pair():
    """run(prefix, body): two ranks of vmstash.distributed's gloo all-gather group, in two
    threads over one of torch's HashStores, body(group, rank) for each; their results, by
    rank (torch needed)."""
    return _gloo_pair


def _gloo_pair(prefix, body):
    import datetime
    import threading
    import torch.distributed as dist
    import vmstash.distributed as vd
    store, out = dist.HashStore(), {}

    def rank(r):
        out[r] = body(vd._GlooGroup(store, prefix, r, 2, datetime.timedelta(seconds=30)), r)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


# --- GPU tests: each in a fresh process ---------------------------------------------------

_devices = []


def _cuda_devices():
    """How many CUDA devices torch sees (None: torch is not importable), asked of a child process
    so that this one never initializes CUDA; once per session."""
    if not _devices:
        r = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True)
        _devices.append(int(r.stdout.split()[-1]) if r.returncode == 0 and r.stdout.split() else None)
    return _devices[0]


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is None or CHILD in os.environ:
        return
    n = _cuda_devices()
    if not n:
        reason = "torch is not importable" if n is None else "torch sees no CUDA device"
        if os.environ.get("VMSTASH_TEST_REQUIRE_GPU") == "1":
            pytest.fail(f"GPU test: {reason} (VMSTASH_TEST_REQUIRE_GPU=1)", pytrace=False)
        pytest.skip(f"GPU test: {reason}")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker("gpu") is None or CHILD in os.environ:
        return None  # a CPU test, or a GPU test in its own child: pytest calls it here
    env = dict(os.environ)
    if _caller_conf is None:
        env.pop("VMSTASH_CONF", None)
    else:
        env["VMSTASH_CONF"] = _caller_conf
    child_env = getattr(pyfuncitem.module, "child_env", None)
    if child_env is not None:
        env = child_env(pyfuncitem.name, env)
    with tempfile.TemporaryDirectory() as d:
        env[CHILD] = os.path.join(d, "outcome")
        cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
               f"{pyfuncitem.path}::{pyfuncitem.name}"]
        rc = subprocess.run(cmd, env=env, cwd=str(pyfuncitem.config.rootpath)).returncode
        outcome = open(env[CHILD]).read() if os.path.exists(env[CHILD]) else "no outcome"
    # The exit status first: a child that skipped and then failed in teardown, or crashed or
    # was killed on its way out, failed.
    if rc == 0 and outcome.startswith("skipped"):
        pytest.skip(outcome.partition("\n")[2] or "skipped in its child process")
    if rc != 0 or outcome != "passed":
        pytest.fail(f"{pyfuncitem.name} in a fresh process: {outcome}, exit status {rc} (its report: the captured "
                    "output)", pytrace=False)
    return True


def pytest_runtest_logreport(report):
    """In a GPU test's child: its outcome, for the parent (passed, failed or skipped and why)."""
    path = os.environ.get(CHILD)
    if path is None or not (report.failed or report.skipped or report.when == "call"):
        return
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        text = "skipped\n" + reason.removeprefix("Skipped: ")
    else:
        text = report.outcome
    # The first failure stays; a failure replaces a skip (a skipped test whose teardown
    # failed failed); a skip or a pass replaces only a pass.
    before = open(path).read() if os.path.exists(path) else None
    if before is None or before == "passed" or (before.startswith("skipped") and text == "failed"):
        with open(path, "w") as f:
            f.write(text)
