"""vmstash.compat.megatron_training without a GPU or Megatron: what it refuses before moving
anything, which optimizers it finds in Megatron's wrappers, that steps and the global memory
buffer's allocations run inside their tags' regions, and what prepare_switch_out does.
Megatron's objects are small fakes with megatron-core 0.19.2's attribute names; regions are
recorded instead of entered (the GPU test, gpu_megatron_training.py, runs Megatron itself)."""
import contextlib
import sys
import types

import pytest

from vmstash import _torch
from vmstash.compat import megatron_training as M


@pytest.fixture
def regions(monkeypatch):
    """_torch.region recorded: the (tag, policy) of each region entered, in order; the tags
    open at each moment in `regions.open`."""
    entered, open_now = [], []

    @contextlib.contextmanager
    def region(tag, policy="discard", **kwargs):
        entered.append((tag, policy))
        open_now.append(tag)
        try:
            yield None
        finally:
            open_now.pop()

    monkeypatch.setattr(_torch, "region", region)
    return types.SimpleNamespace(entered=entered, open=open_now)


@pytest.fixture
def fake_torch(monkeypatch):
    calls = []
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(synchronize=lambda *a: calls.append("synchronize"),
                                       empty_cache=lambda: calls.append("empty_cache"),
                                       memory=types.SimpleNamespace(empty_host_cache=lambda: calls.append("host")))
    torch._C = types.SimpleNamespace()
    monkeypatch.setitem(sys.modules, "torch", torch)
    return calls


class Buffer:
    """_ParamAndGradBuffer's attributes that placement reads."""

    def __init__(self, **attrs):
        self.nccl_mem_pool, self.shared_buffer, self.extra_main_grads = None, None, []
        self.param_data, self.grad_data, self.calls = object(), object(), []
        self.__dict__.update(attrs)

    def offload_to_cpu(self, **kw):
        self.calls.append(("offload", kw))

    def reload_from_cpu(self, **kw):
        self.calls.append(("reload", kw))


def ddp_with(*buffers, expert=()):
    d = types.SimpleNamespace()
    d.buffers, d.expert_parallel_buffers = list(buffers), list(expert)
    return d


@pytest.mark.parametrize("attrs, says", [
    (dict(nccl_mem_pool=object()), "NCCL memory pool"),
    (dict(shared_buffer=object()), "shares one allocation"),
    (dict(extra_main_grads=[object()]), "fp32 accumulation"),
])
def test_unknown_layouts_are_refused_before_anything_moves(attrs, says, fake_torch):
    good, bad = Buffer(), Buffer(**attrs)
    with pytest.raises(ValueError, match=says):
        M.place_ddp_buffers([ddp_with(good), ddp_with(expert=[bad])])
    assert good.calls == [] and bad.calls == [] and fake_torch == []


def test_a_module_without_megatron_buffers_is_refused(fake_torch):
    class Module:  # nn.Module: buffers() is a method, not Megatron's list
        def buffers(self):
            return iter(())

    with pytest.raises(ValueError, match="no _ParamAndGradBuffer"):
        M.place_ddp_buffers([Module()])


def test_buffers_are_reloaded_inside_their_tags(regions, fake_torch, monkeypatch):
    moved = []

    class Sized(Buffer):
        def reload_from_cpu(self, **kw):
            moved.append((kw, list(regions.open)))
            super().reload_from_cpu(**kw)

    tensor = types.SimpleNamespace(numel=lambda: 8, element_size=lambda: 2)
    with_params = Sized(param_data=tensor, grad_data=tensor)
    grads_only = Sized(param_data=None, grad_data=tensor)
    monkeypatch.setattr(_torch, "open_regions", lambda: 0)
    out = M.place_ddp_buffers([ddp_with(with_params, grads_only)])
    assert out == {M.PARAMS_TAG: 16, M.GRADS_TAG: 32}
    assert moved == [({"move_params": False, "move_grads": True}, [M.GRADS_TAG]),
                     ({"move_params": True, "move_grads": False}, [M.PARAMS_TAG]),
                     ({"move_params": False, "move_grads": True}, [M.GRADS_TAG])]
    assert with_params.param_data_cpu is None  # the pinned host copy dropped
    assert fake_torch[-2:] == ["empty_cache", "host"]


