"""Where a paused tag's bytes go and how they are read (simulated driver): backup stores
(pinned, pageable, disk), read_backup while paused, and the memory margin."""
import ctypes
import os

import pytest

import vmstash
from vmstash import _lib

MiB = 1 << 20


def test_read_backup_finds_the_device_of_the_address(sim):
    vmstash.create_tag("cpu_rb_dev1", "backup")
    vmstash.set_current_tag("cpu_rb_dev1")
    try:
        p = _lib.lib().vmstash_malloc(2 * MiB, 1, None)  # on the second simulated device
    finally:
        vmstash.set_current_tag("default")
    assert p, _lib.last_error()
    sim.fill(p, 2 * MiB, 0x5A)
    assert vmstash.pause("cpu_rb_dev1")
    buf = ctypes.create_string_buffer(4096)
    vmstash.read_backup(p + MiB, 4096, ctypes.addressof(buf))  # no device named: found on 1
    assert buf.raw == bytes([0x5A]) * 4096
    vmstash.read_backup(p, 16, ctypes.addressof(buf), device=1)
    with pytest.raises(vmstash.Error) as e:
        vmstash.read_backup(p, 16, ctypes.addressof(buf), device=0)  # named: that device only
    assert e.value.code_name == "NOT_FOUND"
    with pytest.raises(vmstash.Error) as e:
        vmstash.read_backup(p + 4 * MiB, 16, ctypes.addressof(buf))  # held by no backup
    assert e.value.code_name == "NOT_FOUND"
    out = ctypes.c_void_p()
    assert _lib.lib().vmstash_backup_address(p, 16, -1, ctypes.byref(out)) == 0
    assert out.value and ctypes.string_at(out.value, 16) == bytes([0x5A]) * 16
    assert vmstash.resume("cpu_rb_dev1")
    _lib.lib().vmstash_free(p, 2 * MiB, 1, None)


def test_read_backup_while_paused_and_memory_margin(sim):
    vmstash.create_tag("cpu_rb", "backup")
    p = sim.malloc("cpu_rb", 2 * MiB)
    sim.fill(p, 2 * MiB, 0x3C)
    buf = ctypes.create_string_buffer(4096)
    with pytest.raises(vmstash.Error) as e:
        vmstash.read_backup(p, 4096, ctypes.addressof(buf))
    assert e.value.code_name == "NOT_FOUND"
    assert vmstash.pause("cpu_rb")
    vmstash.read_backup(p + MiB, 4096, ctypes.addressof(buf))
    assert buf.raw == bytes([0x3C]) * 4096
    # Issue 16 item 4: sizes that are negative or wrap the address space are refused.
    with pytest.raises(ValueError):
        vmstash.read_backup(p + 16, -1, ctypes.addressof(buf))
    with pytest.raises(ValueError):
        vmstash.read_backup(p + 16, 16, 0)
    with pytest.raises(vmstash.Error) as e:
        vmstash.read_backup(p + 16, (1 << 64) - 16, ctypes.addressof(buf))
    assert e.value.code_name == "INVALID_ARGUMENT"
    # Prepare of a paused tag is refused (its arena holds the paused bytes).
    with pytest.raises(vmstash.Error) as e:
        vmstash.prepare("cpu_rb")
    assert e.value.code_name == "FAILED_PRECONDITION"
    assert vmstash.resume("cpu_rb")
    sim.free(p, 2 * MiB)
    vmstash.set_memory_margin(1 << 40)  # more than the device has
    with pytest.raises(vmstash.Error):
        sim.malloc("cpu_rb", 64 * MiB)
    assert "memory margin" in _lib.last_error()
    vmstash.set_memory_margin(0)
    sim.free(sim.malloc("cpu_rb", 64 * MiB), 64 * MiB)
    with pytest.raises(ValueError):
        vmstash.set_memory_margin(-1)


