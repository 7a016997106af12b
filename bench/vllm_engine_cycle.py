"""vLLM's own engine (0.25.0, from its wheel) through sleep and wake, with vmstash's sleep-mode
backend and with vLLM's own, side by side in one run (GPU).

    python3 bench/vllm_engine_cycle.py [--site build/staged/root/vllm-0.25.0-site] [--cycles 3]
        [--engines vmstash,cumem,cumem_without_plugin] [--json out.json]

--site is the folder scripts/vllm_engine_site.py makes (vLLM 0.25.0 and the packages its engine
imports that the GPU machine lacks), taken there with scripts/stage_to_gpu.py (docs/usage.md §18);
it goes first on PYTHONPATH, then vmstash's Python package, then a folder declaring vmstash's
vllm.general_plugins entry point as the wheel does. Without the site the run stops with exit
status 2, saying how to make it.

The model: a Llama of random weights (--layers x --hidden, vocabulary 32000, bf16) that
transformers makes and saves here (save_pretrained; no hub), loaded by vLLM from disk with
skip_tokenizer_init (prompts are token ids). Every engine runs in its own process, with vLLM's
defaults otherwise (its engine core in a process of its own, torch.compile, CUDA graphs captured),
greedy decoding of --prompts prompts, --tokens tokens each (ignore_eos):
  1. generate: the reference tokens;
  2. --cycles times, as verl's level-1 cycle: sleep(level=1), wake_up(["weights"]),
     wake_up(["kv_cache"]), generate: the same tokens;
  3. level 2 as verl reloads weights: sleep(level=2), wake_up(["weights"]), the checkpoint's
     weights loaded into the model through collective_rpc (model.load_weights, what verl's rollout
     does with the trainer's), wake_up(["kv_cache"]), generate: the tokens of a fresh engine
     (step 1's).
Each call is timed from the LLM's process (what a framework waits for); the device memory used
(NVML, the whole device) before and after each sleep gives what it released. The worker reports
its sleep-mode backend, the allocator vLLM's worker module resolves and the CUDA-graph mode.
  engines: vmstash               vmstash's backend: VMSTASH_VLLM_SLEEP_BACKEND=1 (0.25.0's
                                 EngineArgs has no sleep_mode_backend; where it has, it is
                                 passed too)
           cumem                 vLLM's default backend with vmstash's plugin installed and loaded
           cumem_without_plugin  the same with VLLM_PLUGINS="" (no plugin loaded): what a user
                                 without vmstash gets
The run fails (exit 1) when an engine fails, when tokens differ from the reference anywhere,
or when the engines' reference tokens differ from each other.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_SITE = os.path.join(ROOT, "build", "staged", "root", "vllm-0.25.0-site")
ENGINES = ("vmstash", "cumem", "cumem_without_plugin")
MiB = 1 << 20


def make_model(path, layers, hidden):
    import torch
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                   num_hidden_layers=layers, num_attention_heads=hidden // 128,
                                   num_key_value_heads=max(1, hidden // 256), max_position_embeddings=4096,
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    cfg.dtype = cfg.torch_dtype = torch.bfloat16
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def _worker_facts(self):
    """Runs in vLLM's worker (collective_rpc): what it sleeps and allocates with."""
    import sys as _sys
    module = _sys.modules.get("vllm.v1.worker.gpu_worker") or _sys.modules[type(self).__module__]
    getter = getattr(module, "get_mem_allocator_instance", None)
    cfg = self.vllm_config
    return {"backend": type(self._get_sleep_mode_backend()).__name__,
            "allocator": type(getter()).__name__ if getter else None,
            "sleep_mode_backend": getattr(cfg.model_config, "sleep_mode_backend", None),
            "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
            "enforce_eager": bool(cfg.model_config.enforce_eager)}


def _weights_digest(self):
    """Runs in vLLM's worker: a digest of every parameter and buffer (their bytes summed as
    integers, per tensor), to tell the weights after a wake from those before the sleep."""
    import torch as _torch
    out = {}
    for name, t in list(self.model_runner.model.named_parameters()) + list(self.model_runner.model.named_buffers()):
        flat = t.detach().contiguous().view(-1)
        out[name] = int(flat.view(_torch.uint8).to(_torch.int64).sum().item()) if flat.numel() else 0
    return out


