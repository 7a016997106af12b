"""vmstash.compat.vllm without a GPU: the decisions of every call (plan.py), the plugin's
registration and routing, and the backend's state machine over an allocator that can be
told to fail (the allocator itself: test_vllm_allocator.py). vLLM itself is not importable here: the vLLM modules the plugin touches are
replaced by small fakes with vLLM 0.33's names (the GPU tests, gpu_vllm_backend.py and
scripts/run_vllm_suite.sh, use vLLM's own files)."""
import abc
import sys
import types

import pytest

from vmstash.compat.vllm import plan as P
from vmstash.compat.vllm.plan import Exchange, TagState


def B(**kw):
    return TagState("backup", **kw)


def D(**kw):
    return TagState("discard", **kw)


# -- plan --------------------------------------------------------------------------------------

def test_sleep_keeps_offloaded_and_drops_the_rest():
    s = P.plan_sleep({"weights": B(), "kv_cache": D(), "runtime": B(), "default": B()}, ("weights", "runtime"))
    assert s.keep == ("weights", "runtime") and s.drop == ("kv_cache", "default")
    assert not s.exchange_in and not s.conflicts and not s.empty()


def test_sleep_leaves_asleep_tags_and_reports_a_changed_policy():
    states = {"weights": B(asleep=True, kept=False), "runtime": B(asleep=True, kept=True), "kv_cache": D()}
    s = P.plan_sleep(states, ("weights", "runtime"))
    assert s.keep == () and s.drop == ("kv_cache",) and s.conflicts == ("weights",)


def test_sleep_refuses_to_keep_a_discard_tag_before_anything():
    with pytest.raises(ValueError, match="kv_cache"):
        P.plan_sleep({"kv_cache": D(), "weights": B()}, ("kv_cache",))
    # asleep or empty discard tags are no obstacle
    assert P.plan_sleep({"kv_cache": D(asleep=True), "weights": B()}, ("kv_cache",)).drop == ("weights",)
    assert P.plan_sleep({"kv_cache": D(has_memory=False)}, ("kv_cache",)).empty()


def test_sleep_names_unknown_tags_and_skips_tags_without_memory():
    s = P.plan_sleep({"weights": B(has_memory=False), "runtime": B()}, ("weights", "cudagraph"))
    assert s.keep == () and s.drop == ("runtime",) and s.unknown == ("cudagraph",)


def test_discard_drops_awake_tags_only():
    states = {"kv_cache": D(), "weights": B(asleep=True, kept=True), "runtime": B()}
    s = P.plan_discard(states, ("kv_cache", "weights", "nope"))
    assert s.drop == ("kv_cache",) and s.conflicts == ("weights",) and s.unknown == ("nope",)


def test_wake_defers_only_weights_and_kv_cache():
    states = {t: B(asleep=True, kept=True) for t in ("weights", "kv_cache", "runtime", "cudagraph", "workspace")}
    assert P.plan_wake(states, ("weights",)).wake == ("weights", "runtime", "cudagraph", "workspace")
    assert P.plan_wake(states, ("kv_cache",)).wake == ("kv_cache", "runtime", "cudagraph", "workspace")
    assert P.plan_wake(states, None).wake == tuple(states)
    assert P.plan_wake(states, ()).wake == ("runtime", "cudagraph", "workspace")
    assert P.plan_wake({"weights": B()}, None).empty()


def test_exchange_goes_out_with_a_trigger_and_back_with_the_next_sleep():
    states = {"weights": B(asleep=True, kept=True), "kv_cache": D(asleep=True)}
    ex = Exchange(("train",), ("kv_cache",))
    assert not P.plan_wake(states, ("weights",), ex).exchange_out
    step = P.plan_wake(states, ("kv_cache",), ex)
    assert step.exchange_out and step.wake == ("kv_cache",)
    assert P.plan_wake(states, None, Exchange(("train",), None)).exchange_out
    assert not P.plan_wake(states, None, Exchange(("train",), None, out=True)).exchange_out
    awake = {"weights": B(), "kv_cache": D()}
    assert P.plan_sleep(awake, ("weights",), Exchange(("train",), ("kv_cache",), out=True)).exchange_in
    assert not P.plan_sleep(awake, ("weights",), ex).exchange_in
    assert not P.plan_wake({"weights": B()}, None, Exchange(("train",), None)).exchange_out  # nothing comes in


