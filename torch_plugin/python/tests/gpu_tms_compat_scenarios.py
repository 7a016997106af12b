"""vmstash.compat.torch_memory_saver on a GPU (label gpu): the scenarios torch_memory_saver's
own examples cover (simple, cuda_graph, rl_example, cpu_backup, nested regions,
training_engine); marker gpu, ctest label gpu; each in a fresh process (conftest.py).

    python3 -m pytest -m gpu gpu_tms_compat_scenarios.py [-k NAME]
"""
import pytest

pytestmark = pytest.mark.gpu

GiB = 1 << 30
MiB = 1 << 20


def _tms():
    from vmstash.compat.torch_memory_saver import torch_memory_saver
    return torch_memory_saver


def _free():
    import torch
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_simple():
    import torch
    tms = _tms()
    with tms.region(tag="kv_cache"):
        kv = torch.full((1 * GiB // 4,), 100.0, device="cuda")
    free0 = _free()
    tms.pause("kv_cache")
    assert _free() - free0 >= 0.95 * GiB, (_free() - free0)
    tms.resume("kv_cache")
    kv.fill_(7.0)
    assert kv.sum().item() == 7.0 * kv.numel()
    print("simple: OK")


def test_cuda_graph():
    import torch
    tms = _tms()
    with tms.region(tag="weights", enable_cpu_backup=True):
        w = torch.randn(2048, 2048, device="cuda")
    x = torch.randn(8, 2048, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        (x @ w).tanh()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with tms.cuda_graph(cuda_graph=g, tag="cuda_graph", enable_cpu_backup=True):
        y = (x @ w).tanh()
    g.replay()
    torch.cuda.synchronize()
    expected = y.clone()
    free0 = _free()
    tms.pause()
    assert _free() > free0
    tms.resume()
    y.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, expected)
    print("cuda_graph: OK")


def test_rl_example():
    import torch
    tms = _tms()
    with tms.region(tag="weights", enable_cpu_backup=True):
        w = torch.randn(4096, 4096, device="cuda")
    with tms.region(tag="kv_cache"):
        kv = torch.zeros(512 * MiB // 4, device="cuda")
    ref = w.sum().item()
    for step in range(3):
        kv.fill_(step)  # rollout
        assert kv[-1].item() == step
        tms.pause()
        big = torch.ones(GiB // 4, device="cuda")  # training
        assert big.sum().item() == big.numel()
        del big
        torch.cuda.empty_cache()
        tms.resume()
        assert w.sum().item() == ref
    print("rl_example: 3 cycles OK")


def test_cpu_backup():
    import torch
    tms = _tms()
    with tms.region(tag="a", enable_cpu_backup=True):
        kept = torch.full((16 * MiB // 4,), 10.0, device="cuda")
    with tms.region(tag="b", enable_cpu_backup=False):
        dropped = torch.full((16 * MiB // 4,), 20.0, device="cuda")
    tms.pause()
    backup = tms.get_cpu_backup(kept)
    assert backup is not None and torch.equal(backup, torch.full_like(backup, 10.0))
    assert tms.get_cpu_backup(dropped) is None
    tms.resume()
    assert tms.get_cpu_backup(kept) is None
    assert torch.all(kept == 10.0)
    assert not torch.all(dropped == 20.0)  # not backed up: not silently kept
    print("cpu_backup: OK")


def test_nested_regions():
    import torch
    tms = _tms()
    with tms.region(tag="outer", enable_cpu_backup=True):
        a = torch.full((4 * MiB,), 1.0, device="cuda")
        with tms.region(tag="inner"):
            b = torch.full((4 * MiB,), 2.0, device="cuda")
        c = torch.full((4 * MiB,), 3.0, device="cuda")
    tms.pause("inner")
    assert torch.all(a == 1.0) and torch.all(c == 3.0)  # outer stays usable
    tms.resume("inner")
    b.fill_(5.0)
    assert torch.all(b == 5.0)
    tms.pause("outer")
    tms.resume("outer")
    assert torch.all(a == 1.0) and torch.all(c == 3.0)
    print("nested_regions: OK")


def test_training_engine():
    import torch
    tms = _tms()
    free_initial = _free()
    with tms.region(tag="train", enable_cpu_backup=True):
        weights = [torch.randn(n, device="cuda") for n in (GiB // 4, MiB // 4, 256, 42)]
        acts = torch.empty(4 * GiB // 4, device="cuda")
    del acts
    sums = [w.sum().item() for w in weights]
    tms.pause()
    assert _free() >= free_initial - 200 * MiB, (free_initial - _free()) / MiB
    with tms.disable():
        before = _free()
        x = torch.ones(GiB // 4, device="cuda")
        assert x.sum().item() == x.numel()
        del x
    torch.cuda.empty_cache()
    assert abs(_free() - before) <= 10 * MiB, (_free() - before) / MiB
    tms.resume()
    assert [w.sum().item() for w in weights] == sums
    print("training_engine: OK")
