"""vmstash.compat.vllm's allocator (VmstashMemAllocator) on the simulated driver, with
torch faked: its transitions and their failures (each call one vmstash switch), vLLM's
per-tag hooks (Note [vLLM Tag Hooks]), its locks, and threads calling it at once. The
plan, the plugin and the backend: test_vllm_compat.py."""
import ctypes
import sys
import types

import pytest

def test_allocator_validates_before_touching_anything(sim):
    import vmstash
    from vmstash.compat.vllm.allocator import VmstashMemAllocator
    a = VmstashMemAllocator(discard_tags=("kv_cache",))
    with pytest.raises(ValueError):
        with a.use_memory_pool(""):
            pass
    with pytest.raises(ValueError):
        a.discard(5)
    with pytest.raises(ValueError, match="own tags"):
        a.exchange_with(["vllm.weights"])
    with pytest.raises(vmstash.Error, match="not vmstash tags"):
        a.exchange_with(["never_declared_here"])
    vmstash.create_tag("vllm_test_trainer", "backup")
    a.exchange_with(["vllm_test_trainer"], when_waking=None)
    a.exchange_with(())
    assert a.asleep_tags() == [] and a.tag_names() == {}


# -- the allocator's transitions on the simulated driver (torch faked) --------------------------


MiB = 1 << 20
_HOOK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p)
_kept_hooks = []


def _set_hooks(tag, before=None, after=None):
    from vmstash import _lib
    register = _lib.lib().vmstash_register_hooks
    register.restype, register.argtypes = ctypes.c_int, [ctypes.c_char_p, _HOOK, _HOOK, ctypes.c_void_p]
    b, a = (_HOOK(f) if f else _HOOK() for f in (before, after))
    _kept_hooks.extend([b, a])
    assert register(tag.encode(), b, a, None) == 0, _lib.last_error()


@pytest.fixture
def sim_alloc(sim, monkeypatch):
    """A VmstashMemAllocator whose torch is a fake (no MemPools: every backup pause copies
    whole); `made(tag, policy, size, byte)` gives it a vLLM tag with memory on device 0.
    `on_empty_cache` lists what PyTorch's empty_cache frees (stands for PyTorch's cache)."""
    import vmstash
    from vmstash import _torch
    from vmstash.compat.vllm import allocator as A
    on_empty_cache = []

    def empty_cache(*_):
        while on_empty_cache:
            on_empty_cache.pop()()

    fake = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(empty_cache=empty_cache, synchronize=lambda d=None: None),
        cuda=types.SimpleNamespace(current_device=lambda: 0,
                                   memory=types.SimpleNamespace(_snapshot=lambda: {"segments": []},
                                                                empty_cache=empty_cache)))
    monkeypatch.setattr(_torch, "_torch", lambda: fake)
    a = A.VmstashMemAllocator(discard_tags=())
    a.live = []

    def made(tag, policy, size, byte):
        name = A.TAG_PREFIX + tag
        vmstash.create_tag(name, policy)
        p = sim.malloc(name, size)
        sim.fill(p, size, byte)
        a._tags[tag] = A._Tag(name, policy, set(), {0})
        a.live.append((p, size))
        return p

    a.made = made

    def trainer(name, size):
        """A tag of the trainer's own (not the allocator's), with `size` bytes."""
        vmstash.create_tag(name, "backup")
        p = sim.malloc(name, size)
        a.live.append((p, size))
        a.extra = list(getattr(a, "extra", ())) + [name]
        return p

    a.trainer = trainer
    a.on_empty_cache = on_empty_cache
    yield a
    for tag in list(a._tags.values()) + [types.SimpleNamespace(name=n) for n in getattr(a, "extra", ())]:
        try:
            vmstash.resume(tag.name)
        except vmstash.Error:
            pass
    for p, n in a.live:
        sim.free(p, n)


