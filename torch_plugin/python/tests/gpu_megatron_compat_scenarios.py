"""vmstash.compat.megatron on the GPU, driven through megatron-core's own classes (label gpu).

Megatron's PagedStashBuffer / PagedTensor.offload_to_stash / reload_from_stash and its
manager's allocate_stash_buffers / release_stash_buffers, with vmstash.compat.megatron
installed; every reloaded tensor is compared with its input. Also the stash's torch.library
operators under torch.compile. Needs torch with CUDA, triton and megatron-core importable
(pure Python: pip install --no-deps megatron-core==0.19.2) and vmstash (VMSTASH_LIBRARY or
an installed package). Without megatron-core the tests fail, or skip where
VMSTASH_ALLOW_NO_MEGATRON=1. Marker gpu, ctest label gpu; each test in a fresh process
(conftest.py):

    python3 -m pytest -m gpu gpu_megatron_compat_scenarios.py [-k NAME]
"""
import os

import pytest

try:
    import torch
except ImportError:  # collected where torch is not: the tests skip before they run (conftest.py)
    torch = None

import vmstash  # noqa: F401  (as a user imports it first)

pytestmark = pytest.mark.gpu

P = 64


def _megatron_missing():
    """Why megatron-core cannot be imported here, or None."""
    try:
        import megatron.core.transformer.moe.paged_stash  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def _skip_without_megatron_if_allowed():
    """Without megatron-core importable, the file's tests skip where VMSTASH_ALLOW_NO_MEGATRON=1
    (and fail on the import otherwise)."""
    if os.environ.get("VMSTASH_ALLOW_NO_MEGATRON") == "1":
        missing = _megatron_missing()
        if missing:
            pytest.skip(f"megatron-core not importable ({missing})")


def _megatron():
    _skip_without_megatron_if_allowed()
    from megatron.core.transformer.moe import paged_stash
    import vmstash.compat.megatron as vm_megatron
    vm_megatron.install()
    return paged_stash, vm_megatron


def _flags(dev):
    return torch.zeros(1, dtype=torch.int64, device=dev), torch.zeros(1, dtype=torch.int64, device=dev)


def _paged(m, src, n, max_tokens, hidden, scale=False):
    n_t = torch.tensor([n], dtype=torch.int64, device=src.device)
    t = src.reshape(-1)
    t.grouped_tensor_scale_inv = scale
    return m.PagedTensor(t, num_tokens_tensor=n_t, max_num_tokens=max_tokens, hidden_size=hidden, page_size=P,
                         is_columnwise_scale_inv=scale)


def _reload(pt, buf, fill=7):
    pt._tensor = torch.full(pt.original_shape, fill, dtype=torch.uint8, device=pt.device).view(pt.dtype) \
        if pt.dtype.itemsize == 1 else torch.full(pt.original_shape, fill, dtype=pt.dtype, device=pt.device)
    pt.reload_from_stash(buf)
    return pt._tensor


def _same(out, src, rows, hidden):
    a = out.reshape(-1).view(torch.uint8) if out.dtype.itemsize == 1 else out.reshape(-1)
    b = src.reshape(-1).view(torch.uint8) if src.dtype.itemsize == 1 else src.reshape(-1)
    return torch.equal(a[:rows * hidden], b[:rows * hidden])


