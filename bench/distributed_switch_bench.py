"""A phase switch across two ranks (vmstash.distributed.switch, one process per GPU, NCCL job)
against each rank's own local switch (vmstash.switch) in the same run, and how soon a rank
learns that another one hung or died.

    python3 bench/distributed_switch_bench.py [--gib 2] [--cycles 20] [--timeout 2] [--json out.json]

Each rank holds two backed-up tags of --gib GiB each ("train" active, "roll" paused, known
bytes). Alternately, --cycles times each (after --cycles / 4 warm-up switches of each kind):
  local        every rank switches on its own (train out, roll in; then back), the ranks
               started together by a store barrier; the time of each rank's call, device
               synchronized;
  distributed  vmstash.distributed.switch of the same tags over the job's default group.
The overhead of a distributed switch: its time on a rank less the slower rank's local switch
of the same cycle (the goal: within 2 ms of it, Issue 31). Then, with --timeout:
  hung rank    rank 1 enters the switch --timeout + 1 s late; rank 0's time to raise
  dead rank    rank 1 dies at the vote (os._exit); rank 0's time to raise, every tag as it was
(the goal: within the timeout + 1 s). Prints a table and a JSON line (--json: also to a file).
"""
import argparse
import json
import os
import statistics
import sys
import time

MiB = 1 << 20


def _barrier(store, name, world):
    store.add(name, 1)
    while int(store.add(name, 0)) < world:
        time.sleep(0.0002)


def rank_main(rank, world, port, args, out):
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    import vmstash
    import vmstash.distributed as vd

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    store = c10d._get_default_store()
    n = int(args.gib * 1024) * MiB // 4
    with vmstash.region("train", policy="backup"):
        train = torch.full((n,), float(rank + 1), device="cuda")
    with vmstash.region("roll", policy="backup"):
        roll = torch.full((n,), float(rank + 5), device="cuda")
    torch.cuda.synchronize()
    assert vmstash.pause("roll")
    seq = [0]

    def timed(kind, pause, resume):
        seq[0] += 1
        _barrier(store, f"b{seq[0]}", world)
        t0 = time.perf_counter()
        if kind == "local":
            vmstash.switch(pause, resume)
        else:
            vd.switch(pause, resume, timeout=60)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    times = {"local": [], "distributed": []}
    wrong = []  # switches after which the incoming tag's bytes or the states were not right

    def check(kind, i, incoming, tensor, value):
        states = [vmstash.tag_stats(t)["state"] for t in ("train", "roll")]
        want = ["active", "paused"] if incoming == "train" else ["paused", "active"]
        if states != want or not torch.all(tensor == value).item():
            wrong.append({"kind": kind, "cycle": i, "incoming": incoming, "states": states,
                          "first": float(tensor[0].item()), "want": value})

    warm = max(1, args.cycles // 4)
    for i in range(warm + args.cycles):
        for kind in ("local", "distributed"):
            a = timed(kind, ["train"], ["roll"])
            check(kind, i, "roll", roll, float(rank + 5))
            b = timed(kind, ["roll"], ["train"])
            check(kind, i, "train", train, float(rank + 1))
            if i >= warm:
                times[kind] += [a, b]
    record = {"rank": rank, "times": times, "wrong": wrong}

    def failed_switch(name):
        """A switch that some rank fails: how long this rank took to raise, and its tags."""
        t0 = time.monotonic()
        try:
            vd.switch(["train"], ["roll"], timeout=args.timeout)
            r = {"raised": False}
        except vmstash.Error as e:
            r = {"raised": True, "code": e.code_name}
        r["seconds"] = time.monotonic() - t0
        r["state"] = [vmstash.tag_stats(t)["state"] for t in ("train", "roll")]
        r["bytes"] = torch.all(train == float(rank + 1)).item()
        record[name] = r
        with open(os.path.join(out, f"{rank}.json"), "w") as f:  # before rank 1's death below
            json.dump(record, f)

    # A hung rank: rank 1 comes timeout + 1 s late.
    _barrier(store, "hung", world)
    if rank == 1:
        time.sleep(args.timeout + 1.0)
    failed_switch("hung")
    _barrier(store, "dead", world)
    # A dead rank: rank 1 dies at the vote.
    real, calls = vd._GlooGroup.all_gather, [0]

    def dies(self, obj):
        calls[0] += 1
        if calls[0] == 2:
            os._exit(0)
        return real(self, obj)

    if rank == 1:
        vd._GlooGroup.all_gather = dies
    failed_switch("dead")
    os._exit(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--port", type=int, default=29531)
    ap.add_argument("--json")
    args = ap.parse_args()
    import tempfile
    import torch
    import torch.multiprocessing as mp
    if torch.cuda.device_count() < 2:
        sys.exit(f"distributed_switch_bench: needs 2 GPUs, {torch.cuda.device_count()} here")
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(2, args.port, args, out), nprocs=2, join=True)
        recs = [json.load(open(os.path.join(out, f"{r}.json"))) for r in range(2)]
    local = list(zip(*(r["times"]["local"] for r in recs)))
    dist_ = list(zip(*(r["times"]["distributed"] for r in recs)))
    slower_local = [max(c) for c in local]
    slower_dist = [max(c) for c in dist_]
    over = [d - l for d, l in zip(slower_dist, slower_local)]
    med = statistics.median
    summary = {
        "card": torch.cuda.get_device_name(0), "gib_per_tag": args.gib, "switches": len(local),
        "local_ms_median_per_rank": [med(r["times"]["local"]) for r in recs],
        "distributed_ms_median_per_rank": [med(r["times"]["distributed"]) for r in recs],
        "slower_rank_local_ms_median": med(slower_local),
        "slower_rank_distributed_ms_median": med(slower_dist),
        "overhead_ms_median": med(slower_dist) - med(slower_local),
        "overhead_ms_per_cycle_median_p90": [med(over), sorted(over)[int(0.9 * (len(over) - 1))]],
        "timeout_s": args.timeout,
        "hung_rank": recs[0]["hung"], "dead_rank": recs[0]["dead"],
    }
    print(f"distributed_switch_bench on {summary['card']} x2, {args.gib:g} GiB each way, {len(local)} switches")
    print(f"  local switch, slower rank (median)        {summary['slower_rank_local_ms_median']:8.2f} ms")
    print(f"  distributed switch, slower rank (median)  {summary['slower_rank_distributed_ms_median']:8.2f} ms")
    print(f"  overhead (median of medians)              {summary['overhead_ms_median']:8.2f} ms  (goal <= 2 ms)")
    print(f"  hung rank: rank 0 raised {recs[0]['hung'].get('code')} after {recs[0]['hung']['seconds']:.2f} s "
          f"(timeout {args.timeout:g} s, goal <= {args.timeout + 1:g} s), tags {recs[0]['hung']['state']}")
    print(f"  dead rank: rank 0 raised {recs[0]['dead'].get('code')} after {recs[0]['dead']['seconds']:.2f} s, "
          f"tags {recs[0]['dead']['state']}, bytes intact {recs[0]['dead']['bytes']}")
    summary["switches_with_wrong_bytes_or_states"] = [r["wrong"] for r in recs]
    print(f"  switches with wrong bytes or states: {[len(r['wrong']) for r in recs]} (rank 0, rank 1)")
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "ranks": recs}, f)


if __name__ == "__main__":
    main()
