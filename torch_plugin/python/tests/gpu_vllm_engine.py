"""vLLM 0.25.0's own engine with vmstash's sleep-mode backend, end to end (gpu): the LLM class,
its engine core (in the LLM's process, as verl's colocated rollout runs it), torch.compile and
CUDA graphs, a Llama of random weights loaded from disk. bench/vllm_engine_cycle.py runs three
engines one after another, each in its own process: vmstash's backend, vLLM's default backend
with vmstash's plugin loaded, and vLLM's default without it. Judged here:
  - every engine starts, and after each sleep(level=1) + wake_up(["weights"]) +
    wake_up(["kv_cache"]) generates the tokens it generated before the first sleep (greedy);
    after sleep(level=2) + wake_up(["weights"]) + the weights loaded through collective_rpc as
    verl does + wake_up(["kv_cache"]), the tokens of a fresh engine;
  - the three engines generate the same tokens;
  - the vmstash engine's worker sleeps with VmstashSleepBackend and allocates with vmstash's
    allocator; the other two with vLLM's CuMemAllocator; vmstash's backend is registered (its
    plugin loaded) in the first two and not in the third: loaded but not selected, the plugin
    changes nothing;
  - every level-1 sleep releases (NVML) at least the KV cache and nine tenths of the weights,
    and leaves vmstash's engine using at most 256 MiB more of the device than vLLM's own does
    asleep;
  - after every wake the weights' digest is the one before the first sleep.
Times are reported, not judged (bench/report.py keeps them).
vLLM's engine is not in this repository and the GPU machine has no network: without the folder
scripts/vllm_engine_site.py makes, staged there with scripts/stage_to_gpu.py (docs/usage.md §18),
the test is skipped, saying so (VMSTASH_VLLM_ENGINE_SITE names another folder; under Bazel,
whose runfiles hold no build/, name it so).

    python3 -m pytest -m gpu gpu_vllm_engine.py -s
"""
import json
import os
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.gpu

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from vllm_engine_cycle import DEFAULT_SITE  # noqa: E402

SITE = os.environ.get("VMSTASH_VLLM_ENGINE_SITE", DEFAULT_SITE)


def test_vllm_engine_sleeps_and_wakes_through_vmstash_with_the_same_tokens():
    if not os.path.isfile(os.path.join(SITE, "vllm", "entrypoints", "llm.py")):
        pytest.skip(f"vLLM 0.25.0's engine is not staged at {SITE}: make it with scripts/vllm_engine_site.py on a "
                    "machine with network and stage it with scripts/stage_to_gpu.py (docs/usage.md §18)")
    out = os.environ.get("VMSTASH_VLLM_ENGINE_JSON") or os.path.join(tempfile.mkdtemp(prefix="vllm_engine_"), "r.json")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "vllm_engine_cycle.py"), "--site", SITE,
                        "--cycles", "3", "--deadline", "1400", "--json", out], capture_output=True, text=True, timeout=1500)
    print(r.stdout[-8000:])
    assert os.path.isfile(out), f"no result (exit {r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    with open(out) as f:
        report = json.load(f)
    engines = report["engines"]
    failed = {name: e["error"][-3000:] for name, e in engines.items() if "error" in e}
    assert not failed, f"engines failed: {json.dumps(failed, indent=1)}"
    assert report["references_equal"], "the engines generated different tokens"
    weights_mib = report["model"]["parameters"] * 2 / (1 << 20)
    for name, e in engines.items():
        for i, c in enumerate(e["cycles"]):
            assert c["weights_equal"], f"{name}: the weights differ after cycle {i + 1} (level {c['level']})"
            assert c["tokens_equal"], f"{name}: tokens differ after cycle {i + 1} (level {c['level']})"
            if c["level"] == 1:
                freed, kv_mib = c["used_before_mib"] - c["used_asleep_mib"], c["kv_after_wake"]["bytes"] / (1 << 20)
                assert freed >= kv_mib + 0.9 * weights_mib, (
                    f"{name}: sleep {i + 1} released {freed:.0f} MiB < KV cache {kv_mib:.0f} + weights {weights_mib:.0f}")
        worker = e["worker"][0]
        if name == "vmstash":
            assert worker["backend"] == "VmstashSleepBackend", worker
            assert worker["allocator"] == "VmstashMemAllocator", worker
        else:
            assert worker["backend"] != "VmstashSleepBackend" and worker["allocator"] == "CuMemAllocator", worker
        assert ("vmstash" in worker["registry"]) == (name != "cumem_without_plugin"), (name, worker)
        assert worker["cudagraph_mode"] not in ("NONE", "CUDAGraphMode.NONE") and not worker["enforce_eager"], worker
    for i, (v, c) in enumerate(zip(engines["vmstash"]["cycles"], engines["cumem"]["cycles"])):
        if v["level"] == 1:
            assert v["used_asleep_mib"] <= c["used_asleep_mib"] + 256, (
                f"cycle {i + 1}: asleep, vmstash's engine uses {v['used_asleep_mib']:.0f} MiB, vLLM's own "
                f"{c['used_asleep_mib']:.0f}")
    assert r.returncode == 0, r.stdout[-3000:]