def test_state_after_and_normalize():
    states = {"weights": B(), "kv_cache": D(), "runtime": B(asleep=True, kept=True)}
    step = P.Step(keep=("weights",), drop=("kv_cache",), wake=("runtime",))
    after = P.state_after(states, step)
    assert after["weights"] == B(asleep=True, kept=True) and after["kv_cache"] == D(asleep=True)
    assert after["runtime"] == B()
    assert P.normalize_tags(None, "x", ("default",)) == ("default",)
    assert P.normalize_tags("weights", "x") == ("weights",)
    assert P.normalize_tags(["a", "b"], "x") == ("a", "b")
    for bad in (3, [""], ["a", None]):
        with pytest.raises(ValueError):
            P.normalize_tags(bad, "x")


# -- plugin and backend over fake vLLM modules ----------------------------------------------------

class FakeAllocator:
    """What the backend needs of VmstashMemAllocator, with failures on demand."""

    def __init__(self):
        self.asleep, self.calls, self.fail = set(), [], None
        self.made = {"weights": "vllm.weights"}

    def _maybe_fail(self, what):
        if self.fail == what:
            raise RuntimeError(f"injected {what} failure")

    def sleep(self, offload_tags=None):
        self.calls.append(("sleep", offload_tags))
        self._maybe_fail("sleep")
        self.asleep |= {"weights", "kv_cache", "runtime"}

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        self._maybe_fail("wake_up")
        self.asleep -= set(self.asleep if tags is None else [t for t in self.asleep
                                                              if t in tags or t not in P.DEFERRABLE_TAGS])

    def discard(self, tags):
        self.calls.append(("discard", tags))
        self.asleep |= set(tags)

    def asleep_tags(self):
        return sorted(self.asleep)

    def tag_names(self):
        return dict(self.made)