def _kv_probe(self, zero):
    """Runs in vLLM's worker: the KV cache's elements that are not finite or not zero (what a wake
    left there), then zeroed when asked (what vLLM's allocation at start gives)."""
    import torch as _torch
    nonfinite = nonzero = total = 0
    for t in self.model_runner.kv_caches:
        if t is None:
            continue
        flat = t.view(-1)
        for start in range(0, flat.numel(), 1 << 28):
            part = flat[start:start + (1 << 28)]
            if part.is_floating_point():
                nonfinite += int((~_torch.isfinite(part)).sum().item())
            nonzero += int(_torch.count_nonzero(part).item())
            total += part.numel()
        if zero:
            t.zero_()
    _torch.cuda.synchronize()
    return {"elements": total, "nonfinite": nonfinite, "nonzero": nonzero}


def _reload_weights(self, model_dir):
    """Runs in vLLM's worker: the checkpoint's weights into the model, as verl's rollout loads
    the trainer's (model.load_weights over (name, device tensor) pairs)."""
    import glob as _glob
    import os as _os

    import torch as _torch
    from safetensors.torch import load_file
    model = self.model_runner.model
    count = 0
    for path in sorted(_glob.glob(_os.path.join(model_dir, "*.safetensors"))):
        weights = load_file(path, device=f"cuda:{_torch.cuda.current_device()}")
        model.load_weights(weights.items())
        count += len(weights)
    _torch.cuda.synchronize()
    return count


def run_engine(name, model_dir, args):
    import dataclasses

    import pynvml
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs

    pynvml.nvmlInit()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0)

    def used():
        return pynvml.nvmlDeviceGetMemoryInfo(handle).used

    kwargs = dict(model=model_dir, enable_sleep_mode=True, skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                  gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=1024,
                  max_num_seqs=args.prompts, enable_prefix_caching=args.prefix_caching)
    if name == "vmstash" and "sleep_mode_backend" in {f.name for f in dataclasses.fields(EngineArgs)}:
        kwargs["sleep_mode_backend"] = "vmstash"
    out = {"engine": name, "how": "sleep_mode_backend" if "sleep_mode_backend" in kwargs else
           ("VMSTASH_VLLM_SLEEP_BACKEND=1" if name == "vmstash" else "default"), "cycles": []}
    t = time.perf_counter()
    llm = LLM(**kwargs)
    out["start_s"] = time.perf_counter() - t
    rng = __import__("random").Random(1234)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 32000) for _ in range(rng.randrange(16, 96))]}
               for _ in range(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)

    def generate():
        t = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in res], (time.perf_counter() - t) * 1e3

    def timed(fn, *a, **kw):
        t = time.perf_counter()
        fn(*a, **kw)
        return (time.perf_counter() - t) * 1e3

    def differ(tokens):
        return sum(a != b for x, y in zip(tokens, reference) for a, b in zip(x, y))

    reference, out["generate_ms"] = generate()
    out["reference"] = reference
    digest = llm.collective_rpc(_weights_digest)
    again, _ = generate()  # the control: the engine without a sleep
    out["control_equal"], out["control_differ"] = again == reference, differ(again)
    for cycle in range(args.cycles):
        c = {"level": 1, "used_before_mib": used() / MiB}
        c["sleep_ms"] = timed(llm.sleep, level=1)
        c["used_asleep_mib"] = used() / MiB
        c["wake_weights_ms"] = timed(llm.wake_up, tags=["weights"])
        c["wake_kv_cache_ms"] = timed(llm.wake_up, tags=["kv_cache"])
        c["used_awake_mib"] = used() / MiB
        c["weights_equal"] = llm.collective_rpc(_weights_digest) == digest
        c["kv_after_wake"] = llm.collective_rpc(_kv_probe, args=(cycle in args.zero_kv_cycles,))[0]
        c["kv_zeroed"] = cycle in args.zero_kv_cycles
        tokens, c["generate_ms"] = generate()
        c["tokens_equal"], c["tokens_differ"] = tokens == reference, differ(tokens)
        c["cycle_ms"] = c["sleep_ms"] + c["wake_weights_ms"] + c["wake_kv_cache_ms"]
        out["cycles"].append(c)
        if cycle == 0:
            out["worker"] = llm.collective_rpc(_worker_facts)
    c = {"level": 2, "used_before_mib": used() / MiB}
    c["sleep_ms"] = timed(llm.sleep, level=2)
    c["used_asleep_mib"] = used() / MiB
    c["wake_weights_ms"] = timed(llm.wake_up, tags=["weights"])
    t = time.perf_counter()
    c["weights_loaded"] = llm.collective_rpc(_reload_weights, args=(model_dir,))
    c["load_ms"] = (time.perf_counter() - t) * 1e3
    c["wake_kv_cache_ms"] = timed(llm.wake_up, tags=["kv_cache"])
    c["used_awake_mib"] = used() / MiB
    c["weights_equal"] = llm.collective_rpc(_weights_digest) == digest
    if not c["weights_equal"]:
        now = llm.collective_rpc(_weights_digest)[0]
        c["weights_differ"] = sorted(k for k in now if now[k] != digest[0].get(k))[:20]
    c["kv_after_wake"] = llm.collective_rpc(_kv_probe, args=(args.cycles in args.zero_kv_cycles,))[0]
    c["kv_zeroed"] = args.cycles in args.zero_kv_cycles
    tokens, c["generate_ms"] = generate()
    c["tokens_equal"], c["tokens_differ"] = tokens == reference, differ(tokens)
    c["cycle_ms"] = c["sleep_ms"] + c["wake_weights_ms"] + c["load_ms"] + c["wake_kv_cache_ms"]
    out["cycles"].append(c)
    return out


