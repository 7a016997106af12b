"""GPU tests of vmstash.stash with PyTorch (marker gpu, ctest label gpu), each in a fresh
process (conftest.py).

    python3 -m pytest -m gpu gpu_stash_scenarios.py [-k NAME]

Needs VMSTASH_LIBRARY (or an installed package), torch with CUDA and one GPU.
"""
import pytest

pytestmark = pytest.mark.gpu

P = 64


def test_round_trips():
    """Counts {0, 1, P-1, P, P+1, max} round-trip bit-exact from torch tensors (device
    row counts, torch's current stream), zero tail, released out of order; an int count."""
    import torch
    import vmstash

    dev = torch.device("cuda", 0)
    hidden, max_rows = 2048, 5 * P + 3
    arena = vmstash.stash.Arena(row_bytes=hidden * 2, device_pages=64, page_rows=P)
    x = torch.randn(max_rows, hidden, device=dev, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # a non-default current stream
        stashed = []
        for n in (0, 1, P - 1, P, P + 1, max_rows):
            stashed.append((n, arena.stash(x, torch.tensor([n], device=dev))))
        assert arena.pages_in_use() == sum((n + P - 1) // P for n in (0, 1, P - 1, P, P + 1, max_rows))
        for n, s in reversed(stashed):
            y = s.restore(zero_tail=True)
            assert torch.equal(y[:n], x[:n]), n
            assert not y[n:].any(), n
            assert s.restore() is y  # a second unpack returns the same tensor
        s = arena.stash(x, 7)
        s.discard()
    torch.cuda.synchronize()
    assert arena.pages_in_use() == 0
    f = arena.flags()
    assert not f.overflow and f.peak_device_pages > 0, f
    try:
        arena.stash(x[:, :100].contiguous(), 3)
        raise AssertionError("a tensor of another row size was accepted")
    except ValueError as e:
        assert "do not fit" in str(e)
    arena.close()
    print("round trips: ok")


def _mlp(x, w1, w2):
    import torch.nn.functional as F
    x = x.clone()  # an intermediate, as dispatched tokens are (leaves are never stashed)
    return F.linear(F.gelu(F.linear(x, w1)), w2)


def _close(ref, got, what):
    """Bit-exact is expected; cuBLAS may pick another algorithm under capture, so allow
    bf16 rounding (a misplaced or stale row would differ by far more). Returns exact."""
    import torch
    exact = True
    for r, g, name in zip(ref, got, ("x", "w1", "w2")):
        if torch.equal(r, g):
            continue
        exact = False
        diff = (r.float() - g.float()).abs().max().item()
        scale = r.float().abs().max().item()
        assert diff <= 2e-2 * max(scale, 1e-6), f"{what}: grad {name} differs by {diff} (max {scale})"
    return exact


def test_saved_tensors_gradients():
    """The saved_tensors helper keeps an expert MLP's activations in the arena between
    forward and backward: gradients equal the plain run's, torch holds less memory after
    forward, and every page comes back."""
    import torch
    import vmstash

    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    hidden, ffn, cap, n = 2048, 4096, 8192, 5000
    w1 = (torch.randn(ffn, hidden, device=dev, dtype=torch.bfloat16) / 45).requires_grad_()
    w2 = (torch.randn(hidden, ffn, device=dev, dtype=torch.bfloat16) / 64).requires_grad_()
    x = torch.zeros(cap, hidden, device=dev, dtype=torch.bfloat16)
    x[:n] = torch.randn(n, hidden, device=dev, dtype=torch.bfloat16)
    x.requires_grad_()
    gy = torch.zeros(cap, hidden, device=dev, dtype=torch.bfloat16)
    gy[:n] = torch.randn(n, hidden, device=dev, dtype=torch.bfloat16)

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    y = _mlp(x, w1, w2)
    plain_held = torch.cuda.memory_allocated() - base
    ref = torch.autograd.grad(y, [x, w1, w2], gy)
    del y

    arenas = [vmstash.stash.Arena(row_bytes=hidden * 2, device_pages=256),
              vmstash.stash.Arena(row_bytes=ffn * 2, device_pages=256)]
    rows = torch.tensor([n], device=dev)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with vmstash.stash.saved_tensors(arenas, max_rows=cap, rows=rows, zero_tail=True):
        y = _mlp(x, w1, w2)
    stash_held = torch.cuda.memory_allocated() - base
    used = sum(a.pages_in_use() for a in arenas)
    got = torch.autograd.grad(y, [x, w1, w2], gy)
    exact = _close(ref, got, "saved_tensors")
    assert all(a.pages_in_use() == 0 for a in arenas)
    print(f"saved_tensors: torch held {plain_held / 2**20:.1f} MiB after forward without the stash, "
          f"{stash_held / 2**20:.1f} MiB with it; {used} pages in the arenas; gradients "
          f"{'bit-exact' if exact else 'equal within bf16 rounding'}")
    assert stash_held < plain_held
    # A producer's predicate decides what is pageable: nothing here, so nothing is stashed.
    with vmstash.stash.saved_tensors(arenas, max_rows=cap, rows=rows, select=lambda t: False):
        y = _mlp(x, w1, w2)
    assert sum(a.pages_in_use() for a in arenas) == 0
    _close(ref, torch.autograd.grad(y, [x, w1, w2], gy), "select=False")
    for a in arenas:
        a.close()


def test_captured_graph_counts_overflow_pause():
    """Forward + backward of an expert MLP captured once with the stash (reset at the start
    of the graph), replayed with device counts {1, 4097, 0, max, 3333}, an overflow, then
    a clean replay: gradients equal eager each time. Then the idle arena is paused (its
    memory released) and resumed, and the same graph replays correctly."""
    import torch
    import vmstash

    torch.manual_seed(1)
    dev = torch.device("cuda", 0)
    hidden, ffn, cap = 1024, 2048, 8192
    w1 = (torch.randn(ffn, hidden, device=dev, dtype=torch.bfloat16) / 32).requires_grad_()
    w2 = (torch.randn(hidden, ffn, device=dev, dtype=torch.bfloat16) / 45).requires_grad_()
    x = torch.zeros(cap, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.zeros(cap, hidden, device=dev, dtype=torch.bfloat16)
    rows = torch.zeros(1, dtype=torch.int64, device=dev)
    pages = (6000 + P - 1) // P  # room for 6000 rows of each saved tensor: max (8192) overflows
    arenas = [vmstash.stash.Arena(row_bytes=hidden * 2, device_pages=pages),
              vmstash.stash.Arena(row_bytes=ffn * 2, device_pages=2 * pages)]  # gelu in and out
    for a in arenas:
        a.reserve_handles(4, cap)
    flags = torch.zeros(2, 48, dtype=torch.uint8, device=dev)

    def step():
        for a in arenas:
            a.reset()
        with vmstash.stash.saved_tensors(arenas, max_rows=cap, rows=rows, zero_tail=True):
            y = _mlp(x, w1, w2)
        grads = torch.autograd.grad(y, [x, w1, w2], gy)
        for i, a in enumerate(arenas):
            a.write_flags(flags[i])
        return grads

    def set_inputs(n, seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        with torch.no_grad():
            x.zero_()
            gy.zero_()
            x[:n] = torch.randn(n, hidden, device=dev, dtype=torch.bfloat16, generator=g)
            gy[:n] = torch.randn(n, hidden, device=dev, dtype=torch.bfloat16, generator=g)
        rows.fill_(n)

    set_inputs(100, 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_grads = step()

    def check(n, seed, expect_overflow=False):
        set_inputs(n, seed)
        graph.replay()
        torch.cuda.synchronize()
        overflow = bool(flags[:, 0].any().item())
        assert overflow == expect_overflow, (n, overflow)
        if expect_overflow:
            return
        ref = torch.autograd.grad(_mlp(x, w1, w2), [x, w1, w2], gy)
        exact.append(_close(ref, static_grads, f"n={n}"))

    exact = []

    for i, n in enumerate((1, 4097, 0, 6000, 3333)):
        check(n, i)
    check(cap, 9, expect_overflow=True)
    check(77, 10)
    print(f"captured graph: 5 counts, an overflow and a clean replay: gradients equal eager "
          f"({sum(exact)} of {len(exact)} replays bit-exact)")

    free_before = torch.cuda.mem_get_info()[0]
    vmstash.pause("stash")
    freed = torch.cuda.mem_get_info()[0] - free_before
    reserved = sum(a.info()["device_bytes"] for a in arenas)
    print(f"paused idle arenas: device free rose {freed / 2**20:.1f} MiB; arena pages {reserved / 2**20:.1f} MiB")
    assert freed >= 0.95 * reserved, (freed, reserved)
    vmstash.resume("stash")
    check(5000, 11)
    print("after pause/resume: the same graph replays correctly")
