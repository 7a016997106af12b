"""Megatron-LM RL's offload of its KV cache and inference model through torch_memory_saver's API,
side by side in one run.

    python3 bench/megatron_rl_offload_bench.py [--cycles 5] [--settle 3] [--json out.json]
        [--peers dropin,dropin_retain,tms] [--modes offload,recompute] [--tms-path /tmp/tms_real]

megatron-core 0.19's own code runs in each process (its wheel importable; no Transformer Engine):
  * the RL inference model, a GPTModel of the local layer spec in bf16 (--hidden, --heads,
    --query-groups, --vocab, and --layers or as many layers as come nearest --weights-gib;
    moved to the device and wrapped in Float16Module, as get_model does), built inside
    torch_memory_saver.region("rl_inference_model", enable_cpu_backup=True), as
    megatron/training/training.py builds it when the inference model is offloaded when idle;
  * one DynamicInferenceContext with static_kv_memory_pointers on, whose KV buffer Megatron
    allocates inside region("inference_context", enable_cpu_backup=(mode == offload)).
Each (peer, mode) runs in its own process: every context of a process shares the tag
"inference_context" (DynamicInferenceContext.TMS_TAG), so the first context's suspend pauses
them all and the next one's pause finds them paused, where torch_memory_saver ends the process
("Cannot pause allocation that is not active"): one context per process, as in an RL job.
  modes: offload    the KV buffer (--kv-gib) backed up (KVCacheManagementMode.OFFLOAD)
         recompute  the KV buffer (--discard-gib) discarded (RECOMPUTE)
  peers: dropin         `import torch_memory_saver` gives vmstash's drop-in package
                        (torch_plugin/python/tms_dropin first on PYTHONPATH), default mode
                        (retain_cpu_backup off: host memory given back after every resume)
         dropin_retain  the same with retain_cpu_backup on (the backup stays pinned)
         tms            torch_memory_saver 0.0.10 itself (--tms-path first on PYTHONPATH, e.g.
                        pip install --no-deps --target /tmp/tms_real its wheel; by default the
                        first on sys.path; left out of the default peers when none is found)
The model's weights and the offload KV buffer are written with known bytes after setup;
`--settle` seconds later, `--cycles` times, as Megatron's RL loop: suspend =
context.deallocate_inference_state_buffers() (pause("inference_context")), then
pause("rl_inference_model"); a training step (--train-gib in --tensors tensors outside any
region, and a matmul; then freed); resume = resume("rl_inference_model"), then
context.reinitialize_inference_state_buffers() (resume("inference_context"); recompute resets
the context's bookkeeping too). Each call is timed with the device synchronized. After every
resume: the weights and (offload) the KV buffer bit for bit, every address unchanged, (recompute)
the KV buffer writable at its address. Per cycle: device memory freed and taken by each call
(cudaMemGetInfo); host MemAvailable (relative to the process's start), RSS and the host bytes
vmstash's arenas hold after the suspend, after the resume and, for dropin, once its background
thread gave the memory back. The pinned link of the same run (2 GiB each way) bounds each call:
the bytes backed up at the link's rate. Megatron builds a log line of memory figures
(device_memory_summary: a memory snapshot and an NVML query) inside every suspend and resume,
logging on or off; it is replaced by a constant so that the times are the allocator's (and
nvidia-ml-py is not needed); --megatron-summary keeps it. Prints a table, the ratios and a
PASSED/FAILED line per run; --json writes everything. Exit status 1 when a run failed or a
check did not hold.
"""
import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tms_backup_bench import (GiB, failure_line, link_line, meminfo, pinned_link, report, rss, timed_ms,  # noqa: E402
                              run_peers, workload_args)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN = os.path.join(ROOT, "torch_plugin", "python")
DROPIN = os.path.join(PLUGIN, "tms_dropin")
PEERS = ("dropin", "dropin_retain", "tms")
MODES = ("offload", "recompute")
MODEL_TAG, KV_TAG = "rl_inference_model", "inference_context"
TAGS = ((KV_TAG, "kv"), (MODEL_TAG, "model"))  # (torch_memory_saver tag, key of its figures)
CHUNK = 1 << 26  # bytes written or checked at once (int64 temporaries of 512 MiB)
KV_SEED = 7
FORWARD = ("cycles", "settle", "tensors", "weights_gib", "discard_gib", "gap", "kv_gib", "hidden", "heads",
           "query_groups", "layers", "vocab", "seq", "block_tokens", "max_requests", "train_gib")


