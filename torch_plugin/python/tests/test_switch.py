"""The phase switch on the simulated driver: memory handed over with liveness hints, rollback on
out of memory, and switches from another thread while one allocates."""
import pytest

import vmstash
from vmstash import _api

MiB = 1 << 20


def test_switch_hands_memory_over_with_liveness_hints_and_rolls_back_on_oom(sim):
    vmstash.create_tag("cpu_sw_train", "backup")
    vmstash.create_tag("cpu_sw_roll", "backup")
    train = sim.malloc("cpu_sw_train", 64 * MiB)
    sim.fill(train, 64 * MiB, 0x31)
    assert vmstash.pause("cpu_sw_train")
    roll = sim.malloc("cpu_sw_roll", 64 * MiB)
    sim.fill(roll, 64 * MiB, 0x42)
    handed = vmstash.stats(0)["handed_over_bytes"]
    saved = (_api.live_ranges_provider, _api.pool_devices_provider)
    _api.live_ranges_provider = lambda tag, dev: [(roll, 16 * MiB)]
    _api.pool_devices_provider = lambda tag: [0] if tag == "cpu_sw_roll" else []
    try:
        assert vmstash.switch(pause=["cpu_sw_roll"], resume=["cpu_sw_train"])
    finally:
        _api.live_ranges_provider, _api.pool_devices_provider = saved
    assert sim.holds(train, 64 * MiB, 0x31)
    assert vmstash.tag_stats("cpu_sw_roll")["state"] == "paused"
    assert vmstash.tag_stats("cpu_sw_roll")["backed_up_bytes"] == 16 * MiB  # the hint
    assert vmstash.stats(0)["handed_over_bytes"] - handed == 64 * MiB
    assert not vmstash.switch(["cpu_sw_roll"], ["cpu_sw_train"])  # nothing to do
    with pytest.raises(TypeError):
        vmstash.switch("cpu_sw_train", "cpu_sw_roll")
    with pytest.raises(vmstash.Error) as e:
        vmstash.switch(["cpu_sw_train"], ["cpu_sw_train"])
    assert e.value.code_name == "INVALID_ARGUMENT"
    # Out of memory: the incoming tag does not fit beside a hog; everything stays as it was.
    vmstash.create_tag("cpu_sw_big", "backup")
    big = sim.malloc("cpu_sw_big", 400 * MiB)
    sim.fill(big, 400 * MiB, 0x53)
    assert vmstash.pause("cpu_sw_big")
    vmstash.create_tag("cpu_sw_hog", "discard")
    hog = sim.malloc("cpu_sw_hog", 800 * MiB)
    with pytest.raises(vmstash.OutOfMemoryError) as e:
        vmstash.switch(pause=["cpu_sw_train"], resume=["cpu_sw_big"])
    assert "every tag is as it was" in str(e.value)
    assert vmstash.tag_stats("cpu_sw_train")["state"] == "active"
    assert sim.holds(train, 64 * MiB, 0x31)
    sim.free(hog, 800 * MiB)
    vmstash.empty_cache(tag="cpu_sw_hog")
    assert vmstash.switch(pause=["cpu_sw_train"], resume=["cpu_sw_roll", "cpu_sw_big"])
    assert sim.holds(big, 400 * MiB, 0x53)
    assert sim.holds(roll, 16 * MiB, 0x42)
    assert vmstash.resume("cpu_sw_train")
    assert sim.holds(train, 64 * MiB, 0x31)
    for p, n in ((train, 64 * MiB), (roll, 64 * MiB), (big, 400 * MiB)):
        sim.free(p, n)


def test_switch_from_another_thread_while_this_one_allocates(sim):
    """A phase switch from an RPC thread (as SGLang and slime control their engines)
    while another thread keeps allocating in a tag outside the switch: both phases'
    bytes survive every switch, the worker's tag is untouched, no call fails."""
    import threading
    vmstash.create_tag("thr_sw_roll", "backup")
    vmstash.create_tag("thr_sw_train", "backup")
    vmstash.create_tag("thr_sw_work", "discard")
    roll, train = sim.malloc("thr_sw_roll", 6 * MiB), sim.malloc("thr_sw_train", 6 * MiB)
    sim.fill(roll, 6 * MiB, 0x21)
    sim.fill(train, 6 * MiB, 0x43)
    assert vmstash.pause("thr_sw_train")
    errors, done = [], threading.Event()

    def control():
        try:
            for _ in range(10):
                vmstash.switch(pause=["thr_sw_roll"], resume=["thr_sw_train"])
                if not sim.holds(train, 6 * MiB, 0x43):
                    errors.append("training bytes lost")
                vmstash.switch(pause=["thr_sw_train"], resume=["thr_sw_roll"])
                if not sim.holds(roll, 6 * MiB, 0x21):
                    errors.append("rollout bytes lost")
        except Exception as e:  # reported below
            errors.append(repr(e))

    t = threading.Thread(target=sim.churn, args=("thr_sw_work", done, errors))
    t.start()
    try:
        c = threading.Thread(target=control)
        c.start()
        c.join()
    finally:
        done.set()
        t.join()
    assert errors == []
    assert vmstash.tag_stats("thr_sw_work")["state"] == "active"
    assert vmstash.tag_stats("thr_sw_roll")["switches"] == 20
    assert vmstash.resume("thr_sw_train")
    sim.free(roll, 6 * MiB)
    sim.free(train, 6 * MiB)
