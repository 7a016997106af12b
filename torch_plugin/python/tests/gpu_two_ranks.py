"""Two GPUs, one process per GPU (torch.distributed, NCCL; label gpu, needs 2 GPUs). Skips
with fewer than 2 GPUs. Marker gpu, ctest label gpu; each test in a fresh process
(conftest.py), from which torch.multiprocessing starts the ranks (spawn).

- Pause and resume on each rank, then all_reduce on the resumed buffers.
- vmstash.distributed.switch over the job's NCCL group (its gloo generations, Note [Exchange
  Generations]) with a CUDA graph captured before the switch that holds an NCCL all_reduce
  and an all_gather on tensors of the switched tag: after every switch out and back, the
  replay gives the right sums and gathers for new inputs, at the same addresses. Under
  NCCL's defaults, with NCCL_GRAPH_REGISTER=0, and with torch's allocator hook that
  registers segments with NCCL (TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1).
- Failures, one after another in one job: ranks asking for different switches; one rank out
  of device memory (every rank rolls back, the error names the rank, the retry converges);
  a rank that hangs before the request and one that hangs at the vote (the other raises
  DEADLINE_EXCEEDED, every rank as it was, the retry converges); a rank that dies at the
  vote (the other rolls back and raises within the timeout, no hang).

    python3 -m pytest -m gpu gpu_two_ranks.py
"""
import json
import os
import tempfile
import time

import pytest

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def _init(rank, world, port, env):
    import torch
    import torch.distributed as dist
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))


def _store_barrier(name, world, timeout=120):
    """Every rank here (the job's store: the NCCL group may be the thing under test)."""
    from torch.distributed import distributed_c10d as c10d
    store = c10d._get_default_store()
    store.add(f"barrier/{name}", 1)
    until = time.monotonic() + timeout
    while int(store.add(f"barrier/{name}", 0)) < world:
        assert time.monotonic() < until, f"barrier {name}"
        time.sleep(0.005)


def _finish(world):
    """Leaves once every rank is done, rank 0 (which holds the job's store) last."""
    from torch.distributed import distributed_c10d as c10d
    store = c10d._get_default_store()
    _store_barrier("finish", world)
    if c10d.get_rank() != 0:
        store.add("left", 1)
        os._exit(0)
    until = time.monotonic() + 60
    while int(store.add("left", 0)) < world - 1 and time.monotonic() < until:
        time.sleep(0.005)
    os._exit(0)


def pause_resume_all_reduce(rank, world, port, out, env):
    import torch
    import torch.distributed as dist
    import vmstash
    _init(rank, world, port, env)
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


