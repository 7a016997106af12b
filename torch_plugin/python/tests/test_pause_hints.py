"""Pause hints from a MemPool's own segments (vmstash.h, Note [Liveness Hints]): the hint
is computed from MemPool.snapshot() alone (no snapshot of the whole device through the
library), and every device's hint goes to the library in one vmstash_pause_live_devices
call. The pools here are stand-ins with MemPool.snapshot()'s segment format over blocks of
the simulated driver, so no torch and no GPU are needed; the real MemPool path runs in
the GPU scenarios.

Run with pytest (or `python3 test_pause_hints.py`). Needs libvmstash.so: VMSTASH_LIBRARY
(the Bazel and CTest runners set it), else bazel-bin/torch_plugin/libvmstash.so here.
"""
import ctypes
import os
import sys
import threading
import types

import pytest

os.environ.setdefault("VMSTASH_CONF", "driver:sim,sim_devices:2,sim_capacity:1G,auto_prepare:0")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if "VMSTASH_LIBRARY" not in os.environ and os.path.exists(os.path.join(ROOT, "bazel-bin", "torch_plugin",
                                                                       "libvmstash.so")):
    os.environ["VMSTASH_LIBRARY"] = os.path.join(ROOT, "bazel-bin", "torch_plugin", "libvmstash.so")
try:
    import vmstash  # noqa: F401
except ImportError:  # run from the source tree
    sys.path.insert(0, os.path.join(ROOT, "torch_plugin", "python"))

import vmstash  # noqa: E402
from vmstash import _api, _lib, _torch  # noqa: E402

MiB = 1 << 20
END = (1 << 64) - 1  # where the last range ends: the largest size a uint64 holds


def segment(address, total_size, blocks, device=0):
    """A segment as MemPool.snapshot() lists it; blocks: (offset, size, state)."""
    return {"device": device, "address": address, "total_size": total_size, "segment_type": "large",
            "blocks": [{"address": address + off, "size": size, "requested_size": size, "state": state}
                       for off, size, state in blocks]}


# --- The hint alone ----------------------------------------------------------------------

def test_hint_is_the_active_blocks_and_everything_outside_the_segments():
    segs = [segment(0x9000_0000, 4 * MiB, [(0, MiB, "inactive"), (MiB, MiB, "active_allocated"),
                                          (2 * MiB, 2 * MiB, "active_pending_free")]),
            segment(0x1000_0000, 2 * MiB, [(0, 2 * MiB, "inactive")])]  # unsorted, none active
    assert _torch.hint_from_segments(segs, 0) == [
        (0, 0x1000_0000),                                          # below the first segment
        (0x1000_0000 + 2 * MiB, 0x9000_0000 - 0x1000_0000 - 2 * MiB),  # between them
        (0x9000_0000 + MiB, MiB), (0x9000_0000 + 2 * MiB, 2 * MiB),    # active in the second
        (0x9000_0000 + 4 * MiB, END - 0x9000_0000 - 4 * MiB),          # above, to the end
    ]


def test_hint_of_no_segment_is_everything_and_other_devices_are_left_out():
    assert _torch.hint_from_segments([], 0) == [(0, END)]
    other = [segment(0x2000_0000, MiB, [(0, MiB, "active_allocated")], device=1)]
    assert _torch.hint_from_segments(other, 0) == [(0, END)]
    assert _torch.hint_from_segments(other, 1) == [(0, 0x2000_0000), (0x2000_0000, MiB),
                                                   (0x2000_0000 + MiB, END - 0x2000_0000 - MiB)]


def test_adjacent_segments_leave_no_empty_gap():
    segs = [segment(4 * MiB, 2 * MiB, [(0, MiB, "active_allocated")]), segment(6 * MiB, MiB, [])]
    assert _torch.hint_from_segments(segs, 0) == [(0, 4 * MiB), (4 * MiB, MiB), (7 * MiB, END - 7 * MiB)]


# --- Through the library (simulated driver) ------------------------------------------------

def malloc(tag, size, device=0):
    vmstash.set_current_tag(tag)
    try:
        p = _lib.lib().vmstash_malloc(size, device, None)
    finally:
        vmstash.set_current_tag("default")
    assert p, _lib.last_error()
    return p


def holds(p, n, byte):
    return ctypes.string_at(p, n) == bytes([byte]) * n


class FakePool:
    """Stands in for torch.cuda.MemPool: snapshot() lists its segments."""

    def __init__(self, segments):
        self.segments = segments

    def snapshot(self, include_traces=True):
        return self.segments


