"""GPU tests of the vmstash package with PyTorch (marker gpu, ctest label gpu), each in a
fresh process (conftest.py).

    python3 -m pytest -m gpu gpu_torch_scenarios.py [-k NAME]
    python3 gpu_torch_scenarios.py NAME...   # the named scenarios in this process, no child

Needs VMSTASH_LIBRARY (or an installed package), torch with CUDA and one GPU; the preload_*
tests run with LD_PRELOAD=libvmstash_preload.so (child_env below).
"""
import os
import sys
import time

import pytest

pytestmark = pytest.mark.gpu

GiB = 1 << 30


def _tag_reserved(vmstash, tags, device=0):
    total = 0
    for t in vmstash.stats(device)["tags"]:
        if t["name"] in tags:
            total += t["reserved_bytes"]["current"]
    return total


def test_inference_graph():
    """A decode-style graph reading weights (backup) and a KV cache (discard) survives a
    pause, a training phase using >= 50% of the GPU, and a resume: bit-exact, same addresses."""
    import torch
    import vmstash

    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    with vmstash.region("weights", policy="backup"):
        w1 = torch.randn(8192, 8192, device=dev) / 90  # 256 MiB each
        w2 = torch.randn(8192, 8192, device=dev) / 90
        norm = torch.rand(8192, device=dev) + 0.5
    with vmstash.region("kv_cache"):
        kv = torch.empty(2 * GiB // 4 // 8192, 8192, device=dev)  # 2 GiB
    kv_init = lambda: kv.copy_(torch.arange(kv.numel(), device=dev, dtype=torch.float32).view_as(kv) % 977 / 977)
    kv_init()
    x = torch.randn(16, 8192, device=dev)
    rows = torch.arange(0, kv.shape[0], kv.shape[0] // 16, device=dev)[:16]

    def step():
        h = (x @ w1).relu() * norm
        return h @ w2 + kv.index_select(0, rows)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with vmstash.cuda_graph(graph, tag="cuda_graph"):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    expected = out.clone()
    eager = step()
    assert torch.allclose(expected, eager, rtol=1e-3, atol=1e-3), (expected - eager).abs().max()
    w1_host = w1.cpu()
    addresses = (w1.data_ptr(), w2.data_ptr(), kv.data_ptr(), out.data_ptr())

    tags = ("weights", "kv_cache", "cuda_graph")
    reserved = _tag_reserved(vmstash, tags)
    torch.cuda.synchronize()
    free_before, total = torch.cuda.mem_get_info()
    t0 = time.perf_counter()
    for t in tags:
        assert vmstash.pause(t), t
    t1 = time.perf_counter()
    free_paused, _ = torch.cuda.mem_get_info()
    released = free_paused - free_before
    assert released >= 0.95 * reserved, (released, reserved)
    # "Training": PyTorch's own allocator takes >= 50% of the GPU and computes with it.
    n = int(0.55 * total) // 4
    big = torch.ones(n, device=dev)
    big.mul_(2)
    assert big[-1].item() == 2.0
    del big
    torch.cuda.empty_cache()
    t2 = time.perf_counter()
    for t in reversed(tags):
        assert vmstash.resume(t), t
    t3 = time.perf_counter()
    kv_init()  # discard: the KV cache is refilled after resume
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected), (out - expected).abs().max()
    assert torch.equal(w1.cpu(), w1_host)
    assert addresses == (w1.data_ptr(), w2.data_ptr(), kv.data_ptr(), out.data_ptr())
    s = {t["name"]: t for t in vmstash.stats(0)["tags"]}
    print(f"inference_graph: paused {reserved / GiB:.2f} GiB reserved, device free rose {released / GiB:.2f} GiB; "
          f"pause {1e3 * (t1 - t0):.1f} ms, resume {1e3 * (t3 - t2):.1f} ms; weights backed up "
          f"{s['weights']['last_pause_gib_per_s']:.1f} GiB/s pause, {s['weights']['last_resume_gib_per_s']:.1f} "
          f"GiB/s resume; cuda_graph tag {s['cuda_graph']['reserved_bytes']['current'] / (1 << 20):.0f} MiB")


def test_resume_out_of_memory():
    """OOM during resume raises (a torch.OutOfMemoryError), the process lives, the tag
    stays paused, and resume succeeds once memory is freed."""
    import torch
    import vmstash

    dev = torch.device("cuda", 0)
    with vmstash.region("oom_weights", policy="backup"):
        w = torch.randn(4 * GiB // 4, device=dev)
    w_sum = w.sum().item()
    assert vmstash.pause("oom_weights")
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - 1 * GiB, dtype=torch.uint8, device=dev)
    try:
        vmstash.resume("oom_weights")
        raise AssertionError("resume should have run out of memory")
    except vmstash.OutOfMemoryError as e:
        assert isinstance(e, torch.OutOfMemoryError)
        print(f"resume_out_of_memory: raised as expected: {str(e)[:120]}...")
    assert vmstash.tag_stats("oom_weights")["state"] == "paused"
    del hog
    torch.cuda.empty_cache()
    assert vmstash.resume("oom_weights")
    assert w.sum().item() == w_sum
    print("resume_out_of_memory: retry after freeing memory succeeded, data intact")


def test_all_threads_region_backward():
    """region(all_threads=True) also routes autograd's backward-thread allocations."""
    import torch
    import vmstash

    dev = torch.device("cuda", 0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048)).to(dev)
    before = (vmstash.tag_stats("grads") or {"allocated_bytes": {"current": 0}})["allocated_bytes"]["current"]
    with vmstash.region("grads", policy="backup", all_threads=True):
        loss = model(torch.randn(64, 2048, device=dev)).square().mean()
        loss.backward()
    grads = sum(p.grad.numel() * 4 for p in model.parameters())
    used = vmstash.tag_stats("grads")["allocated_bytes"]["current"] - before
    assert used >= grads, (used, grads)
    g0 = model[0].weight.grad.clone()
    assert vmstash.pause("grads") and vmstash.resume("grads")
    assert torch.equal(model[0].weight.grad, g0)
    print(f"all_threads_region_backward: {used / (1 << 20):.0f} MiB in tag 'grads' (gradients {grads >> 20} MiB)")


