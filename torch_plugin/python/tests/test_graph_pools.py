"""vmstash._torch.graph_pool (the torch_memory_saver drop-in's cuda_graph(pool=...)) without a
GPU: PyTorch stood in by a few names, so the choice of pool is tested alone — graphs given one
pool id share a pool, a graph given none gets one of its own, a graph given another graph's
pool() shares that one, an idle pool (its graphs gone) serves the next capture needing one,
and the tag's pause hint covers every pool of the tag."""
import contextlib
import gc
import itertools
import types

import pytest

from vmstash import _api, _torch


class _Graph:  # a CUDAGraph stand-in: weakly referable
    pass


@pytest.fixture
def fake_torch(monkeypatch):
    ids = itertools.count(1)

    class MemPool:
        def __init__(self, allocator=None):
            self.id = (0, next(ids))

        def snapshot(self, include_traces=False):
            return [{"address": 4096 * self.id[1], "total_size": 4096, "device": 0, "blocks": []}]

    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(MemPool=MemPool, current_device=lambda: 0,
                                                             device=lambda d: contextlib.nullcontext()))
    monkeypatch.setattr(_torch, "_torch_module", torch)
    monkeypatch.setattr(_torch, "_pools", {("gp", 0): MemPool()})
    monkeypatch.setattr(_torch, "_allocators", {"gp": types.SimpleNamespace(allocator=lambda: None)})
    monkeypatch.setattr(_torch, "_graph_pools", {})
    monkeypatch.setattr(_api, "policy_of", lambda tag: "discard")
    return torch


def test_graphs_given_one_pool_share_it_and_a_graph_given_none_has_its_own(fake_torch):
    handle = (0, 1000)  # torch.cuda.graph_pool_handle()
    keep = [_Graph() for _ in range(4)]
    a = _torch.graph_pool("gp", share=handle, graph=keep[0])
    assert _torch.graph_pool("gp", share=handle, graph=keep[1]) is a
    assert _torch.graph_pool("gp", share=a.id, graph=keep[2]) is a  # a graph's pool()
    own = _torch.graph_pool("gp", share=None, graph=keep[3])
    assert own is not a and own is not _torch._pools[("gp", 0)]
    primary = _torch._pools[("gp", 0)]
    assert _torch.graph_pool("gp", share=primary.id) is primary  # the tag's own pool
    assert _torch.graph_pool("gp", share=primary) is primary  # a MemPool given itself


def test_a_graph_given_an_earlier_private_graphs_pool_shares_it(fake_torch):
    first, second = _Graph(), _Graph()
    own = _torch.graph_pool("gp", graph=first)  # SGLang: the first capture without a pool,
    assert _torch.graph_pool("gp", share=own.id, graph=second) is own  # then its pool()


def test_an_idle_pool_serves_the_next_capture_that_needs_one(fake_torch):
    g = _Graph()
    own = _torch.graph_pool("gp", graph=g)
    busy = _Graph()
    other = _torch.graph_pool("gp", graph=busy)
    assert other is not own
    del g
    gc.collect()
    later = _Graph()
    assert _torch.graph_pool("gp", graph=later) is own, "its graph is gone: reused"
    fresh_handle = _torch.graph_pool("gp", share=(0, 2000), graph=busy)
    assert fresh_handle is not own and fresh_handle is not other  # nothing idle left: a new one


def test_a_graph_that_cannot_be_referred_to_weakly_keeps_its_pool_busy(fake_torch):
    own = _torch.graph_pool("gp", graph=object())
    gc.collect()
    assert _torch.graph_pool("gp", graph=_Graph()) is not own


def test_the_pause_hint_covers_every_pool_of_the_tag(fake_torch):
    keep = [_Graph(), _Graph()]
    pools = [_torch._pools[("gp", 0)], _torch.graph_pool("gp", graph=keep[0]),
             _torch.graph_pool("gp", share=(0, 3000), graph=keep[1])]
    hint = _torch.live_ranges("gp", 0)
    for mp in pools:  # each pool's segment (no live block) is no part of the hint
        start = 4096 * mp.id[1]
        assert not any(a <= start < a + n for a, n in hint), (mp.id, hint)