class CallCounter:
    """Counts the calls of some C entry points (the library's own functions stay in place)."""

    def __init__(self, names):
        self.names, self.counts, self.saved = names, dict.fromkeys(names, 0), {}

    def __enter__(self):
        l = _lib.lib()
        for name in self.names:
            fn = self.saved[name] = getattr(l, name)

            def counted(*args, _fn=fn, _name=name):
                self.counts[_name] += 1
                return _fn(*args)
            setattr(l, name, counted)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(_lib.lib(), name, fn)


def with_pools(pools):
    """Registers stand-in pools {(tag, device): FakePool} as vmstash.region would; returns a
    function that removes them."""
    _torch._pools.update(pools)

    def remove():
        for key in pools:
            _torch._pools.pop(key, None)
    return remove


def test_a_pool_pause_copies_active_blocks_and_whole_foreign_blocks_in_one_call():
    vmstash.create_tag("hint_two", "backup")
    seg = [malloc("hint_two", 8 * MiB, d) for d in (0, 1)]        # one pool segment per device
    foreign = malloc("hint_two", MiB, 0)                          # global mode: no segment of the pool
    idle = malloc("hint_two", 2 * MiB, 1)
    for d in (0, 1):
        ctypes.memset(seg[d], 0x10 + d, 8 * MiB)
    ctypes.memset(foreign, 0x7e, MiB)
    ctypes.memset(idle, 0x7f, 2 * MiB)
    remove = with_pools({
        ("hint_two", 0): FakePool([segment(seg[0], 8 * MiB, [(0, MiB, "inactive"), (MiB, MiB, "active_allocated"),
                                                              (2 * MiB, 6 * MiB, "inactive")], 0)]),
        # Device 1's two segments are all cached (nothing active): nothing is kept there.
        ("hint_two", 1): FakePool([segment(seg[1], 8 * MiB, [(0, 8 * MiB, "inactive")], 1),
                                   segment(idle, 2 * MiB, [(0, 2 * MiB, "inactive")], 1)]),
    })
    try:
        with CallCounter(["vmstash_pause_live_devices", "vmstash_snapshot_json", "vmstash_stats_json",
                          "vmstash_tag_policy"]) as calls:
            assert vmstash.pause("hint_two")
        assert calls.counts == {"vmstash_pause_live_devices": 1, "vmstash_snapshot_json": 0,
                                "vmstash_stats_json": 0, "vmstash_tag_policy": 1}, calls.counts
    finally:
        remove()
    assert vmstash.tag_stats("hint_two", 0)["backed_up_bytes"] == MiB + MiB  # active + foreign
    assert vmstash.tag_stats("hint_two", 1)["backed_up_bytes"] == 0  # nothing live there
    assert vmstash.resume("hint_two")
    assert holds(seg[0] + MiB, MiB, 0x10)
    assert holds(foreign, MiB, 0x7e)
    for d, p, n in ((0, seg[0], 8 * MiB), (1, seg[1], 8 * MiB), (0, foreign, MiB), (1, idle, 2 * MiB)):
        _lib.lib().vmstash_free(p, n, d, None)


def test_one_device_pause_passes_only_that_devices_hint():
    vmstash.create_tag("hint_one", "backup")
    seg = [malloc("hint_one", 4 * MiB, d) for d in (0, 1)]
    for d in (0, 1):
        ctypes.memset(seg[d], 0x20 + d, 4 * MiB)
    remove = with_pools({("hint_one", d): FakePool([segment(seg[d], 4 * MiB, [(0, MiB, "active_allocated")], d)])
                         for d in (0, 1)})
    try:
        assert vmstash.pause("hint_one", device=1)
    finally:
        remove()
    assert vmstash.tag_stats("hint_one", 0)["state"] == "active"
    assert vmstash.tag_stats("hint_one", 1)["backed_up_bytes"] == MiB
    assert vmstash.resume("hint_one")
    assert holds(seg[1], MiB, 0x21)
    assert holds(seg[0], 4 * MiB, 0x20)  # never paused
    for d in (0, 1):
        _lib.lib().vmstash_free(seg[d], 4 * MiB, d, None)


