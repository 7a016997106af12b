"""vmstash.distributed on the simulated driver: several processes (ranks), each with its own
vmstash runtime, switch together or not at all. The ranks exchange through files in a shared
folder (FileExchange below: an all-gather with a timeout), standing in for torch.distributed's
gloo group, which the GPU test gpu_two_ranks.py uses. Failure sweep: a rank out of device
memory, a rank that dies before the vote, a rank that hangs before the request, ranks asking
for different switches; every rank ends where it began (or where all went), and a retry
converges."""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

WORKER = textwrap.dedent(r'''
    import ctypes, json, os, pickle, sys, time
    import vmstash, vmstash.distributed as vd
    from vmstash import _lib

    MiB = 1 << 20
    folder, rank, size, scenario = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

    class FileExchange:
        """All-gather through files: round k's object of rank r in folder/k.r."""
        def __init__(self, timeout, die_at=None, hang_at=None):
            self.rank, self.size, self.round, self.timeout = rank, size, 0, timeout
            self.die_at, self.hang_at = die_at, hang_at
        def all_gather(self, obj):
            self.round += 1
            if self.round == self.die_at:
                os._exit(3)
            if self.round == self.hang_at:
                time.sleep(8)
            tmp = os.path.join(folder, f"{self.round}.{rank}.tmp")
            with open(tmp, "wb") as f:
                pickle.dump(obj, f)
            os.rename(tmp, os.path.join(folder, f"{self.round}.{rank}"))
            until = time.monotonic() + self.timeout
            out = []
            for r in range(self.size):
                path = os.path.join(folder, f"{self.round}.{r}")
                while not os.path.exists(path):
                    if time.monotonic() > until:
                        raise TimeoutError(f"round {self.round}: rank {r} did not answer")
                    time.sleep(0.002)
                with open(path, "rb") as f:
                    out.append(pickle.load(f))
            return out

    def malloc(tag, n, byte):
        vmstash.set_current_tag(tag)
        p = _lib.lib().vmstash_malloc(n, 0, None)
        vmstash.set_current_tag("default")
        assert p, _lib.last_error()
        ctypes.memset(p, byte, n)
        return p

    def holds(p, n, byte):
        return ctypes.string_at(p, n) == bytes([byte]) * n

    vmstash.create_tag("train", "backup")
    vmstash.create_tag("roll", "backup")
    vmstash.create_tag("extra", "backup")
    train = malloc("train", 96 * MiB, 0x10 + rank)
    roll = malloc("roll", 200 * MiB, 0x50 + rank)
    assert vmstash.pause("roll")
    result = {"rank": rank, "calls": []}
    timeout = 2.0
    die_at = 2 if scenario == "dies" and rank == 1 else None
    hang_at = 1 if scenario == "hangs" and rank == 1 else None
    ex = FileExchange(timeout, die_at, hang_at)
    if scenario.startswith("torch"):  # torch.distributed's own gloo group, no stand-in
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank, world_size=size)
        ex = None
    pause, resume = ["train"], ["roll"]
    if scenario == "differ" and rank == 1:
        pause = ["train", "extra"]
    hog = None
    if scenario in ("oom", "torch_oom") and rank == 1:
        hog = malloc("default", 400 * MiB, 0x77)  # roll's 200 MiB no longer fit in train's 96 and the rest
    for attempt in range(2):
        t0 = time.monotonic()
        try:
            changed = vd.switch(pause, resume, timeout=timeout if ex else 10.0, exchange=ex)
            call = {"ok": True, "changed": changed}
        except ValueError as e:
            call = {"ok": False, "type": "ValueError", "message": str(e)}
        except vmstash.Error as e:
            call = {"ok": False, "type": type(e).__name__, "code": e.code_name, "message": str(e)}
        call["seconds"] = time.monotonic() - t0
        call["train"] = vmstash.tag_stats("train")["state"]
        call["roll"] = vmstash.tag_stats("roll")["state"]
        call["train_bytes"] = call["train"] != "active" or holds(train, 96 * MiB, 0x10 + rank)
        call["roll_bytes"] = call["roll"] != "active" or holds(roll, 200 * MiB, 0x50 + rank)
        result["calls"].append(call)
        if scenario in ("dies", "hangs", "differ"):
            break
        if hog is not None:  # the retry, once the memory is free
            _lib.lib().vmstash_free(hog, 400 * MiB, 0, None)
            vmstash.empty_cache()
            hog = None
    print(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)
''')


