"""Two GPUs, one process per GPU (torch.distributed, NCCL; label gpu, needs 2 GPUs): each
rank pauses and resumes its tagged buffers, then all_reduce on the resumed buffers gives
the right sum. Skips with fewer than 2 GPUs. Marker gpu, ctest label gpu; in a fresh
process (conftest.py), from which torch.multiprocessing starts the ranks.

    python3 -m pytest -m gpu gpu_two_ranks.py
"""
import os

import pytest

pytestmark = pytest.mark.gpu


def rank_main(rank, world, port):
    import torch
    import torch.distributed as dist
    import vmstash

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    with vmstash.region("dist_weights", policy="backup"):
        w = torch.full((64 << 20,), float(rank + 1), device="cuda")  # 256 MiB
    with vmstash.region("dist_kv"):
        kv = torch.empty(128 << 20, device="cuda")  # 512 MiB, discarded
    dist.all_reduce(torch.ones(1, device="cuda"))  # NCCL is up before the pause
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    assert vmstash.pause("dist_kv") and vmstash.pause("dist_weights")
    freed = torch.cuda.mem_get_info()[0] - free0
    dist.barrier()
    assert vmstash.resume("dist_weights") and vmstash.resume("dist_kv")
    kv.fill_(rank)
    dist.all_reduce(w)  # on the resumed buffer
    dist.all_reduce(kv)
    torch.cuda.synchronize()
    expected = float(sum(r + 1 for r in range(world)))
    assert torch.all(w == expected).item(), (rank, w[:4])
    assert torch.all(kv == float(sum(range(world)))).item()
    print(f"rank {rank}: pause freed {freed / (1 << 30):.2f} GiB; all_reduce on resumed buffers = {expected}")
    dist.destroy_process_group()


def test_two_ranks_pause_resume_all_reduce():
    import torch
    import torch.multiprocessing as mp
    world = torch.cuda.device_count()
    if world == 0:  # the parent saw a GPU (conftest.py): none here is a failure, not a skip
        pytest.fail("two-rank test: torch sees no CUDA device in this process")
    if world < 2:
        pytest.skip(f"two-rank test: {world} GPU(s) here, needs 2")
    world = 2
    mp.spawn(rank_main, args=(world, 29511), nprocs=world, join=True)
    print("two-rank test: OK")