def test_a_pool_with_no_segment_on_a_device_still_keeps_the_tags_other_blocks():
    # The hint is then one range over the whole address space; its size must reach the C
    # call as such (1 << 64 wrapped to 0 there, and a foreign block was released uncopied).
    vmstash.create_tag("hint_empty", "backup")
    foreign = malloc("hint_empty", 2 * MiB, 0)
    ctypes.memset(foreign, 0x5a, 2 * MiB)
    remove = with_pools({("hint_empty", 0): FakePool([])})
    try:
        assert vmstash.pause("hint_empty", device=0)
    finally:
        remove()
    assert vmstash.tag_stats("hint_empty", 0)["backed_up_bytes"] == 2 * MiB
    assert vmstash.resume("hint_empty", device=0)
    assert holds(foreign, 2 * MiB, 0x5a)
    _lib.lib().vmstash_free(foreign, 2 * MiB, 0, None)


def test_a_range_outside_the_address_space_is_refused_and_nothing_pauses():
    vmstash.create_tag("hint_wide", "backup")
    p = malloc("hint_wide", MiB, 0)
    remove = with_pools({("hint_wide", 0): FakePool([])})
    saved = _api.live_ranges_provider
    _api.live_ranges_provider = lambda tag, device: [(0, 1 << 64)]
    try:
        try:
            vmstash.pause("hint_wide", device=0)
            raise AssertionError("a range past the address space was passed on")
        except vmstash.Error as e:
            assert e.code == _lib.INVALID_ARGUMENT
            assert "outside the 64-bit address space" in str(e)
    finally:
        _api.live_ranges_provider = saved
        remove()
    assert vmstash.tag_stats("hint_wide", 0)["state"] == "active"
    _lib.lib().vmstash_free(p, MiB, 0, None)


def test_a_discard_tag_and_a_tag_without_pools_pause_without_hints():
    vmstash.create_tag("hint_discard", "discard")
    vmstash.create_tag("hint_nopool", "backup")
    p = malloc("hint_discard", MiB)
    q = malloc("hint_nopool", 3 * MiB)
    ctypes.memset(q, 0x33, 3 * MiB)
    remove = with_pools({("hint_discard", 0): FakePool([segment(p, MiB, [(0, MiB, "active_allocated")])])})
    try:
        with CallCounter(["vmstash_pause_live_devices"]) as calls:
            assert vmstash.pause("hint_discard")
            assert vmstash.pause("hint_nopool")
        assert calls.counts["vmstash_pause_live_devices"] == 2
        with _api._hinted([("hint_discard", b"hint_discard")], -1) as (_, n_live):
            assert n_live == 0  # no hint entries
    finally:
        remove()
    assert vmstash.tag_stats("hint_nopool", 0)["backed_up_bytes"] == 3 * MiB  # every live block, whole
    assert vmstash.resume("hint_nopool") and vmstash.resume("hint_discard")
    assert holds(q, 3 * MiB, 0x33)
    _lib.lib().vmstash_free(p, MiB, 0, None)
    _lib.lib().vmstash_free(q, 3 * MiB, 0, None)


def test_a_failed_pause_over_two_devices_leaves_both_active_with_their_bytes():
    # The second device's copy fails: the first device is resumed again (one C call, all or
    # nothing), with the hinted bytes back.
    import subprocess
    child = (
        "import ctypes, sys\n"
        f"sys.path[:0] = {[p for p in sys.path if p]!r}\n"
        "import vmstash\n"
        "from vmstash import _lib, _torch\n"
        "from test_pause_hints import FakePool, segment, malloc, MiB\n"
        "vmstash.create_tag('hint_fail', 'backup')\n"
        "p = [malloc('hint_fail', 4 * MiB, d) for d in (0, 1)]\n"
        "for d in (0, 1):\n"
        "    ctypes.memset(p[d], 0x50 + d, 4 * MiB)\n"
        "    active = [(MiB, MiB, 'active_allocated')]\n"
        "    _torch._pools[('hint_fail', d)] = FakePool([segment(p[d], 4 * MiB, active, d)])\n"
        "try:\n"
        "    vmstash.pause('hint_fail')\n"
        "    raise SystemExit('the pause did not fail')\n"
        "except vmstash.Error as e:\n"
        "    assert e.code_name == 'INTERNAL' and 'device 0 resumed again' in str(e), e\n"
        "assert [vmstash.tag_stats('hint_fail', d)['state'] for d in (0, 1)] == ['active', 'active']\n"
        "for d in (0, 1):\n"
        "    assert ctypes.string_at(p[d] + MiB, MiB) == bytes([0x50 + d]) * MiB, d\n"
        "_torch._pools.clear()\n"
        "print('all or nothing ok')\n")
    env = dict(os.environ, VMSTASH_CONF="driver:sim,sim_devices:2,sim_capacity:256M,auto_prepare:0,"
                                        "sim_fail:copy_to_host@2=internal")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__))] + [p for p in sys.path if p])
    result = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "all or nothing ok" in result.stdout


