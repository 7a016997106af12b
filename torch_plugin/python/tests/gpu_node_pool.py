"""The node pool on a GPU (label gpu): two PyTorch processes on one GPU take turns through
torch_memory_saver's API (vmstash's drop-in, torch hook mode) with VMSTASH_CONF=node:1 and no
other change: the first one starts vmstashd, both back their weights up in its pool, and each
replays a CUDA graph captured over its weights before the first pause after every resume, with
the outputs equal to the first replay's. Between turns a third process touches the host's free
memory. The pool's figures are checked at each step: a paused process holds one lease, a resumed
one none.

    python3 -m pytest -m gpu gpu_node_pool.py   (VMSTASH_DAEMON: vmstashd; else it is looked for)
"""
import json
import os
import subprocess
import sys
import tempfile

import pytest

from node_helpers import daemon_binary, stop_daemons

pytestmark = pytest.mark.gpu

MiB = 1 << 20

# One side: weights (in a backup region) and a CUDA graph over them; steps from stdin.
SIDE = r'''
import json, sys, torch
from vmstash.compat.torch_memory_saver import torch_memory_saver as tms
import vmstash
tms.hook_mode = "torch"
seed, mib = int(sys.argv[1]), int(sys.argv[2])
dev = torch.device("cuda", 0)
torch.manual_seed(seed)
n = 4096
with tms.region(tag="weights", enable_cpu_backup=True):
    layers = [torch.randn(n, n, device=dev) / n ** 0.5 for _ in range(max(1, (mib << 20) // (n * n * 4)))]
with tms.region(tag="kv_cache", enable_cpu_backup=False):
    kv = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
x = torch.randn(64, n, device=dev)
stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    y = x
    for w in layers:
        y = torch.tanh(y @ w)
torch.cuda.current_stream().wait_stream(stream)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    y = x
    for w in layers:
        y = torch.tanh(y @ w)
graph.replay()
torch.cuda.synchronize()
first = y.clone()
def say(**kw):
    print(json.dumps(kw), flush=True)
say(step="ready", weights=sum(w.numel() * 4 for w in layers))
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "pause":
        tms.pause()
        say(step="pause", node=vmstash.node.stats())
    elif cmd == "resume":
        tms.resume()
        y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        say(step="resume", equal=bool(torch.equal(y, first)), node=vmstash.node.stats())
    elif cmd == "quit":
        break
say(step="end")
'''


class _Side:
    def __init__(self, env, seed, mib):
        self.p = subprocess.Popen([sys.executable, "-c", SIDE, str(seed), str(mib)], env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.ready = self.read()

    def read(self):
        line = self.p.stdout.readline()
        if not line:
            raise AssertionError(f"the process ended: {self.p.stderr.read()[-3000:]}")
        return json.loads(line)

    def ask(self, cmd):
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self.read()


def _squeeze_host(keep_free=6 << 30):
    """A process that touches all but `keep_free` of the host's available memory, then exits."""
    with open("/proc/meminfo") as f:
        avail = next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:"))
    n = avail - keep_free
    if n < (1 << 30):
        return
    subprocess.run([sys.executable, "-c", _HOG, str(n)], check=True, timeout=600)


# Faults in argv[1] bytes of anonymous memory with 16 threads (MADV_POPULATE_WRITE), then exits.
_HOG = r'''
import ctypes, mmap, sys, threading
n = int(sys.argv[1])
libc = ctypes.CDLL(None)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
m = mmap.mmap(-1, n)
base = ctypes.addressof(ctypes.c_char.from_buffer(m))
step = (n // 16) & ~((2 << 20) - 1)
def populate(k):
    size = step if k < 15 else n - 15 * step
    libc.madvise(base + k * step, size, 14)  # MADV_HUGEPAGE
    libc.madvise(base + k * step, size, 23)  # MADV_POPULATE_WRITE
threads = [threading.Thread(target=populate, args=(k,)) for k in range(16)]
[t.start() for t in threads]
[t.join() for t in threads]
'''



def test_two_processes_take_turns_through_the_node_pool_with_cuda_graphs():
    runtime_dir = tempfile.mkdtemp(prefix="vmstash-gpu-node-")
    os.chmod(runtime_dir, 0o700)
    env = dict(os.environ, VMSTASH_CONF="node:1,node_capacity:8G", VMSTASH_RUNTIME_DIR=runtime_dir,
               VMSTASH_DAEMON=daemon_binary())
    sides = []
    try:
        sides = [_Side(env, 1, 1024), _Side(env, 2, 1024)]
        weights = sides[0].ready["weights"]
        active, other = sides
        paused = other.ask("pause")
        assert paused["node"]["process_leases"] == 1 and paused["node"]["process_leased_bytes"] >= weights
        for turn in range(4):
            _squeeze_host()
            paused = active.ask("pause")
            assert paused["node"]["process_leases"] == 1, (turn, paused)
            resumed = other.ask("resume")
            assert resumed["equal"], f"turn {turn}: the graph replayed over the restored weights differs"
            assert resumed["node"]["process_leases"] == 0, (turn, resumed)
            active, other = other, active
        resumed = other.ask("resume")
        assert resumed["equal"]
        assert resumed["node"]["leased_bytes"] == 0, "every lease went back"
        assert resumed["node"]["peak_bytes"] <= 2 * (weights + 64 * MiB)
        for s in sides:
            s.ask("quit")
            assert s.p.wait(60) == 0
            err = s.p.stderr.read()
            assert "cannot hold" not in err, err[-2000:]
    finally:
        for s in sides:
            if s.p.poll() is None:
                s.p.kill()
        stop_daemons(runtime_dir)