def run_ranks(tmp_path, scenario, size=2):
    folder = tmp_path / scenario
    folder.mkdir()
    env = dict(os.environ, VMSTASH_CONF="driver:sim,sim_devices:1,sim_capacity:512M,auto_prepare:0")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(folder), str(r), str(size), scenario],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(size)]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        lines = [line for line in out.splitlines() if line.startswith("{")]
        results.append(json.loads(lines[-1]) if lines else {"returncode": p.returncode, "stderr": err[-2000:]})
    return results


def test_every_rank_switches_and_a_retry_is_a_no_op(tmp_path):
    for r in run_ranks(tmp_path, "ok", size=3):
        first, again = r["calls"]
        assert first["ok"] and first["changed"], first
        assert (first["train"], first["roll"]) == ("paused", "active")
        assert first["train_bytes"] and first["roll_bytes"]
        assert again["ok"] and not again["changed"], again


def test_one_rank_out_of_memory_rolls_every_rank_back_and_the_retry_converges(tmp_path):
    ranks = run_ranks(tmp_path, "oom")
    for r in ranks:
        failed, retry = r["calls"]
        assert not failed["ok"], failed
        assert (failed["train"], failed["roll"]) == ("active", "paused"), failed
        assert failed["train_bytes"]
        assert retry["ok"] and retry["changed"], retry
        assert (retry["train"], retry["roll"]) == ("paused", "active")
        assert retry["train_bytes"] and retry["roll_bytes"]
    ready, oom = ranks[0]["calls"][0], ranks[1]["calls"][0]
    assert ready["code"] == "ABORTED"
    assert "rank 1 of 2 failed" in ready["message"]
    assert oom["type"] == "OutOfMemoryError"


def test_a_rank_that_dies_before_the_vote_rolls_the_others_back_within_the_timeout(tmp_path):
    ranks = run_ranks(tmp_path, "dies")
    assert ranks[1].get("returncode") == 3
    call = ranks[0]["calls"][0]
    assert not call["ok"] and call["code"] == "DEADLINE_EXCEEDED", call
    # Bounded by the timeout (2 s), not the rank's death: no hang. (How close to the timeout
    # it gets is a figure for a quiet machine, not for this test.)
    assert call["seconds"] < 2.0 + 10.0
    assert (call["train"], call["roll"]) == ("active", "paused")
    assert call["train_bytes"]


def test_a_rank_that_hangs_before_the_request_changes_nothing_elsewhere(tmp_path):
    ranks = run_ranks(tmp_path, "hangs")
    call = ranks[0]["calls"][0]
    assert not call["ok"] and call["code"] == "DEADLINE_EXCEEDED", call
    assert "nothing changed" in call["message"]
    assert call["seconds"] < 2.0 + 10.0
    assert (call["train"], call["roll"]) == ("active", "paused")


def test_ranks_asking_for_different_switches_are_refused_before_anything_changes(tmp_path):
    for r in run_ranks(tmp_path, "differ"):
        call = r["calls"][0]
        assert call["type"] == "ValueError" and "different switches" in call["message"], call
        assert (call["train"], call["roll"]) == ("active", "paused")
        assert call["train_bytes"]


def test_torch_distributed_gloo_ranks_switch_together_and_roll_back_together(tmp_path):
    pytest.importorskip("torch.distributed")
    ranks = run_ranks(tmp_path, "torch_oom")
    for r in ranks:
        failed, retry = r["calls"]
        assert not failed["ok"] and (failed["train"], failed["roll"]) == ("active", "paused"), failed
        assert retry["ok"] and retry["changed"] and (retry["train"], retry["roll"]) == ("paused", "active"), retry
        assert retry["train_bytes"] and retry["roll_bytes"]
    assert "rank 1 of 2 failed" in ranks[0]["calls"][0]["message"]


def test_switch_refuses_a_string_and_needs_torch_distributed_without_an_exchange():
    import vmstash.distributed as vd
    with pytest.raises(TypeError):
        vd.switch("train", [])
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError):
            vd.switch(["train"], [])