# --- Another thread routing into the pool (_torch.py, Note [Hints and Routing]) -----------

class Racing:
    """Replaces a C entry point by one that first runs `before()` (what another thread does
    after the hint was taken, before the library pauses), then calls the library's."""

    def __init__(self, name, before):
        self.name, self.before = name, before

    def __enter__(self):
        l = _lib.lib()
        self.real = getattr(l, self.name)
        setattr(l, self.name, lambda *args: (self.before(), self.real(*args))[1])
        return self

    def __exit__(self, *exc):
        setattr(_lib.lib(), self.name, self.real)


def routing_in_thread(tag, device=0, all_threads=False):
    """Opens a routing into `tag`'s pool in another thread (as a region there would) and
    returns a function that closes it."""
    inside, leave = threading.Event(), threading.Event()

    def body():
        with _torch.routing(tag, device, all_threads=all_threads):
            inside.set()
            leave.wait(60)
    thread = threading.Thread(target=body)
    thread.start()
    assert inside.wait(60)

    def close():
        leave.set()
        thread.join(60)
    return close


def pool_of_one_active_mib(tag, fill):
    p = malloc(tag, 4 * MiB)
    ctypes.memset(p, fill, 4 * MiB)
    pool = FakePool([segment(p, 4 * MiB, [(0, MiB, "active_allocated"), (MiB, 3 * MiB, "inactive")])])
    return p, pool, with_pools({(tag, 0): pool})


def hand_out_second_mib(p, pool, byte):
    """Another thread's allocation: PyTorch hands out a cached block of the pool, and the
    thread writes into it."""
    def run():
        pool.segments = [segment(p, 4 * MiB, [(0, MiB, "active_allocated"), (MiB, MiB, "active_allocated"),
                                              (2 * MiB, 2 * MiB, "inactive")])]
        ctypes.memset(p + MiB, byte, MiB)
    return run


PAUSES = {
    "pause": ("vmstash_pause_live_devices", lambda tag: vmstash.pause(tag)),
    "switch": ("vmstash_switch", lambda tag: vmstash.switch(pause=[tag])),
    "agreed switch": ("vmstash_switch_agreed", lambda tag: vmstash.switch(pause=[tag], agree=lambda local: None)),
}


def test_a_block_another_threads_region_takes_while_the_pause_runs_is_kept():
    # The hint would leave the block out: its bytes, written before the library paused,
    # were lost. With another thread routing into the pool the pause copies every live
    # block whole.
    for i, (kind, (entry, pause)) in enumerate(PAUSES.items()):
        tag = f"hint_race{i}"
        vmstash.create_tag(tag, "backup")
        p, pool, remove = pool_of_one_active_mib(tag, 0x11)
        close = routing_in_thread(tag)
        try:
            with Racing(entry, hand_out_second_mib(p, pool, 0x22)):
                assert pause(tag)
        finally:
            close()
            remove()
        assert vmstash.tag_stats(tag, 0)["backed_up_bytes"] == 4 * MiB, kind  # no hint: the block whole
        assert vmstash.resume(tag)
        assert holds(p, MiB, 0x11) and holds(p + MiB, MiB, 0x22), kind
        _lib.lib().vmstash_free(p, 4 * MiB, 0, None)


def test_a_region_opened_while_a_hinted_pause_runs_is_let_in_and_reported():
    # Not made to wait (a before-pause hook may hand work to another thread and join it):
    # the pause warns that what was allocated there may not be kept.
    for i, (kind, (entry, pause)) in enumerate(PAUSES.items()):
        tag = f"hint_open{i}"
        vmstash.create_tag(tag, "backup")
        p, pool, remove = pool_of_one_active_mib(tag, 0x33)
        entered = threading.Event()

        def open_region():
            with _torch.routing(tag, 0):
                entered.set()

        def another_thread_opens():
            thread = threading.Thread(target=open_region)
            thread.start()
            thread.join(60)
            assert entered.is_set(), f"{kind}: a region waited for the pause"
        try:
            with pytest.warns(RuntimeWarning, match=f"into tag '{tag}' on device 0 was opened while its pause ran"):
                with Racing(entry, another_thread_opens):
                    assert pause(tag)
        finally:
            remove()
        assert vmstash.tag_stats(tag, 0)["backed_up_bytes"] == MiB, kind  # the hint: the active block
        assert vmstash.resume(tag)
        assert holds(p, MiB, 0x33), kind
        assert not _torch._routes and not _torch._hinting and not _torch._opened_while_hinted
        _lib.lib().vmstash_free(p, 4 * MiB, 0, None)