def test_placement_refuses_to_run_inside_a_region(fake_torch, monkeypatch):
    monkeypatch.setattr(_torch, "open_regions", lambda: 1)
    with pytest.raises(RuntimeError, match="region is open"):
        M.place_ddp_buffers([ddp_with(Buffer())])


class TorchOptimizer:
    def __init__(self, name):
        self.name, self.steps, self.state = name, [], {}

    def step(self, *a, **k):
        self.steps.append(a)
        return self.name


class Wrapper:  # Megatron's DistributedOptimizer / Float16 optimizer: the torch one in .optimizer
    def __init__(self, inner):
        self.optimizer = inner

    def step(self):
        return self.optimizer.step()


class Chained:  # Megatron's ChainedOptimizer: .optimizer asserts a single member
    def __init__(self, members):
        self.chained_optimizers = members

    @property
    def optimizer(self):
        assert len(self.chained_optimizers) == 1, "not a single optimizer"
        return self.chained_optimizers[0].optimizer

    def step(self):
        return [o.step() for o in self.chained_optimizers]


def test_inner_optimizers_through_nested_chains():
    a, b, c = TorchOptimizer("a"), TorchOptimizer("b"), TorchOptimizer("c")
    opt = Chained([Wrapper(a), Chained([Wrapper(b), Wrapper(c)])])  # LayerWiseDistributedOptimizer's shape
    assert M._inner_optimizers(opt) == [a, b, c]
    assert M._inner_optimizers(a) == [a]


def test_steps_run_inside_the_optimizer_tag_once_wrapped(regions):
    a, b = TorchOptimizer("a"), TorchOptimizer("b")
    opt = Chained([Wrapper(a), Wrapper(b)])
    assert M.wrap_optimizer_steps(opt) == 2
    assert M.wrap_optimizer_steps(opt) == 0  # idempotent
    assert opt.step() == ["a", "b"]
    assert regions.entered == [(M.OPTIM_TAG, "backup")] * 2
    assert a.steps == [()] and b.steps == [()]


def test_the_global_memory_buffer_allocates_inside_its_tag(regions, monkeypatch):
    made = []

    class GlobalMemoryBuffer:  # megatron.core.utils.GlobalMemoryBuffer.get_tensor's signature
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            with (mem_alloc_context or contextlib.nullcontext)():
                made.append((tensor_shape, name, list(regions.open)))
            return "tensor"

    buf = GlobalMemoryBuffer()
    core = types.ModuleType("megatron.core")
    core.parallel_state = types.SimpleNamespace(get_global_memory_buffer=lambda: buf)
    monkeypatch.setitem(sys.modules, "megatron", types.ModuleType("megatron"))
    monkeypatch.setitem(sys.modules, "megatron.core", core)
    assert M.tag_global_memory_buffer() is buf
    assert M.tag_global_memory_buffer() is buf  # not wrapped twice
    assert buf.get_tensor((4, 4), "bf16", "mpu") == "tensor"
    assert made == [((4, 4), "mpu", [M.GMB_TAG])]
    assert regions.entered == [(M.GMB_TAG, "discard")]
    own = contextlib.nullcontext  # a caller's own context is kept
    buf.get_tensor((2,), "bf16", "mpu", mem_alloc_context=own)
    assert made[-1] == ((2,), "mpu", [])


def test_prepare_switch_out(fake_torch):
    calls = []
    opt = types.SimpleNamespace(zero_grad=lambda: calls.append("zero_grad"))

    def ddp(overlap):
        d = types.SimpleNamespace(ddp_config=types.SimpleNamespace(overlap_param_gather=overlap))
        d.start_param_sync = lambda **kw: calls.append(("param_sync", overlap, kw))
        return d

    M.prepare_switch_out([ddp(True), ddp(False)], opt)
    assert calls == ["zero_grad", ("param_sync", True, {"force_sync": True})]
    assert fake_torch == ["synchronize"]


def test_the_tag_lists():
    assert M.TRAINING_TAGS == M.TRAINING_STATE_TAGS + [M.GMB_TAG]
    assert M.GMB_TAG not in M.TRAINING_STATE_TAGS


def _rank_record(rank, **over):
    MiB = 1 << 20
    rec = dict(rank=rank, device="gpu", losses=["0x1.0p+0"] * 9, final=["h"] * 3, training_state_bytes=600 * MiB,
               nccl_and_warmup_bytes=MiB, rollout_used_over_baseline=[150 * MiB] * 2,
               rollout_tag_bytes=[100 * MiB] * 2, graph_vs_eager=[0.0, 0.0],
               switch_ms=[["params out", 10.0]] * 6)
    rec.update(over)
    return rec