# --- The command line and the model's size (no torch needed) --------------------------------------

def parse_args(argv=None):
    ap = workload_args(__doc__, PEERS)
    ap.set_defaults(weights_gib=3.0, discard_gib=8.0, tensors=64)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--kv-gib", type=float, default=8.0, help="the offload context's KV buffer")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--query-groups", type=int, default=8)
    ap.add_argument("--layers", type=int, default=None, help="default: as many as make --weights-gib")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=4096, help="max sequence length (model and context)")
    ap.add_argument("--block-tokens", type=int, default=256, help="KV block size in tokens")
    ap.add_argument("--max-requests", type=int, default=64)
    ap.add_argument("--train-gib", type=float, default=4.0, help="what the training step allocates")
    ap.add_argument("--tms-path", default=None, help="folder holding torch_memory_saver itself")
    ap.add_argument("--megatron-summary", action="store_true", help="keep Megatron's memory log line")
    return ap.parse_args(argv)


def layers_for(args):
    """The layer count whose bf16 weights come nearest --weights-gib (GPTModel: attention with
    query groups, a 4x MLP, untied embedding and output layer; biases and norms left out)."""
    if args.layers:
        return args.layers
    h, head = args.hidden, args.hidden // args.heads
    per_layer = 2 * (h * (h + 2 * args.query_groups * head) + h * h + 8 * h * h)
    rest = 2 * 2 * args.vocab * h
    return max(1, round((args.weights_gib * GiB - rest) / per_layer))


def child_argv(args, peer, mode):
    argv = [sys.executable, os.path.abspath(__file__), "--child", peer, "--mode", mode]
    for name in FORWARD:
        value = getattr(args, name)
        if value is not None:
            argv += ["--" + name.replace("_", "-"), str(value)]
    return argv + (["--megatron-summary"] if args.megatron_summary else [])


def real_tms_dir(path):
    """The folder holding torch_memory_saver itself (its package has binary_wrapper.py, the
    drop-in's has not): `path`, else the first such entry of sys.path; None if there is none."""
    for folder in ([path] if path else sys.path):
        if folder and os.path.isfile(os.path.join(folder, "torch_memory_saver", "binary_wrapper.py")):
            return os.path.abspath(folder)
    return None


def peer_env(peer, tms_dir, after=()):
    """The child's environment: the peer's torch_memory_saver first on PYTHONPATH, then the
    folders of `after`, then the rest."""
    env = dict(os.environ)
    first = ([DROPIN, PLUGIN] if peer.startswith("dropin") else [tms_dir] if tms_dir else []) + list(after)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in first]
    env["PYTHONPATH"] = os.pathsep.join(first + rest)
    return env


# --- The child: one peer, one mode ---------------------------------------------------------------

def import_saver(peer):
    """torch_memory_saver as Megatron imports it, checked to be the peer's, in torch hook mode."""
    import importlib
    module = importlib.import_module("torch_memory_saver")
    dropin = getattr(module, "served_by", None) == "vmstash"
    if dropin != peer.startswith("dropin"):
        raise SystemExit(f"{peer}: `import torch_memory_saver` gave {module.__file__} "
                         f"({'vmstash drop-in' if dropin else 'torch_memory_saver itself'}); see --tms-path")
    tms = module.torch_memory_saver
    tms.hook_mode = "torch"  # what Megatron sets at import; before the first region
    return tms