_HOOK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p)
_kept_hooks = []


def set_hooks(tag, before=None):
    register = _lib.lib().vmstash_register_hooks
    register.restype, register.argtypes = ctypes.c_int, [ctypes.c_char_p, _HOOK, _HOOK, ctypes.c_void_p]
    hook = _HOOK(before) if before else _HOOK()
    _kept_hooks.append(hook)
    assert register(tag.encode(), hook, _HOOK(), None) == 0, _lib.last_error()


def test_a_before_pause_hook_waiting_for_a_workers_region_does_not_hang():
    # A hook may allocate in its own tag (docs/usage.md §6), here through a worker thread
    # it waits for: the worker's region opens at once; the pause reports it.
    tag = "hint_hook"
    vmstash.create_tag(tag, "backup")
    p, _, remove = pool_of_one_active_mib(tag, 0x44)
    got_in = []

    def worker():
        with _torch.routing(tag, 0):
            got_in.append(True)

    def before_pause(name, dev, user):
        w = threading.Thread(target=worker)
        w.start()
        w.join(60)
        return 0
    set_hooks(tag, before=before_pause)
    try:
        with pytest.warns(RuntimeWarning, match="was opened while its pause ran"):
            assert vmstash.pause(tag)
    finally:
        set_hooks(tag)
        remove()
    assert got_in and all(got_in)  # (the hook runs on each device in use)
    assert vmstash.resume(tag) and holds(p, MiB, 0x44)
    _lib.lib().vmstash_free(p, 4 * MiB, 0, None)


def test_a_region_on_the_current_device_is_counted_under_its_index(monkeypatch):
    # device="cuda" (no index) is the current device, for the pool and its routings alike.
    class Device:
        def __init__(self, spec, index=None):
            kind, _, i = str(spec).partition(":")
            self.index = int(i) if i else index
    fake = types.SimpleNamespace(device=Device, cuda=types.SimpleNamespace(current_device=lambda: 1))
    for spec in (None, "cuda", 1, "cuda:1"):
        assert _torch._device_index(fake, spec) == 1, spec
    assert _torch._device_index(fake, "cuda:0") == 0


def test_the_pausing_threads_own_region_keeps_the_hint_and_an_all_threads_one_does_not():
    vmstash.create_tag("hint_own", "backup")
    vmstash.create_tag("hint_all", "backup")
    p, _, remove = pool_of_one_active_mib("hint_own", 0x44)
    q, _, remove_q = pool_of_one_active_mib("hint_all", 0x55)
    try:
        with _torch.routing("hint_own", 0):  # this thread's region: it does not allocate meanwhile
            assert vmstash.pause("hint_own")
        with _torch.routing("hint_all", 0, all_threads=True):  # every thread allocates into the pool
            assert vmstash.pause("hint_all")
    finally:
        remove()
        remove_q()
    assert vmstash.tag_stats("hint_own", 0)["backed_up_bytes"] == MiB
    assert vmstash.tag_stats("hint_all", 0)["backed_up_bytes"] == 4 * MiB
    assert vmstash.resume("hint_own") and vmstash.resume("hint_all")
    assert holds(p, MiB, 0x44) and holds(q, 4 * MiB, 0x55)
    assert not _torch._routes and not _torch._hinting
    for x in (p, q):
        _lib.lib().vmstash_free(x, 4 * MiB, 0, None)


def test_a_failed_hinted_pause_lets_waiting_regions_in():
    vmstash.create_tag("hint_refused", "backup")
    p, _, remove = pool_of_one_active_mib("hint_refused", 0x66)
    saved = _api.live_ranges_provider
    _api.live_ranges_provider = lambda tag, device: [(0, 1 << 64)]  # refused before the C call
    try:
        try:
            vmstash.pause("hint_refused")
            raise AssertionError("the pause did not fail")
        except vmstash.Error as e:
            assert e.code == _lib.INVALID_ARGUMENT
    finally:
        _api.live_ranges_provider = saved
        remove()
    assert not _torch._hinting
    close = routing_in_thread("hint_refused")  # would wait for good if the hint were still held
    close()
    _lib.lib().vmstash_free(p, 4 * MiB, 0, None)


if __name__ == "__main__":
    import pytest
    sys.exit(pytest.main([__file__] + sys.argv[1:]))