def test_install_global_mode():
    """vmstash.install() before the first CUDA allocation: every tensor comes from vmstash;
    tags route by the thread's current tag; pause/resume works."""
    import torch
    import vmstash

    vmstash.install()
    a = torch.randn(1024, 1024, device="cuda")
    vmstash.create_tag("g_weights", "backup")
    vmstash.set_current_tag("g_weights")
    w = torch.randn(4096, 4096, device="cuda")
    vmstash.set_current_tag("default")
    w_host = w.cpu()
    assert vmstash.tag_stats("g_weights")["allocated_bytes"]["current"] >= w.numel() * 4
    assert vmstash.tag_stats("default")["allocated_bytes"]["current"] >= a.numel() * 4
    assert vmstash.pause("g_weights") and vmstash.resume("g_weights")
    assert torch.equal(w.cpu(), w_host)
    del a, w
    print("install_global_mode: OK")


def test_install_too_late():
    """install() after a CUDA allocation raises a clear vmstash.Error (no exit)."""
    import torch
    import vmstash

    x = torch.ones(10, device="cuda")
    try:
        vmstash.install()
        raise AssertionError("install() after an allocation should fail")
    except vmstash.Error as e:
        assert "before the process's first CUDA allocation" in str(e), e
    assert x.sum().item() == 10
    print("install_too_late: raised as expected")


def test_preload_default_allocator():
    """LD_PRELOAD mode under PyTorch's own caching allocator: a plain MemPool per tag (so
    torch never serves a tagged request from an untagged cached block), routed by the
    thread's tag; pause/resume keeps the data; untagged memory is untouched."""
    import torch
    import vmstash

    assert vmstash.preloaded_library(), "run with LD_PRELOAD=libvmstash_preload.so"
    assert "libvmstash_preload" in vmstash.library_path()
    untagged = torch.randn(1024, 1024, device="cuda")
    vmstash.create_tag("pre_w", "backup")
    pool = torch.cuda.MemPool()  # PyTorch's allocator, cudaMalloc underneath
    with torch.cuda.use_mem_pool(pool):
        vmstash.set_current_tag("pre_w")
        try:
            w = torch.randn(4096, 4096, device="cuda")
        finally:
            vmstash.set_current_tag("default")
    assert _lib_owner(w.data_ptr(), pool), "the tagged segment should come from vmstash"
    w_host = w.cpu()
    reserved = vmstash.tag_stats("pre_w")["reserved_bytes"]["current"]
    free0 = torch.cuda.mem_get_info()[0]
    assert vmstash.pause("pre_w")
    assert torch.cuda.mem_get_info()[0] - free0 >= 0.95 * reserved
    assert untagged.sum().isfinite().item()  # other memory keeps working meanwhile
    assert vmstash.resume("pre_w")
    assert torch.equal(w.cpu(), w_host)
    del w
    del pool
    print(f"preload_default_allocator: {reserved >> 20} MiB tagged through cudaMalloc, paused and resumed")


def _lib_owner(ptr, pool):
    """The vmstash allocation (a PyTorch segment) containing ptr, from the pool's snapshot."""
    import ctypes
    from vmstash import _lib
    for seg in pool.snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return _lib.lib().vmstash_owner_device(ctypes.c_void_p(seg["address"])) >= 0
    return False


