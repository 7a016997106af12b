"""torch_memory_saver's C entry points (vmstash_tms.h) and what they rest on, without a GPU
(simulated driver, through libvmstash.so with ctypes as torch_memory_saver's tests reach
them): the per-thread config and its TMS_INIT_* defaults, tms_pause / tms_resume and the
backup pointer, retained backups (readable after a resume at the same address, gone with
their last block), the disk_files store (a file per backed-up allocation while paused,
removed at the resume, after a failed pause and at exit; stale files of dead processes
swept), and the drop-in's utils module."""
import ctypes
import os
import subprocess
import sys
import tempfile
import threading

import pytest

import vmstash
from vmstash import _lib

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
DROPIN = os.path.join(os.path.dirname(HERE), "tms_dropin")
U8P = ctypes.POINTER(ctypes.c_uint8)


def _cdll():
    from vmstash.compat.torch_memory_saver import _TmsCdll
    return _TmsCdll(_lib.library_path())


def _backup_pointer(cdll, p, n):
    """tms_get_cpu_backup_pointer as an int (0: NULL)."""
    return ctypes.cast(cdll.tms_get_cpu_backup_pointer(ctypes.cast(p, U8P), n), ctypes.c_void_p).value or 0


def _tag(tms_tag, setting):
    name = _lib.lib().vmstash_tms_tag(tms_tag.encode(), setting.encode())
    assert name is not None, _lib.last_error()
    return name.decode()


def _run(code, **env):
    """`code` in a fresh Python (the runtime and every TMS_INIT_* variable read anew)."""
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE)] + sys.path), **env)
    r = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_per_thread_config_defaults_setters_and_errors(sim):
    cdll = _cdll()
    assert cdll.tms_get_current_tag() == b"default" and cdll.tms_get_cpu_backup_backend() == b"pinned"
    assert cdll.tms_get_enable_cpu_backup() is False and cdll.tms_get_enable_disk_backup() is False
    assert cdll.tms_get_interesting_region() is False
    seen = {}

    def other_thread():  # each thread has its own config
        cdll.tms_set_current_tag(b"worker")
        cdll.tms_set_cpu_backup_backend(b"mmap")
        cdll.tms_set_enable_cpu_backup(True)
        seen.update(tag=cdll.tms_get_current_tag(), backend=cdll.tms_get_cpu_backup_backend(),
                    cpu=cdll.tms_get_enable_cpu_backup())

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert seen == {"tag": b"worker", "backend": b"mmap", "cpu": True}
    assert cdll.tms_get_current_tag() == b"default" and cdll.tms_get_cpu_backup_backend() == b"pinned"
    # Bad values keep the previous one and say why (torch_memory_saver exits instead).
    cdll.tms_set_cpu_backup_backend(b"tape")
    assert cdll.tms_get_cpu_backup_backend() == b"pinned" and "tape" in _lib.last_error()
    cdll.tms_set_current_tag(None)
    assert cdll.tms_get_current_tag() == b"default" and "NULL" in _lib.last_error()
    # A region's config is pushed and popped exactly (the routing override's "unset" too).
    l = _lib.lib()
    assert l.vmstash_tms_push_region(b"r", 1, b"mmap", 0) == 0
    assert (cdll.tms_get_current_tag(), cdll.tms_get_cpu_backup_backend()) == (b"r", b"mmap")
    assert cdll.tms_get_interesting_region() is True and cdll.tms_get_enable_cpu_backup() is True
    assert l.vmstash_tms_push_region(b"inner", 0, None, 1) == 0  # backend NULL: the thread's (mmap)
    assert (cdll.tms_get_cpu_backup_backend(), cdll.tms_get_enable_disk_backup()) == (b"mmap", True)
    assert l.vmstash_tms_pop_region() == 0 and l.vmstash_tms_pop_region() == 0
    assert cdll.tms_get_current_tag() == b"default" and cdll.tms_get_interesting_region() is False
    assert l.vmstash_tms_pop_region() == _lib.FAILED_PRECONDITION
    assert l.vmstash_tms_push_region(b"r", 1, b"disk", 0) == _lib.INVALID_ARGUMENT
    # The interesting flag: set and unset (-1 gives the default rule back).
    assert l.vmstash_tms_set_interesting(1) == -1 and cdll.tms_get_interesting_region() is True
    cdll.tms_set_interesting_region(False)
    assert cdll.tms_get_interesting_region() is False
    assert l.vmstash_tms_set_interesting(-1) == 0
    assert cdll.tms_get_retain_cpu_backup() is False
    cdll.tms_set_retain_cpu_backup(True)
    assert cdll.tms_get_retain_cpu_backup() is True
    cdll.tms_set_retain_cpu_backup(False)
    cdll.set_memory_margin_bytes(0)


