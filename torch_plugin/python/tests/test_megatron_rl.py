"""vmstash.compat.megatron.rl without a GPU or Megatron (Note [Megatron-RL Offload]): install()
wraps get_megatron_optimizer where Megatron looks it up (megatron.core.optimizer and the name
megatron.training.training imported), and the RL loop's offload calls then pause and resume
the tags for what it placed and only for that: a model and optimizer built before install(),
or a layout placement refuses, keep Megatron's own methods; chained children and second
model chunks find the tag already paused; restore zeroes the gradients; uninstall puts every
name back. Megatron's classes are small fakes with megatron-core 0.19.2's names; the tags'
pauses are recorded (the GPU test, gpu_megatron_rl.py, runs Megatron itself)."""
import sys
import types

import pytest

from vmstash import _api
from vmstash.compat import megatron_training as M


class Buffer:
    def __init__(self):
        self.nccl_mem_pool, self.shared_buffer, self.extra_main_grads = None, None, []
        self.param_data = None
        self.grad_data = types.SimpleNamespace(zeroed=0)
        self.grad_data.zero_ = lambda g=self.grad_data: setattr(g, "zeroed", g.zeroed + 1)


@pytest.fixture
def megatron(monkeypatch):
    """megatron.core.{distributed, optimizer(.optimizer)} and megatron.training.training as
    fakes; `calls` records what Megatron's own methods did and what vmstash paused."""
    calls = []

    class DistributedDataParallel:
        def __init__(self, *buffers):
            self.buffers, self.expert_parallel_buffers = list(buffers), []

        def offload_grad_buffers(self, synchronize=True, empty_cache=True):
            calls.append(("megatron offload_grad_buffers", id(self)))

        def restore_grad_buffers(self, synchronize=True):
            calls.append(("megatron restore_grad_buffers", id(self)))

    class MegatronOptimizer:
        def offload_to_cpu(self):
            calls.append(("megatron offload_to_cpu", id(self)))

        def restore_from_cpu(self):
            calls.append(("megatron restore_from_cpu", id(self)))

    class DistributedOptimizer(MegatronOptimizer):
        def step(self):
            pass

    class ChainedOptimizer(MegatronOptimizer):
        def __init__(self, children):
            self.chained_optimizers = children

        def offload_to_cpu(self):
            for o in self.chained_optimizers:
                o.offload_to_cpu()

        def restore_from_cpu(self):
            for o in self.chained_optimizers:
                o.restore_from_cpu()

    def get_megatron_optimizer(config, model_chunks, *args, **kwargs):
        calls.append(("megatron get_megatron_optimizer", len(model_chunks)))
        return ChainedOptimizer([DistributedOptimizer(), DistributedOptimizer()])

    optimizer_mod = types.ModuleType("megatron.core.optimizer.optimizer")
    optimizer_mod.MegatronOptimizer, optimizer_mod.ChainedOptimizer = MegatronOptimizer, ChainedOptimizer
    core_optimizer = types.ModuleType("megatron.core.optimizer")
    core_optimizer.get_megatron_optimizer, core_optimizer.optimizer = get_megatron_optimizer, optimizer_mod
    distributed = types.ModuleType("megatron.core.distributed")
    distributed.DistributedDataParallel = DistributedDataParallel
    training = types.ModuleType("megatron.training.training")
    training.get_megatron_optimizer = get_megatron_optimizer
    for name, mod in {"megatron": types.ModuleType("megatron"), "megatron.core": types.ModuleType("megatron.core"),
                      "megatron.core.optimizer": core_optimizer, "megatron.core.optimizer.optimizer": optimizer_mod,
                      "megatron.core.distributed": distributed, "megatron.training": types.ModuleType("x"),
                      "megatron.training.training": training}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(synchronize=lambda *a: None, empty_cache=lambda: calls.append("empty_cache"))
    monkeypatch.setitem(sys.modules, "torch", torch)

    states = {}
    monkeypatch.setattr(_api, "create_tag", lambda tag, policy="discard": states.setdefault(tag, "active"))
    monkeypatch.setattr(_api, "tag_stats", lambda tag, device=None: {"state": states[tag]} if tag in states else None)

    def pause(tag, device=None):
        assert states[tag] == "active"
        states[tag] = "paused"
        calls.append(("pause", tag))

    def resume(tag, device=None):
        assert states[tag] == "paused"
        states[tag] = "active"
        calls.append(("resume", tag))

    monkeypatch.setattr(_api, "pause", pause)
    monkeypatch.setattr(_api, "resume", resume)
    placed = []

    def place_training_state(ddps, make):
        placed.append(list(ddps))
        return make()

    monkeypatch.setattr(M, "place_training_state", place_training_state)
    import vmstash.compat.megatron.rl as rl
    yield types.SimpleNamespace(rl=rl, calls=calls, placed=placed, DDP=DistributedDataParallel, training=training,
                                core=core_optimizer, ChainedOptimizer=ChainedOptimizer,
                                MegatronOptimizer=MegatronOptimizer, originals=dict(
                                    get=get_megatron_optimizer,
                                    ddp=(DistributedDataParallel.offload_grad_buffers,
                                         DistributedDataParallel.restore_grad_buffers),
                                    opt=(MegatronOptimizer.offload_to_cpu, ChainedOptimizer.offload_to_cpu)))
    rl.uninstall()


