"""The vmstash package without a GPU: the C ABI through ctypes on the simulated driver.

Run with VMSTASH_LIBRARY pointing at libvmstash.so (bazel test sets it up through
run_python_test.sh).
The simulator's device memory is host memory, so tests read and write it with ctypes.
"""
import ctypes
import os
import sys
import unittest

os.environ.setdefault("VMSTASH_CONF", "driver:sim,sim_capacity:1G,auto_prepare:0")

import vmstash  # noqa: E402
from vmstash import _api, _lib  # noqa: E402

MiB = 1 << 20


def malloc(tag, size):
    vmstash.set_current_tag(tag)
    try:
        p = _lib.lib().vmstash_malloc(size, 0, None)
    finally:
        vmstash.set_current_tag("default")
    if not p:
        raise vmstash.Error(_lib.last_error())
    return p


def free(p, size):
    _lib.lib().vmstash_free(p, size, 0, None)


def fill(p, n, byte):
    ctypes.memset(p, byte, n)


def holds(p, n, byte):
    return ctypes.string_at(p, n) == bytes([byte]) * n


class VmstashCpuTest(unittest.TestCase):
    def test_version_and_bad_options(self):
        self.assertRegex(vmstash.version(), r"^\d+\.\d+\.\d+$")
        with self.assertRaises(vmstash.Error) as e:
            vmstash.init("no_such_key:1")
        self.assertEqual(e.exception.code_name, "INVALID_ARGUMENT")
        self.assertIn("no_such_key", str(e.exception))

    def test_dunder_version_is_the_library_version(self):
        self.assertIsInstance(vmstash.__version__, str)
        self.assertEqual(vmstash.__version__, vmstash.version())
        self.assertRegex(vmstash.__version__, r"^\d+\.\d+\.\d+([.+-][0-9A-Za-z.]+)?$")
        self.assertEqual(getattr(vmstash, "no_such_attribute", None), None)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        with open(os.path.join(root, "base", "version.h")) as f:  # the version's one place
            self.assertIn(f'kVersion[] = "{vmstash.__version__}";', f.read())

    def test_tags_and_policies(self):
        vmstash.create_tag("cpu_w", "backup")
        vmstash.create_tag("cpu_w", "backup")  # idempotent
        with self.assertRaises(vmstash.Error) as e:
            vmstash.create_tag("cpu_w", "discard")
        self.assertEqual(e.exception.code_name, "FAILED_PRECONDITION")
        with self.assertRaises(ValueError):
            vmstash.create_tag("cpu_x", "disk")
        with self.assertRaises(vmstash.Error) as e:
            vmstash.create_tag("bad tag", "discard")
        self.assertEqual(e.exception.code_name, "INVALID_ARGUMENT")
        with self.assertRaises(TypeError):
            vmstash.pause(3)
        self.assertEqual(vmstash.tags()["cpu_w"], "backup")

    def test_backup_round_trip_and_discard_drops_contents(self):
        vmstash.create_tag("cpu_keep", "backup")
        vmstash.create_tag("cpu_drop", "discard")
        keep, drop = malloc("cpu_keep", 3 * MiB), malloc("cpu_drop", 3 * MiB)
        fill(keep, 3 * MiB, 0x5A)
        fill(drop, 3 * MiB, 0x5A)
        self.assertTrue(vmstash.pause("cpu_keep"))
        self.assertTrue(vmstash.pause("cpu_drop"))
        self.assertFalse(vmstash.pause("cpu_keep"))  # already paused: a no-op, said so
        t = vmstash.tag_stats("cpu_keep")
        self.assertEqual(t["state"], "paused")
        self.assertEqual(t["backed_up_bytes"], 3 * MiB)
        with self.assertRaises(vmstash.Error):
            malloc("cpu_keep", 4096)  # allocation into a paused tag
        self.assertIn("paused", _lib.last_error())
        with self.assertRaises(vmstash.Error) as e:
            vmstash.release_backup("cpu_keep")
        self.assertEqual(e.exception.code_name, "FAILED_PRECONDITION")
        self.assertTrue(vmstash.resume("cpu_keep"))
        self.assertTrue(vmstash.resume("cpu_drop"))
        self.assertFalse(vmstash.resume("cpu_drop"))
        self.assertTrue(holds(keep, 3 * MiB, 0x5A))
        self.assertFalse(holds(drop, 3 * MiB, 0x5A))  # discard does not keep memory silently
        self.assertEqual(_lib.lib().vmstash_owner_device(keep), 0)  # a 64-bit address, not truncated
        self.assertEqual(_lib.lib().vmstash_owner_device(keep + 512), -1)
        free(keep, 3 * MiB)
        free(drop, 3 * MiB)
        vmstash.release_backup("cpu_keep")

    def test_live_range_hint_copies_only_pytorch_active_blocks(self):
        # What vmstash.region does: a provider reports PyTorch's active blocks in our segment.
        vmstash.create_tag("cpu_pool", "backup")
        seg = malloc("cpu_pool", 20 * MiB)
        fill(seg, 20 * MiB, 0x11)
        saved = (_api.live_ranges_provider, _api.pool_devices_provider)
        _api.live_ranges_provider = lambda tag, dev: [(seg + 2 * MiB, MiB), (seg + 8 * MiB, 2 * MiB)]
        _api.pool_devices_provider = lambda tag: [0] if tag == "cpu_pool" else []
        try:
            self.assertTrue(vmstash.pause("cpu_pool"))
        finally:
            _api.live_ranges_provider, _api.pool_devices_provider = saved
        self.assertEqual(vmstash.tag_stats("cpu_pool")["backed_up_bytes"], 3 * MiB)
        self.assertTrue(vmstash.resume("cpu_pool"))
        self.assertTrue(holds(seg + 2 * MiB, MiB, 0x11))
        self.assertTrue(holds(seg + 8 * MiB, 2 * MiB, 0x11))
        free(seg, 20 * MiB)

    def test_switch_hands_memory_over_with_liveness_hints_and_rolls_back_on_oom(self):
        vmstash.create_tag("cpu_sw_train", "backup")
        vmstash.create_tag("cpu_sw_roll", "backup")
        train = malloc("cpu_sw_train", 64 * MiB)
        fill(train, 64 * MiB, 0x31)
        self.assertTrue(vmstash.pause("cpu_sw_train"))
        roll = malloc("cpu_sw_roll", 64 * MiB)
        fill(roll, 64 * MiB, 0x42)
        handed = vmstash.stats(0)["handed_over_bytes"]
        saved = (_api.live_ranges_provider, _api.pool_devices_provider)
        _api.live_ranges_provider = lambda tag, dev: [(roll, 16 * MiB)]
        _api.pool_devices_provider = lambda tag: [0] if tag == "cpu_sw_roll" else []
        try:
            self.assertTrue(vmstash.switch(pause=["cpu_sw_roll"], resume=["cpu_sw_train"]))
        finally:
            _api.live_ranges_provider, _api.pool_devices_provider = saved
        self.assertTrue(holds(train, 64 * MiB, 0x31))
        self.assertEqual(vmstash.tag_stats("cpu_sw_roll")["state"], "paused")
        self.assertEqual(vmstash.tag_stats("cpu_sw_roll")["backed_up_bytes"], 16 * MiB)  # the hint
        self.assertEqual(vmstash.stats(0)["handed_over_bytes"] - handed, 64 * MiB)
        self.assertFalse(vmstash.switch(["cpu_sw_roll"], ["cpu_sw_train"]))  # nothing to do
        with self.assertRaises(TypeError):
            vmstash.switch("cpu_sw_train", "cpu_sw_roll")
        with self.assertRaises(vmstash.Error) as e:
            vmstash.switch(["cpu_sw_train"], ["cpu_sw_train"])
        self.assertEqual(e.exception.code_name, "INVALID_ARGUMENT")
        # Out of memory: the incoming tag does not fit beside a hog; everything stays as it was.
        vmstash.create_tag("cpu_sw_big", "backup")
        big = malloc("cpu_sw_big", 400 * MiB)
        fill(big, 400 * MiB, 0x53)
        self.assertTrue(vmstash.pause("cpu_sw_big"))
        vmstash.create_tag("cpu_sw_hog", "discard")
        hog = malloc("cpu_sw_hog", 800 * MiB)
        with self.assertRaises(vmstash.OutOfMemoryError) as e:
            vmstash.switch(pause=["cpu_sw_train"], resume=["cpu_sw_big"])
        self.assertIn("every tag is as it was", str(e.exception))
        self.assertEqual(vmstash.tag_stats("cpu_sw_train")["state"], "active")
        self.assertTrue(holds(train, 64 * MiB, 0x31))
        free(hog, 800 * MiB)
        vmstash.empty_cache(tag="cpu_sw_hog")
        self.assertTrue(vmstash.switch(pause=["cpu_sw_train"], resume=["cpu_sw_roll", "cpu_sw_big"]))
        self.assertTrue(holds(big, 400 * MiB, 0x53))
        self.assertTrue(holds(roll, 16 * MiB, 0x42))
        self.assertTrue(vmstash.resume("cpu_sw_train"))
        self.assertTrue(holds(train, 64 * MiB, 0x31))
        for p, n in ((train, 64 * MiB), (roll, 64 * MiB), (big, 400 * MiB)):
            free(p, n)

    def test_resume_out_of_memory_raises_keeps_tag_paused_and_retry_succeeds(self):
        vmstash.create_tag("cpu_big", "backup")
        big = malloc("cpu_big", 300 * MiB)
        fill(big, 300 * MiB, 0x77)
        self.assertTrue(vmstash.pause("cpu_big"))
        vmstash.create_tag("cpu_hog", "discard")
        hog = malloc("cpu_hog", 900 * MiB)  # the 1 GiB device is now nearly full
        with self.assertRaises(vmstash.OutOfMemoryError) as e:
            vmstash.resume("cpu_big")
        self.assertIsInstance(e.exception, _lib._oom_base())  # torch.OutOfMemoryError with torch
        self.assertEqual(e.exception.code_name, "RESOURCE_EXHAUSTED")
        self.assertEqual(vmstash.tag_stats("cpu_big")["state"], "paused")
        free(hog, 900 * MiB)
        vmstash.empty_cache(tag="cpu_hog")
        self.assertTrue(vmstash.resume("cpu_big"))
        self.assertTrue(holds(big, 300 * MiB, 0x77))
        free(big, 300 * MiB)
        vmstash.release_backup("cpu_big")

    def test_read_backup_while_paused_and_memory_margin(self):
        vmstash.create_tag("cpu_rb", "backup")
        p = malloc("cpu_rb", 2 * MiB)
        fill(p, 2 * MiB, 0x3C)
        buf = ctypes.create_string_buffer(4096)
        with self.assertRaises(vmstash.Error) as e:
            vmstash.read_backup(p, 4096, ctypes.addressof(buf))
        self.assertEqual(e.exception.code_name, "NOT_FOUND")
        self.assertTrue(vmstash.pause("cpu_rb"))
        vmstash.read_backup(p + MiB, 4096, ctypes.addressof(buf))
        self.assertEqual(buf.raw, bytes([0x3C]) * 4096)
        # Issue 16 item 4: sizes that are negative or wrap the address space are refused.
        with self.assertRaises(ValueError):
            vmstash.read_backup(p + 16, -1, ctypes.addressof(buf))
        with self.assertRaises(ValueError):
            vmstash.read_backup(p + 16, 16, 0)
        with self.assertRaises(vmstash.Error) as e:
            vmstash.read_backup(p + 16, (1 << 64) - 16, ctypes.addressof(buf))
        self.assertEqual(e.exception.code_name, "INVALID_ARGUMENT")
        # Prepare of a paused tag is refused (its arena holds the paused bytes).
        with self.assertRaises(vmstash.Error) as e:
            vmstash.prepare("cpu_rb")
        self.assertEqual(e.exception.code_name, "FAILED_PRECONDITION")
        self.assertTrue(vmstash.resume("cpu_rb"))
        free(p, 2 * MiB)
        vmstash.set_memory_margin(1 << 40)  # more than the device has
        with self.assertRaises(vmstash.Error):
            malloc("cpu_rb", 64 * MiB)
        self.assertIn("memory margin", _lib.last_error())
        vmstash.set_memory_margin(0)
        free(malloc("cpu_rb", 64 * MiB), 64 * MiB)
        with self.assertRaises(ValueError):
            vmstash.set_memory_margin(-1)

    def test_stats_and_snapshot_are_dicts(self):
        vmstash.create_tag("cpu_s", "discard")
        p = malloc("cpu_s", MiB)
        s = vmstash.stats(0)
        self.assertIn("total", s)
        self.assertIn("cpu_s", [t["name"] for t in s["tags"]])
        everything = vmstash.stats()
        self.assertIsInstance(everything, list)
        snap = vmstash.snapshot(0)
        self.assertTrue(any(seg["tag"] == "cpu_s" for seg in snap["segments"]))
        free(p, MiB)
        vmstash.empty_cache()

    def test_torch_memory_saver_compat_pure_parts(self):
        from vmstash.compat.torch_memory_saver import TorchMemorySaver, configure_subprocess, torch_memory_saver
        self.assertTrue(torch_memory_saver.enabled)
        tms = TorchMemorySaver()
        # Tag naming: the first backup setting keeps the name.
        self.assertEqual(tms._vmstash_tag("kv", "discard"), ("kv", "discard"))
        self.assertEqual(tms._vmstash_tag("kv", "pinned"), ("kv:pinned", "backup"))
        self.assertEqual(tms._vmstash_tag("kv", "discard"), ("kv", "discard"))
        self.assertEqual(sorted(n for n, _ in tms._targets("kv")), ["kv", "kv:pinned"])
        self.assertEqual(tms._targets("other"), [])
        # torch_memory_saver's argument checks.
        self.assertEqual(tms._setting(False, False, None), "discard")
        self.assertEqual(tms._setting(True, False, None), "pinned")
        self.assertEqual(tms._setting(True, False, "mmap"), "mmap")
        self.assertEqual(tms._setting(False, True, None), "disk")
        for bad in [(True, True, None), (True, False, "disk"), (False, False, "mmap")]:
            with self.assertRaises(ValueError, msg=str(bad)):
                tms._setting(*bad)
        os.environ["TMS_INIT_CPU_BACKUP_BACKEND"] = "mmap"
        try:
            self.assertEqual(tms._setting(True, False, None), "mmap")
            self.assertEqual(tms._setting(True, False, "pinned"), "pinned")
            os.environ["TMS_INIT_CPU_BACKUP_BACKEND"] = "tape"
            with self.assertRaises(ValueError):
                tms._setting(True, False, None)
        finally:
            del os.environ["TMS_INIT_CPU_BACKUP_BACKEND"]
        with self.assertRaises(vmstash.Error) as e:
            tms.hook_mode = "preload"  # this process was not started with LD_PRELOAD
        self.assertEqual(e.exception.code_name, "FAILED_PRECONDITION")
        with self.assertRaises(ValueError):
            tms.hook_mode = "bogus"
        tms.hook_mode = "torch"
        self.assertFalse(tms.retain_cpu_backup)  # torch_memory_saver's default
        tms.retain_cpu_backup = True
        self.assertTrue(tms.retain_cpu_backup)
        # Not under the preload library: hook mode torch, interesting region = in a region.
        self.assertEqual(TorchMemorySaver().hook_mode, "torch")
        tms._ensure_initialized()
        cdll = tms._impl._binary_wrapper.cdll
        self.assertFalse(cdll.tms_get_interesting_region())
        vmstash.set_current_tag("cpu_interesting")
        self.assertTrue(cdll.tms_get_interesting_region())
        cdll.tms_set_interesting_region(False)
        self.assertEqual(vmstash.current_tag(), "default")
        # Whole-process mode without the preload library is refused, not silently empty.
        os.environ["TMS_INIT_ENABLE"] = "1"
        try:
            with self.assertRaises(vmstash.Error) as e:
                TorchMemorySaver()._ensure_initialized()
            self.assertIn("LD_PRELOAD", str(e.exception))
        finally:
            del os.environ["TMS_INIT_ENABLE"]
        tms.memory_margin_bytes = 0
        self.assertEqual(tms.memory_margin_bytes, 0)
        # pause/resume of tags this instance never saw: nothing to do.
        tms.pause("nothing")
        tms.resume()
        os.environ["VMSTASH_PRELOAD_LIBRARY"] = "/x/libvmstash_preload.so"
        os.environ["LD_PRELOAD"] = "libother.so"
        try:
            with configure_subprocess():
                self.assertEqual(os.environ["LD_PRELOAD"], "/x/libvmstash_preload.so libother.so")
            self.assertEqual(os.environ["LD_PRELOAD"], "libother.so")
        finally:
            del os.environ["VMSTASH_PRELOAD_LIBRARY"]
            del os.environ["LD_PRELOAD"]

    def test_backup_stores(self):
        import tempfile
        vmstash.create_tag("cpu_store", "backup")
        vmstash.create_tag("cpu_store_kv", "discard")
        self.assertEqual(vmstash.backup_store("cpu_store"), "pinned")
        with tempfile.TemporaryDirectory() as d:
            p = malloc("cpu_store", 5 * MiB)
            fill(p, 5 * MiB, 0x3C)
            vmstash.set_backup_store("cpu_store", "disk", d)
            self.assertEqual(vmstash.backup_store("cpu_store"), "disk:" + d)
            self.assertEqual(vmstash.tag_stats("cpu_store")["backup_store"], "disk:" + d)
            self.assertTrue(vmstash.pause("cpu_store"))
            self.assertEqual(os.listdir(d), [])  # the file is unlinked: nothing left behind
            with self.assertRaises(vmstash.Error) as e:
                vmstash.set_backup_store("cpu_store", "pinned")
            self.assertEqual(e.exception.code_name, "FAILED_PRECONDITION")
            self.assertTrue(vmstash.resume("cpu_store"))
            self.assertTrue(holds(p, 5 * MiB, 0x3C))
            vmstash.set_backup_store("cpu_store", "pageable")
            self.assertTrue(vmstash.pause("cpu_store"))
            self.assertTrue(vmstash.resume("cpu_store"))
            self.assertTrue(holds(p, 5 * MiB, 0x3C))
            free(p, 5 * MiB)
        for args, error in [(("cpu_store", "tape"), ValueError), (("cpu_store", "disk"), ValueError),
                            (("cpu_store", "pinned", "/tmp"), ValueError)]:
            with self.assertRaises(error, msg=str(args)):
                vmstash.set_backup_store(*args)
        with self.assertRaises(vmstash.Error) as e:
            vmstash.set_backup_store("cpu_store", "disk", "/nonexistent/vmstash_dir")
        self.assertEqual(e.exception.code_name, "NOT_FOUND")
        self.assertIn("/nonexistent/vmstash_dir", str(e.exception))
        with self.assertRaises(vmstash.Error) as e:
            vmstash.set_backup_store("cpu_store_kv", "pageable")
        self.assertEqual(e.exception.code_name, "FAILED_PRECONDITION")
        vmstash.release_backup("cpu_store")

    def test_torch_memory_saver_backends_disk_and_retain(self):
        """torch_memory_saver's per-region backends (pinned, mmap, disk) on one tag, the disk
        directory's errors, and retain_cpu_backup both ways."""
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
            self.assertEqual(names, {"disk": "st", "mmap": "st:mmap", "pinned": "st:pinned"})
            self.assertEqual(vmstash.backup_store("st"), "disk:" + spill)
            self.assertEqual(vmstash.backup_store("st:mmap"), "pageable")
            self.assertEqual(vmstash.backup_store("st:pinned"), "pinned")
            ptrs = {s: malloc(name, n) for s, name in names.items()}
            for i, p in enumerate(ptrs.values()):
                fill(p, n, 0x40 + i)

            def round_trip():
                tms.pause("st")
                self.assertEqual({vmstash.tag_stats(v)["state"] for v in names.values()}, {"paused"})
                tms.resume("st")
                for i, p in enumerate(ptrs.values()):
                    self.assertTrue(holds(p, n, 0x40 + i))

            round_trip()
            # retain_cpu_backup False (torch_memory_saver's default): every backup is given back.
            self.assertEqual([vmstash.tag_stats(v)["backup_arena_bytes"] for v in names.values()], [0, 0, 0])
            tms.retain_cpu_backup = True
            round_trip()
            self.assertTrue(all(vmstash.tag_stats(v)["backup_arena_bytes"] > 0 for v in names.values()))
            tms.retain_cpu_backup = False
            round_trip()
            self.assertEqual(os.listdir(spill), [])
            # A missing directory fails the pause with a clear error; the tag stays active, intact.
            os.rmdir(spill)
            with self.assertRaises(vmstash.Error) as e:
                tms.pause("st")
            self.assertEqual(e.exception.code_name, "NOT_FOUND")
            self.assertIn(spill, str(e.exception))
            self.assertEqual(vmstash.tag_stats("st")["state"], "active")
            self.assertTrue(holds(ptrs["disk"], n, 0x40))
            # A new directory is used from the next pause on.
            tms.set_disk_backup_dir(os.path.join(d, "spill2"))
            round_trip()
            self.assertEqual(vmstash.backup_store("st"), "disk:" + os.path.join(d, "spill2"))
            for p in ptrs.values():
                free(p, n)

    def test_switch_from_another_thread_while_this_one_allocates(self):
        """A phase switch from an RPC thread (as SGLang and slime control their engines)
        while another thread keeps allocating in a tag outside the switch: both phases'
        bytes survive every switch, the worker's tag is untouched, no call fails."""
        import threading
        vmstash.create_tag("thr_sw_roll", "backup")
        vmstash.create_tag("thr_sw_train", "backup")
        vmstash.create_tag("thr_sw_work", "discard")
        roll, train = malloc("thr_sw_roll", 6 * MiB), malloc("thr_sw_train", 6 * MiB)
        fill(roll, 6 * MiB, 0x21)
        fill(train, 6 * MiB, 0x43)
        self.assertTrue(vmstash.pause("thr_sw_train"))
        errors, done = [], threading.Event()

        def worker():
            try:
                while not done.is_set():
                    q = malloc("thr_sw_work", 3 * MiB)
                    fill(q, 3 * MiB, 0x11)
                    if not holds(q, 3 * MiB, 0x11):
                        errors.append("worker's bytes changed")
                    free(q, 3 * MiB)
            except Exception as e:  # reported below
                errors.append(repr(e))

        def control():
            try:
                for _ in range(10):
                    vmstash.switch(pause=["thr_sw_roll"], resume=["thr_sw_train"])
                    if not holds(train, 6 * MiB, 0x43):
                        errors.append("training bytes lost")
                    vmstash.switch(pause=["thr_sw_train"], resume=["thr_sw_roll"])
                    if not holds(roll, 6 * MiB, 0x21):
                        errors.append("rollout bytes lost")
            except Exception as e:  # reported below
                errors.append(repr(e))

        t = threading.Thread(target=worker)
        t.start()
        try:
            c = threading.Thread(target=control)
            c.start()
            c.join()
        finally:
            done.set()
            t.join()
        self.assertEqual(errors, [])
        self.assertEqual(vmstash.tag_stats("thr_sw_work")["state"], "active")
        self.assertEqual(vmstash.tag_stats("thr_sw_roll")["switches"], 20)
        self.assertTrue(vmstash.resume("thr_sw_train"))
        free(roll, 6 * MiB)
        free(train, 6 * MiB)

    def test_torch_memory_saver_pause_from_another_thread_while_this_one_allocates(self):
        """SGLang and slime pause from an RPC thread while other threads keep working: the
        paused tag comes back intact, the working thread's tag is untouched, no call fails."""
        import threading
        from vmstash.compat.torch_memory_saver import TorchMemorySaver
        tms = TorchMemorySaver()
        tms.hook_mode = "torch"
        weights, _ = tms._vmstash_tag("thr_weights", "pinned")
        work, _ = tms._vmstash_tag("thr_work", "discard")
        p = malloc(weights, 6 * MiB)
        fill(p, 6 * MiB, 0x77)
        errors, done = [], threading.Event()

        def worker():
            try:
                while not done.is_set():
                    q = malloc(work, 3 * MiB)
                    fill(q, 3 * MiB, 0x11)
                    if not holds(q, 3 * MiB, 0x11):
                        errors.append("worker's bytes changed")
                    free(q, 3 * MiB)
            except Exception as e:  # reported below
                errors.append(repr(e))

        t = threading.Thread(target=worker)
        t.start()
        try:
            for _ in range(20):
                tms.pause("thr_weights")
                self.assertEqual(vmstash.tag_stats(weights)["state"], "paused")
                tms.resume("thr_weights")
                self.assertTrue(holds(p, 6 * MiB, 0x77))
        finally:
            done.set()
            t.join()
        self.assertEqual(errors, [])
        self.assertEqual(vmstash.tag_stats(work)["state"], "active")
        free(p, 6 * MiB)

    def test_torch_memory_saver_dropin_wheel_installs_the_package_and_the_preload_names(self):
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
            self.assertRegex(os.path.basename(out),
                             r"^torch_memory_saver-0\.0\.10\+vmstash\.[0-9.]+-py3-none-manylinux_2_\d+_x86_64\.whl$")
            site = os.path.join(tmp, "site")
            with zipfile.ZipFile(out) as z:
                self.assertIsNone(z.testzip())
                record = z.read([n for n in z.namelist() if n.endswith("/RECORD")][0]).decode()
                for name in z.namelist():
                    self.assertIn(name + ",", record)
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
                "print('dropin ok')\n")
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, os.path.join(root, "torch_plugin", "python")]))
            result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
            self.assertEqual(result.returncode, 0, result.stderr)
            self.assertIn("dropin ok", result.stdout)

    def test_pause_over_two_devices_is_all_or_nothing_with_each_devices_hint(self):
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
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("two devices ok", result.stdout)

    def test_stash_arena_round_trip_overflow_reset_and_pause_refusal(self):
        from vmstash import stash
        row, p_rows = 64, 4
        with self.assertRaises(ValueError):
            stash.Arena(row_bytes=0, device_pages=4, device=0)
        with self.assertRaises(vmstash.Error) as e:
            stash.Arena(row_bytes=row, device_pages=4, page_rows=3, device=0)
        self.assertIn("power of two", str(e.exception))
        arena = stash.Arena(row_bytes=row, device_pages=3, host_pages=2, page_rows=p_rows, tag="stash_py",
                            device=0)
        self.assertEqual(arena.info()["executor"], "host")
        self.assertEqual(arena.info()["device_bytes"], 3 * p_rows * row)
        max_rows = 10
        src = malloc("default", max_rows * row)
        dst = malloc("default", max_rows * row)
        n = malloc("default", 8)
        ctypes.memmove(src, bytes(range(256)) * (max_rows * row // 256), max_rows * row)
        h1, h2, h3 = (arena._new_handle(max_rows) for _ in range(3))
        ctypes.c_int64.from_address(n).value = 9          # 3 pages: the whole device tier
        arena.stash_ptr(src, n, max_rows, h1)
        self.assertEqual(arena.pages_in_use(), 3)
        with self.assertRaises(vmstash.Error) as e:
            vmstash.pause("stash_py", device=0)
        self.assertEqual(e.exception.code_name, "FAILED_PRECONDITION")
        ctypes.c_int64.from_address(n).value = 5          # 2 pages: spills to the host tier
        arena.stash_ptr(src, n, max_rows, h2)
        f = arena.flags()
        self.assertTrue(f.host_spill)
        self.assertFalse(f.overflow)
        ctypes.c_int64.from_address(n).value = 1          # no room anywhere: sticky overflow
        arena.stash_ptr(src, n, max_rows, h3)
        f = arena.flags()
        self.assertTrue(f.overflow)
        self.assertEqual(f.last_failed_pages, 1)
        ctypes.memset(dst, 0xAA, max_rows * row)
        arena.reset()                                     # forgets all, clears overflow
        self.assertFalse(arena.flags().overflow)
        self.assertEqual(arena.pages_in_use(), 0)
        ctypes.c_int64.from_address(n).value = 6
        arena.stash_ptr(src, n, max_rows, h1)
        arena.restore_ptr(h1, dst, max_rows, zero_tail=True)
        self.assertEqual(ctypes.string_at(dst, 6 * row), ctypes.string_at(src, 6 * row))
        self.assertEqual(ctypes.string_at(dst + 6 * row, 4 * row), bytes(4 * row))
        vmstash.pause("stash_py", device=0)               # idle: allowed, memory released
        vmstash.resume("stash_py", device=0)
        arena.reset()
        arena.stash_ptr(src, n, max_rows, h1)
        arena.discard_ptr(h1, max_rows)
        self.assertEqual(arena.pages_in_use(), 0)
        arena.close()
        with self.assertRaises(vmstash.Error):
            arena.reset()
        for p, size in ((src, max_rows * row), (dst, max_rows * row), (n, 8)):
            free(p, size)

    def test_stash_linked_flags_and_launch_shape(self):
        from vmstash import stash
        with self.assertRaises(vmstash.Error) as e:
            stash.set_launch_shape(264, 33)
        self.assertIn("multiple of 32", str(e.exception))
        stash.set_launch_shape(0, 0)  # keeps both
        row, p_rows, max_rows = 32, 4, 8
        a = stash.Arena(row_bytes=row, device_pages=2, page_rows=p_rows, tag="stash_link", device=0)
        b = stash.Arena(row_bytes=2 * row, device_pages=4, page_rows=p_rows, tag="stash_link", device=0)
        flags = malloc("default", 16)
        ctypes.memset(flags, 0, 16)
        a.link_flags(flags, flags + 8)
        b.link_flags(flags, flags + 8)
        src, dst, n = malloc("default", max_rows * 2 * row), malloc("default", max_rows * 2 * row), malloc("default", 8)
        ctypes.memmove(src, bytes(range(256))[: max_rows * 2 * row], max_rows * 2 * row)
        ha, hb = a._new_handle(max_rows), b._new_handle(max_rows)
        ctypes.c_int64.from_address(n).value = max_rows + 1   # clamped to 8 rows: 2 pages, fits
        a.stash_ptr(src, n, max_rows, ha)
        a.discard_ptr(ha, max_rows)
        ctypes.c_int64.from_address(n).value = max_rows
        a.stash_ptr(src, n, max_rows, ha)
        hc = a._new_handle(max_rows)
        a.stash_ptr(src, n, max_rows, hc)                    # no room: the shared overflow is set
        self.assertEqual(ctypes.c_int64.from_address(flags).value, 1)
        b.stash_ptr(src, n, max_rows, hb)                    # a no-op in the other arena
        self.assertEqual(b.pages_in_use(), 0)
        ctypes.c_int64.from_address(flags).value = 0         # the owner clears it, then resets
        a.reset()
        b.reset()
        b.stash_ptr(src, n, max_rows, hb)
        ctypes.memset(dst, 0, max_rows * 2 * row)
        b.restore_ptr(hb, dst, max_rows)
        self.assertEqual(ctypes.string_at(dst, max_rows * 2 * row), ctypes.string_at(src, max_rows * 2 * row))
        a.close()
        b.close()
        for p, size in ((src, max_rows * 2 * row), (dst, max_rows * 2 * row), (n, 8), (flags, 16)):
            free(p, size)

    def test_cli_shim_never_execs_a_script_named_by_vmstash_cli(self):
        # VMSTASH_CLI naming the console script itself looped exec forever (hung on the H200).
        import subprocess
        import tempfile
        from vmstash import _cli
        with tempfile.TemporaryDirectory() as d:
            script = os.path.join(d, "vmstash")
            with open(script, "w") as f:
                f.write("#!/usr/bin/env python3\nfrom vmstash._cli import main\nmain()\n")
            os.chmod(script, 0o755)
            env = dict(os.environ, VMSTASH_CLI=script)
            old = os.environ.get("VMSTASH_CLI")
            os.environ["VMSTASH_CLI"] = script
            try:
                try:
                    path = _cli.cli_path()
                    self.assertNotEqual(path, script)  # the package's own binary, never the script
                except FileNotFoundError as e:
                    self.assertIn("VMSTASH_CLI", str(e))  # a source tree: no binary, a clear error
            finally:
                if old is None:
                    del os.environ["VMSTASH_CLI"]
                else:
                    os.environ["VMSTASH_CLI"] = old
            # Started by itself, the shim stops at once with a clear message instead of looping.
            env["_VMSTASH_CLI_SHIM"] = "1"
            r = subprocess.run([sys.executable, "-c", "import sys; from vmstash._cli import main; sys.exit(main())",
                                "ps"], env=env, capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("started by itself", r.stderr)

    def test_torch_functions_without_torch_raise_clearly(self):
        try:
            import torch  # noqa: F401
            self.skipTest("torch is importable here")
        except ImportError:
            pass
        with self.assertRaises(vmstash.Error) as e:
            with vmstash.region("cpu_r"):
                pass
        self.assertIn("needs PyTorch", str(e.exception))


if __name__ == "__main__":
    unittest.main()
