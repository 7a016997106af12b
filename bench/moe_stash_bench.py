"""Synthetic MoE memory benchmark of the paged stash (issue 6, spec claim C8).

Each layer routes T tokens top-k over E experts with skewed (Zipf) per-expert counts; an
expert's input buffer has the static capacity C = ceil(cf * T * k / E) rows (tokens past
C are dropped), as capacity-factor MoE does to keep shapes static for CUDA graphs. Each
expert is a bf16 MLP (hidden -> ffn -> hidden, GELU) whose saved activations are its input
[C, hidden] and the GELU input/output [C, ffn]:
  - oversized: autograd keeps those [C, ...] tensors for every layer in flight;
  - paged stash: vmstash.stash.saved_tensors moves the live rows (rounded up to pages of
    64 rows) into two arenas, sized here to the step's need + 5%.
Reported per (capacity factor, layers in flight): device bytes held after the forward of
all layers (torch's allocations + the arenas' pages), the peak pages used, and the ratio.
One configuration also runs backward and compares the weight gradients with the plain run.

    python3 bench/moe_stash_bench.py [--hidden 2048 --ffn 1024 --experts 16 --tokens 4096 --topk 4]

Needs torch with CUDA and vmstash importable (VMSTASH_LIBRARY or an installed package).
Expert weights are shared by all layers (the memory in question is the activations').
"""
import argparse
import math

import torch
import torch.nn.functional as F

import vmstash

P = 64


def expert(x, w1, w2):
    x = x.clone()  # dispatched tokens: an intermediate tensor, as in a real MoE layer
    return F.linear(F.gelu(F.linear(x, w1)), w2)


def skewed_counts(gen, tokens, topk, experts, capacity):
    probs = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.0
    probs = probs[torch.randperm(experts, generator=gen)]
    counts = torch.multinomial(probs / probs.sum(), tokens * topk, replacement=True, generator=gen).bincount(
        minlength=experts)
    return [min(int(c), capacity) for c in counts]


def run(args, cf, layers, check=False):
    dev = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(1000 * layers + int(cf * 10))
    capacity = math.ceil(cf * args.tokens * args.topk / args.experts)
    counts = [skewed_counts(gen, args.tokens, args.topk, args.experts, capacity) for _ in range(layers)]
    torch.manual_seed(0)
    w1 = [(torch.randn(args.ffn, args.hidden, device=dev, dtype=torch.bfloat16) / 45).requires_grad_()
          for _ in range(args.experts)]
    w2 = [(torch.randn(args.hidden, args.ffn, device=dev, dtype=torch.bfloat16) / 32).requires_grad_()
          for _ in range(args.experts)]
    inputs = [torch.randn(capacity, args.hidden, device=dev, dtype=torch.bfloat16) for _ in range(args.experts)]
    gout = torch.randn(capacity, args.hidden, device=dev, dtype=torch.bfloat16)
    rows = [[torch.tensor([c], device=dev) for c in layer] for layer in counts]
    position = torch.arange(capacity, device=dev).unsqueeze(1)

    def forward(arenas):
        loss = torch.zeros((), device=dev, dtype=torch.float32)
        for l in range(layers):
            for e in range(args.experts):
                # The dispatched buffer: rows past this layer's count are padding (zero).
                x = inputs[e] * (position < rows[l][e]).to(torch.bfloat16)
                if arenas is None:
                    y = expert(x, w1[e], w2[e])
                else:
                    with vmstash.stash.saved_tensors(arenas, max_rows=capacity, rows=rows[l][e], zero_tail=True):
                        y = expert(x, w1[e], w2[e])
                del x
                loss = loss + (y * gout).float().sum()
        return loss

    results = {}
    grads = {}
    for mode in ("oversized", "stash"):
        arenas = None
        arena_bytes = 0
        if mode == "stash":
            pages = sum((c + P - 1) // P for layer in counts for c in layer)
            arenas = [vmstash.stash.Arena(row_bytes=args.hidden * 2, device_pages=math.ceil(pages * 1.05) + 1),
                      vmstash.stash.Arena(row_bytes=args.ffn * 2, device_pages=math.ceil(2 * pages * 1.05) + 1)]
            arena_bytes = sum(a.info()["device_bytes"] for a in arenas)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = forward(arenas)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        peak = torch.cuda.max_memory_allocated() - base
        used_pages = 0
        if arenas is not None:
            flags = [a.flags() for a in arenas]
            assert not any(f.overflow for f in flags), flags
            used_pages = [f.peak_device_pages for f in flags]
        if check:
            grads[mode] = torch.autograd.grad(loss, w1 + w2)
        else:
            del loss
        results[mode] = {"held": held, "peak": peak, "arena": arena_bytes, "used_pages": used_pages}
        if arenas is not None:
            assert all(a.pages_in_use() == 0 for a in arenas) or not check
            for a in arenas:
                a.reset()
                a.close()
        torch.cuda.synchronize()
    if check:
        worst = 0.0
        for r, g in zip(grads["oversized"], grads["stash"]):
            scale = r.float().abs().max().item()
            worst = max(worst, (r.float() - g.float()).abs().max().item() / max(scale, 1e-6))
        assert worst <= 2e-2, f"weight gradients differ: relative {worst}"
        results["grad_rel_diff"] = worst
    live_rows = sum(sum(layer) for layer in counts)
    results["capacity"] = capacity
    results["fill"] = live_rows / (capacity * args.experts * layers)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--cf", type=float, nargs="*", default=[1.5, 2.0, 4.0])
    ap.add_argument("--layers", type=int, nargs="*", default=[4, 16, 64])
    args = ap.parse_args()
    print(f"# MoE stash memory: {torch.cuda.get_device_name(0)}; hidden {args.hidden}, expert ffn {args.ffn}, "
          f"{args.experts} experts, {args.tokens} tokens top-{args.topk}, bf16, pages of {P} rows, Zipf(1.0) routing")
    print("| capacity factor | layers | rows filled | oversized: held after forward | paged stash: torch + arenas "
          "(pages used) | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    first = True
    for cf in args.cf:
        for layers in args.layers:
            r = run(args, cf, layers, check=first)
            o, s = r["oversized"], r["stash"]
            stash_total = s["held"] + s["arena"]
            used = sum(p * P * b for p, b in zip(s["used_pages"], (args.hidden * 2, args.ffn * 2)))
            print(f"| {cf} | {layers} | {100 * r['fill']:.0f}% of {r['capacity']} x {args.experts} | "
                  f"{o['held'] / 2**30:.2f} GiB | {s['held'] / 2**30:.2f} + {s['arena'] / 2**30:.2f} GiB "
                  f"({used / 2**30:.2f} GiB used) | {stash_total / o['held']:.2f} |", flush=True)
            if first:
                print(f"(gradients of the first configuration: stash vs plain, relative max difference "
                      f"{r['grad_rel_diff']:.2e})")
                first = False


if __name__ == "__main__":
    main()
