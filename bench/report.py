"""Runs every benchmark of the project on this GPU machine and writes the report,
bench/README.md, with the machine named, each benchmark's command, wall time, exit status
and full output, a table of the headline lines, and the memory timeline of the RL demo
(bench/results/rl_phase_switch_memory.svg). scripts/bench_report.sh builds and calls it.

    python3 bench/report.py --build build/cmake [--only NAME,...] [--out bench/README.md]

--only re-runs those benchmarks and keeps the others' last results (bench/results/report.json);
without it every benchmark runs. --render-only rewrites the report from that file (no run). The report is rewritten after each benchmark, so a run
cut short still leaves what it measured.
"""
import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from child_run import run_child  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
PLOT = "results/rl_phase_switch_memory.svg"


def benchmarks(build, torch_ok):
    """(name, what it measures, argv, extra environment, headline, needs torch); the headline
    is a list of regexes (the matching lines) or a (first, last) pair of regexes (the lines
    from the first match of `first` to the next match of `last`)."""
    py = "python3"  # paths relative to the repository root, where they run (nothing of this machine's)
    demo_json = "bench/results/rl_phase_switch.json"
    peers = ["--peer", "vmstash.compat.torch_memory_saver"]
    if _importable("torch_memory_saver"):
        peers += ["--peer", "torch_memory_saver"]
    return [
        ("rl_phase_switch", "The RL phase-switch demo (examples/rl_phase_switch.py): 10 rollout/training "
         "cycles, every replay checked against eager; then the same tag bytes switched through the "
         "torch_memory_saver API: vmstash's drop-in module, and torch_memory_saver itself where importable.",
         [py, "examples/rl_phase_switch.py", "--cycles", "10", "--plot", "bench/" + PLOT, "--json",
          demo_json] + peers, {},
         (r"^Summary", r"^(PASSED|FAILED)"), True),
        ("host_ceiling_bench", "What the host side allows a backup that gives its memory back "
         "(bench/host_ceiling_bench.cc): the pinned link, cudaHostAlloc/cudaFreeHost, first touch of fresh "
         "memory (1 and 16 threads, 4 KiB and huge pages), memcpy into fresh and touched memory, "
         "cudaHostRegister/Unregister (one call, 64 MiB pieces), registering pipelined with the copies, "
         "whether (un)registering waits for queued copies, memory handed back with MADV_FREE, and a D2H into "
         "memory handed back and registered again several ways (`reuse`).",
         [os.path.join(build, "bench/host_ceiling_bench"), "8", "16"], {}, [r"."], False),
        ("tms_backup_bench", "Backups through torch_memory_saver's API (bench/tms_backup_bench.py): 8 GiB "
         "backed up in 512 tensors, 16 GiB discarded, 4 GiB of which 2 GiB live backed up; 5 cycles of pause "
         "and resume, the first 3 s after the tags stopped growing; vmstash's own API, the drop-in "
         "(retain_cpu_backup off and on) and torch_memory_saver itself where importable, each in its own "
         "process, against the same run's pinned link, with host memory after pause, resume and hand-back.",
         [py, "bench/tms_backup_bench.py", "--json", "bench/results/tms_backup.json"]
         + ([] if _importable("torch_memory_saver") else ["--peers", "native,dropin,dropin_retain"]), {},
         [r"."], True),
        ("node_pool_bench", "Two processes on one GPU taking turns through torch_memory_saver's API while other "
         "processes take the host's memory (bench/node_pool_bench.py): 8 GiB backed up in 512 tensors and 16 GiB "
         "discarded in each, 3 turns each way, a ballast holding all but 28 GiB of the host's available memory "
         "and a hog touching all but 6 GiB before each turn; the drop-in without the node pool, with it "
         "(node:1), with it pinned ahead (node_pin:1), and torch_memory_saver 0.0.10 where importable.",
         [py, "bench/node_pool_bench.py", "--cycles", "3", "--json", "bench/results/node_pool.json"]
         + ([] if _importable("torch_memory_saver") else ["--peers", "dropin,dropin_node,dropin_node_pin"]),
         {"VMSTASH_DAEMON": os.path.join(build, "tools/vmstashd/vmstashd")}, [r"."], True),
        ("node_switch_bench", "A switch across two processes on one GPU (bench/node_switch_bench.py): "
         "vmstash.node.switch of 8 GiB backed up in 512 tensors and 16 GiB discarded out of one process and "
         "as much into the other, against vmstash.switch of the same tags inside one process and against "
         "a pause then a resume in two node switches; the same with the discarded tags only; 4 cycles each "
         "way, every byte checked, against the same run's pinned link.",
         [py, "bench/node_switch_bench.py", "--json", "bench/results/node_switch.json"],
         {"VMSTASH_DAEMON": os.path.join(build, "tools/vmstashd/vmstashd")}, [r"."], True),
        ("weights_sync_bench", "Weights from a trainer process to a rollout process on one GPU "
         "(bench/weights_sync_bench.py): vmstash.weights.sync into the rollout's mapped tag against torch's "
         "CUDA IPC path (tensors sent through torch.multiprocessing's reductions, opened in the rollout and "
         "copied, as SGLang's update_weights_from_tensor) and against the same batched copy inside one "
         "process and one flat copy; the same plan into the paused rollout's backup in the node pool against "
         "one device-to-host copy into pinned memory (the link); 8 GiB of bf16 in 512 tensors and 4 GiB in "
         "2048, 5 steps each, every step's bytes checked in the rollout.",
         [py, "bench/weights_sync_bench.py", "--json", "bench/results/weights_sync.json"],
         {"VMSTASH_DAEMON": os.path.join(build, "tools/vmstashd/vmstashd")}, [r"."], True),
        ("tms_suite", "torch_memory_saver's own test suite (test/test_examples.py of its repository at 4a43c97, "
         "unmodified, in third_party/tms_suite: scripts/export_tms_suite.sh), through the drop-in built from "
         "this build, then through torch_memory_saver 0.0.10's own wheel (third_party/wheels: "
         "scripts/fetch_wheels.sh), each needing at least 19 passed (the tests that apply on one GPU).",
         ["scripts/run_tms_suite.sh", "third_party/tms_suite", "--build-tree", "--min-passed", "19",
          "--beside-tms", "third_party/wheels"], {},
         [r"^tms_suite", r"^  (failure|error)", r"^run_tms_suite: (exit|no|expected)"], True),
        ("vllm_sleep_bench", "vLLM's sleep mode (bench/vllm_sleep_bench.py): vmstash's sleep-mode backend "
         "and vLLM 0.33's CuMemAllocator (its own files), each in its own process; 8 GiB of weights in 512 "
         "tensors kept, a 16 GiB KV cache dropped, 4 GiB of runtime state of which 2 GiB live kept; the first "
         "sleep 3 s after the tags stopped growing, 5 cycles of sleep(1) and a whole wake, then 3 with "
         "selective wakes (weights, then the KV cache), against the same run's pinned link.",
         [py, "bench/vllm_sleep_bench.py", "--json", "bench/results/vllm_sleep.json"], {}, [r"."], True),
        ("verl_cycle_bench", "verl's rollout cycle at sleep level 2 (bench/verl_cycle_bench.py): vmstash's "
         "sleep-mode backend (default preparation, and verl's recipe VMSTASH_VLLM_PREPARE_TAGS=runtime,cudagraph) and "
         "vLLM 0.33's CuMemAllocator, each in its own process; 8 GiB of weights in 512 tensors, a 16 GiB KV "
         "cache, a 1 GiB CUDA graph pool; 5 cycles of suspend(level=2), resume(weights), the trainer's "
         "weights copied in, resume(kv_cache), every weight and the graph checked.",
         [py, "bench/verl_cycle_bench.py", "--json", "bench/results/verl_cycle.json"], {}, [r"."], True),
        ("vllm_engine_cycle", "vLLM 0.25.0's own engine through sleep and wake (bench/vllm_engine_cycle.py): "
         "LLM() with sleep mode, CUDA graphs and torch.compile over a Llama of random weights (16 x 2048, "
         "886 M parameters, bf16) loaded from disk; 3 level-1 cycles (sleep, wake weights, wake KV cache, "
         "generate) and a level-2 cycle with the weights reloaded through collective_rpc as verl does; "
         "vmstash's backend, vLLM's default with vmstash's plugin loaded, and without it, each in its own "
         "process; greedy tokens, the weights' digest and the device memory each sleep frees, per cycle. "
         "Needs vLLM's wheel staged (scripts/vllm_engine_site.py, docs/usage.md §18).",
         [py, "bench/vllm_engine_cycle.py", "--json", "bench/results/vllm_engine.json"], {},
         [r"^\S+: (backend|FAILED)", r"^  level", r"^cumem / vmstash", r"^references"], True),
        ("megatron_engine_cycle", "Megatron-core's dynamic inference engine through torch_memory_saver's API "
         "(bench/megatron_engine_cycle.py): a GPTModel (8 x 2048, bf16) in region('rl_inference_model') and "
         "the engine with a 4 GiB KV buffer (offload, recompute) and Megatron's own CUDA graphs, generating "
         "greedily; 3 cycles of engine.suspend, model pause, a training step, model resume, engine.resume "
         "and generate; vmstash's drop-in and torch_memory_saver itself where importable. Its attention "
         "runs vLLM's FlashAttention 3 build, so it needs vLLM's wheel staged (docs/usage.md §18).",
         [py, "bench/megatron_engine_cycle.py", "--json", "bench/results/megatron_engine.json"], {}, [r"."],
         True),
        ("megatron_rl_offload_bench", "Megatron-LM RL's offload of its inference model and KV cache through "
         "torch_memory_saver's API (bench/megatron_rl_offload_bench.py): megatron-core 0.19's own GPTModel "
         "(1.67 B parameters, 3.11 GiB bf16) built in region('rl_inference_model', enable_cpu_backup=True) and "
         "its DynamicInferenceContext with an 8 GiB KV buffer backed up (offload) or discarded (recompute), "
         "suspended and resumed as Megatron's engine does; vmstash's drop-in (retain_cpu_backup off and on) "
         "and torch_memory_saver itself where importable, each run in its own process, against the same "
         "run's pinned link, with device and host memory per cycle and every byte checked.",
         [py, "bench/megatron_rl_offload_bench.py", "--json", "bench/results/megatron_rl_offload.json"], {},
         [r"."], True),
        ("megatron_training", "Megatron-LM's training state through RL phase switches "
         "(vmstash.demo.megatron_training): megatron-core 0.19's GPT (4 layers of 1024, local spec) in its "
         "DistributedDataParallel with the distributed optimizer, its parameter and gradient buffers, fp32 "
         "main parameters, Adam's state and global memory buffer in vmstash tags "
         "(vmstash.compat.megatron); 3 training steps, a rollout phase (weights copy, KV cache, a captured "
         "decode graph) switched in and out twice, 3 more steps; against a twin that never switched (losses "
         "and state bit for bit), with device memory during the rollouts against the pre-training baseline "
         "and each switch's time; megatron-core must be importable.",
         [py, "-m", "vmstash.demo.megatron_training", "--json", "bench/results/megatron_training.json"], {},
         [r"^Megatron", r"^rank", r"^  rollout", r"^  switch", r"FAILED", r"^PASSED"], True),
        ("vmm_bench", "The driver's limits (bench/vmm_bench.cc): create+map+unmap+release of 16 GiB by "
         "chunk size, release cost, create after release, pinned copy bandwidth.",
         [os.path.join(build, "bench/vmm_bench")], {}, [r"^\s+chunk\s", r"^\s+(2|32|512|2048)MiB", r"pinned D2H"], False),
        ("allocator_bench", "The caching allocator against PyTorch's (bench/allocator_bench.cc): "
         "malloc+free pairs, churn, and a training trace's peak reserved memory.",
         [os.path.join(build, "bench/allocator_bench")], {"VMSTASH_DRIVER": "cuda"},
         [r"^(case|pair|churn|trace)"], False),
        ("pause_bench", "Pause/resume of a 16 GiB tag against the same run's pinned copies "
         "(bench/pause_bench.cc).",
         [os.path.join(build, "bench/pause_bench"), "16"], {"VMSTASH_DRIVER": "cuda"},
         [r"^limit", r"^prepare", r"^case", r"%$", r"after the pause", r"^discard", r"^background"], False),
        ("switch_bench", "A phase switch (one transaction: D2H and H2D at once, physical memory handed "
         "from the outgoing to the incoming tags) against the same tags paused and resumed one after the "
         "other and against the same run's concurrent pinned copies; 8 GiB each way, then 16 GiB discard "
         "each way (bench/switch_bench.cc).",
         [os.path.join(build, "bench/switch_bench"), "8", "8", "5"], {"VMSTASH_DRIVER": "cuda"},
         [r"^limit", r"^case", r" GiB in, ", r"^  \d+ blocks?:", r"^  one more", r"^(as|grown) ", r"^switches"],
         False),
        ("switch_bench_asym", "The same switch with 8 GiB out and 2 GiB in, and back (bench/switch_bench.cc).",
         [os.path.join(build, "bench/switch_bench"), "8", "2", "5", "0"], {"VMSTASH_DRIVER": "cuda"},
         [r"^limit", r"^case", r" GiB in, ", r"^  \d+ blocks?:", r"^  one more"], False),
        ("vmstash_demo", "The C++ demo (tools/demo): 4 GiB paused with backup in 64 MiB chunks and resumed "
         "at the same address.",
         [os.path.join(build, "tools/demo/vmstash_demo"), "--size=4G", "--chunk=64M"], {"VMSTASH_DRIVER": "cuda"},
         [r"^  (pause|resume)"], False),
        ("python_bench", "The Python package's own costs (bench/python_bench.py): new 64 MiB segments "
         "against PyTorch's allocator, region() and an empty tag's pause+resume.",
         [py, "bench/python_bench.py"], {}, [r"."], True),
        ("stash_bench", "The paged stash kernels against a same-run device-to-device copy "
         "(bench/stash_bench.cc).",
         [os.path.join(build, "bench/stash_bench")], {}, [r"^\s+MB\s", r"^\s+\d+\s", r"host tier", r"empty stash"], False),
        ("megatron_stash_bench", "The paged stash side by side with megatron-core 0.19's own Triton kernels "
         "(PagedStashBuffer / PagedTensor), both in CUDA graphs, against the same run's D2D and pinned D2H "
         "copies (bench/megatron_stash_bench.py); megatron-core must be importable.",
         [py, "bench/megatron_stash_bench.py", "--json", "bench/results/megatron_stash.json"], {},
         [r"^case", r"^(bf16|uint8|mxfp8|tiny|host)", r"^(MISS|WRONG|empty stash|goals)"], True),
        ("moe_stash_bench", "Expert-activation memory of a synthetic MoE with and without the paged stash "
         "(bench/moe_stash_bench.py).",
         [py, "bench/moe_stash_bench.py"], {}, [r"^\|", r"^\(gradients"], True),
    ]


