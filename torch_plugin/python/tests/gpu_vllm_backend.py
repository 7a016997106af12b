"""vmstash as vLLM 0.33's sleep-mode backend, driven with vLLM's own files (gpu).

vLLM's allocator files (device_allocator/, the sleep-mode backends, the CUDA-graph pool
router, CuMemAllocator's extension) come from its 0.33.0 wheel (scripts/fetch_vllm.py:
third_party/vllm), with the stand-ins of vllm_standins/ for the vLLM modules they import
(the engine does not run under this PyTorch). Each test runs in a fresh process
(conftest.py) with that vllm package first on PYTHONPATH.

The scenarios follow the order verl uses: load weights in "weights", the KV cache in
"kv_cache", capture a decode graph in the graph pool vLLM routes to the allocator, sleep,
a training step that takes the memory, wake "weights", update them, wake "kv_cache", replay.
The model is the RL demo's small MoE decoder (vmstash.demo.rl_phase_switch), made smaller.
"""
import atexit
import importlib.util
import os
import shutil
import tempfile

import pytest

pytestmark = pytest.mark.gpu

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
GiB = 1 << 30
_env = {}


def _assembler():
    spec = importlib.util.spec_from_file_location("vllm_assemble", os.path.join(HERE, "vllm_standins", "assemble.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child_env(name, env):
    """vLLM's files and the stand-ins, put together once, first on PYTHONPATH."""
    if "dir" not in _env:
        tmp = tempfile.mkdtemp(prefix="vmstash_vllm_")
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        try:
            _env["dir"] = _assembler().assemble(tmp)
        except FileNotFoundError as e:
            _env["dir"], _env["missing"] = None, str(e)
    parts = [_env["dir"], os.path.join(ROOT, "torch_plugin", "python"), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in parts if p)
    if "missing" in _env:
        env["VMSTASH_VLLM_MISSING"] = _env["missing"]
    if name == "test_expandable_segments_stay_on":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if name == "test_the_environment_switch":
        env["VMSTASH_VLLM_SLEEP_BACKEND"] = "1"
    return env


def _vllm():
    """vLLM's modules with vmstash's plugin loaded as vLLM loads it (the entry point's
    function, in a process that has no worker config yet)."""
    missing = os.environ.get("VMSTASH_VLLM_MISSING")
    if missing:
        pytest.fail(missing, pytrace=False)
    import vllm.v1.worker.worker_base  # noqa: F401  (vLLM's worker loads the plugins from here)
    import vmstash.compat.vllm as vm
    vm.register()
    return vm


class Small:
    """The RL demo's decoder, made small: 2 layers of 4 experts."""
    vocab, d, heads, layers, experts, topk, ffn, cf = 4096, 1024, 8, 2, 4, 2, 2048, 2.0
    batch, max_len, decode_steps, train_batch, train_len = 8, 128, 6, 4, 64


class Rollout:
    """vLLM's side: weights, KV cache and runtime inputs in the allocator's tags, a decode
    graph captured in the graph pool vLLM routes to the allocator (capture_pool)."""

    def __init__(self, torch, allocator, master):
        from vllm.compilation.cudagraph_pool import capture_pool
        from vllm.config import ModelConfig, VllmConfig
        from vmstash.demo.rl_phase_switch import decode_step
        cfg, dev = Small, torch.device("cuda", 0)
        self.torch, self.cfg, self.decode_step = torch, cfg, decode_step
        with allocator.use_memory_pool("weights"):
            self.weights = {k: v.detach().to(torch.bfloat16) for k, v in master.items()}
        with allocator.use_memory_pool("kv_cache"):
            self.kv = torch.zeros(cfg.layers, 2, cfg.batch, cfg.max_len, cfg.heads, cfg.d // cfg.heads, device=dev,
                                  dtype=torch.bfloat16)
        with allocator.use_memory_pool("runtime"):
            self.tok = torch.zeros(cfg.batch, dtype=torch.long, device=dev)
            self.pos = torch.zeros(1, dtype=torch.long, device=dev)
            gen = torch.Generator(device=dev).manual_seed(1)
            self.prompts = torch.randint(0, cfg.vocab, (cfg.decode_steps, cfg.batch), generator=gen, device=dev)
        config = VllmConfig(ModelConfig(sleep_mode_backend="vmstash", sleep_mode_offload_cudagraph=True))
        assert config.use_cumem_cudagraph_pool, "the plugin did not extend the graph pool to vmstash"
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with capture_pool(None, config) as pool, torch.cuda.graph(self.graph, pool=pool, stream=side):
            self.logits = self.step()
        assert pool != None and allocator.current_tag != "cudagraph"  # noqa: E711
        self.addresses = self.pointers()

    def step(self):
        return self.decode_step(self.cfg, self.weights, self.kv, self.tok, self.pos)

    def pointers(self):
        return [t.data_ptr() for t in (*self.weights.values(), self.kv, self.tok, self.pos, self.logits)]

    def run(self, graph=True):
        """A fresh sequence: the KV cache zeroed, decode_steps tokens; the logits of each."""
        torch = self.torch
        self.kv.zero_()
        out = []
        for i in range(self.cfg.decode_steps):
            self.tok.copy_(self.prompts[i])
            self.pos.fill_(i)
            if graph:
                self.graph.replay()
                out.append(self.logits.clone())
            else:
                out.append(self.step())
        torch.cuda.synchronize()
        return torch.stack(out)


class Trainer:
    """The training side: fp32 master weights and Adam in the trainer's own vmstash tag."""

    def __init__(self, torch, tag="train.state"):
        import vmstash
        from vmstash.demo.rl_phase_switch import make_params
        dev = torch.device("cuda", 0)
        self.torch, self.tag = torch, tag
        gen = torch.Generator(device=dev).manual_seed(0)
        with vmstash.region(tag, policy="backup"):
            self.master = {k: v.requires_grad_() for k, v in make_params(Small, torch.float32, gen, dev).items()}
            self.opt = torch.optim.Adam(self.master.values(), lr=1e-3, fused=True)
            for v in self.master.values():
                v.grad = torch.zeros_like(v)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        gen = torch.Generator(device=dev).manual_seed(2)
        self.tokens = torch.randint(0, Small.vocab, (Small.train_batch, Small.train_len), generator=gen, device=dev)

    def step(self, hog_fraction=0.5):
        """One training step, with a temporary that takes `hog_fraction` of the device."""
        import torch.nn.functional as F
        from vmstash.demo.rl_phase_switch import train_forward
        torch = self.torch
        free, total = torch.cuda.mem_get_info()
        hog = torch.ones(int(min(hog_fraction * total, 0.9 * free)) // 4, device="cuda")
        hog.mul_(2)
        p = {k: v.to(torch.bfloat16) for k, v in self.master.items()}
        logits = train_forward(Small, p, self.tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, Small.vocab).float(), self.tokens[:, 1:].reshape(-1))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        assert hog[-1].item() == 2.0
        del hog, p, logits
        torch.cuda.empty_cache()
        return loss.item()

    def state(self):
        adam = [v for st in self.opt.state.values() for v in st.values() if self.torch.is_tensor(v) and v.is_cuda]
        return list(self.master.values()) + adam


def _prints(torch, tensors):
    from vmstash.demo.rl_phase_switch import fingerprint
    return fingerprint(list(tensors)).cpu()


def _setup():
    import torch
    vm = _vllm()
    vm.select(True)  # what a model with sleep_mode_backend="vmstash" selects (test_plugin_selection)
    from vllm.device_allocator import get_mem_allocator_instance
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
    from vllm.config import ModelConfig
    allocator = get_mem_allocator_instance()
    assert isinstance(allocator, vm.VmstashMemAllocator)
    backend = SleepModeBackendFactory.create_backend(ModelConfig(sleep_mode_backend="vmstash"))
    assert type(backend).__name__ == "VmstashSleepBackend" and backend.state() == "RUNNING"
    return torch, vm, allocator, backend


def test_plugin_selection():
    """The entry point's function registers "vmstash"; the allocator vLLM's worker gets
    follows the model config, also where the worker loads its model outside
    set_current_vllm_config (the config noted when the worker was made); the graph pool
    router holds for vmstash; cumem stays vLLM's."""
    vm = _vllm()
    vm.register()  # plugins may be loaded more than once
    import vllm.device_allocator as da
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.device_allocator.cumem import CuMemAllocator
    from vllm.device_allocator.sleep_mode_backend import CuMemBackend, SleepModeBackendFactory
    import vllm.v1.worker.worker_base as worker_base
    assert isinstance(da.get_mem_allocator_instance(), CuMemAllocator)  # nothing selected yet
    ours, theirs = VllmConfig(ModelConfig(sleep_mode_backend="vmstash")), VllmConfig(ModelConfig())
    with set_current_vllm_config(ours):
        assert isinstance(da.get_mem_allocator_instance(), vm.VmstashMemAllocator)
        worker_base.WorkerBase(vllm_config=ours)  # vLLM makes the worker under the config
    with set_current_vllm_config(theirs):
        assert isinstance(da.get_mem_allocator_instance(), CuMemAllocator)
    # load_model runs outside set_current_vllm_config: the worker's config decides
    assert isinstance(da.get_mem_allocator_instance(), vm.VmstashMemAllocator)
    backend_cls = SleepModeBackendFactory.get_backend_class("vmstash")
    assert backend_cls.is_supported() and backend_cls.preserves_communicators()
    assert not backend_cls.supports_durable_storage() and not backend_cls.preserves_graphs_with_communicators()
    assert isinstance(SleepModeBackendFactory.create_backend(ModelConfig()), CuMemBackend)
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        backend_cls().suspend(level=3)
    graph_cfg = VllmConfig(ModelConfig(sleep_mode_backend="vmstash", sleep_mode_offload_cudagraph=True))
    assert graph_cfg.use_cumem_cudagraph_pool
    assert not VllmConfig(ModelConfig(sleep_mode_backend="vmstash")).use_cumem_cudagraph_pool


def test_the_environment_switch():
    """VMSTASH_VLLM_SLEEP_BACKEND=1 with vLLM 0.33's own backend factory: a model config with
    sleep mode on and the default backend gets vmstash's backend (and says so from then on),
    its allocations vmstash's allocator; sleep mode off, or another backend named, is left."""
    vm = _vllm()
    import vllm.device_allocator as da
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.device_allocator.cumem import CuMemAllocator
    from vllm.device_allocator.sleep_mode_backend import CuMemBackend, SleepModeBackendFactory
    mc = ModelConfig()
    assert mc.sleep_mode_backend == "cumem" and mc.enable_sleep_mode
    with set_current_vllm_config(VllmConfig(ModelConfig())):
        assert isinstance(da.get_mem_allocator_instance(), vm.VmstashMemAllocator)
    backend = SleepModeBackendFactory.create_backend(mc)
    assert type(backend).__name__ == "VmstashSleepBackend" and mc.sleep_mode_backend == "vmstash"
    off = ModelConfig(enable_sleep_mode=False)
    assert isinstance(SleepModeBackendFactory.create_backend(off), CuMemBackend)
    with set_current_vllm_config(VllmConfig(off)):
        assert isinstance(da.get_mem_allocator_instance(), CuMemAllocator)


def test_verl_order_level1():
    """Load, capture, sleep(1), train on the freed memory, wake weights (bit-equal), update
    them, wake the KV cache, replay (graph as eager); a second cycle replays bit-equal."""
    torch, vm, allocator, backend = _setup()
    trainer = Trainer(torch)
    rollout = Rollout(torch, allocator, trainer.master)
    before = rollout.run()
    w0 = _prints(torch, rollout.weights.values())
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    backend.suspend(level=1)
    assert backend.state() == "SUSPENDED"
    freed = torch.cuda.mem_get_info()[0] - free0
    held = sum(t.nbytes for t in rollout.weights.values()) + rollout.kv.nbytes
    assert freed >= held, (freed, held)
    losses = [trainer.step(), trainer.step()]
    backend.resume(tags=["weights"])
    assert backend.state() == "RESUMING" and allocator.asleep_tags() == ["kv_cache"]
    assert torch.equal(_prints(torch, rollout.weights.values()), w0), "weights changed between sleep and wake"
    with torch.no_grad():  # the weight update (verl: from the trainer's weights)
        for k, w in rollout.weights.items():
            w.copy_(trainer.master[k])
    backend.resume(tags=["kv_cache"])
    assert backend.state() == "RUNNING" and allocator.asleep_tags() == []
    assert rollout.pointers() == rollout.addresses
    after = rollout.run()
    eager = rollout.run(graph=False)
    rel = ((after.float() - eager.float()).abs().max() / eager.float().abs().max()).item()
    assert rel < 2e-2, f"graph differs from eager by {rel:.3g} after the update"
    assert not torch.equal(after, before), "the weight update did not reach the graph"
    backend.suspend(level=1)
    backend.resume()
    assert torch.equal(rollout.run(), after), "the graph's replay changed across a sleep"
    print(f"verl order: losses {losses}, freed {freed / GiB:.2f} GiB, graph vs eager {rel:.2e}")


def test_level2():
    """sleep(2) drops the weights and gives back their host backup; runtime state and the
    graph pool are kept; after the weights are reloaded the graph replays bit-equal."""
    torch, vm, allocator, backend = _setup()
    import vmstash
    trainer = Trainer(torch)
    rollout = Rollout(torch, allocator, trainer.master)
    before = rollout.run()
    saved = {k: v.cpu() for k, v in rollout.weights.items()}  # "the model source"
    backend.suspend(level=2)
    assert backend.state() == "SUSPENDED"
    held = vmstash.tag_stats("vllm.weights")
    assert held["state"] == "paused" and held["backed_up_bytes"] == 0, held
    assert held["backup_arena_bytes"] == 0, f"level 2 kept {held['backup_arena_bytes']} bytes of host backup"
    assert vmstash.tag_stats("vllm.runtime")["backed_up_bytes"] > 0
    backend.resume(tags=["weights"])
    with torch.no_grad():
        for k, w in rollout.weights.items():
            w.copy_(saved[k])  # vLLM's reload_weights
    backend.resume(tags=["kv_cache"])
    assert backend.state() == "RUNNING"
    assert torch.equal(rollout.run(), before), "the graph's replay changed across a level-2 sleep"


def test_wake_out_of_memory_then_retry():
    """A wake that cannot find the memory raises (a RuntimeError, as vLLM's test expects),
    leaves every tag asleep and the state SUSPENDED; once memory is free, a retry works."""
    torch, vm, allocator, backend = _setup()
    trainer = Trainer(torch)
    rollout = Rollout(torch, allocator, trainer.master)
    before = rollout.run()
    backend.suspend(level=1)
    asleep = allocator.asleep_tags()
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - (64 << 20), dtype=torch.uint8, device="cuda")
    with pytest.raises(RuntimeError):
        backend.resume()
    assert backend.state() == "SUSPENDED" and allocator.asleep_tags() == asleep
    with pytest.raises(RuntimeError):
        backend.resume(tags=["weights"])
    assert backend.state() == "SUSPENDED"
    del hog
    torch.cuda.empty_cache()
    backend.resume()
    assert backend.state() == "RUNNING"
    assert torch.equal(rollout.run(), before)


def test_exchange_with_training_state():
    """The trainer's tag goes out in the switch that wakes the KV cache and comes back in the
    switch of the next sleep; its bytes are intact and training goes on."""
    torch, vm, allocator, backend = _setup()
    import vmstash
    trainer = Trainer(torch)
    rollout = Rollout(torch, allocator, trainer.master)
    allocator.exchange_with([trainer.tag], when_waking=("kv_cache",))
    for cycle in range(2):
        backend.suspend(level=1)
        trainer.step(hog_fraction=0.3)
        backend.resume(tags=["weights"])
        with torch.no_grad():
            for k, w in rollout.weights.items():
                w.copy_(trainer.master[k])
        state = _prints(torch, trainer.state())
        free_before = torch.cuda.mem_get_info()[0]
        backend.resume(tags=["kv_cache"])
        trainer_bytes = sum(t.nbytes for t in trainer.state())
        assert vmstash.tag_stats(trainer.tag)["state"] == "paused", "the trainer's state did not go out"
        rollout.run()
        free_rollout = torch.cuda.mem_get_info()[0]
        print(f"cycle {cycle}: free before the KV wake {free_before / GiB:.2f} GiB, during rollout "
              f"{free_rollout / GiB:.2f} GiB (trainer state {trainer_bytes / GiB:.2f} GiB out)")
        backend.suspend(level=1)  # the trainer's state comes back in this switch
        assert vmstash.tag_stats(trainer.tag)["state"] == "active"
        assert torch.equal(_prints(torch, trainer.state()), state), "the trainer's state changed"
    trainer.step()


def test_expandable_segments_stay_on():
    """With PyTorch's expandable segments on (CuMemAllocator turns them off around its
    pools), the tags' pools work, sleep frees their memory, a wake restores it, and
    PyTorch's own allocations keep using expandable segments."""
    torch, vm, allocator, backend = _setup()
    from vllm.device_allocator.alloc_conf import expandable_segments_enabled
    assert expandable_segments_enabled() is not False
    outside = torch.arange(1 << 20, device="cuda")
    with allocator.use_memory_pool("weights"):
        w = torch.arange(64 << 20, device="cuda", dtype=torch.int32)
    with allocator.use_memory_pool("kv_cache"):
        kv = torch.ones(256 << 20, device="cuda", dtype=torch.uint8)
    assert expandable_segments_enabled() is not False
    import vmstash
    asked = w.nbytes + kv.nbytes  # ints: an assertion never prints a paused tensor (its repr reads it)
    held = sum(vmstash.tag_stats(t)["reserved_bytes"]["current"] for t in ("vllm.weights", "vllm.kv_cache"))
    assert held >= asked, (held, asked)
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    backend.suspend(level=1)
    freed = torch.cuda.mem_get_info()[0] - free0
    left = sum(vmstash.tag_stats(t)["reserved_bytes"]["current"] for t in ("vllm.weights", "vllm.kv_cache"))
    assert left == 0, left  # every byte the tags held went back to the driver
    # The driver's free memory also moves with whatever else takes device memory meanwhile
    # (the pause's own stream and events, another process on the GPU: at 03955ed an H200's
    # sleep freed 2 MiB less than the tags held): the device-wide figure within 16 MiB.
    assert freed >= held - (16 << 20), (freed, held)
    grown = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")  # PyTorch's pool grows meanwhile
    del grown
    backend.resume()
    assert torch.equal(w, torch.arange(64 << 20, device="cuda", dtype=torch.int32))
    assert torch.equal(outside, torch.arange(1 << 20, device="cuda"))
    segments = [s for s in torch.cuda.memory._snapshot()["segments"] if s.get("segment_pool_id") == (0, 0)]
    assert any(s.get("is_expandable") for s in segments), "PyTorch's own segments are not expandable"