def test_backup_stores(sim):
    import tempfile
    vmstash.create_tag("cpu_store", "backup")
    vmstash.create_tag("cpu_store_kv", "discard")
    assert vmstash.backup_store("cpu_store") == "pinned"
    with tempfile.TemporaryDirectory() as d:
        p = sim.malloc("cpu_store", 5 * MiB)
        sim.fill(p, 5 * MiB, 0x3C)
        vmstash.set_backup_store("cpu_store", "disk", d)
        assert vmstash.backup_store("cpu_store") == "disk:" + d
        assert vmstash.tag_stats("cpu_store")["backup_store"] == "disk:" + d
        assert vmstash.pause("cpu_store")
        assert os.listdir(d) == []  # the file is unlinked: nothing left behind
        with pytest.raises(vmstash.Error) as e:
            vmstash.set_backup_store("cpu_store", "pinned")
        assert e.value.code_name == "FAILED_PRECONDITION"
        assert vmstash.resume("cpu_store")
        assert sim.holds(p, 5 * MiB, 0x3C)
        vmstash.set_backup_store("cpu_store", "pageable")
        assert vmstash.pause("cpu_store")
        assert vmstash.resume("cpu_store")
        assert sim.holds(p, 5 * MiB, 0x3C)
        sim.free(p, 5 * MiB)
    for args, error in [(("cpu_store", "tape"), ValueError), (("cpu_store", "disk"), ValueError),
                        (("cpu_store", "pinned", "/tmp"), ValueError)]:
        with pytest.raises(error):
            vmstash.set_backup_store(*args)
    with pytest.raises(vmstash.Error) as e:
        vmstash.set_backup_store("cpu_store", "disk", "/nonexistent/vmstash_dir")
    assert e.value.code_name == "NOT_FOUND"
    assert "/nonexistent/vmstash_dir" in str(e.value)
    with pytest.raises(vmstash.Error) as e:
        vmstash.set_backup_store("cpu_store_kv", "pageable")
    assert e.value.code_name == "FAILED_PRECONDITION"
    vmstash.release_backup("cpu_store")


_PREPARE_AHEAD_CASE = r"""
import ctypes, time
import vmstash
from vmstash import _lib
l = _lib.lib()
MiB = 1 << 20
try:
    vmstash.set_prepare_ahead("pa_never_declared", False)
except vmstash.Error as e:
    print("undeclared:", e.code_name)
for tag in ("pa_lazy", "pa_ahead"):
    vmstash.create_tag(tag, "backup")
vmstash.set_prepare_ahead("pa_lazy", False)  # before device 1 is first used
def grow(tag, size):
    vmstash.set_current_tag(tag)
    p = l.vmstash_malloc(size, 1, None)
    vmstash.set_current_tag("default")
    ctypes.memset(p, 0x3C, size)
    return p
lazy, ahead = grow("pa_lazy", 64 * MiB), grow("pa_ahead", 64 * MiB)
arena = lambda tag: vmstash.tag_stats(tag, 1)["backup_arena_bytes"]
deadline = time.monotonic() + 60
while arena("pa_ahead") == 0 and time.monotonic() < deadline:
    time.sleep(0.05)
print("arenas:", arena("pa_ahead") > 0, arena("pa_lazy"))
vmstash.pause("pa_lazy", 1)  # the arena made by the pause that needs it, every byte kept
vmstash.resume("pa_lazy", 1)
print("kept:", ctypes.string_at(lazy, 64 * MiB) == b"\x3c" * (64 * MiB))
"""


def test_prepare_ahead_is_chosen_per_tag_and_reaches_devices_used_later():
    """vmstash.set_prepare_ahead(tag, False) with background preparation on: the tag's
    backup is not pinned ahead on a device first used after the call (the other tag's is),
    its pause makes it and loses nothing; an undeclared tag is NOT_FOUND. A fresh Python
    (auto_prepare is off in this process's simulated runtime)."""
    import subprocess
    import sys
    env = dict(os.environ, VMSTASH_CONF="driver:sim,sim_devices:2,sim_capacity:1G,auto_prepare:1")
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here)] + sys.path)
    r = subprocess.run([sys.executable, "-c", _PREPARE_AHEAD_CASE], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "undeclared: NOT_FOUND" in r.stdout, r.stdout
    assert "arenas: True 0" in r.stdout and "kept: True" in r.stdout, r.stdout
