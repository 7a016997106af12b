"""Megatron-core's own inference engine (DynamicInferenceEngine, the one Megatron-LM's RL loop
rolls out with) generating with its CUDA graphs, suspended and resumed through the
torch_memory_saver API: vmstash's drop-in and torch_memory_saver 0.0.10 itself, side by side in
one run (GPU).

    python3 bench/megatron_engine_cycle.py [--peers dropin,tms] [--modes offload,recompute]
        [--cycles 3] [--json out.json] [--tms-path /tmp/tms_real]

SGLang, the serving engine that calls torch_memory_saver, does not load on the GPU machine (its
newest release on the index, 0.5.10.post1, pins torch 2.9.1 and sglang-kernel 0.4.1, whose
libraries link CUDA 12's runtime and torch 2.9's C++ symbols; the machine has CUDA 13 and torch
2.11): this is the closest real consumer of that API that does. Megatron's dynamic engine needs
flash-attn for its paged attention, which the machine lacks and PyPI has no binary of: --site
(scripts/vllm_engine_site.py's folder, staged as docs/usage.md §18 says) provides vLLM's
FlashAttention 3 build, which bench/flash_attn_standin/flash_attn exposes as the two flash-attn
functions Megatron calls (its attention code unchanged). megatron-core 0.19.2's code in each
process (its wheel importable; no Transformer Engine):
  * a GPTModel of the local layer spec in bf16 with Megatron's own CUDA graphs
    (cuda_graph_impl "local"), built inside torch_memory_saver.region("rl_inference_model",
    enable_cpu_backup=True) as megatron/training builds the RL inference model;
  * the engine pipeline as megatron.core.inference.apis builds it: DynamicInferenceContext with
    static_kv_memory_pointers (its KV buffer in region("inference_context"), backed up in mode
    offload, discarded in recompute), GPTInferenceWrapper, TextGenerationController (a stand-in
    tokenizer: prompts are token ids), DynamicInferenceEngine, which captures its CUDA graphs
    when it is made.
Per peer and mode, in its own process: generate --prompts prompts, --tokens tokens each, greedy
(top_k 1, no early stop): the reference. Then --cycles times, as Megatron's RL loop: engine.suspend()
(pause of the KV region), pause("rl_inference_model"), a training step outside any region,
resume("rl_inference_model"), engine.resume() (resume of the KV region; with static pointers
the graphs are kept, not captured again), generate: the same tokens, replayed through the same
graphs; in mode offload the KV buffer's bytes are compared before the suspend and after the
resume. Each call is timed with the device synchronized; the device memory each pause frees
(cudaMemGetInfo). Each run is a process group of its own, killed at --timeout or the run's
--deadline.
Exit status 1 when a run failed, tokens differ after a cycle, or the peers' references differ.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_rl_offload_bench import (MODEL_TAG, chunks, import_saver, init_distributed,  # noqa: E402
                                       megatron, peer_env, real_tms_dir, training_step)
from tms_backup_bench import timed_ms  # noqa: E402
from child_run import Deadline, run_child, scrub  # noqa: E402
from vllm_engine_cycle import DEFAULT_SITE  # noqa: E402  (the staged vLLM: its FlashAttention 3)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STANDIN = os.path.join(HERE, "flash_attn_standin")

PEERS = ("dropin", "tms")
MODES = ("offload", "recompute")
MiB = 1 << 20


class StandInTokenizer:
    """What the controller and engine ask of a tokenizer when prompts are token ids."""

    def __init__(self, vocab):
        self.vocab_size, self.eod, self.bos = vocab, vocab - 1, None

    def tokenize(self, text):
        return [int(x) for x in text.split()]

    def detokenize(self, tokens, **_):
        return " ".join(str(int(t)) for t in tokens)

    def offsets(self, tokens, text):
        out, pos = [], 0
        for t in tokens:
            out.append(pos)
            pos += len(str(int(t))) + 1
        return out


def engine_parts():
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController)
    return DynamicInferenceEngine, GPTInferenceWrapper, SamplingParams, TextGenerationController


def build(torch, m, tms, args, dev):
    """The model in its region, then the engine pipeline as megatron.core.inference.apis makes it
    (the engine captures its CUDA graphs when it is made): (model, context, engine, seconds)."""
    Engine, Wrapper, _, Controller = engine_parts()
    cfg = m.TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.hidden // 128,
                              num_query_groups=max(1, args.hidden // 512), ffn_hidden_size=4 * args.hidden, bf16=True,
                              params_dtype=torch.bfloat16, transformer_impl="local", hidden_dropout=0.0,
                              attention_dropout=0.0, init_method_std=0.02, cuda_graph_impl="local")
    with tms.region(tag=MODEL_TAG, enable_cpu_backup=True):
        gpt = m.GPTModel(cfg, m.local_spec(), vocab_size=args.vocab, max_sequence_length=args.seq,
                         position_embedding_type="rope")
        gpt.cuda(dev)
        model = m.Float16Module(cfg, gpt).eval()
    inference = m.InferenceConfig(block_size_tokens=256, buffer_size_gb=args.kv_gib, max_requests=args.prompts,
                                  max_sequence_length=args.seq, static_kv_memory_pointers=True,
                                  kv_cache_management_mode=m.Mode.OFFLOAD if args.mode == "offload" else
                                  m.Mode.RECOMPUTE, num_cuda_graphs=args.graphs, unified_memory_level=0)
    t = time.perf_counter()
    ctx = m.Context(cfg, inference)
    engine = Engine(controller=Controller(inference_wrapped_model=Wrapper(model, ctx),
                                          tokenizer=StandInTokenizer(args.vocab)), context=ctx)
    return model, ctx, engine, time.perf_counter() - t


def kv_digest(torch, buf):
    """The KV buffer's bytes summed, a piece at a time (megatron_rl_offload_bench.chunks)."""
    return sum(int(part.to(torch.int64).sum().item()) for _, part in chunks(buf))


