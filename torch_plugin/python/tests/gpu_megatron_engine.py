"""Megatron-core's dynamic inference engine (the RL loop's rollout engine) generating through its
own CUDA graphs, suspended and resumed through the torch_memory_saver API (gpu):
bench/megatron_engine_cycle.py runs vmstash's drop-in and, where its wheel is unpacked
(scripts/gpu_build.sh: vmstash_tms_peer), torch_memory_saver 0.0.10 itself, each in modes offload
and recompute, in processes of their own. Judged here: every run generates after each
suspend + model pause + training step + resume the tokens it generated before the first one
(greedy, replayed through the graphs captured at the start), every run generates the same tokens,
in mode offload the KV buffer's bytes come back unchanged, and the drop-in's suspend frees the
KV buffer and its model pause the model.
Megatron's engine needs flash-attn, which the GPU machine lacks: the run takes vLLM's
FlashAttention 3 build from the folder scripts/vllm_engine_site.py makes (staged there with
scripts/stage_to_gpu.py, docs/usage.md §18); without it the test is skipped, saying so.

    python3 -m pytest -m gpu gpu_megatron_engine.py -s
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


def test_megatron_engine_generates_the_same_tokens_after_each_suspend_through_the_dropin():
    if not os.path.isfile(os.path.join(SITE, "vllm", "vllm_flash_attn", "_vllm_fa3_C.abi3.so")):
        pytest.skip(f"no FlashAttention 3 build at {SITE} (Megatron's dynamic engine needs one): make it with "
                    "scripts/vllm_engine_site.py and stage it with scripts/stage_to_gpu.py (docs/usage.md §18)")
    pytest.importorskip("megatron.core", reason="megatron-core is not importable (scripts/gpu_build.sh: "
                                                "vmstash_ensure_megatron)")
    out = os.environ.get("VMSTASH_MEGATRON_ENGINE_JSON") or os.path.join(tempfile.mkdtemp(prefix="mcore_"), "r.json")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "megatron_engine_cycle.py"), "--site", SITE,
                        "--deadline", "1400", "--json", out], capture_output=True, text=True, timeout=1500)
    print(r.stdout[-8000:])
    assert os.path.isfile(out), f"no result (exit {r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    with open(out) as f:
        runs = json.load(f)["runs"]
    assert "dropin/offload" in runs and "dropin/recompute" in runs, sorted(runs)
    failed = {n: x["error"][-3000:] for n, x in runs.items() if "error" in x}
    assert not failed, json.dumps(failed, indent=1)
    for name, run in runs.items():
        assert run["graphs"] > 0, f"{name}: no CUDA graph captured"
        for row in run["rows"]:
            assert row["tokens_equal"], f"{name}: cycle {row['cycle']}: {row['tokens_differ']} tokens differ"
            if name.endswith("/offload"):
                assert row["kv_equal"], f"{name}: cycle {row['cycle']}: the KV buffer's bytes changed"
            if name.startswith("dropin"):
                assert row["kv_freed_mib"] * (1 << 20) >= 0.9 * run["kv_bytes"], (name, row)
                assert row["model_freed_mib"] * (1 << 20) >= 0.9 * run["params"] * 2, (name, row)
    assert r.returncode == 0, r.stdout[-3000:]
