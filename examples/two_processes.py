"""Two PyTorch processes on one GPU taking turns through vmstash.node.switch (docs/node.md).

    python3 examples/two_processes.py [--turns 4] [--gib 2]

A "trainer" process trains a model whose parameters, gradients and Adam state live in a backup
tag; a "rollout" process holds its own weights (backup) and a KV cache (discarded), and decodes
with a CUDA graph captured once over them. This script takes no part: each turn it switches the
GPU from the trainer to the rollout process (the trainer's tags paused, the rollout's resumed, in
one transaction across the two processes), lets the rollout replay its graph, and switches back
for the next training steps. The graph's output must equal its first replay's after every
switch, and the trainer's loss must keep falling across its pauses. Needs vmstash (the library,
vmstashd beside it or VMSTASH_DAEMON) and a GPU.
"""
import argparse
import json
import subprocess
import sys
import time

TRAINER = r'''
import json, sys, torch, vmstash
gib = float(sys.argv[1])
dev = torch.device("cuda", 0)
torch.manual_seed(0)
width = 4096
layers = max(1, int(gib * (1 << 30) / (width * width * 4 * 4)))  # params + grads + 2 Adam moments
x = torch.randn(256, width, device=dev)
target = torch.randn(256, width, device=dev) * 0.1
with vmstash.region("train", policy="backup"):
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    loss = torch.nn.functional.mse_loss(model(x), target)  # the first step makes the grads and Adam's state here
    loss.backward()
    opt.step()
print(json.dumps(dict(ready=True)), flush=True)
for line in sys.stdin:
    steps = int(line)
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
    print(json.dumps(dict(loss=loss.item())), flush=True)
'''

ROLLOUT = r'''
import json, sys, torch, vmstash
gib = float(sys.argv[1])
dev = torch.device("cuda", 0)
torch.manual_seed(1)
width = 4096
with vmstash.region("weights", policy="backup"):
    layers = [torch.randn(width, width, device=dev) / width ** 0.5 for _ in range(max(1, int(gib * (1 << 30) / (width * width * 4))))]
with vmstash.region("kv_cache"):
    kv = torch.zeros(int(gib * (1 << 30)) // 4, device=dev)
x = torch.randn(64, width, device=dev)
def decode():
    y = x
    for w in layers:
        y = torch.tanh(y @ w)
    kv[: y.numel()].copy_(y.flatten())  # the step writes its KV cache
    return y
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    decode()
torch.cuda.current_stream().wait_stream(s)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    out = decode()
graph.replay()
first = out.clone()
vmstash.pause("weights")
vmstash.pause("kv_cache")
print(json.dumps(dict(ready=True)), flush=True)
for line in sys.stdin:
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    print(json.dumps(dict(equal=bool(torch.equal(out, first)))), flush=True)
'''


class Process:
    def __init__(self, code, gib):
        self.p = subprocess.Popen([sys.executable, "-c", code, str(gib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        self.pid = self.p.pid
        assert self.ask(None)["ready"]

    def ask(self, line):
        if line is not None:
            self.p.stdin.write(f"{line}\n")
            self.p.stdin.flush()
        reply = self.p.stdout.readline()
        if not reply:
            raise RuntimeError(f"process {self.pid} ended (exit {self.p.wait()})")
        return json.loads(reply)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--gib", type=float, default=2, help="each process's backed-up state (the rollout's KV cache too)")
    ap.add_argument("--steps", type=int, default=5, help="training steps per turn")
    args = ap.parse_args()
    import vmstash
    trainer, rollout = Process(TRAINER, args.gib), Process(ROLLOUT, args.gib)
    to_rollout = dict(pause=[(trainer.pid, "train")], resume=[(rollout.pid, "weights"), (rollout.pid, "kv_cache")])
    to_trainer = dict(pause=to_rollout["resume"], resume=to_rollout["pause"])
    losses, ok = [], True
    try:
        for turn in range(args.turns):
            losses.append(trainer.ask(args.steps)["loss"])
            t = time.perf_counter()
            vmstash.node.switch(**to_rollout)
            to_ms = (time.perf_counter() - t) * 1e3
            equal = rollout.ask("decode")["equal"]
            t = time.perf_counter()
            vmstash.node.switch(**to_trainer)
            back_ms = (time.perf_counter() - t) * 1e3
            ok = ok and equal
            print(f"turn {turn}: loss {losses[-1]:.6f}; switch to rollout {to_ms:.1f} ms, graph output "
                  f"{'equal' if equal else 'DIFFERENT'}; switch back {back_ms:.1f} ms", flush=True)
        losses.append(trainer.ask(args.steps)["loss"])
    finally:
        for p in (trainer, rollout):
            p.p.stdin.close()
            p.p.wait(60)
    falling = all(b < a for a, b in zip(losses, losses[1:]))
    print(f"losses {' > '.join(f'{l:.6f}' for l in losses)}: {'falling' if falling else 'NOT falling'}")
    print("vmstashd keeps serving this user's node; `vmstash daemon stop` stops it")
    return 0 if ok and falling else 1


if __name__ == "__main__":
    sys.exit(main())
