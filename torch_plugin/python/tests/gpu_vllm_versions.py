"""vmstash's vLLM plugin with the vLLM releases frameworks pin (gpu): 0.24.0 (verl), 0.25.0,
0.27.1 (OpenRLHF) and 0.33.0, each release's own files (scripts/fetch_vllm.py --version V:
third_party/vllm-V, third_party/vllm for 0.33) beside the stand-ins of vllm_standins, each
check in a fresh process:
  - vLLM's own plugin loader (vllm/plugins/__init__.py: load_general_plugins, which runs
    general plugins without a try) finds vmstash's entry point as the wheel declares it and
    runs it without an error; on 0.24, which has no sleep-mode backend registry, it changes
    nothing (vLLM's allocator still answers) and says so in one debug line; on the others it
    registers the backend "vmstash" beside vLLM's "cumem", and vLLM's allocator still answers
    until a model selects vmstash's;
  - on the releases with a registry, vLLM's own allocator tests of that release
    (scripts/run_vllm_suite.sh with its test file) pass through vmstash's allocator: those
    that do not start vLLM's engine, at least 3 (test_mem.py) or 12 (0.33's test_cumem.py).
A release whose files are missing fails, naming the command that fetches them (the GPU
machine has no network: carry the folders).

    python3 -m pytest -m gpu gpu_vllm_versions.py -s
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.gpu

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
RELEASES = {"0.24.0": None, "0.25.0": 3, "0.27.1": 3, "0.33.0": 12}  # release -> allocator tests that must pass


def _folder(release):
    name = "vllm" if release == "0.33.0" else f"vllm-{release}"
    folder = os.path.join(ROOT, "third_party", name)
    if not os.path.isfile(os.path.join(folder, "pkg", "vllm", "plugins", "__init__.py")):
        pytest.fail(f"vLLM {release}'s files are not in {folder}: run `python3 scripts/fetch_vllm.py --version "
                    f"{release}` on a machine with network and carry the folder", pytrace=False)
    with open(os.path.join(folder, "VERSION")) as f:
        assert f.read().strip() == release
    return folder


_PROBE = r"""
import json, logging
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append((record.name, record.levelname, record.getMessage()))
logging.getLogger().addHandler(Keep())
logging.getLogger().setLevel(logging.DEBUG)
import vllm.device_allocator as da
before = type(da.get_mem_allocator_instance()).__name__
import vllm.plugins
vllm.plugins.load_general_plugins()  # as every vLLM process does at start
out = {"allocator_before": before, "allocator_after": type(da.get_mem_allocator_instance()).__name__,
       "loaded": [m for n, l, m in records if n == "vllm.plugins"],
       "vmstash_log": [(l, m) for n, l, m in records if n.startswith("vmstash")]}
try:
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
except ImportError:
    out["registry"] = None
else:
    out["registry"] = sorted(SleepModeBackendFactory._registry)
    out["vmstash_backend"] = SleepModeBackendFactory.get_backend_class("vmstash").__name__
print("PROBE " + json.dumps(out))
"""


def _probe(release):
    sys.path.insert(0, os.path.join(HERE, "vllm_standins"))
    import assemble
    dest = tempfile.mkdtemp(prefix=f"vmstash_vllm_{release}_")
    try:
        assemble.assemble(dest, _folder(release))
        assemble.declare_entry_point(dest)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [dest, os.path.join(ROOT, "torch_plugin", "python"), os.environ.get("PYTHONPATH", "")]))
        env.pop("VLLM_PLUGINS", None)
        env.pop("VMSTASH_VLLM_SLEEP_BACKEND", None)
        r = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300,
                           cwd=dest)
        assert r.returncode == 0, f"vLLM {release}: loading the plugins failed:\n{r.stdout}\n{r.stderr[-4000:]}"
        line = [x for x in r.stdout.splitlines() if x.startswith("PROBE ")]
        assert line, r.stdout + r.stderr
        return json.loads(line[-1][len("PROBE "):])
    finally:
        shutil.rmtree(dest, ignore_errors=True)


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_the_plugin_loads_in_every_release_and_registers_only_what_exists(release):
    got = _probe(release)
    print(f"vLLM {release}: {got}")
    assert got["allocator_before"] == got["allocator_after"] == "CuMemAllocator", got  # nothing selected
    if RELEASES[release] is None:  # no sleep-mode backend registry
        assert got["registry"] is None
        said = [m for level, m in got["vmstash_log"]]
        assert any("no sleep-mode backend registry" in m for m in said), got
        assert all(level == "DEBUG" for level, _ in got["vmstash_log"]), got
    else:
        assert got["registry"] == ["cumem", "vmstash"], got
        assert got["vmstash_backend"] == "VmstashSleepBackend", got
        assert not [m for level, m in got["vmstash_log"] if level in ("WARNING", "ERROR")], got


@pytest.mark.parametrize("release", sorted(r for r, n in RELEASES.items() if n))
def test_vllms_own_allocator_tests_of_each_release_pass_through_vmstash(release):
    env = dict(os.environ, VMSTASH_VLLM_DIR=_folder(release))
    r = subprocess.run([os.path.join(ROOT, "scripts", "run_vllm_suite.sh"), "--min-passed", str(RELEASES[release])],
                       env=env, capture_output=True, text=True, timeout=1500)
    print(r.stdout[-6000:])
    assert r.returncode == 0, f"vLLM {release}'s allocator tests through vmstash:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