def test_the_megatron_demo_judges_each_rank_against_its_twin():
    """vmstash.demo.megatron_training.judge: every check named per rank, none passing vacuously."""
    from vmstash.demo import megatron_training as demo
    MiB = 1 << 20
    twin = [_rank_record(0), _rank_record(1)]
    assert demo.judge([_rank_record(0), _rank_record(1)], twin) == []
    cases = [
        (dict(losses=["0x1.1p+0"] + ["0x1.0p+0"] * 8), "rank 1: losses differ"),
        (dict(final=["h", "h", "x"]), "rank 1: the final training state differs"),
        (dict(training_state_bytes=200 * MiB), "too small for the memory check"),
        (dict(rollout_used_over_baseline=[150 * MiB, 300 * MiB]), "during a rollout 300.0 MiB over the baseline"),
        (dict(graph_vs_eager=[0.0, 0.5]), "the decode graph differs from eager"),
        (dict(error="Traceback ...\nAssertionError: the training state moved\n"),
         "rank 1, switched job: AssertionError: the training state moved"),
    ]
    for over, says in cases:
        failures = demo.judge([_rank_record(0), _rank_record(1, **over)], twin)
        assert len(failures) == 1 and says in failures[0], (over, failures)
    broken_twin = [_rank_record(0), {"rank": 1, "error": "exited with -9 and no record"}]
    assert demo.judge([_rank_record(0), _rank_record(1)], broken_twin) == [
        "rank 1, twin job: exited with -9 and no record"]
    lines = demo.report([_rank_record(0)], [_rank_record(0)], 1)
    assert "rank 0 of 1" in lines[0] and "150.0, 150.0 MiB" in lines[1] and "10.0, 10.0" in lines[2], lines


def _failing_or_hanging_rank(rank, world, port, switch, cycles, steps, out):
    """A rank's process for run_job with Megatron's scenario replaced: rank 1 fails at once,
    the others wait forever, as a rank does in a collective whose peer died."""
    import time
    from vmstash.demo import megatron_training as demo

    def scenario(rank, *args):
        if rank == 1:
            raise AssertionError("the training state moved")
        while True:
            time.sleep(1)
    demo.scenario = scenario
    demo._rank_main(rank, world, port, switch, cycles, steps, out)


def _rank_that_hangs_after_its_record(rank, world, port, switch, cycles, steps, out):
    """A rank that wrote its record and then never ends (an interpreter teardown waiting)."""
    import json
    import os
    import time
    with open(os.path.join(out, f"{rank}.json.tmp"), "w") as f:  # written whole, as _rank_main does
        json.dump({"rank": rank, "losses": []}, f)
    os.replace(os.path.join(out, f"{rank}.json.tmp"), os.path.join(out, f"{rank}.json"))
    while True:
        time.sleep(1)


def test_the_megatron_demo_kills_the_other_ranks_once_one_failed(monkeypatch):
    """run_job: a rank that fails does not leave the others waiting for the whole timeout;
    each record says what happened (the failure, or why the rank was killed)."""
    import time
    from vmstash.demo import megatron_training as demo
    monkeypatch.setattr(demo, "_rank_main", _failing_or_hanging_rank)
    t0 = time.monotonic()
    records = demo.run_job(3, True, 1, 1, timeout=120, grace=1)
    assert time.monotonic() - t0 < 60
    assert [r["rank"] for r in records] == [0, 1, 2]
    assert records[1]["error"].strip().splitlines()[-1] == "AssertionError: the training state moved"
    assert records[0]["error"] == records[2]["error"] == "killed 1 s after another rank failed"
    records = demo.run_job(1, True, 1, 1, timeout=2, grace=1)  # one rank that only waits
    assert records == [{"rank": 0, "error": "killed after the 2 s timeout"}]
    monkeypatch.setattr(demo, "_rank_main", _rank_that_hangs_after_its_record)
    t0 = time.monotonic()
    assert demo.run_job(2, True, 1, 1, timeout=120, grace=1) == [{"rank": 0, "losses": []},
                                                                 {"rank": 1, "losses": []}]
    assert time.monotonic() - t0 < 60  # done once every record was written, not at the timeout