def test_config_defaults_come_from_the_tms_init_variables():
    out = _run(
        "import threading\n"
        "from vmstash.compat.torch_memory_saver import _TmsCdll\n"
        "from vmstash import _lib\n"
        "c = _TmsCdll(_lib.library_path())\n"
        "def show():\n"
        "    print(c.tms_get_enable_cpu_backup(), c.tms_get_cpu_backup_backend().decode(),\n"
        "          c.tms_get_enable_disk_backup(), c.tms_get_retain_cpu_backup())\n"
        "show()\n"
        "t = threading.Thread(target=show); t.start(); t.join()\n",
        TMS_INIT_ENABLE_CPU_BACKUP="1", TMS_INIT_CPU_BACKUP_BACKEND="mmap", TMS_INIT_ENABLE_DISK_BACKUP="1",
        TMS_RETAIN_CPU_BACKUP="1")
    assert out.split("\n")[:2] == ["True mmap True True"] * 2, out


def test_torch_memory_saver_variables_are_read_in_one_place(sim):
    """The C library reads TMS_INIT_* once (tms_env.h) and the Python layer asks it: a bad
    backend is a ValueError at the first use, whole-process mode without the preload
    library is refused (not silently empty), and a flag is on for "1" or "true" only."""
    probe = ("from vmstash.compat.torch_memory_saver import TorchMemorySaver\n"
             "from vmstash import _lib\n"
             "print('whole', _lib.lib().vmstash_tms_whole_process())\n"
             "try:\n"
             "    TorchMemorySaver()._ensure_initialized()\n"
             "    print('initialized')\n"
             "except Exception as e:\n"
             "    print(type(e).__name__, e)\n")
    out = _run(probe, TMS_INIT_CPU_BACKUP_BACKEND="tape")
    assert "whole 0" in out and "ValueError TMS_INIT_CPU_BACKUP_BACKEND must be 'pinned' or 'mmap', got 'tape'" in out
    out = _run(probe, TMS_INIT_ENABLE="1")
    assert "whole 1" in out and "Error" in out and "LD_PRELOAD" in out, out
    out = _run(probe, TMS_INIT_ENABLE="yes")  # torch_memory_saver's rule: not on
    assert "whole 0" in out and "initialized" in out, out



def test_a_pause_or_resume_before_any_allocation_makes_no_runtime(sim):
    """Nothing can be paused before the runtime exists: 0, and the runtime is not made
    (a later vmstash_init with other options still works)."""
    out = _run(
        "import ctypes\n"
        "from vmstash.compat.torch_memory_saver import _TmsCdll\n"
        "from vmstash import _lib\n"
        "c = _TmsCdll(_lib.library_path())\n"
        "l = _lib.lib()\n"
        "print(c.tms_pause(None), c.tms_resume(b'kv'), l.vmstash_tms_pause(None, None, 0),\n"
        "      l.vmstash_tms_pause(None, None, 1), l.vmstash_is_initialized())\n")
    assert out.split() == ["0", "0", "0", str(_lib.INVALID_ARGUMENT), "0"], out