def _declare_plugin(dest):
    """vmstash's vllm.general_plugins entry point, declared as the wheel does."""
    sys.path.insert(0, os.path.join(ROOT, "torch_plugin", "python", "tests", "vllm_standins"))
    import assemble
    return assemble.declare_entry_point(dest, "0+bench")


def _child(args, extra, env, timeout):
    cmd = [sys.executable, os.path.abspath(__file__)] + extra
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return r


def _summary(results):
    lines = []
    for name, r in results.items():
        if "error" in r:
            lines.append(f"{name}: FAILED: {r['error'][-600:]}")
            continue
        w = r.get("worker", [{}])[0]
        lines.append(f"{name}: backend {w.get('backend')}, allocator {w.get('allocator')}, graphs "
                     f"{w.get('cudagraph_mode')}, start {r['start_s']:.1f} s ({r['how']}); control equal "
                     f"{r['control_equal']} ({r['control_differ']} differ)")
        for i, c in enumerate(r["cycles"]):
            freed = c["used_before_mib"] - c["used_asleep_mib"]
            load = f" load {c['load_ms']:.1f}" if "load_ms" in c else ""
            lines.append(f"  level {c['level']} cycle {i + 1}: sleep {c['sleep_ms']:.1f} ms (freed {freed:.0f} MiB), "
                         f"wake weights {c['wake_weights_ms']:.1f}{load}, wake kv {c['wake_kv_cache_ms']:.1f}, "
                         f"cycle {c['cycle_ms']:.1f} ms, tokens equal {c['tokens_equal']} "
                         f"({c['tokens_differ']} differ), weights equal {c['weights_equal']}, KV after wake "
                         f"{c['kv_after_wake']}{' zeroed' if c['kv_zeroed'] else ''}")
    return "\n".join(lines)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--site", default=DEFAULT_SITE)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    ap.add_argument("--engine-timeout", type=int, default=420)
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--zero-kv-cycles", default="", type=lambda v: {int(x) for x in v.split(",") if x})
    ap.add_argument("--json")
    ap.add_argument("--make-model", help=argparse.SUPPRESS)
    ap.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.make_model:
        print(json.dumps({"parameters": make_model(args.make_model, args.layers, args.hidden)}))
        return 0
    if args.engine:
        result = run_engine(args.engine, args.model, args)
        with open(args.result, "w") as f:
            json.dump(result, f)
        return 0

    engines = [e for e in args.engines.split(",") if e]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        ap.error(f"--engines: {unknown or 'none'}; choose from {', '.join(ENGINES)}")
    site = os.path.abspath(args.site)
    if not os.path.isfile(os.path.join(site, "vllm", "entrypoints", "llm.py")):
        print(f"vllm_engine_cycle: vLLM's engine is not at {site}: make it with scripts/vllm_engine_site.py "
              "and take it to this machine with scripts/stage_to_gpu.py (docs/usage.md §18)", file=sys.stderr)
        return 2
    tmp = tempfile.mkdtemp(prefix="vllm_engine_cycle_")
    # FlashInfer is not staged (scripts/vllm_engine_site.py): vLLM's top-k/top-p sampler from it
    # is turned off (greedy decoding never uses it), as a user without FlashInfer would.
    # collective_rpc with a function (the weight reload, the worker's facts) needs vLLM's pickle
    # fallback, as verl turns it on.
    # The engine core runs in the LLM's process, as in verl's colocated rollout: requests go in
    # together, so every generate runs the same batches (with a core process of its own, requests
    # arriving while it steps make other batches, and a random model's close logits give other
    # tokens even without a sleep).
    base = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_USE_FLASHINFER_SAMPLER="0",
                VLLM_ALLOW_INSECURE_SERIALIZATION="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    base["PYTHONPATH"] = os.pathsep.join(p for p in [site, os.path.join(ROOT, "torch_plugin", "python"),
                                                     _declare_plugin(os.path.join(tmp, "plugin")),
                                                     os.environ.get("PYTHONPATH", "")] if p)
    for var in ("VMSTASH_VLLM_SLEEP_BACKEND", "VLLM_PLUGINS"):
        base.pop(var, None)
    model_dir = os.path.join(tmp, "model")
    shape = ["--layers", str(args.layers), "--hidden", str(args.hidden)]
    r = _child(args, ["--make-model", model_dir] + shape, base, 600)
    if r.returncode:
        print(f"vllm_engine_cycle: making the model failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}", file=sys.stderr)
        return 1
    report = {"model": {"layers": args.layers, "hidden": args.hidden, **json.loads(r.stdout.splitlines()[-1])},
              "prompts": args.prompts, "tokens": args.tokens, "cycles": args.cycles, "engines": {}}
    for name in engines:
        env = dict(base)
        if name == "vmstash":
            env["VMSTASH_VLLM_SLEEP_BACKEND"] = "1"
        elif name == "cumem_without_plugin":
            env["VLLM_PLUGINS"] = ""
        result = os.path.join(tmp, name + ".json")
        extra = ["--engine", name, "--model", model_dir, "--result", result, "--cycles", str(args.cycles),
                 "--prompts", str(args.prompts), "--tokens", str(args.tokens),
                 "--gpu-memory-utilization", str(args.gpu_memory_utilization)] + (
                     ["--prefix-caching"] if args.prefix_caching else []) + (
                     ["--zero-kv-cycles", ",".join(map(str, sorted(args.zero_kv_cycles)))] if args.zero_kv_cycles else [])
        try:
            r = _child(args, extra, env, args.engine_timeout)
            failed = r.returncode != 0 or not os.path.isfile(result)
            log = (r.stdout or "") + (r.stderr or "")
        except subprocess.TimeoutExpired as e:
            failed, log = True, f"timed out after {args.engine_timeout} s\n{e.stderr or ''}"
        if failed:
            report["engines"][name] = {"error": log[-6000:] if isinstance(log, str) else str(log)[-6000:]}
        else:
            with open(result) as f:
                report["engines"][name] = json.load(f)
            report["engines"][name]["log_tail"] = log[-1500:]
    ok_engines = {n: r for n, r in report["engines"].items() if "error" not in r}
    refs = {n: r["reference"] for n, r in ok_engines.items()}
    first = next(iter(refs.values()), [])
    report["references_differ"] = {n: sum(a != b for x, y in zip(v, first) for a, b in zip(x, y))
                                   for n, v in refs.items()}
    report["references_equal"] = len({json.dumps(v) for v in refs.values()}) <= 1
    report["all_tokens_equal"] = all(c["tokens_equal"] for r in ok_engines.values() for c in r["cycles"])
    report["passed"] = len(ok_engines) == len(engines) and report["references_equal"] and report["all_tokens_equal"]
    print(_summary(report["engines"]))
    if {"vmstash", "cumem"} <= set(ok_engines):
        v, c = ok_engines["vmstash"]["cycles"], ok_engines["cumem"]["cycles"]
        for key in ("sleep_ms", "wake_weights_ms", "wake_kv_cache_ms", "cycle_ms"):
            ratios = [b[key] / a[key] for a, b in zip(v, c) if a[key] > 0]
            print(f"cumem / vmstash, {key}: " + ", ".join(f"{x:.2f}x" for x in ratios))
    print(f"references equal across engines: {report['references_equal']} {report['references_differ']}; "
          f"every cycle's tokens equal: "
          f"{report['all_tokens_equal']}")
    if args.json:
        for r in report["engines"].values():
            r.pop("reference", None)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