def test_preload_expandable_segments():
    """LD_PRELOAD with expandable_segments:True for the rest of the process: region tensors
    (the tag's MemPool) and raw cudaMalloc calls of a thread in a region go to vmstash;
    PyTorch's expandable default pool is untouched and keeps working across a pause."""
    import ctypes
    import torch
    import vmstash

    assert vmstash.preloaded_library()
    assert "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    default = torch.ones(64 << 20, device="cuda")
    with vmstash.region("pre_kv", policy="backup"):
        kv = torch.full((256 << 20,), 3.0, device="cuda")
        raw = ctypes.c_void_p()
        cudart_malloc = ctypes.CDLL(None).cudaMalloc  # resolved like any C library's call
        assert cudart_malloc(ctypes.byref(raw), ctypes.c_size_t(32 << 20)) == 0
    from vmstash import _lib
    assert _lib.lib().vmstash_owner_device(raw) == 0, "raw cudaMalloc in a region belongs to the tag"
    assert vmstash.pause("pre_kv") and vmstash.resume("pre_kv")
    assert torch.all(kv == 3.0) and default.sum().item() == default.numel()
    assert ctypes.CDLL(None).cudaFree(raw) == 0
    assert _lib.lib().vmstash_owner_device(raw) == -1
    print("preload_expandable_segments: OK")


def _matmuls_outside(torch, dev):
    """bf16 8192 x 8192 matmuls outside any region on the current stream and on another
    stream (and a linear with a bias: the cuBLASLt path); returns the checked results."""
    import torch.nn.functional as F
    g = torch.Generator(device=dev).manual_seed(3)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16, generator=g) / 64
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16, generator=g) / 64
    bias = torch.randn(8192, device=dev, dtype=torch.bfloat16, generator=g)
    same = [a @ b for _ in range(3)]
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        other = a @ b
        lin = F.linear(a, b, bias)
    torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize(dev)
    assert all(torch.equal(x, same[0]) for x in same[1:]) and torch.equal(other, same[0]), "matmuls disagree"
    ref = (a[:64].float() @ b.float())
    assert (same[0][:64].float() - ref).abs().max().item() < 0.05, "matmul result is wrong"
    assert (lin[:64].float() - (a[:64].float() @ b.float().t() + bias.float())).abs().max().item() < 0.05
    return same[0]


def test_cublas_workspace_linear_in_region():
    """Issue 16 item 8, the minimal sequence: no CUDA work before the region, a bf16
    F.linear of 4096 x 4096 inside region("kv_cache"), pause, bf16 8192 x 8192 matmuls
    outside on the same and on another stream, resume. (Before the fix: the stream's cuBLAS
    workspace lived in kv_cache and the matmul after the pause lost the CUDA context.)"""
    import torch
    import torch.nn.functional as F
    import vmstash

    dev = torch.device("cuda", 0)
    with vmstash.region("kv_cache"):
        x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
        w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
        y = F.linear(x, w)
        cache = torch.empty(1 << 30, device=dev, dtype=torch.uint8)
    torch.cuda.synchronize()
    del y
    assert vmstash.pause("kv_cache")
    _matmuls_outside(torch, dev)
    assert vmstash.resume("kv_cache")
    cache.fill_(1)
    with vmstash.region("kv_cache"):
        z = F.linear(x, w)  # works again after the resume
    torch.cuda.synchronize()
    assert z.shape == (4096, 4096)
    print("cublas_workspace_linear_in_region: pause, 8192^2 matmuls on two streams, resume: ok")


def test_cublas_workspace_transformer_prefill():
    """Issue 16 item 8 as a user runs it: no CUDA work before; a transformer's weights
    loaded under region("weights", backup), its prefill (first matmul of the process)
    inside region("kv_cache"); pause both; training-style matmuls on the same and on
    another stream; resume; the prefill again gives the same logits."""
    import torch
    import vmstash
    from transformers import LlamaConfig, LlamaForCausalLM

    dev = torch.device("cuda", 0)
    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
    torch.manual_seed(0)
    with vmstash.region("weights", policy="backup"):
        with torch.device(dev):
            model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (4, 512), generator=torch.Generator().manual_seed(1)).to(dev)
    with torch.no_grad(), vmstash.region("kv_cache"):
        out = model(input_ids=ids, use_cache=True)
        cache = out.past_key_values
    first = out.logits.float()  # outside the region: kept across the pause of kv_cache
    del out
    torch.cuda.synchronize()
    assert vmstash.pause("kv_cache") and vmstash.pause("weights")
    _matmuls_outside(torch, dev)
    assert vmstash.resume("weights") and vmstash.resume("kv_cache")
    with torch.no_grad(), vmstash.region("kv_cache"):
        again = model(input_ids=ids, use_cache=True).logits.float()
    torch.cuda.synchronize()
    assert torch.equal(first, again), f"prefill after resume differs: {(first - again).abs().max().item()}"
    del cache
    print("cublas_workspace_transformer_prefill: prefill, pause, matmuls on two streams, resume, same logits: ok")


def child_env(name, env):
    """The environment of a test's fresh process (conftest.py): the preload_* tests start
    with the preload library, one of them with PyTorch's expandable segments."""
    if name.startswith("test_preload_"):
        import vmstash
        env["LD_PRELOAD"] = vmstash.preload_library_path()
        if name == "test_preload_expandable_segments":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return env


if __name__ == "__main__":
    # Scenarios by name in this process, without pytest's child (scripts/gpu_repro_cublas_trap.sh
    # runs the cuBLAS ones so, with vmstash's protection patched out).
    for scenario in sys.argv[1:]:
        globals()["test_" + scenario]()