def graph_across_switches(rank, world, port, out, env):
    """A graph with NCCL collectives on tensors of tag 'train', captured before the switches."""
    import torch
    import torch.distributed as dist
    import vmstash
    import vmstash.distributed as vd
    _init(rank, world, port, env)
    n = 1 << 20  # 4 MiB of float32 per tensor
    with vmstash.region("train", policy="backup"):
        filler = torch.full((256 * MiB // 4,), float(rank + 7), device="cuda")
        x = torch.zeros(n, device="cuda")
        y = torch.zeros(n, device="cuda")
        gathered = torch.zeros(world * n, device="cuda")
    with vmstash.region("roll", policy="backup"):
        kv = torch.full((512 * MiB // 4,), float(rank + 3), device="cuda")
    assert vd.pause("roll", timeout=60)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up on a side stream before the capture
            dist.all_reduce(x)
            dist.all_gather_into_tensor(gathered, y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(x)            # in place
        y.copy_(x)
        y.mul_(rank + 1)
        dist.all_gather_into_tensor(gathered, y)  # out of place: NCCL may register `gathered`
    torch.cuda.synchronize()
    ptrs = (x.data_ptr(), y.data_ptr(), gathered.data_ptr(), filler.data_ptr(), kv.data_ptr())
    record = {"rank": rank, "cycles": []}
    for cycle in range(3):
        t0 = time.perf_counter()
        assert vd.switch(["train"], ["roll"], timeout=60)
        t1 = time.perf_counter()
        free_train_paused = torch.cuda.mem_get_info()[0]
        assert torch.all(kv == float(rank + 3)).item(), "roll's bytes after its resume"
        dist.all_reduce(kv)  # eager NCCL on a resumed tag
        torch.cuda.synchronize()
        assert torch.all(kv == float(sum(r + 3 for r in range(world)))).item(), (rank, kv[:4])
        kv.fill_(float(rank + 3))
        assert vd.switch(["roll"], ["train"], timeout=60)
        t2 = time.perf_counter()
        free_roll_paused = torch.cuda.mem_get_info()[0]
        assert torch.all(filler == float(rank + 7)).item(), "train's bytes after its resume"
        base = 10.0 * (cycle + 1)
        x.fill_(base + rank)
        graph.replay()
        torch.cuda.synchronize()
        total = sum(base + r for r in range(world))
        ok_x = torch.all(x == total).item()
        ok_g = all(torch.all(gathered[r * n:(r + 1) * n] == total * (r + 1)).item() for r in range(world))
        record["cycles"].append({"switch_out_ms": (t1 - t0) * 1e3, "switch_back_ms": (t2 - t1) * 1e3,
                                 "free_train_paused_gib": free_train_paused / (1 << 30),
                                 "free_roll_paused_gib": free_roll_paused / (1 << 30),
                                 "all_reduce_ok": ok_x, "all_gather_ok": ok_g,
                                 "x": float(x[0].item()), "gathered": [float(gathered[r * n].item())
                                                                       for r in range(world)]})
    record["same_addresses"] = ptrs == (x.data_ptr(), y.data_ptr(), gathered.data_ptr(), filler.data_ptr(),
                                        kv.data_ptr())
    # NCCL's own memory (Note [NCCL Memory Across a Switch]): the hook finds this rank's
    # communicator; it releases and restores where NCCL has ncclCommSuspend, else says why.
    _, comm = vd._nccl_comm(None)
    record["comm_found"] = bool(comm.value)
    released, why = vd.release_nccl_memory()
    restored = vd.restore_nccl_memory()[0] if released else False
    x.fill_(1.0)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    record["nccl_memory"] = {"released": released, "restored": restored, "why": why,
                             "all_reduce_after": bool(torch.all(x == float(world)).item())}
    _write(out, rank, record)
    _finish(world)  # no NCCL teardown needed


def failures(rank, world, port, out, env):
    """Each failure in turn, every rank's state checked after each (record per rank)."""
    import torch
    import vmstash
    import vmstash.distributed as vd
    from vmstash import _lib
    _init(rank, world, port, env)
    T = 3.0
    with vmstash.region("train", policy="backup"):
        train = torch.full((256 * MiB // 4,), float(rank + 1), device="cuda")
    with vmstash.region("big", policy="backup"):
        big = torch.full((4096 * MiB // 4,), float(rank + 2), device="cuda")
    assert vd.pause("big", timeout=60)
    record = {"rank": rank, "steps": {}}

    def state():
        return vmstash.tag_stats("train")["state"], vmstash.tag_stats("big")["state"]

    def attempt(name, pause=("train",), resume=("big",)):
        t0 = time.monotonic()
        try:
            changed = vd.switch(list(pause), list(resume), timeout=T)
            r = {"ok": True, "changed": changed}
        except ValueError as e:
            r = {"ok": False, "type": "ValueError", "message": str(e)}
        except vmstash.Error as e:
            r = {"ok": False, "type": type(e).__name__, "code": e.code_name, "message": str(e)}
        r["seconds"] = time.monotonic() - t0
        r["state"] = state()
        r["bytes"] = (r["state"][0] != "active" or torch.all(train == float(rank + 1)).item()) and \
                     (r["state"][1] != "active" or torch.all(big == float(rank + 2)).item())
        record["steps"][name] = r
        _write(out, rank, record)
        _store_barrier(name, world)
        return r

    def back(name):
        attempt(name, pause=("big",), resume=("train",))

    attempt("ok")
    back("ok_back")
    attempt("differ", pause=("train",) if rank == 0 else ("train", "big"), resume=())
    hog = None
    if rank == 1:  # leave less than big's 4 GiB free beside train's 256 MiB
        free = torch.cuda.mem_get_info()[0]
        hog = torch.empty(free - 1024 * MiB, dtype=torch.uint8, device="cuda")
    attempt("oom")
    del hog
    torch.cuda.empty_cache()
    attempt("oom_retry")
    back("oom_back")
    if rank == 1:
        time.sleep(T + 0.5)  # hung before the request
    attempt("hang_request")
    attempt("hang_request_retry")
    back("hang_request_back")
    real = vd._GlooGroup.all_gather
    calls = [0]

    def slow_vote(self, obj):  # rank 1: the outcome exchange (its 2nd) comes T + 0.5 s late
        calls[0] += 1
        if calls[0] == 2:
            time.sleep(T + 0.5)
        return real(self, obj)

    if rank == 1:
        vd._GlooGroup.all_gather = slow_vote
    attempt("hang_vote")
    vd._GlooGroup.all_gather = real
    attempt("hang_vote_retry")
    back("hang_vote_back")
    calls[0] = 0

    def dies_at_vote(self, obj):
        calls[0] += 1
        if calls[0] == 2:
            os._exit(3)
        return real(self, obj)

    if rank == 1:
        vd._GlooGroup.all_gather = dies_at_vote
    t0 = time.monotonic()
    try:
        vd.switch(["train"], ["big"], timeout=T)
        r = {"ok": True}
    except vmstash.Error as e:
        r = {"ok": False, "code": e.code_name, "message": str(e)}
    r["seconds"] = time.monotonic() - t0
    r["state"] = state()
    r["bytes"] = torch.all(train == float(rank + 1)).item()
    record["steps"]["dies_at_vote"] = r
    _write(out, rank, record)
    del _lib
    os._exit(0)  # rank 1 is gone (it held no store: rank 0 does)


def _write(out, rank, record):
    tmp = os.path.join(out, f"{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(out, f"{rank}.json"))


def _two_gpus():
    import torch
    world = torch.cuda.device_count()
    if world == 0:  # the parent saw a GPU (conftest.py): none here is a failure, not a skip
        pytest.fail("two-rank test: torch sees no CUDA device in this process")
    if world < 2:
        pytest.skip(f"two-rank test: {world} GPU(s) here, needs 2")


def run(fn, port, env=None, timeout=300):
    """Starts two ranks of `fn` (spawn) and returns each rank's record and exit code."""
    import torch.multiprocessing as mp
    _two_gpus()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out:
        procs = [ctx.Process(target=fn, args=(r, 2, port, out, dict(env or {}))) for r in range(2)]
        for p in procs:
            p.start()
        until = time.monotonic() + timeout
        for p in procs:
            p.join(max(1.0, until - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        records = []
        for r in range(2):
            path = os.path.join(out, f"{r}.json")
            records.append(json.load(open(path)) if os.path.exists(path) else None)
        return records, [p.exitcode for p in procs]


def test_two_ranks_pause_resume_all_reduce():
    _, codes = run(pause_resume_all_reduce, 29511)
    assert codes == [0, 0], codes


GRAPH_ENVS = {
    "nccl_defaults": {},
    "graph_register_off": {"NCCL_GRAPH_REGISTER": "0"},
    "torch_register_hook": {"TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "1"},
}


@pytest.mark.parametrize("setting", list(GRAPH_ENVS))
def test_a_graph_with_collectives_captured_before_the_switches_replays_right(setting):
    env = dict(GRAPH_ENVS[setting])
    if os.environ.get("VMSTASH_NCCL_DEBUG_DIR"):  # which buffers NCCL registered (docs/usage.md)
        env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,REG,NVLS,TUNING",
                   NCCL_DEBUG_FILE=os.path.join(os.environ["VMSTASH_NCCL_DEBUG_DIR"], f"{setting}.%h.%p.log"))
    records, codes = run(graph_across_switches, 29512 + list(GRAPH_ENVS).index(setting), env)
    print(json.dumps(records))
    assert codes == [0, 0], codes
    for rec in records:
        assert rec["same_addresses"], rec
        assert rec["comm_found"], rec
        m = rec["nccl_memory"]
        assert m["all_reduce_after"] and m["released"] == m["restored"], m
        if not m["released"]:
            assert "ncclCommSuspend" in m["why"], m
        for c in rec["cycles"]:
            assert c["all_reduce_ok"] and c["all_gather_ok"], (rec["rank"], c)


def test_failures_leave_every_rank_in_one_state_and_retries_converge():
    records, codes = run(failures, 29520)
    print(json.dumps(records))
    assert codes[0] == 0 and codes[1] == 3, codes
    before, after = ["active", "paused"], ["paused", "active"]
    for rec in records:
        s = rec["steps"]
        assert s["ok"]["ok"] and s["ok"]["state"] == after and s["ok"]["bytes"], s["ok"]
        assert s["differ"]["type"] == "ValueError" and s["differ"]["state"] == before, s["differ"]
        for name in ("oom", "hang_request", "hang_vote"):
            assert not s[name]["ok"] and s[name]["state"] == before and s[name]["bytes"], (rec["rank"], name, s[name])
            retry = s[name + "_retry"]
            assert retry["ok"] and retry["changed"] and retry["state"] == after and retry["bytes"], (name, retry)
    r0 = records[0]["steps"]
    assert r0["oom"]["code"] == "ABORTED" and "rank 1 of 2 failed" in r0["oom"]["message"], r0["oom"]
    assert records[1]["steps"]["oom"]["type"] == "OutOfMemoryError"
    for name in ("hang_request", "hang_vote"):
        assert r0[name]["code"] == "DEADLINE_EXCEEDED" and r0[name]["seconds"] < 3.0 + 10.0, r0[name]
    assert "nothing changed" in r0["hang_request"]["message"]
    dead = r0["dies_at_vote"]
    assert not dead["ok"] and dead["code"] == "DEADLINE_EXCEEDED", dead
    assert dead["state"] == before and dead["bytes"] and dead["seconds"] < 3.0 + 10.0, dead