def test_a_sleep_done_with_a_failed_hook_records_vllms_tag_asleep(sim_alloc, sim):
    """A sleep whose switch is done but reports an after-resume hook failure of an exchanged
    (trainer) tag (ABORTED, done=True): the vLLM tag is paused and recorded so, and the next
    wake_up brings it back (it was once recorded awake: vLLM served on unmapped memory)."""
    import vmstash
    a = sim_alloc
    rt = a.made("rv1_rt", "backup", 4 * MiB, 0x5A)
    a.trainer("rv1_train", 4 * MiB)
    a.exchange_with(["rv1_train"], when_waking=None)
    a.sleep(offload_tags=("rv1_rt",))
    a.wake_up()  # rv1_train goes out
    assert vmstash.tag_stats("rv1_train")["state"] == "paused"
    _set_hooks("rv1_train", after=lambda tag, dev, user: 1)
    try:
        with pytest.raises(vmstash.Error) as e:
            a.sleep(offload_tags=("rv1_rt",))
        assert e.value.done  # the switch is done
        assert vmstash.tag_stats("vllm.rv1_rt")["state"] == "paused"
        a.wake_up()  # vLLM's next wake
        assert vmstash.tag_stats("vllm.rv1_rt")["state"] == "active", \
            f"wake_up left vLLM's tag paused: the allocator believes {a.asleep_tags()} are asleep"
        assert sim.holds(rt, 4 * MiB, 0x5A)
    finally:
        _set_hooks("rv1_train")


def test_a_sleep_bringing_the_exchange_back_empties_pytorchs_cache_first(sim_alloc, sim):
    """With an exchange, sleep()'s switch brings the trainer's tags in: PyTorch's cached
    memory (here a 'hog' that empty_cache frees) goes first, so they fit (once emptied only
    after the switch, it failed out of memory, and every later sleep with it)."""
    import vmstash
    a = sim_alloc
    a.made("rv2_w", "backup", 100 * MiB, 0x11)
    a.made("rv2_kv", "discard", 100 * MiB, 0x22)
    a.trainer("rv2_train", 500 * MiB)
    a.exchange_with(["rv2_train"], when_waking=None)
    a.sleep(offload_tags=("rv2_w",))
    a.wake_up()  # the trainer's 500 MiB goes out, vLLM's 200 MiB comes in
    vmstash.create_tag("rv2_hog", "discard")
    hog = sim.malloc("rv2_hog", 600 * MiB)  # PyTorch's cache grows while vLLM serves

    def free_hog():
        sim.free(hog, 600 * MiB)
        vmstash.empty_cache(tag="rv2_hog")

    a.on_empty_cache.append(free_hog)
    try:
        a.sleep(offload_tags=("rv2_w",))
    except vmstash.OutOfMemoryError as e:
        with pytest.raises(vmstash.Error, match="sleep\\(\\) first"):
            a.exchange_with(())  # no way out but freeing memory by hand
        pytest.fail(f"sleep failed for PyTorch's cached memory it empties only afterwards: {e}")
    finally:
        if a.on_empty_cache:
            free_hog()
    assert vmstash.tag_stats("rv2_train")["state"] == "active"


def test_exchange_with_a_repeated_tag_counts_it_once(sim_alloc, sim):
    """exchange_with given a tag twice keeps it once, so the wakes that send it out work
    (listed twice, vmstash_switch refused every one: INVALID_ARGUMENT)."""
    import vmstash
    a = sim_alloc
    a.made("rv3_rt", "backup", 2 * MiB, 0x33)
    a.trainer("rv3_train", 2 * MiB)
    a.sleep(offload_tags=("rv3_rt",))
    try:
        a.exchange_with(["rv3_train", "rv3_train"], when_waking=None)
    except ValueError:
        return  # refused up front: fine
    try:
        a.wake_up()
    except vmstash.Error as e:
        pytest.fail(f"exchange_with accepted a repeated tag and now vLLM cannot wake: {e}")