def test_round_trips_bf16_fp8_and_mxfp8_scales():
    m, vm = _megatron()
    dev = torch.device("cuda", 0)
    overflow, spill = _flags(dev)
    M, H = 4096, 1024
    bf16 = m.PagedStashBuffer(2 * M, H, P, dev, overflow, spill, torch.bfloat16)
    assert isinstance(bf16, vm.PagedStashBuffer), type(bf16)
    fp8 = m.PagedStashBuffer(2 * M, 2 * H, P, dev, overflow, spill, torch.uint8)
    scales = m.PagedStashBuffer(2 * M // 32, 2 * H // 32, P, dev, overflow, spill, torch.uint8)
    checked = 0
    for n in (0, 1, 63, 64, 65, 1000, M):
        x = torch.randn(M, H, dtype=torch.bfloat16, device=dev)
        q = torch.randint(0, 255, (M, 2 * H), dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
        s = torch.randint(0, 255, (M // 32, 2 * H // 32), dtype=torch.uint8, device=dev)
        pts = [(_paged(m, x, n, M, H), bf16, x, n, H),
               (_paged(m, q, n, M, 2 * H), fp8, q, n, 2 * H),
               (_paged(m, s, n, M, 2 * H // 32, scale=True), scales, s, n // 32, 2 * H // 32)]
        for pt, buf, _, _, _ in pts:
            pt.offload_to_stash(buf)
            assert pt._tensor is None and pt._original_tensor is not None
        for pt, buf, src, rows, hidden in pts:
            out = _reload(pt, buf)
            assert _same(out, src, rows, hidden), (n, buf)
            checked += 1
    torch.cuda.synchronize()
    assert int(overflow.item()) == 0 and int(spill.item()) == 0
    print(f"round trips: {checked} Megatron PagedTensors (bf16, fp8 as uint8, MXFP8 scales at tokens // 32; "
          f"n = 0 .. {M}) reloaded bit-equal")


def test_host_spill_overflow_and_reset_semantics():
    m, vm = _megatron()
    dev = torch.device("cuda", 0)
    overflow, spill = _flags(dev)
    M, H = 512, 256
    a = m.PagedStashBuffer(M, H, P, dev, overflow, spill, torch.bfloat16, num_tokens_host=M)
    b = m.PagedStashBuffer(4 * M, 2 * H, P, dev, overflow, spill, torch.bfloat16)
    xs = [torch.randn(M, H, dtype=torch.bfloat16, device=dev) for _ in range(3)]
    y = torch.randn(M, 2 * H, dtype=torch.bfloat16, device=dev)
    p0, p1 = _paged(m, xs[0], M, M, H), _paged(m, xs[1], M, M, H)
    p0.offload_to_stash(a)            # the device tier, full
    p1.offload_to_stash(a)            # the pinned host tier
    torch.cuda.synchronize()
    assert int(spill.item()) == 1 and int(overflow.item()) == 0
    assert _same(_reload(p1, a), xs[1], M, H) and _same(_reload(p0, a), xs[0], M, H)
    # Fill both tiers, then one more: the shared overflow is set ...
    p0, p1, p2 = (_paged(m, x, M, M, H) for x in xs)
    p0.offload_to_stash(a)
    p1.offload_to_stash(a)
    q = _paged(m, y, M, M, 2 * H)
    q.offload_to_stash(b)             # placed before the overflow
    p2.offload_to_stash(a)            # no room anywhere
    torch.cuda.synchronize()
    assert int(overflow.item()) == 1
    # ... and every later stash and reload of every buffer is a no-op, as in Megatron.
    late = _paged(m, y, M, M, 2 * H)
    late.offload_to_stash(b)
    assert b.arena.pages_in_use() == M // P, b.arena.pages_in_use()  # only q's pages
    out = _reload(q, b, fill=3)
    torch.cuda.synchronize()
    assert bool((out == 3).all()), "a reload after the overflow wrote data"
    for pt in (p0, p1, p2, late):
        _reload(pt, a if pt is not late else b)
    # Megatron's reset: each buffer's reset(), then overflow / host_spill zeroed.
    for buf in (a, b):
        buf.reset()
    overflow.zero_()
    spill.zero_()
    r = _paged(m, y, 100, M, 2 * H)
    r.offload_to_stash(b)
    assert _same(_reload(r, b), y, 100, 2 * H)
    torch.cuda.synchronize()
    assert int(overflow.item()) == 0
    print("host spill sets the shared host_spill flag and reloads bit-equal; an overflow in one buffer makes the "
          "other buffer's stash and reload no-ops until Megatron's reset; then all works again")


def test_manager_allocate_capture_release():
    """The manager's own allocate_stash_buffers (handles reserved from the measuring
    iteration's count), a CUDA graph of offloads and reloads replayed with other counts,
    then release_stash_buffers: memory returned, the same graph valid after the reset."""
    m, vm = _megatron()
    dev = torch.device("cuda", 0)
    mgr = m.PagedStashManager.get_instance()
    M, H, L = 2048, 1024, 4
    mgr.device = dev
    mgr.page_size = P
    mgr.vp_size = 1
    mgr.status = "capture"  # the measuring iteration: Megatron makes its PagedTensors eagerly
    n_t = torch.tensor([M], dtype=torch.int64, device=dev)
    for _ in range(L):
        m.PagedTensor(torch.empty(M * H, dtype=torch.bfloat16, device=dev), num_tokens_tensor=n_t, max_num_tokens=M,
                      hidden_size=H, page_size=P)
    mgr.max_tokens_across_vp_stages = {(torch.bfloat16, H): L * M}
    mgr.max_avg_tokens_across_vp_stages = {(torch.bfloat16, H): L * M}
    mgr.status = "captured"
    mgr.allocate_stash_buffers(1.0, 0.0)
    buf = mgr.stash_buffers[torch.bfloat16][H]
    assert isinstance(buf, vm.PagedStashBuffer)
    xs = [torch.randn(M, H, dtype=torch.bfloat16, device=dev) for _ in range(L)]
    counts = torch.tensor([M], dtype=torch.int64, device=dev)
    outs = [torch.empty(M, H, dtype=torch.bfloat16, device=dev) for _ in range(L)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())

    def step():
        buf.reset()
        pts = [m.PagedTensor(x.reshape(-1), num_tokens_tensor=counts, max_num_tokens=M, hidden_size=H, page_size=P)
               for x in xs]
        for pt in pts:
            pt.offload_to_stash(buf)
        for pt, o in zip(pts, outs):
            pt._tensor = o.reshape(-1)
            pt.reload_from_stash(buf)

    with torch.cuda.stream(stream):
        step()  # warm-up, eager
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):  # no handle is made during the capture: reserved ahead
        step()

    def replay_and_check(n):
        counts.fill_(n)
        for o in outs:
            o.fill_(0)
        g.replay()
        torch.cuda.synchronize()
        return all(torch.equal(o[:n], x[:n]) for o, x in zip(outs, xs)) and int(mgr.overflow.item()) == 0

    assert all(replay_and_check(n) for n in (M, 1, 700, 0, 1999))
    free0 = torch.cuda.mem_get_info()[0]
    mgr.release_stash_buffers()
    freed = torch.cuda.mem_get_info()[0] - free0
    pages = buf.arena.info()["device_bytes"]
    assert freed >= 0.9 * pages, (freed, pages)
    assert mgr.stash_buffers is not None and mgr.stash_buffers[torch.bfloat16][H] is buf
    m.paged_stash_reset(enabled=True)  # Megatron's next iteration: resets the buffers (resume)
    assert replay_and_check(1234)
    print(f"manager: allocate_stash_buffers reserved handles for {L} paged tensors; a graph of {L} offloads and "
          f"reloads replayed bit-equal at 5 counts; release_stash_buffers returned {freed / 2**20:.0f} MiB "
          f"({pages / 2**20:.0f} MiB of pages) and the same graph replayed bit-equal after paged_stash_reset")


def test_torch_compile_custom_ops():
    _skip_without_megatron_if_allowed()  # as the whole file did
    from vmstash import stash
    dev = torch.device("cuda", 0)
    arena = stash.Arena(row_bytes=512 * 4, device_pages=64, tag="compile_stash")

    def f(x, rows):
        token = arena.stash_op(x * 2, rows)
        y = torch.relu(x) + 1
        back = arena.restore_op(token, x.shape, x.dtype)
        return back * y

    # float32: with bf16, inductor's fusion rounds (relu(x) + 1) * back once where eager
    # rounds twice, which differs in the last bit for reasons that have nothing to do with
    # the stash; in float32 both compute each element the same way.
    x = torch.randn(1000, 512, dtype=torch.float32, device=dev)
    compiled = torch.compile(f, fullgraph=True)
    for n in (1000, 333, 0):
        rows = torch.tensor([n], dtype=torch.int64, device=dev)
        want = f(x, rows)
        got = compiled(x, rows)
        expect = torch.cat([(x * 2 * (torch.relu(x) + 1))[:n], torch.zeros_like(x[n:])])  # rows past n: zeroed
        assert torch.equal(want, expect), n
        assert torch.equal(want, got), n
    assert arena.pages_in_use() == 0
    print("torch.compile(fullgraph=True) of a function that stashes and restores through torch.ops.vmstash: "
          "bit-equal to eager at 3 row counts")
