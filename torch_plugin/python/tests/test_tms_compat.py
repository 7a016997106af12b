"""vmstash.compat.torch_memory_saver without a GPU (simulated driver): its pure parts, the
backup backends, a pause from another thread, and the drop-in wheel."""
import os
import re
import sys

import pytest

import vmstash
from vmstash import _lib

MiB = 1 << 20


def test_torch_memory_saver_compat_pure_parts(sim):
    from vmstash.compat.torch_memory_saver import TorchMemorySaver, configure_subprocess, torch_memory_saver
    assert torch_memory_saver.enabled
    tms = TorchMemorySaver()
    # Tag naming (in the C library, one for every caller): the first backup setting keeps the name.
    assert tms._vmstash_tag("kv", "discard") == ("kv", "discard")
    assert tms._vmstash_tag("kv", "pinned") == ("kv:pinned", "backup")
    assert tms._vmstash_tag("kv", "discard") == ("kv", "discard")
    assert TorchMemorySaver()._vmstash_tag("kv", "pinned") == ("kv:pinned", "backup")  # process-wide
    assert sorted(tms._targets("kv")) == ["kv", "kv:pinned"]
    assert tms._targets("other") == []
    assert vmstash.tags()["kv:pinned"] == "backup" and vmstash.backup_store("kv:pinned") == "pinned"
    # torch_memory_saver's argument checks.
    assert tms._setting(False, False, None) == "discard"
    assert tms._setting(True, False, None) == "pinned"  # this thread's backend (TMS_INIT_CPU_BACKUP_BACKEND)
    assert tms._setting(True, False, "mmap") == "mmap"
    assert tms._setting(False, True, None) == "disk"
    for bad in [(True, True, None), (True, False, "disk"), (False, False, "mmap")]:
        with pytest.raises(ValueError):
            tms._setting(*bad)
    tms.hook_mode = "torch"
    tms._ensure_initialized()
    # An enclosing region's backend is the default of the regions inside it (the thread's config).
    with tms._impl._with_region_config("outer", True, "mmap"):
        assert tms._setting(True, False, None) == "mmap"
    assert tms._setting(True, False, None) == "pinned"
    with pytest.raises(vmstash.Error) as e:
        tms.hook_mode = "preload"  # this process was not started with LD_PRELOAD
    assert e.value.code_name == "FAILED_PRECONDITION"
    with pytest.raises(ValueError):
        tms.hook_mode = "bogus"
    assert not tms.retain_cpu_backup  # torch_memory_saver's default
    tms.retain_cpu_backup = True
    assert tms.retain_cpu_backup and TorchMemorySaver().retain_cpu_backup  # process-wide, in C
    tms.retain_cpu_backup = False
    # Not under the preload library: hook mode torch; interesting region = in a region.
    assert TorchMemorySaver().hook_mode == "torch"
    cdll = tms._impl._binary_wrapper.cdll
    assert cdll.tms_get_interesting_region() is False
    vmstash.set_current_tag("cpu_interesting")
    assert cdll.tms_get_interesting_region() is True
    vmstash.set_current_tag("default")
    with tms._impl._with_region_config("r", False, None):
        assert cdll.tms_get_interesting_region() is True and cdll.tms_get_current_tag() == b"r"
    assert cdll.tms_get_interesting_region() is False and cdll.tms_get_current_tag() == b"default"
    tms.memory_margin_bytes = 0
    assert tms.memory_margin_bytes == 0
    # pause/resume of tags nobody declared: nothing to do.
    tms.pause("nothing")
    tms.resume("nothing")
    os.environ["VMSTASH_PRELOAD_LIBRARY"] = "/x/libvmstash_preload.so"
    os.environ["LD_PRELOAD"] = "libother.so"
    try:
        with configure_subprocess():
            assert os.environ["LD_PRELOAD"] == "/x/libvmstash_preload.so libother.so"
        assert os.environ["LD_PRELOAD"] == "libother.so"
    finally:
        del os.environ["VMSTASH_PRELOAD_LIBRARY"]
        del os.environ["LD_PRELOAD"]


