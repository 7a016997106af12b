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
skip_tokenizer_init (prompts are token ids). Every engine runs in its own process, its engine
core in that process as in verl's colocated rollout (why: _environment), with vLLM's defaults
otherwise (torch.compile, CUDA graphs captured), greedy decoding of --prompts prompts, --tokens
tokens each (ignore_eos):
  1. generate: the reference tokens;
  2. --cycles times, as verl's level-1 cycle: sleep(level=1), wake_up(["weights"]),
     wake_up(["kv_cache"]), generate: the same tokens;
  3. level 2 as verl reloads weights: sleep(level=2), wake_up(["weights"]), the checkpoint's
     weights loaded into the model through collective_rpc (model.load_weights, what verl's rollout
     does with the trainer's), wake_up(["kv_cache"]), generate: the tokens of a fresh engine
     (step 1's).
Each call is timed from the LLM's process (what a framework waits for); the device memory used
(NVML, the whole device) before and after each sleep gives what it released. The worker reports
its sleep-mode backend, the allocator vLLM's worker module resolves, the backends registered
(vmstash's when its plugin was loaded) and the CUDA-graph mode; after each wake, a digest of the
weights and the KV cache's contents (elements not finite, not zero). Children run in process
groups of their own, killed at --engine-timeout or the run's --deadline.
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
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from child_run import Deadline, run_child, scrub  # noqa: E402

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
    try:
        from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
        registry = sorted(SleepModeBackendFactory._registry)
    except ImportError:
        registry = None
    return {"backend": type(self._get_sleep_mode_backend()).__name__, "registry": registry,
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
    nonfinite = nonzero = total = nbytes = 0
    for t in self.model_runner.kv_caches:
        if t is None:
            continue
        flat = t.reshape(-1)
        nbytes += flat.numel() * flat.element_size()
        for start in range(0, flat.numel(), 1 << 28):
            part = flat[start:start + (1 << 28)]
            if part.is_floating_point():
                nonfinite += int((~_torch.isfinite(part)).sum().item())
            nonzero += int(_torch.count_nonzero(part).item())
            total += part.numel()
        if zero:
            t.zero_()
    _torch.cuda.synchronize()
    return {"elements": total, "bytes": nbytes, "nonfinite": nonfinite, "nonzero": nonzero}


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


def _timed(fn, *a, **kw):
    t = time.perf_counter()
    fn(*a, **kw)
    return (time.perf_counter() - t) * 1e3


class EngineRun:
    """One engine in this process: made, its reference tokens, then the cycles (run_engine)."""

    def __init__(self, name, model_dir, args):
        import dataclasses

        import pynvml
        from vllm import LLM, SamplingParams
        from vllm.engine.arg_utils import EngineArgs
        self.model_dir, self.zero = model_dir, args.zero_kv_cycles
        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        self.nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0))
        kwargs = dict(model=model_dir, enable_sleep_mode=True, skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                      gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=1024,
                      max_num_seqs=args.prompts, enable_prefix_caching=args.prefix_caching)
        if name == "vmstash" and "sleep_mode_backend" in {f.name for f in dataclasses.fields(EngineArgs)}:
            kwargs["sleep_mode_backend"] = "vmstash"
        self.out = {"engine": name, "how": "sleep_mode_backend" if "sleep_mode_backend" in kwargs else
                    ("VMSTASH_VLLM_SLEEP_BACKEND=1" if name == "vmstash" else "default"), "cycles": []}
        t = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.out["start_s"] = time.perf_counter() - t
        rng = __import__("random").Random(1234)
        self.prompts = [{"prompt_token_ids": [rng.randrange(3, 32000) for _ in range(rng.randrange(16, 96))]}
                        for _ in range(args.prompts)]
        self.params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
        self.reference, self.out["generate_ms"] = self.generate()
        self.out["reference"] = self.reference
        self.digest = self.llm.collective_rpc(_weights_digest)
        again, _ = self.generate()  # the control: the engine without a sleep
        self.out["control_equal"], self.out["control_differ"] = again == self.reference, self.differ(again)

    def used_mib(self):
        pynvml, handle = self.nvml
        return pynvml.nvmlDeviceGetMemoryInfo(handle).used / MiB

    def generate(self):
        t = time.perf_counter()
        res = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        return [list(r.outputs[0].token_ids) for r in res], (time.perf_counter() - t) * 1e3

    def differ(self, tokens):
        return sum(a != b for x, y in zip(tokens, self.reference) for a, b in zip(x, y))

    def _after_wake(self, c, index):
        """The checks after a whole wake, then the generate (cycle `index`, from 0)."""
        c["used_awake_mib"] = self.used_mib()
        now = self.llm.collective_rpc(_weights_digest)
        c["weights_equal"] = now == self.digest
        if not c["weights_equal"]:
            c["weights_differ"] = sorted(k for k in now[0] if now[0][k] != self.digest[0].get(k))[:20]
        c["kv_after_wake"] = self.llm.collective_rpc(_kv_probe, args=(index in self.zero,))[0]
        c["kv_zeroed"] = index in self.zero
        tokens, c["generate_ms"] = self.generate()
        c["tokens_equal"], c["tokens_differ"] = tokens == self.reference, self.differ(tokens)
        self.out["cycles"].append(c)

    def level1(self, index):
        c = {"level": 1, "used_before_mib": self.used_mib()}
        c["sleep_ms"] = _timed(self.llm.sleep, level=1)
        c["used_asleep_mib"] = self.used_mib()
        c["wake_weights_ms"] = _timed(self.llm.wake_up, tags=["weights"])
        c["wake_kv_cache_ms"] = _timed(self.llm.wake_up, tags=["kv_cache"])
        c["cycle_ms"] = c["sleep_ms"] + c["wake_weights_ms"] + c["wake_kv_cache_ms"]
        self._after_wake(c, index)

    def level2(self, index):
        """verl's order: the weights dropped, woken, loaded from the checkpoint, then the KV cache."""
        c = {"level": 2, "used_before_mib": self.used_mib()}
        c["sleep_ms"] = _timed(self.llm.sleep, level=2)
        c["used_asleep_mib"] = self.used_mib()
        c["wake_weights_ms"] = _timed(self.llm.wake_up, tags=["weights"])
        t = time.perf_counter()
        c["weights_loaded"] = self.llm.collective_rpc(_reload_weights, args=(self.model_dir,))
        c["load_ms"] = (time.perf_counter() - t) * 1e3
        c["wake_kv_cache_ms"] = _timed(self.llm.wake_up, tags=["kv_cache"])
        c["cycle_ms"] = c["sleep_ms"] + c["wake_weights_ms"] + c["load_ms"] + c["wake_kv_cache_ms"]
        self._after_wake(c, index)


def run_engine(name, model_dir, args):
    run = EngineRun(name, model_dir, args)
    for index in range(args.cycles):
        run.level1(index)
        if index == 0:
            run.out["worker"] = run.llm.collective_rpc(_worker_facts)
    run.level2(args.cycles)
    return run.out


def _declare_plugin(dest):
    """vmstash's vllm.general_plugins entry point, declared as the wheel does."""
    sys.path.insert(0, os.path.join(ROOT, "torch_plugin", "python", "tests", "vllm_standins"))
    import assemble
    return assemble.declare_entry_point(dest, "0+bench")


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


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--site", default=DEFAULT_SITE)
    ap.add_argument("--cycles", type=int, default=3, help="level-1 cycles (then one level-2 cycle)")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    ap.add_argument("--engine-timeout", type=int, default=360, help="seconds for one engine's process")
    ap.add_argument("--deadline", type=int, default=840, help="seconds for the whole run (report.py gives 900)")
    ap.add_argument("--prefix-caching", action="store_true", help="vLLM's prefix caching on (tokens may differ)")
    ap.add_argument("--zero-kv-cycles", default="", type=_cycle_list,
                    help="cycles (1-based; the level-2 one is --cycles + 1) whose KV cache is zeroed after its "
                         "wake, before generating: a diagnostic")
    ap.add_argument("--json")
    ap.add_argument("--make-model", help=argparse.SUPPRESS)
    ap.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    return ap, ap.parse_args(argv)


def _cycle_list(value):
    try:
        cycles = {int(x) for x in value.split(",") if x.strip()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected cycle numbers separated by commas") from None
    if any(c < 1 for c in cycles):
        raise argparse.ArgumentTypeError(f"{value!r}: cycles count from 1")
    return {c - 1 for c in cycles}  # run_engine counts from 0


def _environment(site, plugin_dir):
    """What every engine's process runs with."""
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
                                                     _declare_plugin(plugin_dir),
                                                     os.environ.get("PYTHONPATH", "")] if p)
    for var in ("VMSTASH_VLLM_SLEEP_BACKEND", "VLLM_PLUGINS"):
        base.pop(var, None)
    return base


def _run_engine_process(name, args, base, model_dir, tmp, deadline):
    """One engine's result, or {"error": ...} saying why there is none."""
    env = dict(base)
    if name == "vmstash":
        env["VMSTASH_VLLM_SLEEP_BACKEND"] = "1"
    elif name == "cumem_without_plugin":
        env["VLLM_PLUGINS"] = ""  # vLLM loads no plugin
    timeout = deadline.left(args.engine_timeout)
    if timeout < 30:
        return {"error": f"not started: the run's --deadline ({args.deadline} s) has passed"}
    result = os.path.join(tmp, name + ".json")
    extra = ["--engine", name, "--model", model_dir, "--result", result, "--cycles", str(args.cycles),
             "--prompts", str(args.prompts), "--tokens", str(args.tokens),
             "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.prefix_caching:
        extra.append("--prefix-caching")
    if args.zero_kv_cycles:
        extra += ["--zero-kv-cycles", ",".join(str(c + 1) for c in sorted(args.zero_kv_cycles))]
    rc, out, err = run_child([sys.executable, os.path.abspath(__file__)] + extra, env, timeout)
    if rc != 0 or not os.path.isfile(result):
        why = "killed at its time limit" if rc is None else f"exit status {rc}" + (
            "" if rc else ", no result written")
        return {"error": f"{why}\n{(out + err)[-6000:]}"}
    with open(result) as f:
        return json.load(f)


def _judge(report, engines):
    ok = {n: r for n, r in report["engines"].items() if "error" not in r}
    refs = {n: r["reference"] for n, r in ok.items()}
    first = next(iter(refs.values()), [])
    report["references_differ"] = {n: sum(a != b for x, y in zip(v, first) for a, b in zip(x, y))
                                   for n, v in refs.items()}
    report["references_equal"] = len({json.dumps(v) for v in refs.values()}) <= 1
    report["all_tokens_equal"] = all(c["tokens_equal"] for r in ok.values() for c in r["cycles"])
    report["passed"] = len(ok) == len(engines) and report["references_equal"] and report["all_tokens_equal"]
    print(_summary(report["engines"]))
    if {"vmstash", "cumem"} <= set(ok):
        v, c = ok["vmstash"]["cycles"], ok["cumem"]["cycles"]
        for key in ("sleep_ms", "wake_weights_ms", "wake_kv_cache_ms", "cycle_ms"):
            ratios = [b[key] / a[key] for a, b in zip(v, c) if a[key] > 0]
            print(f"cumem / vmstash, {key}: " + ", ".join(f"{x:.2f}x" for x in ratios))
    print(f"references equal across engines: {report['references_equal']} {report['references_differ']}; "
          f"every cycle's tokens equal: {report['all_tokens_equal']}")


def _write(report, path, names):
    """The JSON, without the token lists, with this machine's paths replaced by names."""
    for r in report["engines"].values():
        r.pop("reference", None)
        if "error" in r:
            r["error"] = scrub(r["error"], names)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def main(argv):
    ap, args = _parse(argv)
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
    if unknown or not engines or len(set(engines)) != len(engines):
        ap.error(f"--engines {args.engines!r}: name each of {', '.join(ENGINES)} at most once")
    if args.cycles < 1:
        ap.error("--cycles: at least 1")
    site = os.path.abspath(args.site)
    if not os.path.isfile(os.path.join(site, "vllm", "entrypoints", "llm.py")):
        print(f"vllm_engine_cycle: vLLM's engine is not at {site}: make it with scripts/vllm_engine_site.py "
              "and take it to this machine with scripts/stage_to_gpu.py (docs/usage.md §18)", file=sys.stderr)
        return 2
    deadline = Deadline(args.deadline)
    tmp = tempfile.mkdtemp(prefix="vllm_engine_cycle_")
    try:
        base = _environment(site, os.path.join(tmp, "plugin"))
        model_dir = os.path.join(tmp, "model")
        rc, out, err = run_child([sys.executable, os.path.abspath(__file__), "--make-model", model_dir, "--layers",
                                  str(args.layers), "--hidden", str(args.hidden)], base, deadline.left(300))
        if rc != 0:
            print(f"vllm_engine_cycle: making the model failed ({'killed' if rc is None else f'exit {rc}'}):\n"
                  f"{out[-2000:]}\n{err[-4000:]}", file=sys.stderr)
            return 1
        report = {"model": {"layers": args.layers, "hidden": args.hidden, **json.loads(out.splitlines()[-1])},
                  "prompts": args.prompts, "tokens": args.tokens, "cycles": args.cycles, "engines": {}}
        for name in engines:
            report["engines"][name] = _run_engine_process(name, args, base, model_dir, tmp, deadline)
        _judge(report, engines)
        if args.json:
            _write(report, args.json, {site: "<site>", tmp: "<tmp>", ROOT: "<repo>"})
        return 0 if report["passed"] else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
