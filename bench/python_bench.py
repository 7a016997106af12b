"""Python-level costs of the vmstash package on a GPU, side by side in one process.

    VMSTASH_LIBRARY=.../libvmstash.so PYTHONPATH=torch_plugin/python python3 bench/python_bench.py

1. New 64 MiB segments: N tensors of 64 MiB allocated in a fresh vmstash.region (each a
   new PyTorch segment, served by vmstash_malloc_slot<N>) vs the same through PyTorch's
   own allocator (cudaMalloc per segment); mean per tensor, CUDA-synchronized.
2. region() enter+exit, and pause()+resume() of a tag with no memory, per call.
torch_memory_saver runs the same cases when importable.
"""
import os
import subprocess
import sys
import time

import torch

import vmstash

MiB = 1 << 20
N = 64


def per_segment(make):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    keep = [make() for _ in range(N)]
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / N
    del keep
    return dt


def main():
    torch.cuda.init()
    torch.empty(1, device="cuda")  # context
    new = lambda: torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    with vmstash.region("bench_segments"):
        ours = per_segment(new)
    theirs = per_segment(new)
    torch.cuda.empty_cache()
    print(f"new 64 MiB segment: vmstash MemPool {ours * 1e6:.1f} us, PyTorch default (cudaMalloc) "
          f"{theirs * 1e6:.1f} us, ratio {theirs / ours:.2f}x ({os.environ.get('VMSTASH_CONF') or 'default options'})")
    if len(sys.argv) > 1 and sys.argv[1] == "--segments-only":
        return
    # The same with larger growth steps (fewer cuMemCreate calls), in a fresh process.
    env = dict(os.environ, VMSTASH_CONF=(os.environ.get("VMSTASH_CONF", "") + ",min_chunk:512M").lstrip(","))
    subprocess.run([sys.executable, os.path.abspath(__file__), "--segments-only"], env=env, check=False)
    try:
        from torch_memory_saver import torch_memory_saver as tms
        tms.hook_mode = "torch"  # in process: its preload mode needs LD_PRELOAD set at start
        with tms.region(tag="bench_tms"):
            t = per_segment(new)
        print(f"new 64 MiB segment: torch_memory_saver {t * 1e6:.1f} us")
    except ImportError:
        print("torch_memory_saver: not importable here (no comparison run)")

    reps = 10000
    with vmstash.region("bench_empty"):
        pass
    t0 = time.perf_counter()
    for _ in range(reps):
        with vmstash.region("bench_empty"):
            pass
    region_us = (time.perf_counter() - t0) / reps * 1e6
    t0 = time.perf_counter()
    for _ in range(reps):
        with torch.cuda.use_mem_pool(vmstash.pool("bench_empty")):
            pass
    use_pool_us = (time.perf_counter() - t0) / reps * 1e6
    reps = 1000
    t0 = time.perf_counter()
    for _ in range(reps):
        vmstash.pause("bench_empty")
        vmstash.resume("bench_empty")
    pr_us = (time.perf_counter() - t0) / reps * 1e6
    with vmstash.region("bench_empty_backup", policy="backup"):
        pass
    t0 = time.perf_counter()
    for _ in range(reps):
        vmstash.pause("bench_empty_backup")
        vmstash.resume("bench_empty_backup")
    prb_us = (time.perf_counter() - t0) / reps * 1e6
    print(f"region enter+exit {region_us:.1f} us (torch.cuda.use_mem_pool alone {use_pool_us:.1f} us); "
          f"pause+resume of an empty tag {pr_us:.1f} us (discard), {prb_us:.1f} us (backup: reads the pool's "
          "block state)")


if __name__ == "__main__":
    main()
    # No teardown: torch_memory_saver's torch hook mode refuses the frees of its pool's
    # segments that PyTorch makes at exit, outside a region.
    sys.stdout.flush()
    os._exit(0)