def test_the_rl_loops_calls_pause_and_resume_what_install_placed(megatron):
    m = megatron
    before_model = m.DDP(Buffer())
    before_opt = m.core.get_megatron_optimizer(None, [before_model])  # built before install: Megatron's
    m.rl.install()
    m.rl.install()  # idempotent
    assert m.training.get_megatron_optimizer is m.core.get_megatron_optimizer  # both names wrapped
    b0, b1 = Buffer(), Buffer()
    chunks = [m.DDP(b0), m.DDP(b1)]  # two model chunks (virtual pipeline stages)
    opt = m.training.get_megatron_optimizer("config", chunks)  # as setup_model_and_optimizer calls it
    assert m.placed == [chunks] and m.rl.placed(chunks[1]) and m.rl.placed(opt.chained_optimizers[0])
    m.calls.clear()
    # The RL loop's order (rl_utils.get_environment_rollouts, then get_grpo_data_iterator)
    chunks[0].offload_grad_buffers()
    opt.offload_to_cpu()
    chunks[1].offload_grad_buffers()  # the tag is paused already: nothing more
    opt.chained_optimizers[1].offload_to_cpu()
    assert m.calls == [("pause", M.GRADS_TAG), "empty_cache", ("pause", M.OPTIM_TAG), "empty_cache"], m.calls
    m.calls.clear()
    chunks[0].restore_grad_buffers()
    opt.restore_from_cpu()
    assert m.calls == [("resume", M.GRADS_TAG), ("resume", M.OPTIM_TAG)], m.calls
    assert b0.grad_data.zeroed == 1 and b1.grad_data.zeroed == 1  # every placed model's gradients
    m.calls.clear()
    before_model.offload_grad_buffers()
    before_opt.offload_to_cpu()  # Megatron's own, through each child
    assert m.calls[0] == ("megatron offload_grad_buffers", id(before_model))
    assert [c[0] for c in m.calls[1:]] == ["megatron offload_to_cpu"] * 2, m.calls


def test_a_layout_placement_refuses_keeps_megatrons_own_offload(megatron, caplog):
    m = megatron
    m.rl.install()
    refused = Buffer()
    refused.nccl_mem_pool = object()  # Megatron's NCCL memory pool (nccl_ub)
    model = m.DDP(refused)
    with caplog.at_level("WARNING", logger="vmstash.compat.megatron.rl"):
        opt = m.core.get_megatron_optimizer(None, [model])
    assert "stays Megatron's" in caplog.text and "nccl_ub" in caplog.text
    assert not m.rl.placed(model) and not m.rl.placed(opt)
    assert m.placed == [] and [c for c in m.calls if c[0] == "megatron get_megatron_optimizer"] == \
        [("megatron get_megatron_optimizer", 1)]  # built once, by Megatron
    m.calls.clear()
    model.offload_grad_buffers()
    opt.offload_to_cpu()
    assert [c[0] for c in m.calls] == ["megatron offload_grad_buffers"] + ["megatron offload_to_cpu"] * 2, m.calls
    # A model without Megatron's buffers (not DDP-wrapped) is built as Megatron builds it.
    assert m.core.get_megatron_optimizer(None, [types.SimpleNamespace()]) is not None


def test_megatrons_own_build_failing_is_raised_once_and_not_retried(megatron, monkeypatch):
    """A config error of Megatron's (a ValueError from get_megatron_optimizer) reaches the
    caller as it is; the optimizer is not built a second time."""
    m = megatron
    m.rl.install()

    def place(ddps, make):
        m.placed.append(list(ddps))
        return make()

    def bad_config(config, model_chunks, *args, **kwargs):
        m.calls.append(("megatron get_megatron_optimizer", len(model_chunks)))
        raise ValueError("Invalid optimizer type")

    monkeypatch.setattr(M, "place_training_state", place)
    wrapped = m.rl._make_get_megatron_optimizer(bad_config)
    with pytest.raises(ValueError, match="Invalid optimizer"):
        wrapped(None, [m.DDP(Buffer())])
    assert [c for c in m.calls if c[0] == "megatron get_megatron_optimizer"] == [("megatron get_megatron_optimizer", 1)]


def test_restore_zeroes_only_after_an_offload(megatron):
    m = megatron
    m.rl.install()
    b = Buffer()
    model = m.DDP(b)
    m.core.get_megatron_optimizer(None, [model])
    model.restore_grad_buffers()  # nothing offloaded: the gradients are left alone
    assert b.grad_data.zeroed == 0
    model.offload_grad_buffers()
    model.restore_grad_buffers()
    model.restore_grad_buffers()
    assert b.grad_data.zeroed == 1


def test_an_install_that_fails_half_way_leaves_nothing_installed(megatron, monkeypatch):
    m = megatron

    def broken(owner, name, make):
        if name == "restore_grad_buffers":
            raise AttributeError("restore_grad_buffers moved")
        m.rl._originals[(owner, name)] = (vars(owner).get(name), getattr(owner, name))
        setattr(owner, name, make(getattr(owner, name)))

    monkeypatch.setattr(m.rl, "_patch", broken)
    with pytest.raises(AttributeError):
        m.rl.install()
    assert not m.rl.installed()
    assert m.core.get_megatron_optimizer is m.originals["get"]
    assert m.DDP.offload_grad_buffers is m.originals["ddp"][0]


def test_uninstall_puts_every_name_back(megatron):
    m = megatron
    m.rl.install()
    assert m.core.get_megatron_optimizer is not m.originals["get"]
    m.rl.uninstall()
    assert not m.rl.installed()
    assert m.core.get_megatron_optimizer is m.originals["get"] and m.training.get_megatron_optimizer is m.originals["get"]
    assert (m.DDP.offload_grad_buffers, m.DDP.restore_grad_buffers) == m.originals["ddp"]
    assert (m.MegatronOptimizer.offload_to_cpu, m.ChainedOptimizer.offload_to_cpu) == m.originals["opt"]