def test_a_failed_level2_sleep_costs_the_weights_backup_only(sim_alloc, sim):
    """_run gives a dropped backup tag's prepared host memory back before its switch (a
    paused tag's arena cannot be released); when the switch then fails (vetoed here), every
    tag is as it was, bytes included, and the next level-1 sleep backs the weights up (its
    arena made again): what the failure cost is that preparation, nothing else."""
    import vmstash
    a = sim_alloc
    w = a.made("rv4_weights", "backup", 8 * MiB, 0x44)
    a.made("rv4_rt", "backup", 2 * MiB, 0x55)
    vmstash.prepare("vllm.rv4_weights")
    assert vmstash.tag_stats("vllm.rv4_weights")["backup_arena_bytes"] > 0
    veto = [1]
    _set_hooks("vllm.rv4_rt", before=lambda tag, dev, user: veto[0])  # hooks stay: vetoes while veto[0]
    try:
        with pytest.raises(vmstash.Error):
            a.sleep(offload_tags=("rv4_rt",))  # level 2's shape: weights dropped
    finally:
        veto[0] = 0
    assert vmstash.tag_stats("vllm.rv4_weights")["state"] == "active" and a.asleep_tags() == []
    assert sim.holds(w, 8 * MiB, 0x44)
    a.sleep(offload_tags=("rv4_weights", "rv4_rt"))  # level 1
    assert vmstash.tag_stats("vllm.rv4_weights")["backed_up_bytes"] >= 8 * MiB
    a.wake_up()
    assert sim.holds(w, 8 * MiB, 0x44)


# -- vLLM's per-tag hooks (allocator.py, Note [vLLM Tag Hooks]) -------------------------------------

@pytest.fixture
def tag_hooks(monkeypatch):
    """A vllm.device_allocator with per-tag hooks, as newer vLLMs have (register_tag_hooks,
    run_before_unmap_hooks, run_after_map_hooks; written here from their documented
    behaviour). Yields register(tag, before_unmap, after_map)."""
    hooks = {}

    def register(tag, before_unmap, after_map):
        hooks.setdefault(tag, []).append((before_unmap, after_map))

    def run_before_unmap_hooks(allocations, tags=None):
        mapped = {d.tag for d in allocations if not d.is_asleep and (tags is None or d.tag in tags)}
        for tag in sorted(mapped & hooks.keys()):
            for before_unmap, _ in hooks[tag]:
                before_unmap()

    def run_after_map_hooks(allocations):
        asleep = {d.tag for d in allocations if d.is_asleep}
        for tag in sorted(hooks.keys() - asleep):
            for _, after_map in hooks[tag]:
                after_map()

    module = types.ModuleType("vllm.device_allocator")
    module.register_tag_hooks = register
    module.run_before_unmap_hooks = run_before_unmap_hooks
    module.run_after_map_hooks = run_after_map_hooks
    monkeypatch.setitem(sys.modules, "vllm.device_allocator", module)
    return register


def test_vllms_tag_hooks_run_before_each_unmap_and_after_each_wake(sim_alloc, tag_hooks, sim):
    import vmstash
    a = sim_alloc
    w = a.made("weights", "backup", 4 * MiB, 0x31)
    a.made("kv_cache", "discard", 2 * MiB, 0)
    events = []

    def hook(kind, tag):
        def run():
            state = vmstash.tag_stats("vllm." + tag)["state"]
            events.append((kind, tag, state))  # the state the tag is in when the hook runs
        return run
    for tag in ("weights", "kv_cache"):
        tag_hooks(tag, hook("before_unmap", tag), hook("after_map", tag))
    a.sleep(offload_tags=("weights",))
    assert events == [("before_unmap", "kv_cache", "active"), ("before_unmap", "weights", "active")]
    events.clear()
    a.wake_up(["weights"])  # kv_cache stays asleep (deferrable): only th_weights is all mapped
    assert events == [("after_map", "weights", "active")]
    events.clear()
    a.wake_up()
    assert events == [("after_map", "kv_cache", "active"), ("after_map", "weights", "active")]
    events.clear()
    a.discard(["kv_cache"])
    assert events == [("before_unmap", "kv_cache", "active")]
    events.clear()
    a.discard(["kv_cache"])  # asleep already: nothing unmapped, no hook
    a.sleep(offload_tags=("weights",))  # only th_weights is mapped
    assert events == [("before_unmap", "weights", "active")]
    a.wake_up()
    assert sim.holds(w, 4 * MiB, 0x31)