def test_tms_pause_resume_and_the_backup_pointer(sim):
    cdll = _cdll()
    name, n = _tag("ckv", "pinned"), 3 * MiB
    assert name == "ckv" and _tag("ckv", "discard") == "ckv:discard"
    p = sim.malloc(name, n)
    sim.fill(p, n, 0x5c)
    assert _backup_pointer(cdll, p, n) == 0  # active, nothing retained
    assert cdll.tms_pause(b"ckv") == 0
    assert vmstash.tag_stats(name)["state"] == "paused"
    assert cdll.tms_pause(b"ckv") == 0  # paused already: nothing to do
    at = _backup_pointer(cdll, p + 4096, 4096)
    assert at and ctypes.string_at(at, 4096) == b"\x5c" * 4096
    assert cdll.tms_resume(b"ckv") == 0
    assert sim.holds(p, n, 0x5c)
    assert _backup_pointer(cdll, p, n) == 0 and vmstash.tag_stats(name)["backup_arena_bytes"] == 0
    # retain_cpu_backup: the backup stays readable after the resume, at the same address, and
    # the next pause writes it in place.
    cdll.tms_set_retain_cpu_backup(True)
    try:
        assert cdll.tms_pause(None) == 0
        paused_at = _backup_pointer(cdll, p, n)
        assert cdll.tms_resume(None) == 0
        assert _backup_pointer(cdll, p, n) == paused_at and ctypes.string_at(paused_at, n) == b"\x5c" * n
        sim.fill(p, n, 0x5d)
        assert ctypes.string_at(paused_at, 16) == b"\x5c" * 16  # a copy, not the device memory
        assert cdll.tms_pause(b"ckv") == 0
        assert _backup_pointer(cdll, p, n) == paused_at and ctypes.string_at(paused_at, n) == b"\x5d" * n
    finally:
        cdll.tms_set_retain_cpu_backup(False)
    assert cdll.tms_resume(b"ckv") == 0
    assert _backup_pointer(cdll, p, n) == 0 and vmstash.tag_stats(name)["backup_arena_bytes"] == 0
    assert sim.holds(p, n, 0x5d)
    sim.free(p, n)


def test_a_failed_tms_resume_names_the_tags_it_resumed_and_a_retry_resumes_the_rest(sim):
    """tms_resume of a torch_memory_saver tag with a backed-up and a discarded vmstash tag
    when only one fits: it stops at the one that does not, its error naming the one resumed
    before it (active, bytes intact); the retry resumes the rest."""
    cdll = _cdll()
    kept, dropped, n = _tag("one_txn", "pinned"), _tag("one_txn", "discard"), 256 * MiB
    p, q = sim.malloc(kept, n), sim.malloc(dropped, n)
    sim.fill(p, n, 0x3a)
    assert cdll.tms_pause(b"one_txn") == 0
    assert {vmstash.tag_stats(t)["state"] for t in (kept, dropped)} == {"paused"}
    vmstash.create_tag("one_txn_hog", "discard")
    hog_bytes = 640 * MiB  # of 1 GiB: either tag alone fits beside it, not both
    hog = sim.malloc("one_txn_hog", hog_bytes)
    try:
        rc = cdll.tms_resume(b"one_txn")
        assert rc == _lib.RESOURCE_EXHAUSTED, (rc, _lib.last_error())
        said = _lib.last_error()
        assert f"resumed before it: '{kept}'; the others stay paused" in said, said
        assert said.startswith("RESOURCE_EXHAUSTED: ") and said.count("RESOURCE_EXHAUSTED: ") == 1, said
        assert [vmstash.tag_stats(t)["state"] for t in (kept, dropped)] == ["active", "paused"]
        assert sim.holds(p, n, 0x3a)
    finally:
        sim.free(hog, hog_bytes)
        vmstash.empty_cache(tag="one_txn_hog")
    assert cdll.tms_resume(b"one_txn") == 0
    assert {vmstash.tag_stats(t)["state"] for t in (kept, dropped)} == {"active"}
    assert sim.holds(p, n, 0x3a)
    assert cdll.tms_resume(b"one_txn") == 0  # resumed already: nothing to do
    sim.free(p, n)
    sim.free(q, n)


SEPARATORS = "".join(chr(c) for c in range(0x21, 0x7f) if not chr(c).isalnum())