def _importable(module):
    import importlib.util
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _cmd(argv):
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine():
    gpu = _cmd(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        pass
    torch_version = _cmd([sys.executable, "-c", "import torch; print(torch.__version__, torch.version.cuda)"])
    nvcc = _cmd(["nvcc", "--version"]).splitlines()
    osname = ""
    try:
        with open("/etc/os-release") as f:
            osname = next((l.split("=", 1)[1].strip().strip('"') for l in f if l.startswith("PRETTY_NAME=")), "")
    except OSError:
        pass
    return {"gpu": gpu or "no GPU visible", "cpu": f"{cpu} ({os.cpu_count()} threads)", "os": osname,
            "kernel": platform.release(), "torch": torch_version or "not importable",
            "nvcc": nvcc[-1] if nvcc else "", "python": platform.python_version(),
            "commit": os.environ.get("VMSTASH_COMMIT") or _cmd(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def headline(output, spec):
    lines = output.splitlines()
    if isinstance(spec, tuple):
        first = next((i for i, l in enumerate(lines) if re.search(spec[0], l)), None)
        if first is None:
            return []
        last = next((i for i in range(first, len(lines)) if re.search(spec[1], lines[i])), len(lines) - 1)
        return lines[first:last + 1]
    return [l for l in lines if any(re.search(p, l) for p in spec)]


def scrub(text):
    """Paths of the machine that ran it out of the output: the repository root becomes `.`,
    an installed package's folder `<site-packages>`."""
    text = text.replace(ROOT + os.sep, "")
    return re.sub(r"(/[^\s:'\"]+)*/(site|dist)-packages/", "<site-packages>/", text)


def run(name, argv, env, timeout):
    """One benchmark, in a process group of its own: at `timeout` s it is killed with every
    process it started (a peer's child holding device memory would skew the next benchmark)."""
    print(f"== {name}: {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    try:
        rc, stdout, stderr = run_child(argv, dict(os.environ, **env), timeout, cwd=ROOT)
        out = stdout + (("\n" + stderr) if stderr.strip() else "")
        if rc is None:
            out, rc = out + f"\n(cut off after {timeout} s)", "timeout"
    except OSError as e:
        out, rc = f"could not start: {e}", "not started"
    seconds = time.perf_counter() - t0
    out = scrub(out)
    print(out, flush=True)
    return {"argv": argv, "env": env, "rc": rc, "seconds": seconds, "output": out}


def shown(argv, env):
    """The command as typed in the repository root."""
    return " ".join([f"{k}={v}" for k, v in env.items()] + argv)


def render(results, specs, info):
    out = ["# Benchmark report", "",
           "Written by `scripts/bench_report.sh` (builds, then runs `bench/report.py`); every figure below is "
           "from the run it names. Ratios and percentages compare against the same run's physical limit or "
           "peer. Goals, tuning history and earlier runs: [HISTORY.md](HISTORY.md) (kept by hand).", "",
           "| machine | |", "| --- | --- |"]
    for k in ("gpu", "cpu", "os", "kernel", "nvcc", "torch", "python", "commit", "date"):
        out.append(f"| {k} | {info.get(k, '')} |")
    out += ["", "## Headlines", "",
            "The lines of each benchmark's output that carry its main figures (full outputs below).", ""]
    for name, _, _, _, patterns, _ in specs:
        r = results.get(name)
        if not r:
            continue
        lines = headline(r["output"], patterns)
        out += [f"**{name}** (exit {r['rc']}, {r['seconds']:.0f} s)", "", "```"] + lines[:40] + ["```", ""]
    if "rl_phase_switch" in results and os.path.exists(os.path.join(HERE, PLOT)):
        out += ["## GPU memory across the RL phase switches", "",
                f"![GPU memory in use over time across the phase switches]({PLOT})", "",
                "Green: rollout phases (decode graph replays); red: training steps. Sampled with "
                "`cudaMemGetInfo` at each phase and switch.", ""]
    out += ["## Each benchmark", ""]
    for name, what, _, _, _, _ in specs:
        r = results.get(name)
        if not r:
            out += [f"### {name}", "", what, "", "Not run (needs torch, or not run yet).", ""]
            continue
        out += [f"### {name}", "", what, "", f"Command: `{shown(r['argv'], r['env'])}`; exit status {r['rc']}; "
                f"{r['seconds']:.1f} s.", "", "```", r["output"].rstrip(), "```", ""]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", required=True, help="the CMake build folder")
    ap.add_argument("--only", default="", help="comma-separated names to re-run (default: all)")
    ap.add_argument("--out", default=os.path.join(HERE, "README.md"))
    ap.add_argument("--timeout", type=int, default=900, help="seconds per benchmark")
    ap.add_argument("--render-only", action="store_true", help="rewrite the report from the stored results")
    args = ap.parse_args()
    torch_ok = _importable("torch")
    build = os.path.relpath(os.path.abspath(args.build), ROOT)
    if build.startswith(".."):
        ap.error("--build must lie inside the repository (its paths go into the report)")
    specs = benchmarks(build, torch_ok)
    names = [s[0] for s in specs]
    only = [n for n in args.only.split(",") if n]
    unknown = [n for n in only if n not in names]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; known: {names}")
    os.makedirs(RESULTS, exist_ok=True)
    store = os.path.join(RESULTS, "report.json")
    results, info = {}, None
    if (only or args.render_only) and os.path.exists(store):
        with open(store) as f:
            stored = json.load(f)
        results, info = stored.get("results", {}), stored.get("machine")
    if args.render_only:
        if not results:
            ap.error(f"--render-only: no stored results in {os.path.relpath(store, ROOT)}")
        with open(args.out, "w") as f:
            f.write(render(results, specs, info))
        return 0
    if only:  # the report names one machine: the stored results must come from this one
        current = machine()
        if info and info.get("gpu") != current["gpu"]:
            ap.error(f"--only: the stored results are from {info.get('gpu')}, this is {current['gpu']}; run all")
    info = machine()
    failed = []
    for name, _, argv, env, _, needs_torch in specs:
        if only and name not in only:
            continue
        if needs_torch and not torch_ok:
            results.pop(name, None)
            continue
        results[name] = run(name, argv, env, args.timeout)
        if results[name]["rc"] != 0:
            failed.append(name)
        with open(store, "w") as f:
            json.dump({"machine": info, "results": results}, f, indent=1)
        with open(args.out, "w") as f:
            f.write(render(results, specs, info))
    print(f"report: {os.path.relpath(args.out, ROOT)}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