def test_a_failed_sleep_after_the_before_unmap_hooks_runs_the_after_map_hooks(sim_alloc, tag_hooks, sim):
    """Nothing was unmapped: what the before_unmap hooks took down comes back, whether a hook
    raised or the switch failed; the failure raised is the first one."""
    import vmstash
    a = sim_alloc
    w = a.made("thf_weights", "backup", 4 * MiB, 0x32)
    a.made("thf_kv", "discard", 2 * MiB, 0)
    registered = {"thf_weights": True, "thf_kv": True}

    def take_down(tag):
        def run():
            registered[tag] = False
        return run

    def bring_up(tag):
        def run():
            registered[tag] = True
        return run
    tag_hooks("thf_weights", take_down("thf_weights"), bring_up("thf_weights"))

    def refuses():
        raise RuntimeError("transport busy")
    tag_hooks("thf_kv", take_down("thf_kv"), bring_up("thf_kv"))
    tag_hooks("thf_weights", refuses, lambda: None)  # runs after thf_kv's and thf_weights' first hook
    with pytest.raises(RuntimeError, match="transport busy"):
        a.sleep(offload_tags=("thf_weights",))
    assert a.asleep_tags() == [] and vmstash.tag_stats("vllm.thf_weights")["state"] == "active"
    assert registered == {"thf_weights": True, "thf_kv": True}

    # The switch fails (a vmstash before-pause hook vetoes it) after every before_unmap ran.
    tag_hooks("thf_kv", lambda: None, lambda: None)
    hooks = sys.modules["vllm.device_allocator"]
    saved = hooks.run_before_unmap_hooks

    def only_take_down(allocations, tags=None):  # the refusing hook out of the way
        for d in allocations:
            registered[d.tag] = False
    hooks.run_before_unmap_hooks = only_take_down
    _set_hooks("vllm.thf_kv", before=lambda tag, dev, user: 1)
    try:
        with pytest.raises(vmstash.Error):
            a.sleep(offload_tags=("thf_weights",))
    finally:
        _set_hooks("vllm.thf_kv")
        hooks.run_before_unmap_hooks = saved
    assert a.asleep_tags() == [] and registered == {"thf_weights": True, "thf_kv": True}
    assert sim.holds(w, 4 * MiB, 0x32)


def test_a_wake_done_with_a_failed_vmstash_hook_still_runs_vllms_after_map_hooks(sim_alloc, tag_hooks, sim):
    """Every tag is mapped again (the switch is done; a vmstash after-resume hook failed):
    vLLM's after_map hooks run before the error is raised."""
    import vmstash
    a = sim_alloc
    a.made("thd_weights", "backup", 2 * MiB, 0x21)
    a.made("thd_kv", "discard", 2 * MiB, 0)
    registered = {"thd_kv": True}
    tag_hooks("thd_kv", lambda: registered.__setitem__("thd_kv", False),
              lambda: registered.__setitem__("thd_kv", True))
    a.sleep(offload_tags=("thd_weights",))
    assert registered == {"thd_kv": False}
    _set_hooks("vllm.thd_weights", after=lambda tag, dev, user: 1)
    try:
        with pytest.raises(vmstash.Error) as e:
            a.wake_up()
    finally:
        _set_hooks("vllm.thd_weights")
    assert e.value.done and a.asleep_tags() == []
    assert registered == {"thd_kv": True}