@pytest.mark.parametrize("order", ["second_setting_first", "named_tag_first"])
@pytest.mark.parametrize("sep", list(SEPARATORS), ids=[f"0x{ord(c):02x}" for c in SEPARATORS])
def test_a_tms_tag_named_like_another_tags_second_setting_is_a_tag_of_its_own(sim, sep, order):
    """torch_memory_saver tags "<base>" (discard, then pinned: a second setting) and
    "<base><sep>pinned" (pinned), resolved in either order, for every separator a tag can
    hold: three vmstash tags, and pausing one torch_memory_saver tag pauses only its own
    memory, the other's stays active with its bytes (before the fix, with ":", both
    resolved to one vmstash tag, or the backed-up allocations of one were refused)."""
    cdll = _cdll()
    base = f"coll{ord(sep):02x}{order[0]}"
    named = f"{base}{sep}pinned"
    if order == "named_tag_first":
        own = _tag(named, "pinned")
        first, second = _tag(base, "discard"), _tag(base, "pinned")
    else:
        first, second = _tag(base, "discard"), _tag(base, "pinned")
        own = _tag(named, "pinned")
    assert len({first, second, own}) == 3, (first, second, own)
    assert [vmstash.tags()[t] for t in (first, second, own)] == ["discard", "backup", "backup"]
    assert _tag(base, "pinned") == second and _tag(named, "pinned") == own  # stable names
    n = 4 * MiB
    p, q, r = sim.malloc(first, n), sim.malloc(second, n), sim.malloc(own, n)
    sim.fill(q, n, 0x21)
    sim.fill(r, n, 0x42)
    assert cdll.tms_pause(base.encode()) == 0, _lib.last_error()
    assert [vmstash.tag_stats(t)["state"] for t in (first, second, own)] == ["paused", "paused", "active"]
    assert sim.holds(r, n, 0x42)  # the other tag's memory is still mapped and its own
    assert cdll.tms_pause(named.encode()) == 0, _lib.last_error()
    assert cdll.tms_resume(base.encode()) == 0, _lib.last_error()
    assert [vmstash.tag_stats(t)["state"] for t in (first, second, own)] == ["active", "active", "paused"]
    assert sim.holds(q, n, 0x21)
    assert cdll.tms_resume(named.encode()) == 0, _lib.last_error()
    assert sim.holds(r, n, 0x42)
    for ptr in (p, q, r):
        sim.free(ptr, n)


def test_every_tms_tag_pauses_each_of_its_vmstash_tags_once(sim):
    """A pause of every torch_memory_saver tag (NULL) with a tag named like another's
    second setting moves each vmstash tag once (a switch refuses a tag listed twice)."""
    cdll = _cdll()
    a, b, c = _tag("nm:pinned", "pinned"), _tag("nm", "discard"), _tag("nm", "pinned")
    assert len({a, b, c}) == 3 and c == "nm:pinned:2"
    p, q = sim.malloc(a, 4 * MiB), sim.malloc(c, 4 * MiB)
    sim.fill(p, 4 * MiB, 0x44)
    sim.fill(q, 4 * MiB, 0x45)
    assert cdll.tms_pause(None) == 0, _lib.last_error()
    assert [vmstash.tag_stats(t)["state"] for t in (a, c)] == ["paused", "paused"]
    assert cdll.tms_resume(None) == 0, _lib.last_error()
    assert sim.holds(p, 4 * MiB, 0x44) and sim.holds(q, 4 * MiB, 0x45)
    sim.free(p, 4 * MiB)
    sim.free(q, 4 * MiB)


def test_a_tms_resume_whose_after_resume_hook_fails_resumes_every_tag_and_says_so(sim):
    """An after-resume hook failing is reported with the transition done
    (vmstash_last_error_done() 1): tms_resume goes on with the other tags and returns it."""
    cdll = _cdll()
    l = _lib.lib()
    hook_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p)
    failing = hook_t(lambda tag, dev, user: 1)
    register = l.vmstash_register_hooks
    register.restype, register.argtypes = ctypes.c_int, [ctypes.c_char_p, hook_t, hook_t, ctypes.c_void_p]
    first, second = _tag("hk", "discard"), _tag("hk", "pinned")
    p, q = sim.malloc(first, 4 * MiB), sim.malloc(second, 4 * MiB)
    sim.fill(q, 4 * MiB, 0x55)
    assert register(first.encode(), ctypes.cast(None, hook_t), failing, None) == 0, _lib.last_error()
    assert cdll.tms_pause(b"hk") == 0
    rc = cdll.tms_resume(b"hk")
    assert rc != 0 and l.vmstash_last_error_done() == 1, (rc, _lib.last_error())
    assert [vmstash.tag_stats(t)["state"] for t in (first, second)] == ["active", "active"]
    assert sim.holds(q, 4 * MiB, 0x55)
    assert register(first.encode(), ctypes.cast(None, hook_t), ctypes.cast(None, hook_t), None) == 0
    sim.free(p, 4 * MiB)
    sim.free(q, 4 * MiB)