def cycle(torch, tms, engine, ctx, dev, args):
    """One RL-loop cycle, each call timed, the KV buffer's bytes compared in mode offload."""
    free = lambda: torch.cuda.mem_get_info()[0]  # noqa: E731
    before = kv_digest(torch, ctx.memory_buffer) if args.mode == "offload" else None
    row, f0 = {}, free()
    row["engine_suspend_ms"] = timed_ms(torch, engine.suspend)
    f1 = free()
    row["model_pause_ms"] = timed_ms(torch, lambda: tms.pause(MODEL_TAG))
    f2 = free()
    row.update(kv_freed_mib=(f1 - f0) / MiB, model_freed_mib=(f2 - f1) / MiB)
    row["train_ms"] = timed_ms(torch, lambda: training_step(torch, dev, args.train_gib, 64))
    row["model_resume_ms"] = timed_ms(torch, lambda: tms.resume(MODEL_TAG))
    row["engine_resume_ms"] = timed_ms(torch, engine.resume)
    if before is not None:
        row["kv_equal"] = kv_digest(torch, ctx.memory_buffer) == before
    return row


def child(args):
    import random

    import torch
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    tms = import_saver(args.child)
    m = megatron(False)
    init_distributed(torch, m)
    m.seed(123, inference_rng_tracker=True, force_reset_rng=True)  # CUDA graphs need it (as Megatron's inference)
    model, ctx, engine, made_s = build(torch, m, tms, args, dev)
    rng = random.Random(99)
    prompts = [[rng.randrange(1, args.vocab - 1) for _ in range(rng.randrange(16, 64))] for _ in range(args.prompts)]
    params = engine_parts()[2](top_k=1, num_tokens_to_generate=args.tokens, termination_id=-1)

    def generate():
        t = time.perf_counter()
        records = engine.generate(prompts, params)
        torch.cuda.synchronize()
        return [list(map(int, r.merge().generated_tokens)) for r in records], (time.perf_counter() - t) * 1e3

    reference, gen_ms = generate()
    rows = []
    for n in range(1, args.cycles + 1):
        row = dict(cycle=n, **cycle(torch, tms, engine, ctx, dev, args))
        tokens, row["generate_ms"] = generate()
        row["tokens_equal"] = tokens == reference
        row["tokens_differ"] = sum(a != b for x, y in zip(tokens, reference) for a, b in zip(x, y))
        rows.append(row)
        print(json.dumps(dict(peer=f"{args.child}/{args.mode}", **row)), file=sys.stderr, flush=True)
    out = {"peer": f"{args.child}/{args.mode}", "engine_made_s": made_s, "generate_ms": gen_ms, "rows": rows,
           "graphs": len(getattr(ctx, "cuda_graph_batch_dimensions_list", []) or []),
           "params": sum(p.numel() for p in model.parameters()), "reference": reference,
           "kv_bytes": ctx.memory_buffer.numel() * ctx.memory_buffer.element_size()}
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # no teardown: torch_memory_saver's torch mode refuses frees outside a region


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--graphs", type=int, default=8)
    ap.add_argument("--kv-gib", type=float, default=4.0)
    ap.add_argument("--train-gib", type=float, default=2.0)
    ap.add_argument("--tms-path")
    ap.add_argument("--site", default=DEFAULT_SITE, help="vLLM's wheel unpacked (scripts/vllm_engine_site.py)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds for one run's process")
    ap.add_argument("--deadline", type=int, default=840, help="seconds for the whole run (report.py gives 900)")
    ap.add_argument("--json")
    ap.add_argument("--child", choices=PEERS, help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    return ap, ap.parse_args(argv)


def _names(ap, value, known, option):
    names = [x for x in value.split(",") if x]
    if not names or len(set(names)) != len(names) or any(x not in known for x in names):
        ap.error(f"{option} {value!r}: name each of {', '.join(known)} at most once")
    return names


def _run(peer, mode, args, site, tms_dir, deadline):
    """One (peer, mode) in its own process: its result, or {"error": ...} saying why there is none."""
    timeout = deadline.left(args.timeout)
    if timeout < 30:
        return {"error": f"not started: the run's --deadline ({args.deadline} s) has passed"}
    keep = ["--layers", args.layers, "--hidden", args.hidden, "--vocab", args.vocab, "--seq", args.seq,
            "--prompts", args.prompts, "--tokens", args.tokens, "--graphs", args.graphs,
            "--kv-gib", args.kv_gib, "--train-gib", args.train_gib, "--cycles", args.cycles]
    cmd = [sys.executable, os.path.abspath(__file__), "--child", peer, "--mode", mode] + [str(x) for x in keep]
    env = dict(peer_env(peer, tms_dir, after=(STANDIN, site)), PYTHONUNBUFFERED="1")
    rc, out, err = run_child(cmd, env, timeout)
    line = [x for x in out.splitlines() if x.startswith("RESULT ")]
    if rc == 0 and line:
        return json.loads(line[-1][7:])
    why = "killed at its time limit" if rc is None else f"exit status {rc}" + ("" if rc else ", no result")
    return {"error": f"{why}\n{(out + err)[-6000:]}"}


def _print(results):
    for name, r in results.items():
        if "error" in r:
            print(f"{name}: FAILED\n{r['error'][-3000:]}")
            continue
        print(f"{name}: {r['params'] / 1e6:.0f}M parameters, KV buffer {r['kv_bytes'] / MiB:.0f} MiB, "
              f"{r['graphs']} CUDA graphs, engine made in {r['engine_made_s']:.1f} s")
        for x in r["rows"]:
            print(f"  cycle {x['cycle']}: suspend {x['engine_suspend_ms']:.1f} ms (freed {x['kv_freed_mib']:.0f} MiB), "
                  f"model pause {x['model_pause_ms']:.1f} ({x['model_freed_mib']:.0f} MiB), model resume "
                  f"{x['model_resume_ms']:.1f}, resume {x['engine_resume_ms']:.1f} ms, tokens equal "
                  f"{x['tokens_equal']} ({x['tokens_differ']} differ), KV bytes equal {x.get('kv_equal', '-')}")
    for mode in MODES:
        a, b = results.get(f"dropin/{mode}"), results.get(f"tms/{mode}")
        if a and b and "error" not in a and "error" not in b:
            for key in ("engine_suspend_ms", "model_pause_ms", "model_resume_ms", "engine_resume_ms"):
                print(f"{mode}: torch_memory_saver / drop-in, {key}: " +
                      ", ".join(f"{y[key] / x[key]:.2f}x" for x, y in zip(a["rows"], b["rows"]) if x[key] > 0))


def main(argv):
    ap, args = _parse(argv)
    if args.child:
        return child(args)
    peers, modes = _names(ap, args.peers, PEERS, "--peers"), _names(ap, args.modes, MODES, "--modes")
    if args.cycles < 1:
        ap.error("--cycles: at least 1")
    tms_dir = real_tms_dir(args.tms_path)
    site = os.path.abspath(args.site)
    if not os.path.isfile(os.path.join(site, "vllm", "vllm_flash_attn", "_vllm_fa3_C.abi3.so")):
        print(f"megatron_engine_cycle: no FlashAttention 3 build at {site}: Megatron's dynamic engine needs one; make "
              "it with scripts/vllm_engine_site.py and stage it with scripts/stage_to_gpu.py (docs/usage.md §18)",
              file=sys.stderr)
        return 2
    deadline, results = Deadline(args.deadline), {}
    for peer in peers:
        if peer == "tms" and not tms_dir:
            print("torch_memory_saver 0.0.10 itself is not importable (--tms-path): left out", flush=True)
            continue
        for mode in modes:
            results[f"{peer}/{mode}"] = _run(peer, mode, args, site, tms_dir, deadline)
    ok = {n: r for n, r in results.items() if "error" not in r}
    refs_equal = len({json.dumps(r["reference"]) for r in ok.values()}) <= 1
    passed = bool(results) and len(ok) == len(results) and refs_equal and all(
        x["tokens_equal"] and x.get("kv_equal", True) for r in ok.values() for x in r["rows"])
    _print(results)
    print(f"references equal across runs: {refs_equal}; {'PASSED' if passed else 'FAILED'}")
    if args.json:
        names = {site: "<site>", ROOT: "<repo>"}
        for r in results.values():
            r.pop("reference", None)
            if "error" in r:
                r["error"] = scrub(r["error"], names)
        with open(args.json, "w") as f:
            json.dump({"runs": results, "passed": passed}, f, indent=1)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