def test_dropping_retired_pools_and_a_discard_take_the_locks_in_one_order(sim_alloc, sim, monkeypatch):
    """_drop_retired paused inside both locks while another thread discards: the discard
    waits for it, then runs (the opposite orders waited for each other for good)."""
    import threading
    from vmstash import _torch
    a = sim_alloc
    a.made("lo_kv", "discard", 2 * MiB, 0)
    a._retired = [(0, object())]
    inside, go = threading.Event(), threading.Event()
    real = _torch.open_regions

    def held_here():  # the thread descheduled inside the locks
        inside.set()
        go.wait(60)
        return real()
    monkeypatch.setattr(_torch, "open_regions", held_here)
    dropping = threading.Thread(target=a._drop_retired, daemon=True)
    dropping.start()
    assert inside.wait(60)
    discarding = threading.Thread(target=a.discard, args=(["lo_kv"],), daemon=True)
    discarding.start()
    go.set()
    dropping.join(60)
    discarding.join(60)
    assert not dropping.is_alive() and not discarding.is_alive()
    assert a.asleep_tags() == ["lo_kv"]
    a.wake_up()


def test_a_vllm_without_tag_hooks_gets_none_run(sim_alloc, monkeypatch, sim):
    """vLLM 0.33's vllm.device_allocator (no hook functions), or none imported: the allocator
    sleeps and wakes as before."""
    a = sim_alloc
    w = a.made("thn_weights", "backup", 2 * MiB, 0x33)
    for module in (types.ModuleType("vllm.device_allocator"), None):
        if module is None:
            monkeypatch.delitem(sys.modules, "vllm.device_allocator", raising=False)
        else:
            monkeypatch.setitem(sys.modules, "vllm.device_allocator", module)
        a.sleep(offload_tags=("thn_weights",))
        a.wake_up()
        assert sim.holds(w, 2 * MiB, 0x33)


def test_threads_sleeping_waking_and_discarding_at_once(sim_alloc, sim):
    """Four threads call sleep, wake_up (whole and selective), discard and the read-only
    views on one allocator at random: every call is one switch under the allocator's lock,
    so after each one the allocator's record of which tags sleep is vmstash's, and the kept
    tags' bytes survive every cycle."""
    import random
    import threading
    import vmstash
    a = sim_alloc
    w = a.made("st_weights", "backup", 3 * MiB, 0x61)
    rt = a.made("st_runtime", "backup", 1 * MiB, 0x62)
    a.made("st_kv", "discard", 2 * MiB, 0x63)
    calls = [lambda: a.sleep(offload_tags=("st_weights", "st_runtime")), lambda: a.wake_up(),
             lambda: a.wake_up(["st_weights"]), lambda: a.wake_up(["st_kv"]), lambda: a.discard(("st_kv",)),
             lambda: (a.asleep_tags(), a.get_current_usage(), a.pointer_to_data)]
    errors, mismatches = [], []

    def agree():
        with a._lock:
            for tag, t in a._tags.items():
                actual = vmstash.tag_stats(t.name)["state"]
                if (actual == "paused") != t.asleep:
                    mismatches.append((tag, actual, t.asleep))

    def worker(seed):
        rnd = random.Random(seed)
        try:
            for _ in range(60):
                rnd.choice(calls)()
                agree()
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors and not mismatches, (errors[:3], mismatches[:3])
    a.wake_up()
    assert a.asleep_tags() == []
    assert sim.holds(w, 3 * MiB, 0x61) and sim.holds(rt, 1 * MiB, 0x62)


# -- which backups are prepared ahead (the allocator's docstring; vmstash.set_prepare_ahead) --------