@pytest.fixture
def fake_vllm(monkeypatch):
    """vllm, vllm.device_allocator(.sleep_mode_backend), vllm.config and the worker base as
    small fakes in sys.modules; vmstash's plugin modules fresh for each test."""
    mods = {}

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__path__ = []  # a package, as far as imports of submodules go
        m.__dict__.update(attrs)
        mods[name] = m
        return m

    class SleepModeBackend(abc.ABC):
        def __init__(self):
            self._state = "RUNNING"

        def state(self):
            return self._state

    class Factory:
        _registry = {}

        @classmethod
        def register_backend(cls, name, module_path, class_name):
            if name in cls._registry:
                raise ValueError(f"Sleep-mode backend '{name}' is already registered.")
            cls._registry[name] = (module_path, class_name)

        @classmethod
        def create_backend(cls, model_config):
            return model_config.sleep_mode_backend  # the name it was made for

    class Theirs:
        pass

    theirs = Theirs()
    current = {"config": None}

    class VllmConfig:
        def __init__(self, backend="cumem", offload_graphs=False, mode="FULL", sleep=True):
            self.model_config = types.SimpleNamespace(sleep_mode_backend=backend, enable_sleep_mode=sleep,
                                                      sleep_mode_offload_cudagraph=offload_graphs)
            self.compilation_config = types.SimpleNamespace(cudagraph_mode=types.SimpleNamespace(name=mode))

        @property
        def use_cumem_cudagraph_pool(self):
            m = self.model_config
            return m.sleep_mode_offload_cudagraph and m.sleep_mode_backend == "cumem"

    class WorkerBase:
        def __init__(self, vllm_config, local_rank=0):
            self.vllm_config = vllm_config

    module("vllm")
    da = module("vllm.device_allocator", get_mem_allocator_instance=lambda: theirs, DEFERRABLE_TAGS=P.DEFERRABLE_TAGS)
    module("vllm.device_allocator.sleep_mode_backend", SleepModeBackend=SleepModeBackend,
           SleepModeBackendFactory=Factory)
    module("vllm.config", VllmConfig=VllmConfig, get_current_vllm_config_or_none=lambda: current["config"])
    module("vllm.platforms", current_platform=types.SimpleNamespace(is_cuda_alike=lambda: True))
    module("vllm.v1")
    module("vllm.v1.worker")
    module("vllm.v1.worker.worker_base", WorkerBase=WorkerBase)
    gpu_worker = module("vllm.v1.worker.gpu_worker", get_mem_allocator_instance=da.get_mem_allocator_instance)
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)
    for name in ("vmstash.compat.vllm.plugin", "vmstash.compat.vllm.backend"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import importlib
    plugin = importlib.import_module("vmstash.compat.vllm.plugin")
    return types.SimpleNamespace(plugin=plugin, da=da, gpu_worker=gpu_worker, theirs=theirs, current=current,
                                 Factory=Factory, VllmConfig=VllmConfig, WorkerBase=WorkerBase)


def test_register_is_idempotent_and_registers_the_backend(fake_vllm):
    f = fake_vllm
    f.plugin.register()
    f.plugin.register()
    assert f.Factory._registry["vmstash"] == ("vmstash.compat.vllm.backend", "VmstashSleepBackend")
    assert f.da.get_mem_allocator_instance is f.gpu_worker.get_mem_allocator_instance  # rebound
    assert f.da.get_mem_allocator_instance() is f.theirs  # nothing selected


def test_the_plugin_changes_nothing_and_never_raises_on_a_vllm_without_a_backend_registry(fake_vllm, monkeypatch,
                                                                                         caplog):
    """vLLM 0.24's layout: vllm.device_allocator without sleep_mode_backend. vLLM calls
    general plugins without a try, so register() raising took every such process down at
    startup; now it logs one debug line and changes nothing (select(True), an explicit
    request, says why it cannot)."""
    import logging
    f = fake_vllm
    monkeypatch.delitem(sys.modules, "vllm.device_allocator.sleep_mode_backend")
    before = f.da.get_mem_allocator_instance
    init = f.WorkerBase.__init__
    with caplog.at_level(logging.DEBUG, logger="vmstash.compat.vllm"):
        f.plugin.register()
        f.plugin.register()
    assert f.da.get_mem_allocator_instance is before and f.WorkerBase.__init__ is init
    assert not f.Factory._registry
    said = [r for r in caplog.records if r.name == "vmstash.compat.vllm"]
    assert len(said) == 2 and all(r.levelno == logging.DEBUG for r in said), said
    assert "no sleep-mode backend registry" in said[0].getMessage()
    with pytest.raises(ImportError, match="sleep-mode backend registry"):
        f.plugin.select(True)


def test_a_plugin_step_that_fails_is_a_warning_not_a_crash(fake_vllm, monkeypatch, caplog):
    """Any other failure inside register() (a vLLM whose names moved) is logged as a warning;
    vLLM goes on without the backend."""
    import logging
    f = fake_vllm

    def broken(*a):
        raise AttributeError("register_backend moved")

    monkeypatch.setattr(f.Factory, "register_backend", classmethod(broken))
    with caplog.at_level(logging.WARNING, logger="vmstash.compat.vllm"):
        f.plugin.register()
    assert any("not registered" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_routing_follows_the_config_then_the_workers_then_select(fake_vllm):
    from vmstash.compat.vllm.allocator import VmstashMemAllocator
    f = fake_vllm
    f.plugin.register()
    ours = VmstashMemAllocator.get_instance()
    f.current["config"] = f.VllmConfig("vmstash")
    assert f.da.get_mem_allocator_instance() is ours
    f.current["config"] = f.VllmConfig("cumem")
    assert f.da.get_mem_allocator_instance() is f.theirs
    f.current["config"] = None
    f.WorkerBase(vllm_config=f.VllmConfig("vmstash"))  # the worker made, then load_model outside the config
    assert f.gpu_worker.get_mem_allocator_instance() is ours
    f.WorkerBase(f.VllmConfig("cumem"))
    assert f.gpu_worker.get_mem_allocator_instance() is f.theirs
    f.plugin.select(True)
    assert f.da.get_mem_allocator_instance() is ours
    f.plugin.select(None)
    assert f.da.get_mem_allocator_instance() is f.theirs
    with pytest.raises(TypeError):
        f.plugin.select("yes")


def test_graph_pool_router_holds_for_vmstash_under_vllms_conditions(fake_vllm):
    f = fake_vllm
    f.plugin.register()
    assert f.VllmConfig("vmstash", offload_graphs=True).use_cumem_cudagraph_pool
    assert not f.VllmConfig("vmstash", offload_graphs=False).use_cumem_cudagraph_pool
    assert not f.VllmConfig("vmstash", offload_graphs=True, mode="NONE").use_cumem_cudagraph_pool
    assert f.VllmConfig("cumem", offload_graphs=True).use_cumem_cudagraph_pool
    assert not f.VllmConfig("other", offload_graphs=True).use_cumem_cudagraph_pool
    f.plugin.register()  # not wrapped twice
    assert f.VllmConfig("vmstash", offload_graphs=True).use_cumem_cudagraph_pool


def test_the_environment_switch_puts_vmstash_in_place_of_vllms_default_backend(fake_vllm, monkeypatch):
    """VMSTASH_VLLM_SLEEP_BACKEND=1 (item 2 of the frameworks issue): engines whose arguments
    the framework builds (OpenRLHF) get vmstash without code changes, in every process of
    the tree; an engine naming another backend, or without sleep mode, keeps its own."""
    from vmstash.compat.vllm.allocator import VmstashMemAllocator
    f = fake_vllm
    monkeypatch.setenv("VMSTASH_VLLM_SLEEP_BACKEND", "1")
    from vmstash.compat.vllm.backend import VmstashSleepBackend
    monkeypatch.setattr(VmstashSleepBackend, "is_supported", classmethod(lambda cls: True))
    f.plugin.register()
    f.plugin.register()  # not wrapped twice
    ours = VmstashMemAllocator.get_instance()
    f.current["config"] = f.VllmConfig("cumem")  # the engine core's own copy, untouched
    assert f.da.get_mem_allocator_instance() is ours
    assert f.VllmConfig("cumem", offload_graphs=True).use_cumem_cudagraph_pool
    f.current["config"] = None
    worker = f.WorkerBase(f.VllmConfig("cumem"))  # the worker's copy says vmstash from here on
    assert worker.vllm_config.model_config.sleep_mode_backend == "vmstash"
    assert f.gpu_worker.get_mem_allocator_instance() is ours
    assert f.Factory.create_backend(f.VllmConfig("cumem").model_config) == "vmstash"
    for kept in (f.VllmConfig("other"), f.VllmConfig("cumem", sleep=False)):
        assert f.Factory.create_backend(kept.model_config) == kept.model_config.sleep_mode_backend
        f.WorkerBase(kept)
        assert f.gpu_worker.get_mem_allocator_instance() is f.theirs
    assert f.Factory.create_backend(model_config=f.VllmConfig("cumem").model_config) == "vmstash"  # by keyword


def test_the_environment_switch_is_off_where_vmstash_cannot_run(fake_vllm, monkeypatch, caplog):
    """No CUDA device or no library here: the engine keeps vLLM's backend (one warning),
    instead of failing where it would have worked; and the switch is read once."""
    import logging
    f = fake_vllm
    monkeypatch.setenv("VMSTASH_VLLM_SLEEP_BACKEND", "1")
    from vmstash.compat.vllm.backend import VmstashSleepBackend
    monkeypatch.setattr(VmstashSleepBackend, "is_supported", classmethod(lambda cls: False))
    with caplog.at_level(logging.WARNING, logger="vmstash.compat.vllm"):
        f.plugin.register()
        worker = f.WorkerBase(f.VllmConfig("cumem"))
        f.WorkerBase(f.VllmConfig("cumem"))
    assert worker.vllm_config.model_config.sleep_mode_backend == "cumem"
    assert f.gpu_worker.get_mem_allocator_instance() is f.theirs
    assert f.Factory.create_backend(f.VllmConfig("cumem").model_config) == "cumem"
    assert sum("cannot run in this process" in r.getMessage() for r in caplog.records) == 1


def test_a_bad_environment_switch_is_a_warning_and_changes_nothing(fake_vllm, monkeypatch, caplog):
    import logging
    f = fake_vllm
    monkeypatch.setenv("VMSTASH_VLLM_SLEEP_BACKEND", "maybe")
    with caplog.at_level(logging.WARNING, logger="vmstash.compat.vllm"):
        f.plugin.register()
    assert any("VMSTASH_VLLM_SLEEP_BACKEND='maybe'" in r.getMessage() for r in caplog.records)
    f.WorkerBase(f.VllmConfig("cumem"))
    assert f.gpu_worker.get_mem_allocator_instance() is f.theirs  # never raises in vLLM's path
    assert f.Factory.create_backend(f.VllmConfig("cumem").model_config) == "cumem"
    with pytest.raises(ValueError, match="expected 1"):
        f.plugin.switched_on()


@pytest.fixture
def backend(fake_vllm, monkeypatch):
    from vmstash.compat.vllm import allocator as A
    fake = FakeAllocator()
    monkeypatch.setattr(A.VmstashMemAllocator, "get_instance", staticmethod(lambda: fake))
    from vmstash.compat.vllm.backend import VmstashSleepBackend
    b = VmstashSleepBackend()
    return b, fake


def test_backend_levels_and_states(backend):
    b, fake = backend
    assert b.state() == "RUNNING"
    b.suspend(level=1)
    assert fake.calls[-1] == ("sleep", ("weights", "runtime", "cudagraph")) and b.state() == "SUSPENDED"
    b.resume(tags=["weights"])
    assert b.state() == "RESUMING" and fake.asleep_tags() == ["kv_cache"]
    b.resume(tags=["kv_cache"])
    assert b.state() == "RUNNING"
    b.suspend(level=2)
    assert fake.calls[-1] == ("sleep", ("runtime", "cudagraph"))
    b.resume()
    assert b.state() == "RUNNING"
    b.discard(("kv_cache",))
    assert b.state() == "SUSPENDED"


def test_backend_failures_leave_the_state(backend):
    b, fake = backend
    for level in (0, 3, True, "1", None):
        with pytest.raises(ValueError, match="level must be 1 or 2"):
            b.suspend(level=level)
    assert b.state() == "RUNNING" and not fake.calls
    fake.fail = "sleep"
    with pytest.raises(RuntimeError, match="injected"):
        b.suspend(level=1)
    assert b.state() == "RUNNING"
    fake.fail = None
    b.suspend(level=1)
    fake.fail = "wake_up"
    with pytest.raises(RuntimeError, match="injected"):
        b.resume()
    assert b.state() == "SUSPENDED"
    fake.fail = None
    b.resume(tags=["weights"])
    fake.fail = "wake_up"
    with pytest.raises(RuntimeError):
        b.resume(tags=["kv_cache"])
    assert b.state() == "RESUMING"
    fake.fail = None
    b.resume()
    assert b.state() == "RUNNING"


def test_backend_capabilities(backend):
    b, _ = backend
    cls = type(b)
    assert cls.preserves_communicators() and cls.preserves_compiled_artifacts()
    assert not cls.preserves_graphs_with_communicators() and not cls.supports_durable_storage()


def test_backend_refuses_a_suspend_that_would_free_nothing(backend, monkeypatch):
    b, fake = backend
    fake.made = {}
    cumem = types.ModuleType("vllm.device_allocator.cumem")
    cumem.CuMemAllocator = types.SimpleNamespace(instance=types.SimpleNamespace(get_current_usage=lambda: 1 << 30))
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", cumem)
    with pytest.raises(RuntimeError, match="through CuMemAllocator"):
        b.suspend(level=1)
    assert b.state() == "RUNNING" and not fake.calls


# -- the plugin's routing ------------------------------------------------------------------------

def test_select_routes_even_when_the_plugin_was_not_loaded(fake_vllm):
    """select(True) (documented: 'whatever the config says') routes to vmstash also when
    register() did not run in this process (VLLM_PLUGINS without 'vmstash')."""
    from vmstash.compat.vllm.allocator import VmstashMemAllocator
    f = fake_vllm
    f.plugin.select(True)
    try:
        assert f.da.get_mem_allocator_instance() is VmstashMemAllocator.get_instance(), \
            "select(True) did not route vLLM's allocations (and said nothing)"
    finally:
        f.plugin.select(None)


def test_a_worker_made_after_an_early_plugin_load_is_routed(fake_vllm, monkeypatch):
    """vLLM loads general plugins once per process (plugins_loaded). Where that first load
    runs before vllm.v1.worker.worker_base is imported (an in-process engine: LLM(...) in the
    trainer's process), the worker made later is still noted, so load_model (outside
    set_current_vllm_config) gets vmstash's allocator, not CuMemAllocator."""
    from vmstash.compat.vllm.allocator import VmstashMemAllocator
    f = fake_vllm
    import importlib.abc
    import importlib.util
    base = sys.modules.pop("vllm.v1.worker.worker_base")

    class OnDisk(importlib.abc.MetaPathFinder, importlib.abc.Loader):  # importable, not imported yet
        def find_spec(self, name, path=None, target=None):
            return importlib.util.spec_from_loader(name, self) if name == base.__name__ else None

        def create_module(self, spec):
            return base

        def exec_module(self, module):
            pass

    monkeypatch.setattr(sys, "meta_path", [OnDisk()] + sys.meta_path)
    f.plugin.register()  # the one load of this process
    assert sys.modules.get(base.__name__) is base
    f.WorkerBase(vllm_config=f.VllmConfig("vmstash"))
    assert f.gpu_worker.get_mem_allocator_instance() is VmstashMemAllocator.get_instance(), \
        "a worker made with sleep_mode_backend='vmstash' loads its model through CuMemAllocator"


def test_suspend_refuses_a_partly_routed_worker(backend, monkeypatch):
    """With the weights and KV cache in CuMemAllocator and only the graph pool routed to
    vmstash (capture under the config, load_model outside it), suspend would free nothing of
    them: it raises, naming CuMemAllocator (it once reported success)."""
    b, fake = backend
    fake.made = {"cudagraph": "vllm.cudagraph"}
    cumem = types.ModuleType("vllm.device_allocator.cumem")
    cumem.CuMemAllocator = types.SimpleNamespace(instance=types.SimpleNamespace(get_current_usage=lambda: 8 << 30))
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", cumem)
    with pytest.raises(RuntimeError, match="CuMemAllocator"):
        b.suspend(level=1)


def test_the_wheel_declares_the_plugin_as_pyproject_does():
    """The vllm.general_plugins entry point: pyproject.toml (pip install .) and the release
    wheel's writer (scripts/build_vmstash_wheel.py) declare the same one."""
    import os
    import re
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    text = open(os.path.join(root, "pyproject.toml")).read()
    section = re.search(r'\[project\.entry-points\."vllm\.general_plugins"\]\n((?:[^\[\n].*\n)+)', text)
    assert section, "pyproject.toml declares no vllm.general_plugins entry point"
    declared = re.findall(r'^(\w+) = "([^"]+)"', section.group(1), re.M)
    sys.path.insert(0, os.path.join(root, "scripts"))
    try:
        import build_vmstash_wheel
    finally:
        sys.path.pop(0)
    wheel = build_vmstash_wheel.ENTRY_POINTS.split("[vllm.general_plugins]")[1].strip().splitlines()
    assert declared == [tuple(x.split(" = ")) for x in wheel] == [("vmstash", "vmstash.compat.vllm.plugin:register")]