def test_torch_memory_saver_backends_disk_and_retain(sim):
    """torch_memory_saver's per-region backends (pinned, mmap, disk) on one tag, the disk
    directory's layout and errors, and retain_cpu_backup both ways."""
    import ctypes
    import tempfile
    from vmstash.compat.torch_memory_saver import TorchMemorySaver
    tms = TorchMemorySaver()
    tms.hook_mode = "torch"
    n = 4 * MiB
    with tempfile.TemporaryDirectory() as d:
        spill = os.path.join(d, "spill")
        tms.set_disk_backup_dir(spill)  # created
        names = {}
        for setting in ("disk", "mmap", "pinned"):
            names[setting], _ = tms._vmstash_tag("st", setting)
        assert names == {"disk": "st", "mmap": "st:mmap", "pinned": "st:pinned"}
        assert vmstash.backup_store("st") == "disk_files:" + spill
        assert vmstash.backup_store("st:mmap") == "pageable"
        assert vmstash.backup_store("st:pinned") == "pinned"
        ptrs = {s: sim.malloc(name, n) for s, name in names.items()}
        second = sim.malloc(names["disk"], n // 2)  # the disk tag's second allocation: its own file
        sim.fill(second, n // 2, 0x3f)
        for i, p in enumerate(ptrs.values()):
            sim.fill(p, n, 0x40 + i)

        def round_trip(files_while_paused=2):
            tms.pause("st")
            assert {vmstash.tag_stats(v)["state"] for v in names.values()} == {"paused"}
            # torch_memory_saver's disk layout: a file per backed-up allocation while paused.
            files = sorted(os.listdir(spill))
            assert len(files) == files_while_paused, files
            assert all(f.startswith(f"vmstash-tms-{os.getpid()}-") for f in files), files
            assert sum(os.path.getsize(os.path.join(spill, f)) for f in files) >= n + n // 2
            tms.resume("st")
            assert os.listdir(spill) == []  # removed at the resume
            for i, p in enumerate(ptrs.values()):
                assert sim.holds(p, n, 0x40 + i)
            assert sim.holds(second, n // 2, 0x3f)

        round_trip()
        # retain_cpu_backup False (torch_memory_saver's default): every backup is given back.
        assert [vmstash.tag_stats(v)["backup_arena_bytes"] for v in names.values()] == [0, 0, 0]
        tms.retain_cpu_backup = True
        round_trip()
        # Retained: the host backups stay, readable after the resume (a disk backup is not kept).
        assert [vmstash.tag_stats(v)["backup_arena_bytes"] > 0 for v in names.values()] == [False, True, True]
        for i, setting in enumerate(names):
            kept = ctypes.c_void_p()
            code = _lib.lib().vmstash_backup_address(ptrs[setting], n, 0, ctypes.byref(kept))
            if setting == "disk":
                assert code == _lib.NOT_FOUND
            else:
                assert code == 0 and ctypes.string_at(kept.value, n) == bytes([0x40 + i]) * n
        tms.retain_cpu_backup = False
        round_trip()
        assert [vmstash.tag_stats(v)["backup_arena_bytes"] for v in names.values()] == [0, 0, 0]
        # A missing directory fails the pause with a clear error; every tag stays active, intact.
        os.rmdir(spill)
        with pytest.raises(vmstash.Error) as e:
            tms.pause("st")
        assert e.value.code_name == "NOT_FOUND"
        assert spill in str(e.value)
        assert {vmstash.tag_stats(v)["state"] for v in names.values()} == {"active"}
        assert sim.holds(ptrs["disk"], n, 0x40)
        # A new directory is used from the next pause on.
        tms.set_disk_backup_dir(os.path.join(d, "spill2"))
        spill = os.path.join(d, "spill2")
        round_trip()
        assert vmstash.backup_store("st") == "disk_files:" + spill
        for p in ptrs.values():
            sim.free(p, n)
        sim.free(second, n // 2)


def test_torch_memory_saver_pause_from_another_thread_while_this_one_allocates(sim):
    """SGLang and slime pause from an RPC thread while other threads keep working: the
    paused tag comes back intact, the working thread's tag is untouched, no call fails."""
    import threading
    from vmstash.compat.torch_memory_saver import TorchMemorySaver
    tms = TorchMemorySaver()
    tms.hook_mode = "torch"
    weights, _ = tms._vmstash_tag("thr_weights", "pinned")
    work, _ = tms._vmstash_tag("thr_work", "discard")
    p = sim.malloc(weights, 6 * MiB)
    sim.fill(p, 6 * MiB, 0x77)
    errors, done = [], threading.Event()

    t = threading.Thread(target=sim.churn, args=(work, done, errors))
    t.start()
    try:
        for _ in range(20):
            tms.pause("thr_weights")
            assert vmstash.tag_stats(weights)["state"] == "paused"
            tms.resume("thr_weights")
            assert sim.holds(p, 6 * MiB, 0x77)
    finally:
        done.set()
        t.join()
    assert errors == []
    assert vmstash.tag_stats(work)["state"] == "active"
    sim.free(p, 6 * MiB)


def test_torch_memory_saver_dropin_wheel_installs_the_package_and_the_preload_names():
    import subprocess
    import tempfile
    import zipfile
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    builder = os.path.join(root, "scripts", "build_tms_dropin_wheel.py")
    with tempfile.TemporaryDirectory() as tmp:
        # A real ELF file stands in for the preload library (its glibc needs give the tag).
        stand_in = _lib.library_path()
        out = subprocess.run([sys.executable, builder, "--preload", stand_in, "--out", tmp], check=True,
                             capture_output=True, text=True).stdout.strip()
        assert re.search(r"^torch_memory_saver-0\.0\.10\+vmstash\.[0-9.]+-py3-none-manylinux_2_\d+_x86_64\.whl$",
                         os.path.basename(out))
        site = os.path.join(tmp, "site")
        with zipfile.ZipFile(out) as z:
            assert z.testzip() is None
            record = z.read([n for n in z.namelist() if n.endswith("/RECORD")][0]).decode()
            for name in z.namelist():
                assert name + "," in record
            z.extractall(site)  # what pip puts into site-packages
        probe = (
            "import os, torch_memory_saver as t\n"
            "from torch_memory_saver import torch_memory_saver, configure_subprocess\n"
            "from torch_memory_saver.hooks.mode_preload import configure_subprocess as c2\n"
            "from torch_memory_saver.entrypoint import TorchMemorySaver\n"
            "import vmstash.compat.torch_memory_saver as compat\n"
            "assert torch_memory_saver is compat.torch_memory_saver and c2 is configure_subprocess\n"
            "assert isinstance(torch_memory_saver, TorchMemorySaver) and t.served_by == 'vmstash'\n"
            "here = os.path.dirname(os.path.dirname(t.__file__))\n"  # slime's lookup
            "assert os.path.exists(os.path.join(here, 'torch_memory_saver_hook_mode_preload_cu13.abi3.so'))\n"
            "assert os.path.exists(os.path.join(here, 'torch_memory_saver_hook_mode_preload.abi3.so'))\n"
            "torch_memory_saver._ensure_initialized()\n"
            "assert torch_memory_saver._impl._binary_wrapper.cdll.tms_get_interesting_region() is False\n"
            "from torch_memory_saver.utils import change_env, get_binary_path_from_package, is_xpu\n"
            "from torch_memory_saver.hooks.base import HookMode\n"
            "stem = 'torch_memory_saver_hook_mode_preload'\n"
            "assert str(get_binary_path_from_package(stem)) == os.path.join(here, stem + '.abi3.so')\n"
            "with configure_subprocess():\n"
            "    assert os.environ['LD_PRELOAD'].split(':')[0] == os.path.join(here, stem + '.abi3.so')\n"
            "print('dropin ok')\n")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, os.path.join(root, "torch_plugin", "python")]))
        result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        assert "dropin ok" in result.stdout