_PREPARE_CASE = r"""
import ctypes, time, types
import vmstash
from vmstash import _lib, _torch
from vmstash.compat.vllm import allocator as A
MiB = 1 << 20
fake = types.SimpleNamespace(
    accelerator=types.SimpleNamespace(empty_cache=lambda *_: None, synchronize=lambda d=None: None),
    cuda=types.SimpleNamespace(current_device=lambda: 0,
                               memory=types.SimpleNamespace(_snapshot=lambda: {"segments": []},
                                                            empty_cache=lambda *_: None)))
_torch._torch = lambda: fake
a = A.VmstashMemAllocator()  # VMSTASH_VLLM_PREPARE_TAGS from the environment
l = _lib.lib()
live = {}
def grow(tag, size, byte):  # memory of a vLLM tag, as its pool's segments would be
    t = a._tag(tag)
    t.devices.add(0)
    vmstash.set_current_tag(t.name)
    p = l.vmstash_malloc(size, 0, None)
    vmstash.set_current_tag("default")
    ctypes.memset(p, byte, size)
    live.setdefault(tag, []).append((p, size, byte))
def arena(tag):
    return vmstash.tag_stats(A.TAG_PREFIX + tag, 0)["backup_arena_bytes"]
def settle(tag):  # the background preparation of a tag prepared ahead has run
    deadline = time.monotonic() + 60
    while arena(tag) == 0:
        assert time.monotonic() < deadline, "the named tag was never prepared"
        time.sleep(0.05)
def intact():
    return all(ctypes.string_at(p, n) == bytes([b]) * n for ps in live.values() for p, n, b in ps)
grow("weights", 64 * MiB, 0x11)
grow("lora", 96 * MiB, 0x22)
grow("kv_cache", 128 * MiB, 0x33)
for tag in ("weights", "lora"):
    if tag in a._prepare_tags:
        settle(tag)
print("prepared before the first sleep:", {t: arena(t) > 0 for t in ("weights", "lora", "kv_cache")})
a.sleep(offload_tags=())  # level 2: weights and the LoRA pool dropped
print("after level 2:", {t: arena(t) for t in ("weights", "lora")})
a.wake_up()
for tag in ("weights", "lora"):  # reloaded, as verl syncs the weights after a level-2 wake
    for p, n, b in live[tag]:
        ctypes.memset(p, b, n)
del live["kv_cache"]  # never kept
grow("lora", 32 * MiB, 0x44)
a.sleep(offload_tags=("weights", "lora"))  # level 1: both kept, the LoRA pool's arena made now
a.wake_up()
print("intact:", intact())
kept = arena("lora")
grow("lora", 256 * MiB, 0x55)  # kept at its last sleep: prepared ahead from now on
deadline = time.monotonic() + 60
while arena("lora") <= kept and time.monotonic() < deadline:
    time.sleep(0.05)
print("lora grows prepared:", arena("lora") > kept)
"""


@pytest.mark.parametrize("named", [None, "lora"])
def test_backups_are_prepared_ahead_only_for_named_tags_and_those_kept_at_a_sleep(named):
    """With background preparation on (auto_prepare:1), the named tags' backups (default
    weights, runtime and cudagraph) are pinned ahead of the first sleep; another backup tag (a LoRA
    pool) holds no host memory until a sleep keeps its bytes, so a level-2 sleep dropping it
    has nothing to give back; once a sleep kept it, its growth is prepared ahead."""
    import os
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "VMSTASH_VLLM_PREPARE_TAGS"}
    env["VMSTASH_CONF"] = "driver:sim,sim_devices:1,sim_capacity:2G,auto_prepare:1"
    if named is not None:
        env["VMSTASH_VLLM_PREPARE_TAGS"] = "weights," + named
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here)] + sys.path)
    r = subprocess.run([sys.executable, "-c", _PREPARE_CASE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    lora_ahead = named == "lora"
    assert f"prepared before the first sleep: {{'weights': True, 'lora': {lora_ahead}, 'kv_cache': False}}" in out, out
    assert "after level 2: {'weights': 0, 'lora': 0}" in out, out
    assert "intact: True" in out and "lora grows prepared: True" in out, out