def test_tms_torch_malloc_allocates_in_the_threads_region_tag(sim):
    cdll = _cdll()
    malloc, free = cdll.tms_torch_malloc, cdll.tms_torch_free
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    free.restype, free.argtypes = None, [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    assert malloc(MiB, 0, None) is None and "interesting region" in _lib.last_error()
    l = _lib.lib()
    assert l.vmstash_tms_push_region(b"tt", 1, b"mmap", 0) == 0
    try:
        p = malloc(2 * MiB, 0, None)
    finally:
        assert l.vmstash_tms_pop_region() == 0
    assert p and vmstash.tag_stats("tt")["allocated_bytes"]["current"] >= 2 * MiB
    assert vmstash.tags()["tt"] == "backup" and vmstash.backup_store("tt") == "pageable"
    assert vmstash.current_tag() == "default"
    free(p, 2 * MiB, 0, None)
    assert vmstash.tag_stats("tt")["allocated_bytes"]["current"] == 0


def test_a_retained_backup_goes_with_its_last_block(sim):
    """torch_memory_saver's backup lives as long as its allocation: freed blocks release the
    tag's arena once none of its backed-up bytes are left (active and retained, or paused)."""
    cdll = _cdll()
    n = 2 * MiB
    cdll.tms_set_retain_cpu_backup(True)
    try:
        name = _tag("rel_active", "pinned")
        a, b = sim.malloc(name, n), sim.malloc(name, n)
        assert cdll.tms_pause(b"rel_active") == 0 and cdll.tms_resume(b"rel_active") == 0
        assert vmstash.tag_stats(name)["backup_arena_bytes"] > 0 and _backup_pointer(cdll, b, n)
        sim.free(a, n)
        assert vmstash.tag_stats(name)["backup_arena_bytes"] > 0  # b's bytes are still there
        sim.free(b, n)
        assert vmstash.tag_stats(name)["backup_arena_bytes"] == 0
        name = _tag("rel_paused", "mmap")
        a = sim.malloc(name, n)
        assert cdll.tms_pause(b"rel_paused") == 0
        sim.free(a, n)  # freed while paused
        assert vmstash.tag_stats(name)["backup_arena_bytes"] == 0
        assert vmstash.tag_stats(name)["state"] == "paused"
        assert cdll.tms_resume(b"rel_paused") == 0
    finally:
        cdll.tms_set_retain_cpu_backup(False)
    # vmstash's own tags keep their arena (prepared for the next pause).
    vmstash.create_tag("rel_native", "backup")
    a = sim.malloc("rel_native", n)
    vmstash.pause("rel_native")
    sim.free(a, n)
    assert vmstash.tag_stats("rel_native")["backup_arena_bytes"] > 0
    vmstash.resume("rel_native")
    vmstash.release_backup("rel_native")


def test_a_retained_backup_is_dropped_when_its_arena_is(sim):
    cdll = _cdll()
    n = 2 * MiB
    name = _tag("drop_ret", "pinned")
    p = sim.malloc(name, n)
    cdll.tms_set_retain_cpu_backup(True)
    try:
        for drop in (lambda: vmstash.release_backup(name), lambda: vmstash.prepare(name, nbytes=256 * MiB),
                     lambda: vmstash.set_backup_store(name, "pageable")):
            assert cdll.tms_pause(b"drop_ret") == 0 and cdll.tms_resume(b"drop_ret") == 0
            assert _backup_pointer(cdll, p, n)
            drop()
            assert _backup_pointer(cdll, p, n) == 0
    finally:
        cdll.tms_set_retain_cpu_backup(False)
    vmstash.release_backup(name)
    sim.free(p, n)


def _disk_tag(tms_tag, directory):
    """A disk_files tag in `directory` (the C layer's disk directory set there)."""
    _cdll().tms_set_disk_backup_dir(directory.encode())
    return _tag(tms_tag, "disk")


def test_disk_files_sweep_the_stale_files_of_dead_processes(sim):
    with tempfile.TemporaryDirectory() as d:
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout.strip()
        with open("/proc/1/stat") as f:
            start1 = f.read().rsplit(")", 1)[1].split()[19]
        stale = [f"vmstash-tms-{dead}-1-abcdef", f"vmstash-tms-1-{int(start1) + 1}-abcdef"]
        kept = [f"vmstash-tms-1-{start1}-abcdef", "vmstash-tms-x", "someone-elses.bin"]
        for f in stale + kept:
            open(os.path.join(d, f), "w").close()
        name = _disk_tag("sweep", d)
        p = sim.malloc(name, MiB)
        sim.fill(p, MiB, 0x6e)
        cdll = _cdll()
        assert cdll.tms_pause(b"sweep") == 0
        mine = [f for f in os.listdir(d) if f.startswith(f"vmstash-tms-{os.getpid()}-")]
        assert len(mine) == 1
        assert sorted(set(os.listdir(d)) - set(mine)) == sorted(kept)
        at = _backup_pointer(cdll, p, MiB)  # read back from the file
        assert at and ctypes.string_at(at, MiB) == b"\x6e" * MiB
        assert cdll.tms_resume(b"sweep") == 0
        assert sorted(os.listdir(d)) == sorted(kept)
        assert sim.holds(p, MiB, 0x6e)
        # A phase switch lays the files out the same way.
        vmstash.switch(pause=[name])
        assert len([f for f in os.listdir(d) if f.startswith(f"vmstash-tms-{os.getpid()}-")]) == 1
        vmstash.switch(resume=[name])
        assert sorted(os.listdir(d)) == sorted(kept)
        assert sim.holds(p, MiB, 0x6e)
        sim.free(p, MiB)


def test_a_paused_disk_tag_keeps_its_store_when_the_directory_is_gone(sim):
    """A pause of a torch_memory_saver tag whose disk part is paused already, after the disk
    directory changed to one that does not exist: that part's pause is a no-op (as
    torch_memory_saver's is), the tag's pinned part pauses; once the disk part is active
    again, its pause fails on the missing directory and nothing pauses; a disk tag with no
    live block pauses there (nothing to write)."""
    with tempfile.TemporaryDirectory() as d:
        disk = _disk_tag("gone_dir", d)
        p = sim.malloc(disk, MiB)
        sim.fill(p, MiB, 0x41)
        cdll = _cdll()
        assert cdll.tms_pause(b"gone_dir") == 0
        pinned = _tag("gone_dir", "pinned")
        assert pinned == "gone_dir:pinned"
        q = sim.malloc(pinned, MiB)
        sim.fill(q, MiB, 0x42)
        missing = os.path.join(d, "missing")
        cdll.tms_set_disk_backup_dir(missing.encode())
        try:
            assert cdll.tms_pause(b"gone_dir") == 0, _lib.last_error()
            assert vmstash.tag_stats(disk)["state"] == "paused" and vmstash.tag_stats(pinned)["state"] == "paused"
            assert cdll.tms_resume(b"gone_dir") == 0, _lib.last_error()
            assert sim.holds(p, MiB, 0x41) and sim.holds(q, MiB, 0x42)
            assert cdll.tms_pause(b"gone_dir") == _lib.NOT_FOUND
            assert missing in _lib.last_error()
            assert vmstash.tag_stats(disk)["state"] == "active" and vmstash.tag_stats(pinned)["state"] == "active"
            # A disk tag without live blocks has nothing to write there: it pauses.
            empty = _disk_tag("gone_dir_empty", missing)
            sim.free(sim.malloc(empty, MiB), MiB)
            assert cdll.tms_pause(b"gone_dir_empty") == 0, _lib.last_error()
            assert cdll.tms_resume(b"gone_dir_empty") == 0, _lib.last_error()
        finally:
            cdll.tms_set_disk_backup_dir(d.encode())
        sim.free(p, MiB)
        sim.free(q, MiB)


def _disk_prelude(d):
    """The start of a child script: torch_memory_saver's C entry points as `c`, the
    library as `l`, disk backups into `d`."""
    return ("import ctypes, os, resource, vmstash\n"
            "from vmstash import _lib\n"
            "from vmstash.compat.torch_memory_saver import _TmsCdll\n"
            "c = _TmsCdll(_lib.library_path())\n"
            f"c.tms_set_disk_backup_dir({d!r}.encode())\n"
            "l = _lib.lib()\n")


def test_disk_files_leave_nothing_after_a_failed_pause_or_at_exit():
    with tempfile.TemporaryDirectory() as d:
        # A file size limit lets the first file be made and refuses the second: the pause
        # fails (out of room) with both files removed and the tag active, intact.
        out = _run(
            _disk_prelude(d) +
            "name = l.vmstash_tms_tag(b'lim', b'disk').decode()\n"
            "vmstash.set_current_tag(name)\n"
            "small, big = l.vmstash_malloc(256 << 10, 0, None), l.vmstash_malloc(8 << 20, 0, None)\n"
            "vmstash.set_current_tag('default')\n"
            "ctypes.memset(small, 0x21, 256 << 10); ctypes.memset(big, 0x22, 8 << 20)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, resource.RLIM_INFINITY))\n"
            "rc = c.tms_pause(b'lim')\n"
            f"print(rc, vmstash.tag_stats(name)['state'], os.listdir({d!r}))\n"
            "assert ctypes.string_at(big, 8 << 20) == b'\\x22' * (8 << 20)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))\n"
            "assert c.tms_pause(b'lim') == 0\n"
            f"print(len(os.listdir({d!r})))\n",
            VMSTASH_CONF="driver:sim,sim_devices:1,sim_capacity:1G,auto_prepare:0")
        lines = out.strip().split("\n")
        assert lines[0] == f"{_lib.RESOURCE_EXHAUSTED} active []", out
        assert lines[1] == "2", out  # then paused at exit, with its two files ...
        assert os.listdir(d) == []  # ... which the process removed as it ended


def test_a_pause_of_several_tags_that_fails_leaves_all_of_them_active():
    """A torch_memory_saver tag with a pinned and a disk vmstash tag pauses both in one
    switch: the disk store refused (a file size limit), neither is paused, no file is left,
    every byte is intact; then both pause, and resume. (Paused one by one, the pinned tag's
    memory was released first, and undoing its pause had to create it again: here that
    failed too, since the file size limit also holds for the simulated device's memory,
    and the tag stayed paused.)"""
    with tempfile.TemporaryDirectory() as d:
        out = _run(
            _disk_prelude(d) +
            "names = [l.vmstash_tms_tag(b'two', s).decode() for s in (b'pinned', b'disk')]\n"
            "ptrs = []\n"
            "for i, name in enumerate(names):\n"
            "    vmstash.set_current_tag(name)\n"
            "    ptrs.append(l.vmstash_malloc(8 << 20, 0, None))\n"
            "    ctypes.memset(ptrs[-1], 0x31 + i, 8 << 20)\n"
            "vmstash.set_current_tag('default')\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, resource.RLIM_INFINITY))\n"
            "rc = c.tms_pause(b'two')\n"
            f"print(rc, [vmstash.tag_stats(n)['state'] for n in names], os.listdir({d!r}))\n"
            "assert all(ctypes.string_at(p, 8 << 20) == bytes([0x31 + i]) * (8 << 20) for i, p in enumerate(ptrs))\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))\n"
            "assert c.tms_pause(b'two') == 0\n"
            "print([vmstash.tag_stats(n)['state'] for n in names])\n"
            "assert c.tms_resume(b'two') == 0\n"
            "assert all(ctypes.string_at(p, 8 << 20) == bytes([0x31 + i]) * (8 << 20) for i, p in enumerate(ptrs))\n"
            "print('intact')\n",
            VMSTASH_CONF="driver:sim,sim_devices:1,sim_capacity:1G,auto_prepare:0")
        lines = out.strip().split("\n")
        assert lines[0] == f"{_lib.RESOURCE_EXHAUSTED} ['active', 'active'] []", out
        assert lines[1:] == ["['paused', 'paused']", "intact"], out


def test_a_killed_process_files_are_swept_by_the_next_pause(sim):
    with tempfile.TemporaryDirectory() as d:
        child = subprocess.Popen(
            [sys.executable, "-c",
             "import os, sys, vmstash\n"
             "from vmstash import _lib\n"
             "from vmstash.compat.torch_memory_saver import _TmsCdll\n"
             "c = _TmsCdll(_lib.library_path())\n"
             f"c.tms_set_disk_backup_dir({d!r}.encode())\n"
             "l = _lib.lib()\n"
             "vmstash.set_current_tag(l.vmstash_tms_tag(b'k', b'disk').decode())\n"
             "l.vmstash_malloc(1 << 20, 0, None)\n"
             "assert c.tms_pause(b'k') == 0\n"
             "print('paused', flush=True)\n"
             "sys.stdin.read()\n"],
            env=dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE)] + sys.path),
                     VMSTASH_CONF="driver:sim,sim_devices:1,sim_capacity:1G,auto_prepare:0"),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "paused"
        assert [f.startswith(f"vmstash-tms-{child.pid}-") for f in os.listdir(d)] == [True]
        child.kill()
        child.wait()
        assert len(os.listdir(d)) == 1  # SIGKILL: nothing ran
        name = _disk_tag("after_kill", d)
        p = sim.malloc(name, MiB)
        cdll = _cdll()
        assert cdll.tms_pause(b"after_kill") == 0
        assert [f.startswith(f"vmstash-tms-{os.getpid()}-") for f in os.listdir(d)] == [True]
        assert cdll.tms_resume(b"after_kill") == 0
        assert os.listdir(d) == []
        sim.free(p, MiB)