def megatron(keep_summary):
    """megatron-core's modules this benchmark drives."""
    from types import SimpleNamespace
    try:
        from megatron.core import parallel_state
        from megatron.core.inference.config import InferenceConfig, KVCacheManagementMode
        from megatron.core.inference.contexts import dynamic_context
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.module import Float16Module
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as e:
        raise SystemExit(f"megatron-core is not importable ({e}): python3 -m pip install --no-deps --no-index "
                         "third_party/wheels/megatron_core-0.19.2-*.whl") from None
    if not dynamic_context.HAVE_TORCH_MEMORY_SAVER:
        raise SystemExit("megatron-core did not find torch_memory_saver")
    if not keep_summary:
        dynamic_context.device_memory_summary = lambda: "(left out by the benchmark)"
    return SimpleNamespace(ps=parallel_state, InferenceConfig=InferenceConfig, Mode=KVCacheManagementMode,
                           Context=dynamic_context.DynamicInferenceContext, local_spec=get_gpt_layer_local_spec,
                           GPTModel=GPTModel, seed=model_parallel_cuda_manual_seed, Float16Module=Float16Module,
                           TransformerConfig=TransformerConfig)


def init_distributed(torch, m):
    """One rank, as Megatron's unit tests set it up."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    m.ps.initialize_model_parallel(1, 1)
    m.seed(123)


def model_config(torch, m, args, layers):
    return m.TransformerConfig(num_layers=layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                               num_query_groups=args.query_groups, ffn_hidden_size=4 * args.hidden, bf16=True,
                               params_dtype=torch.bfloat16, transformer_impl="local", perform_initialization=False,
                               hidden_dropout=0.0, attention_dropout=0.0)


def build_model(torch, m, tms, cfg, args):
    """As training.py builds the RL inference model (get_model: to the device, Float16Module)."""
    with tms.region(tag=MODEL_TAG, enable_cpu_backup=True):
        gpt = m.GPTModel(cfg, m.local_spec(), vocab_size=args.vocab, max_sequence_length=args.seq,
                         position_embedding_type="rope")
        gpt.cuda(torch.cuda.current_device())
        model = m.Float16Module(cfg, gpt)
    return model.eval()


def build_context(m, cfg, args, mode):
    offload = mode == "offload"
    inference = m.InferenceConfig(
        block_size_tokens=args.block_tokens, buffer_size_gb=args.kv_gib if offload else args.discard_gib,
        max_requests=args.max_requests, max_sequence_length=args.seq, static_kv_memory_pointers=True,
        kv_cache_management_mode=m.Mode.OFFLOAD if offload else m.Mode.RECOMPUTE, num_cuda_graphs=None,
        unified_memory_level=0)
    return m.Context(cfg, inference)


def byte_view(t):
    """A contiguous tensor's bytes, flat."""
    import torch
    return t.detach().reshape(-1).view(torch.uint8)


def pattern(torch, n, seed, dev):
    return torch.arange(n, dtype=torch.int64, device=dev).mul_(2654435761).add_(seed).bitwise_right_shift_(9) \
        .to(torch.uint8)


def chunks(t):
    b = byte_view(t)
    for i, start in enumerate(range(0, b.numel(), CHUNK)):
        yield i, b[start:start + CHUNK]


def fill(torch, t, seed):
    for i, part in chunks(t):
        part.copy_(pattern(torch, part.numel(), seed * 100_003 + i, part.device))


def matches(torch, t, seed):
    return all(torch.equal(part, pattern(torch, part.numel(), seed * 100_003 + i, part.device))
               for i, part in chunks(t))


