"""Pause and resume on the simulated driver: backup and discard, MemPool liveness hints, out of
memory on resume, and a pause over two devices that is all or nothing."""
import os
import sys

import pytest

import vmstash
from vmstash import _api, _lib

MiB = 1 << 20


def test_backup_round_trip_and_discard_drops_contents(sim):
    vmstash.create_tag("cpu_keep", "backup")
    vmstash.create_tag("cpu_drop", "discard")
    keep, drop = sim.malloc("cpu_keep", 3 * MiB), sim.malloc("cpu_drop", 3 * MiB)
    sim.fill(keep, 3 * MiB, 0x5A)
    sim.fill(drop, 3 * MiB, 0x5A)
    assert vmstash.pause("cpu_keep")
    assert vmstash.pause("cpu_drop")
    assert not vmstash.pause("cpu_keep")  # already paused: a no-op, said so
    t = vmstash.tag_stats("cpu_keep")
    assert t["state"] == "paused"
    assert t["backed_up_bytes"] == 3 * MiB
    with pytest.raises(vmstash.Error):
        sim.malloc("cpu_keep", 4096)  # allocation into a paused tag
    assert "paused" in _lib.last_error()
    with pytest.raises(vmstash.Error) as e:
        vmstash.release_backup("cpu_keep")
    assert e.value.code_name == "FAILED_PRECONDITION"
    assert vmstash.resume("cpu_keep")
    assert vmstash.resume("cpu_drop")
    assert not vmstash.resume("cpu_drop")
    assert sim.holds(keep, 3 * MiB, 0x5A)
    assert not sim.holds(drop, 3 * MiB, 0x5A)  # discard does not keep memory silently
    assert _lib.lib().vmstash_owner_device(keep) == 0  # a 64-bit address, not truncated
    assert _lib.lib().vmstash_owner_device(keep + 512) == -1
    sim.free(keep, 3 * MiB)
    sim.free(drop, 3 * MiB)
    vmstash.release_backup("cpu_keep")


def test_live_range_hint_copies_only_pytorch_active_blocks(sim):
    # What vmstash.region does: a provider reports PyTorch's active blocks in our segment.
    vmstash.create_tag("cpu_pool", "backup")
    seg = sim.malloc("cpu_pool", 20 * MiB)
    sim.fill(seg, 20 * MiB, 0x11)
    saved = (_api.live_ranges_provider, _api.pool_devices_provider)
    _api.live_ranges_provider = lambda tag, dev: [(seg + 2 * MiB, MiB), (seg + 8 * MiB, 2 * MiB)]
    _api.pool_devices_provider = lambda tag: [0] if tag == "cpu_pool" else []
    try:
        assert vmstash.pause("cpu_pool")
    finally:
        _api.live_ranges_provider, _api.pool_devices_provider = saved
    assert vmstash.tag_stats("cpu_pool")["backed_up_bytes"] == 3 * MiB
    assert vmstash.resume("cpu_pool")
    assert sim.holds(seg + 2 * MiB, MiB, 0x11)
    assert sim.holds(seg + 8 * MiB, 2 * MiB, 0x11)
    sim.free(seg, 20 * MiB)


def test_resume_out_of_memory_raises_keeps_tag_paused_and_retry_succeeds(sim):
    vmstash.create_tag("cpu_big", "backup")
    big = sim.malloc("cpu_big", 300 * MiB)
    sim.fill(big, 300 * MiB, 0x77)
    assert vmstash.pause("cpu_big")
    vmstash.create_tag("cpu_hog", "discard")
    hog = sim.malloc("cpu_hog", 900 * MiB)  # the 1 GiB device is now nearly full
    with pytest.raises(vmstash.OutOfMemoryError) as e:
        vmstash.resume("cpu_big")
    assert isinstance(e.value, _lib._oom_base())  # torch.OutOfMemoryError with torch
    assert e.value.code_name == "RESOURCE_EXHAUSTED"
    assert vmstash.tag_stats("cpu_big")["state"] == "paused"
    sim.free(hog, 900 * MiB)
    vmstash.empty_cache(tag="cpu_hog")
    assert vmstash.resume("cpu_big")
    assert sim.holds(big, 300 * MiB, 0x77)
    sim.free(big, 300 * MiB)
    vmstash.release_backup("cpu_big")


def test_pause_over_two_devices_is_all_or_nothing_with_each_devices_hint():
    # Two simulated devices, each with a MemPool-hinted block; the second device's backup
    # copy fails: the first device must be resumed back with its bytes (one C call
    # carries both devices' hints into the runtime's all-or-nothing pause).
    import subprocess
    child = (
        "import ctypes, vmstash\n"
        "from vmstash import _api, _lib\n"
        "MiB, n = 1 << 20, 3 << 20\n"
        "vmstash.create_tag('cpu_two', 'backup')\n"
        "vmstash.set_current_tag('cpu_two')\n"
        "p = [_lib.lib().vmstash_malloc(n, d, None) for d in (0, 1)]\n"
        "vmstash.set_current_tag('default')\n"
        "assert all(p), _lib.last_error()\n"
        "for d in (0, 1):\n"
        "    ctypes.memset(p[d], 0x60 + d, n)\n"
        "_api.live_ranges_provider = lambda tag, d: [(p[d] + MiB, MiB)]\n"
        "_api.pool_devices_provider = lambda tag: [0, 1]\n"
        "try:\n"
        "    vmstash.pause('cpu_two')\n"
        "    raise SystemExit('the pause did not fail')\n"
        "except vmstash.Error as e:\n"
        "    assert e.code_name == 'INTERNAL', e\n"
        "    assert 'failed on device 1' in str(e) and 'device 0 resumed again' in str(e), e\n"
        "states = [vmstash.tag_stats('cpu_two', d)['state'] for d in (0, 1)]\n"
        "assert states == ['active', 'active'], states\n"
        "for d in (0, 1):\n"  # the hinted bytes (device 0's came back from its backup)
        "    assert ctypes.string_at(p[d] + MiB, MiB) == bytes([0x60 + d]) * MiB, d\n"
        "assert vmstash.pause('cpu_two')\n"  # the fault is spent: both devices, each its hint
        "assert [vmstash.tag_stats('cpu_two', d)['backed_up_bytes'] for d in (0, 1)] == [MiB, MiB]\n"
        "assert vmstash.resume('cpu_two')\n"
        "for d in (0, 1):\n"
        "    assert ctypes.string_at(p[d] + MiB, MiB) == bytes([0x60 + d]) * MiB, d\n"
        "    _lib.lib().vmstash_free(p[d], n, d, None)\n"
        "print('two devices ok')\n")
    env = dict(os.environ, VMSTASH_CONF="driver:sim,sim_devices:2,sim_capacity:256M,auto_prepare:0,"
                                        "sim_fail:copy_to_host@2=internal")
    result = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "two devices ok" in result.stdout