def test_dropin_utils(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(DROPIN)
    from torch_memory_saver import utils
    from torch_memory_saver.hooks.base import HookMode  # noqa: F401
    from torch_memory_saver.hooks.mode_preload import configure_subprocess
    key = "VMSTASH_TEST_CHANGE_ENV"
    monkeypatch.delenv(key, raising=False)
    with utils.change_env(key, "1"):
        assert os.environ[key] == "1"
    assert key not in os.environ
    monkeypatch.setenv(key, "before")
    with utils.change_env(key, "2"):
        assert os.environ[key] == "2"
    assert os.environ[key] == "before"
    assert utils.is_xpu() in (False, True)
    # The library beside the package: the CUDA major's name, else the unsuffixed one.
    package = tmp_path / "torch_memory_saver"
    package.mkdir()
    stem = "torch_memory_saver_hook_mode_preload"
    monkeypatch.setattr(utils, "__file__", str(package / "utils.py"))
    monkeypatch.setattr(utils, "_cuda_major", lambda: 13)
    with pytest.raises(RuntimeError, match="no library matches"):
        utils.get_binary_path_from_package(stem)
    (tmp_path / f"{stem}.abi3.so").touch()
    assert utils.get_binary_path_from_package(stem) == tmp_path / f"{stem}.abi3.so"
    (tmp_path / f"{stem}_cu13.abi3.so").touch()
    assert utils.get_binary_path_from_package(stem) == tmp_path / f"{stem}_cu13.abi3.so"
    monkeypatch.setattr(utils, "_cuda_major", lambda: None)
    assert utils.get_binary_path_from_package(stem) == tmp_path / f"{stem}.abi3.so"
    # configure_subprocess: that library first in LD_PRELOAD, joined with ":", then restored.
    monkeypatch.setattr("torch_memory_saver.hooks.mode_preload.get_binary_path_from_package", lambda s: "/x/tms.so")
    monkeypatch.setenv("LD_PRELOAD", "/other/lib.so")
    with configure_subprocess():
        assert os.environ["LD_PRELOAD"] == "/x/tms.so:/other/lib.so"
    assert os.environ["LD_PRELOAD"] == "/other/lib.so"
    monkeypatch.delenv("LD_PRELOAD")
    with configure_subprocess():
        assert os.environ["LD_PRELOAD"] == "/x/tms.so"
    assert "LD_PRELOAD" not in os.environ


def test_the_drop_in_says_that_vmstash_is_missing_beside_it():
    """The drop-in installed without the vmstash package: a clear ImportError, not a bare
    "No module named vmstash" (or the loader's libabsl_hash.so message)."""
    code = ("import sys\n"
            f"sys.path[:] = [{DROPIN!r}] + [p for p in sys.path if 'packages' not in p and p]\n"
            "import torch_memory_saver\n")
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=""))
    assert r.returncode != 0
    assert "needs the vmstash package of the same version installed beside it" in r.stderr, r.stderr


def test_the_drop_in_says_why_its_preload_library_is_not_loaded(sim, tmp_path):
    """LD_PRELOAD naming the drop-in's preload library where the loader refused it (here: a
    file that is no library): a warning with the loader's reason."""
    bad = tmp_path / "torch_memory_saver_hook_mode_preload.abi3.so"
    bad.write_bytes(b"not a library")
    out = _run("import warnings\nwarnings.simplefilter('always')\n"
               f"import sys; sys.path.insert(0, {DROPIN!r})\n"
               "with warnings.catch_warnings(record=True) as w:\n"
               "    import torch_memory_saver\n"
               "print([str(x.message) for x in w])\n", LD_PRELOAD=str(bad))
    assert f"LD_PRELOAD names {bad}, which is not vmstash's loaded preload library (the dynamic loader " \
           "refused it at the start" in out, out
    assert "the vmstash package of the same version is missing beside it" in out