def training_step(torch, dev, gib, tensors):
    """Activations and a matmul outside any region, then freed (PyTorch keeps them cached)."""
    n = max(1, int(gib * GiB) // tensors // 2)
    acts = [torch.empty(n, dtype=torch.bfloat16, device=dev).normal_() for _ in range(tensors)]
    w = torch.randn(4096, 4096, dtype=torch.bfloat16, device=dev)
    total = (w @ w).float().sum() + sum(a.float().sum() for a in acts[:4])
    total.item()
    del acts, w, total



class Run:
    """One child's state: the model, the context, what was written, and the host figures."""

    def __init__(self, torch, tms, peer, mode, model, ctx, baseline):
        self.torch, self.tms, self.peer, self.mode, self.ctx = torch, tms, peer, mode, ctx
        self.params = list(model.parameters())
        self.param_ptrs = [p.data_ptr() for p in self.params]
        self.kv_ptr = ctx.memory_buffer.data_ptr()
        self.baseline = baseline

    def free(self):
        return self.torch.cuda.mem_get_info()[0]

    def held(self):
        """Host bytes vmstash's backup arenas hold (None for torch_memory_saver itself)."""
        if self.peer == "tms":
            return None
        import vmstash
        return sum((vmstash.tag_stats(t) or {}).get("backup_arena_bytes", 0) for t in vmstash.tags())

    def host(self, when):
        return {f"avail_{when}": meminfo("MemAvailable") - self.baseline, f"rss_{when}": rss(),
                f"held_{when}": self.held()}

    def given_back_ms(self, since):
        """dropin gives the backup back on a background thread: wait for it (5 s at most)."""
        if self.peer != "dropin":
            return None
        while self.held() > 0 and time.perf_counter() - since < 5:
            time.sleep(0.005)
        return (time.perf_counter() - since) * 1e3 if self.held() == 0 else None

    def check(self):
        torch, ctx, failures = self.torch, self.ctx, []
        if [p.data_ptr() for p in self.params] != self.param_ptrs:
            failures.append("parameter addresses moved")
        bad = sum(not matches(torch, p, 1000 + i) for i, p in enumerate(self.params))
        if bad:
            failures.append(f"{bad} of {len(self.params)} parameters differ")
        buf = getattr(ctx, "memory_buffer", None)
        if not ctx.is_tensor_state_allocated or buf is None:
            failures.append("the context's state is not allocated")
        elif buf.data_ptr() != self.kv_ptr:
            failures.append("the KV buffer moved")
        elif self.mode == "offload" and not matches(torch, buf, KV_SEED):
            failures.append("the KV buffer differs")
        elif self.mode == "recompute":
            buf.zero_()
            if bool(byte_view(buf).any()):
                failures.append("the KV buffer is not writable")
        return failures

    def cycle(self, n, args):
        torch, ctx, tms, dev = self.torch, self.ctx, self.tms, self.ctx.memory_buffer.device
        row, f0 = {"cycle": n}, self.free()
        row["kv_pause_ms"] = timed_ms(torch, ctx.deallocate_inference_state_buffers)
        f1 = self.free()
        row["model_pause_ms"] = timed_ms(torch, lambda: tms.pause(MODEL_TAG))
        f2 = self.free()
        row.update(kv_freed=f1 - f0, model_freed=f2 - f1, **self.host("suspended"))
        row["train_ms"] = timed_ms(torch, lambda: training_step(torch, dev, args.train_gib, args.tensors))
        f3 = self.free()
        row["model_resume_ms"] = timed_ms(torch, lambda: tms.resume(MODEL_TAG))
        f4 = self.free()
        row["kv_resume_ms"] = timed_ms(torch, ctx.reinitialize_inference_state_buffers)
        resumed = time.perf_counter()
        row.update(model_taken=f3 - f4, kv_taken=f4 - self.free(), **self.host("resumed"))
        row["given_back_ms"] = self.given_back_ms(resumed)
        row.update(self.host("after"))
        row["failures"] = self.check()
        row["mismatches"] = len(row["failures"])
        return row


def child(args):
    import json
    baseline = meminfo("MemAvailable")
    import torch
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    peer, mode = args.child, args.mode
    tms = import_saver(peer)
    m = megatron(args.megatron_summary)
    if peer == "dropin_retain":
        tms.retain_cpu_backup = True
    init_distributed(torch, m)
    layers = layers_for(args)
    cfg = model_config(torch, m, args, layers)
    t0 = time.perf_counter()
    model = build_model(torch, m, tms, cfg, args)
    t1 = time.perf_counter()
    ctx = build_context(m, cfg, args, mode)
    t2 = time.perf_counter()
    run = Run(torch, tms, peer, mode, model, ctx, baseline)
    for i, p in enumerate(run.params):
        fill(torch, p, 1000 + i)
    if mode == "offload":
        fill(torch, ctx.memory_buffer, KV_SEED)
    torch.cuda.synchronize()
    out = dict(peer=f"{peer}/{mode}", mode=mode, layers=layers, params=sum(p.numel() for p in run.params),
               tensors=len(run.params), model_bytes=sum(p.numel() * p.element_size() for p in run.params),
               kv_bytes=ctx.memory_buffer.numel() * ctx.memory_buffer.element_size(),
               kv_shape=list(ctx.memory_buffer.shape), build_model_s=t1 - t0, build_context_s=t2 - t1,
               config={name: getattr(args, name) for name in FORWARD})
    time.sleep(args.settle)
    rows = []
    for n in range(1, args.cycles + 1):
        rows.append(run.cycle(n, args))
        print(json.dumps(dict(peer=out["peer"], **rows[-1])), file=sys.stderr, flush=True)
        time.sleep(args.gap)
    print(json.dumps(dict(out, rows=rows)), flush=True)
    os._exit(0)  # no teardown: torch_memory_saver's torch mode refuses frees outside a region


# --- The parent -------------------------------------------------------------------------------

def run_child(args, label, tms_dir):
    import json
    peer, mode = label.split("/")
    t = time.perf_counter()
    p = subprocess.run(child_argv(args, peer, mode), capture_output=True, text=True, env=peer_env(peer, tms_dir))
    if p.returncode != 0 or not p.stdout.strip():
        return dict(peer=label, mode=mode, error=(p.stderr or p.stdout)[-3000:], seconds=time.perf_counter() - t)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["seconds"] = time.perf_counter() - t
    return out


def span(xs):
    return f"{min(xs):.1f}-{max(xs):.1f}" if xs else "-"


def gib(x):
    return "-" if x is None else f"{x / GiB:.2f}"


def tag_bytes(r, key):
    """Bytes the tag backs up (0: discarded)."""
    if key == "model":
        return r["model_bytes"]
    return r["kv_bytes"] if r["mode"] == "offload" else 0


def time_lines(results, d2h, h2d):
    lines = [f"{'run':<24} {'tag':<19} {'backed up':>9} {'pause ms c1':>11} {'later':>13} "
             f"{'resume ms c1':>12} {'later':>13} {'best x bound out/in':>19} {'freed GiB':>9}"]
    for r in results:
        if "error" in r:
            lines.append(failure_line(r, 24))
            continue
        for tag, key in TAGS:
            pause = [row[f"{key}_pause_ms"] for row in r["rows"]]
            resume = [row[f"{key}_resume_ms"] for row in r["rows"]]
            nbytes = tag_bytes(r, key)
            bound = (f"{min(pause) / (nbytes / d2h * 1e3):.2f}x / {min(resume) / (nbytes / h2d * 1e3):.2f}x"
                     if nbytes and pause else "-")
            freed = gib(r["rows"][0][f"{key}_freed"]) if r["rows"] else "-"
            lines.append(f"{r['peer']:<24} {tag:<19} {gib(nbytes) if nbytes else 'discard':>9} "
                         f"{pause[0] if pause else 0:11.1f} {span(pause[1:]):>13} {resume[0] if resume else 0:12.1f} "
                         f"{span(resume[1:]):>13} {bound:>19} {freed:>9}")
    return lines


def ratio_lines(results):
    """torch_memory_saver's times over each drop-in peer's, per cycle, per mode and tag."""
    by = {r["peer"]: r for r in results if "error" not in r}
    lines = []
    for mode in MODES:
        ref = by.get(f"tms/{mode}")
        for peer in PEERS[:-1]:
            mine = by.get(f"{peer}/{mode}")
            if not ref or not mine:
                continue
            for tag, key in TAGS:
                for what in ("pause", "resume"):
                    k = f"{key}_{what}_ms"
                    ratios = [t[k] / v[k] if v[k] > 0 else float("inf") for t, v in zip(ref["rows"], mine["rows"])]
                    lines.append(f"torch_memory_saver / {peer:<13} {mode:<9} {tag:<18} {what:<6} per cycle: "
                                 + " ".join(f"{x:.1f}x" for x in ratios))
    return lines


def memory_lines(results):
    lines = ["device GiB freed by the suspend (KV / model) and taken by the resume (model / KV); host GiB:",
             "MemAvailable relative to the process's start and held (vmstash's arenas) after the suspend / the "
             "resume / the give-back (dropin)",
             f"{'run':<24} {'cycle':>5} {'freed':>11} {'taken':>11} {'avail':>20} {'held':>20} {'RSS after':>9} "
             f"{'given back ms':>13} {'train ms':>8} bad"]
    for r in results:
        for row in r.get("rows", []):
            given = "-" if row["given_back_ms"] is None else f"{row['given_back_ms']:.0f}"
            avail = " / ".join(gib(row[f"avail_{w}"]) for w in ("suspended", "resumed", "after"))
            held = " / ".join(gib(row[f"held_{w}"]) for w in ("suspended", "resumed", "after"))
            lines.append(f"{r['peer']:<24} {row['cycle']:>5} {gib(row['kv_freed']):>5}/{gib(row['model_freed']):<5} "
                         f"{gib(row['model_taken']):>5}/{gib(row['kv_taken']):<5} {avail:>20} {held:>20} "
                         f"{gib(row['rss_after']):>9} {given:>13} {row['train_ms']:8.1f} {row['mismatches']}")
    return lines


def verdict_lines(results):
    lines = []
    for r in results:
        if "error" in r:
            lines.append("FAILED " + failure_line(r, 0))
            continue
        bad = [(row["cycle"], row["failures"]) for row in r["rows"] if row["failures"]]
        if bad:
            lines += [f"FAILED {r['peer']}: cycle {c}: {'; '.join(f)}" for c, f in bad]
            continue
        kv = (f"the KV buffer ({gib(r['kv_bytes'])} GiB) bit for bit" if r["mode"] == "offload"
              else "the KV buffer writable")
        lines.append(f"PASSED {r['peer']}: {len(r['rows'])} cycles: {r['tensors']} weight tensors "
                     f"({gib(r['model_bytes'])} GiB) bit for bit, {kv}, every address unchanged")
    return lines


def table(results, d2h, h2d):
    ok = [r for r in results if "error" not in r]
    lines = [link_line(d2h, h2d)]
    if ok:
        r = ok[0]
        lines.append(f"model: GPTModel, {r['layers']} layers, {r['params'] / 1e9:.2f} B parameters, "
                     f"{gib(r['model_bytes'])} GiB bf16 in {r['tensors']} tensors; KV buffer {r['kv_shape']}")
    lines += ["times in ms with the device synchronized; c1: the first cycle, later: the others (min-max);",
              "x bound: the best time over the tag's backed-up bytes at the link's rate"]
    return lines + time_lines(results, d2h, h2d) + ratio_lines(results) + memory_lines(results) \
        + verdict_lines(results)


def chosen_runs(args, tms_dir):
    """The (peer/mode) runs: the default peers leave tms out when torch_memory_saver itself is
    not found."""
    peers, modes = args.peers.split(","), args.modes.split(",")
    unknown = [x for x in peers if x not in PEERS] + [x for x in modes if x not in MODES]
    if unknown:
        raise SystemExit(f"unknown peer or mode: {', '.join(unknown)} (peers: {', '.join(PEERS)}; "
                         f"modes: {', '.join(MODES)})")
    if "tms" in peers and tms_dir is None:
        if args.peers != ",".join(PEERS):
            raise SystemExit("--peers tms: torch_memory_saver itself not found (its folder: --tms-path)")
        print("torch_memory_saver itself not found (--tms-path): running the drop-in peers only", flush=True)
        peers.remove("tms")
    return ",".join(f"{p}/{m}" for p in peers for m in modes)


def main():
    args = parse_args()
    if args.child:
        return child(args)
    tms_dir = real_tms_dir(args.tms_path)
    names = chosen_runs(args, tms_dir)
    known = [f"{p}/{m}" for p in PEERS for m in MODES]
    import torch
    d2h, h2d = pinned_link(torch, torch.device("cuda", 0))
    torch.cuda.empty_cache()  # the link's device buffer back before the children start
    results = run_peers(names, known, lambda label: run_child(args, label, tms_dir))
    return report(torch, results, table(results, d2h, h2d), args.json, d2h, h2d)


if __name__ == "__main__":
    sys.exit(main())
