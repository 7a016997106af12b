"""Tags and their policies, and the stats and snapshot that report them (simulated driver)."""
import pytest

import vmstash

MiB = 1 << 20


def test_tags_and_policies(sim):
    vmstash.create_tag("cpu_w", "backup")
    vmstash.create_tag("cpu_w", "backup")  # idempotent
    with pytest.raises(vmstash.Error) as e:
        vmstash.create_tag("cpu_w", "discard")
    assert e.value.code_name == "FAILED_PRECONDITION"
    with pytest.raises(ValueError):
        vmstash.create_tag("cpu_x", "disk")
    with pytest.raises(vmstash.Error) as e:
        vmstash.create_tag("bad tag", "discard")
    assert e.value.code_name == "INVALID_ARGUMENT"
    with pytest.raises(TypeError):
        vmstash.pause(3)
    assert vmstash.tags()["cpu_w"] == "backup"


def test_stats_and_snapshot_are_dicts(sim):
    vmstash.create_tag("cpu_s", "discard")
    p = sim.malloc("cpu_s", MiB)
    s = vmstash.stats(0)
    assert "total" in s
    assert "cpu_s" in [t["name"] for t in s["tags"]]
    everything = vmstash.stats()
    assert isinstance(everything, list)
    snap = vmstash.snapshot(0)
    assert any(seg["tag"] == "cpu_s" for seg in snap["segments"])
    sim.free(p, MiB)
    vmstash.empty_cache()
