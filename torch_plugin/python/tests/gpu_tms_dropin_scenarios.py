"""The torch_memory_saver drop-in on a GPU (label gpu): the wheel built from this tree is
installed into a fresh folder, and programs written against torch_memory_saver run
unchanged, each in a fresh process, the way the frameworks start them:
  slime_training   slime / AReaL's training actor: the preload library found as slime finds
                   it (next to the torch_memory_saver package), TMS_INIT_ENABLE=1,
                   TMS_INIT_ENABLE_CPU_BACKUP=1, no region for the model; model + Adam + a
                   step, pause(), a weight read through get_cpu_backup(zero_copy=True), a
                   weight update under disable() while paused, resume(), the next step
                   equal to a run that never paused
  slime_training_disk  the same with TMS_INIT_ENABLE_DISK_BACKUP=1 (the process's memory
                   goes to a file in TMS_DISK_BACKUP_DIR while paused)
  sglang_server    SGLang: the parent enters configure_subprocess() and starts the
                   scheduler; the child (preload mode, the default there) holds weights,
                   kv_cache and a CUDA graph, releases kv_cache -> weights -> cuda_graph and
                   resumes in reverse
  megatron_rl      Megatron-LM's RL loop in torch hook mode: rl_inference_model (backup),
                   inference_context with and without backup, the first matmul inside a
                   region, a training step and a disable() buffer while paused
  backends         cpu_backup_backend pinned and mmap, enable_disk_backup, with
                   retain_cpu_backup False and True: device memory, host memory (RSS,
                   MemAvailable) and disk space measured at each step; the disk backup as
                   torch_memory_saver lays it out (a file per allocation while paused)
  expandable_segments_with_regions / _whole_process  PyTorch's expandable segments on:
                   regions and a graph pause beside them; whole-process mode refuses a
                   pause while expandable segments turned on at run time hold tensors
  backups_under_pressure  the pinned and mmap backends' bytes when another process takes
                   the host's memory: after a resume handed the pinned backup back lazily
                   (MADV_FREE: the kernel takes those pages), and again while paused (a
                   page the copy engine wrote that the kernel could drop unseen would come
                   back as zeros)
Marker gpu, ctest label gpu; each test in a fresh process (conftest.py) with its
environment from child_env below.

    python3 -m pytest -m gpu gpu_tms_dropin_scenarios.py [-k NAME]   (VMSTASH_PRELOAD_LIBRARY: the library)
"""
import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

import pytest

pytestmark = pytest.mark.gpu

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
MiB = 1 << 20


def _free():
    import torch
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


class _RawBuffer:
    """A buffer made the way DeepEP makes its NVL buffer: cudaMalloc called directly (found
    in the process's global scope, so the preload library's hook sees it), not PyTorch."""

    def __init__(self, nbytes):
        import ctypes
        self._rt = ctypes.CDLL(None)  # global scope: the interposed cudaMalloc
        self.ptr, self.nbytes = ctypes.c_void_p(), nbytes
        assert self._rt.cudaMalloc(ctypes.byref(self.ptr), ctypes.c_size_t(nbytes)) == 0
        assert self._rt.cudaMemset(self.ptr, ctypes.c_int(0x5A), ctypes.c_size_t(nbytes)) == 0
        assert self._rt.cudaDeviceSynchronize() == 0

    def owner(self):
        from vmstash import _lib
        return _lib.lib().vmstash_owner_device(self.ptr.value)

    def check_and_free(self):
        import ctypes
        host = (ctypes.c_uint8 * self.nbytes)()
        assert self._rt.cudaMemcpy(host, self.ptr, ctypes.c_size_t(self.nbytes), 2) == 0  # device to host
        assert bytes(host) == b"\x5a" * self.nbytes, "the DeepEP buffer lost its bytes"
        assert self._rt.cudaFree(self.ptr) == 0


def _deepep_buffer(tms):
    """slime's DeepEP patch: the interesting-region flag off around the buffer's creation, so
    the buffer is plain CUDA memory that pause() does not touch."""
    tms._ensure_initialized()  # as any earlier torch_memory_saver call does
    cdll = tms._impl._binary_wrapper.cdll
    routed = _RawBuffer(MiB)
    assert routed.owner() == 0, "whole-process mode: a raw cudaMalloc is managed"
    routed.check_and_free()
    previous = cdll.tms_get_interesting_region()
    assert previous
    cdll.tms_set_interesting_region(False)
    try:
        buf = _RawBuffer(64 * MiB)
    finally:
        cdll.tms_set_interesting_region(previous)
    assert buf.owner() == -1, "the DeepEP buffer must bypass vmstash"
    return buf


def test_slime_training():
    import copy
    import torch
    import torch_memory_saver
    from torch_memory_saver import torch_memory_saver as tms
    assert torch_memory_saver.served_by == "vmstash"
    torch.zeros(1, device="cuda")  # the context
    free0 = _free()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, 4096, device="cuda")

    def step(m, o):
        o.zero_grad(set_to_none=True)
        loss = m(x).square().mean()
        loss.backward()
        o.step()

    step(model, opt)
    deepep = _deepep_buffer(tms)
    with tms.region(tag="kv_cache"):  # a region besides the whole process
        kv = torch.ones(256 * MiB // 4, device="cuda")
    torch.cuda.synchronize()
    ref_model = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    ref_opt = copy.deepcopy(opt.state_dict())
    addresses = [p.data_ptr() for p in model.parameters()] + [kv.data_ptr()]
    held = free0 - _free()
    assert held > 1500 * MiB, held  # weights, grads, two Adam moments
    torch.cuda.empty_cache()
    tms.pause()
    after = _free()
    assert after >= free0 - 200 * MiB, f"paused: {(free0 - after) / MiB:.0f} MiB still held of {held / MiB:.0f}"
    w = model[0].weight
    view = tms.get_cpu_backup(w, zero_copy=True)
    assert view is not None and view.device.type == "cpu" and torch.equal(view, ref_model["0.weight"])
    assert torch.equal(tms.get_cpu_backup(w), ref_model["0.weight"])
    assert tms.get_cpu_backup(kv) is None  # discard region: nothing saved
    with tms.disable():  # weight sync while the model is paused: plain CUDA memory
        update = torch.full((4096, 4096), 0.5, device="cuda")
        assert update.sum().item() == 0.5 * 4096 * 4096
        del update
    tms.resume()
    assert [p.data_ptr() for p in model.parameters()] + [kv.data_ptr()] == addresses
    for k, v in model.state_dict().items():
        assert torch.equal(v.cpu(), ref_model[k]), k
    kv.fill_(3.0)
    assert kv.sum().item() == 3.0 * kv.numel()
    deepep.check_and_free()
    # The next step equals that of a run that never paused.
    twin = copy.deepcopy(model)
    twin.load_state_dict({k: v.cuda() for k, v in ref_model.items()})
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-3)
    twin_opt.load_state_dict(ref_opt)
    step(model, opt)
    step(twin, twin_opt)
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(a, b), name
    print(f"slime_training: OK (held {held / MiB:.0f} MiB, {(free0 - after) / MiB:.0f} MiB while paused)")


def test_sglang_server():
    from torch_memory_saver import configure_subprocess
    with configure_subprocess():
        rc = subprocess.run([sys.executable, os.path.abspath(__file__), "sglang_scheduler"]).returncode
    assert rc == 0, rc
    assert "LD_PRELOAD" not in os.environ or "vmstash" not in os.environ["LD_PRELOAD"]
    print("sglang_server: OK")


def sglang_scheduler():
    import torch
    from torch_memory_saver import torch_memory_saver as tms
    assert tms.hook_mode == "preload", tms.hook_mode
    with tms.region(tag="weights", enable_cpu_backup=True):
        w = torch.randn(4096, 4096, device="cuda")
    with tms.region(tag="kv_cache"):
        kv = torch.zeros(1024 * MiB // 4, device="cuda")
    x = torch.randn(16, 4096, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        (x @ w).relu()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with tms.cuda_graph(cuda_graph=g, tag="cuda_graph"):
        y = (x @ w).relu()
    g.replay()
    expected = y.clone()
    ref = w.clone().cpu()
    addresses = (w.data_ptr(), kv.data_ptr(), y.data_ptr())
    free0 = _free()
    steps = []
    for tag in ("kv_cache", "weights", "cuda_graph"):
        tms.pause(tag)
        steps.append(_free())
    assert steps[0] - free0 >= 1000 * MiB, steps  # kv_cache
    assert steps[1] - steps[0] >= 60 * MiB, steps  # weights
    for tag in ("cuda_graph", "weights", "kv_cache"):
        tms.resume(tag)
    assert (w.data_ptr(), kv.data_ptr(), y.data_ptr()) == addresses
    assert torch.equal(w.cpu(), ref)
    y.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, expected)
    kv.fill_(1.0)
    assert kv.sum().item() == kv.numel()
    print("sglang_scheduler: OK")


def test_cuda_graph_pools_as_torch_chooses_them():
    """cuda_graph(pool=...) as torch.cuda.graph(pool=...): graphs given one pool (SGLang's
    graph_pool_handle(), an earlier graph's pool()) share it, a graph given none has its own;
    all their memory is the tag's, released by a pause, and every graph replays after the
    resume."""
    import torch
    from torch_memory_saver import torch_memory_saver as tms
    x = torch.randn(1024, 1024, device="cuda")
    torch.cuda.synchronize()
    share = torch.cuda.graph_pool_handle()
    graphs, outs, factors = [], [], (2.0, 3.0, 5.0, 7.0)
    for k, f in enumerate(factors):
        g = torch.cuda.CUDAGraph()
        pool = share if k < 2 else (graphs[0].pool() if k == 2 else None)
        with tms.cuda_graph(cuda_graph=g, pool=pool, tag="graphs"):
            outs.append((x * f).sin())
        graphs.append(g)
    p = [g.pool() for g in graphs]
    assert p[0] == p[1] == p[2], p  # the handle, then an earlier graph's pool
    assert p[3] != p[0], p  # no pool given: a private one
    free = _free()
    tms.pause("graphs")
    assert _free() - free >= 4 * 4 * MiB, "the graphs' outputs (4 x 4 MiB) are the tag's memory"
    tms.resume("graphs")
    for g, y, f in zip(graphs, outs, factors):
        y.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, (x * f).sin()), f
    # A graph given its pool() (SGLang's loop: the first capture without a pool, then its
    # pool for the next ones) shares that private pool.
    g5 = torch.cuda.CUDAGraph()
    with tms.cuda_graph(cuda_graph=g5, pool=graphs[3].pool(), tag="graphs"):
        y5 = (x * 11.0).sin()
    assert g5.pool() == p[3]
    # A pool whose graphs are all gone serves the next capture that needs one of its own.
    import gc
    import weakref
    weakref.ref(g5)  # CUDAGraph must be weakly referable, or no pool is ever seen idle
    del graphs[3], outs[3], g5, y5, g, y  # (g and y: the last graph and output of the loop above)
    gc.collect()
    g6 = torch.cuda.CUDAGraph()
    with tms.cuda_graph(cuda_graph=g6, tag="graphs"):
        y6 = (x * 13.0).sin()
    assert g6.pool() == p[3], "an idle pool is reused"
    y6.zero_()
    g6.replay()
    torch.cuda.synchronize()
    assert torch.equal(y6, (x * 13.0).sin())


def _set_allocator_settings(torch, conf):
    """PyTorch's allocator settings changed at run time, as frameworks toggle
    expandable_segments around a training step."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or \
        torch.cuda.memory._set_allocator_settings
    setter(conf)


def _expandable_segments(torch):
    return [s for s in torch.cuda.memory_snapshot() if s.get("is_expandable")]


def test_expandable_segments_with_regions():
    """PYTORCH_ALLOC_CONF=expandable_segments:True, the preload library in place (SGLang's
    set-up with the setting on): regions and a graph pause and resume, their memory freed,
    while PyTorch's own memory stays expandable."""
    import torch
    from torch_memory_saver import torch_memory_saver as tms
    assert tms.hook_mode == "preload"
    outside = torch.arange(1 << 20, device="cuda")
    assert _expandable_segments(torch), "PyTorch's own pool is not expandable"
    with tms.region(tag="weights", enable_cpu_backup=True):
        w = torch.arange(64 * MiB, device="cuda", dtype=torch.int32)
    with tms.region(tag="kv_cache"):
        kv = torch.ones(256 * MiB, device="cuda", dtype=torch.uint8)
    g = torch.cuda.CUDAGraph()
    with tms.cuda_graph(cuda_graph=g, tag="graphs"):
        y = (w[:1 << 20].float() * 2.0)
    free = _free()
    tms.pause()
    freed = _free() - free
    assert freed >= w.nbytes + kv.nbytes, (freed, w.nbytes + kv.nbytes)
    tms.resume()
    assert torch.equal(w, torch.arange(64 * MiB, device="cuda", dtype=torch.int32))
    y.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.arange(1 << 20, device="cuda", dtype=torch.float32) * 2.0)
    assert torch.equal(outside, torch.arange(1 << 20, device="cuda"))
    print(f"expandable_segments_with_regions: OK (freed {freed / MiB:.0f} MiB)")


def test_expandable_segments_whole_process():
    """slime's training actor (preload library, TMS_INIT_ENABLE=1) with expandable segments
    turned on at run time around a step: the pause refuses with the setting named while
    they hold live tensors, nothing paused; with the setting off again and those tensors
    freed, the pause releases the process's memory and the resume brings it back."""
    import torch
    import vmstash
    from torch_memory_saver import torch_memory_saver as tms
    torch.zeros(1, device="cuda")
    free0 = _free()
    model = torch.nn.Linear(4096, 4096).cuda()
    ref = model.weight.detach().clone()
    _set_allocator_settings(torch, "expandable_segments:True")
    act = torch.randn(64 * MiB // 4, device="cuda")  # a training step's activation
    assert _expandable_segments(torch), "the setting did not reach PyTorch"
    with pytest.raises(vmstash.Error, match="expandable segments hold") as e:
        tms.pause()
    from vmstash import _lib
    assert e.value.code == _lib.FAILED_PRECONDITION
    import ctypes
    c_pause = ctypes.CDLL(None).tms_pause  # torch_memory_saver's C entry point, as C callers reach it
    c_pause.restype, c_pause.argtypes = ctypes.c_int, [ctypes.c_char_p]
    assert c_pause(None) != 0, "tms_pause from C paused the process past live expandable segments"
    assert torch.equal(model.weight, ref), "a refused pause changed the model"
    del act
    _set_allocator_settings(torch, "expandable_segments:False")
    torch.cuda.empty_cache()
    assert not _expandable_segments(torch)
    held = free0 - _free()
    tms.pause()
    assert _free() >= free0 - 64 * MiB, "the process's memory was not released"
    tms.resume()
    assert torch.equal(model.weight, ref)
    print(f"expandable_segments_whole_process: OK (held {held / MiB:.0f} MiB)")


def test_slime_training_disk():
    test_slime_training()  # with the environment of child_env below


def _owner(t):
    """The device whose vmstash allocator holds the tensor's memory, or -1."""
    from vmstash import _lib
    return _lib.lib().vmstash_owner_device(t.data_ptr())


def test_megatron_rl():
    import torch
    from torch_memory_saver import torch_memory_saver as tms
    tms.hook_mode = "torch"  # Megatron-LM sets it before the first region
    torch.zeros(1, device="cuda")
    free0 = _free()
    torch.manual_seed(1)
    with tms.region(tag="rl_inference_model", enable_cpu_backup=True):
        model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(6)]).cuda().to(torch.bfloat16)
    with tms.region(tag="inference_context", enable_cpu_backup=False):
        kv = torch.empty(1024 * MiB // 2, dtype=torch.bfloat16, device="cuda")
    with tms.region(tag="inference_context", enable_cpu_backup=True):
        block_table = torch.arange(4 * MiB, dtype=torch.int32, device="cuda")
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad(), tms.region(tag="inference_context"):  # the prefill: first matmul inside a region
        out = model(x)
        kv[: out.numel()].copy_(out.flatten())
    ref_out = out.clone()
    ref_weights = [p.detach().clone() for p in model.parameters()]  # outside regions
    ref_table = block_table.clone()
    addresses = [p.data_ptr() for p in model.parameters()] + [kv.data_ptr(), block_table.data_ptr()]
    held = free0 - _free()
    tms.pause("inference_context")
    tms.pause("rl_inference_model")
    released = _free() - (free0 - held)
    assert released >= 1024 * MiB + 6 * 32 * MiB, f"released {released / MiB:.0f} MiB of {held / MiB:.0f}"
    # Training while the inference engine sleeps: plain PyTorch memory, and a buffer under
    # disable() that vmstash must not manage.
    train = torch.nn.Linear(4096, 4096).cuda()
    opt = torch.optim.SGD(train.parameters(), lr=0.1)
    train(torch.randn(64, 4096, device="cuda")).square().mean().backward()
    opt.step()
    with tms.region(tag="inference_context"), tms.disable():
        synced = torch.full((64 * MiB // 4,), 2.0, device="cuda")
    assert _owner(synced) == -1 and _owner(train.weight) == -1, (_owner(synced), _owner(train.weight))
    assert _owner(kv) == 0, "the KV cache (its segment's first block) is vmstash memory"
    tms.resume("rl_inference_model")
    tms.resume("inference_context")
    assert [p.data_ptr() for p in model.parameters()] + [kv.data_ptr(), block_table.data_ptr()] == addresses
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), ref_weights))
    assert torch.equal(block_table, ref_table)
    with torch.no_grad(), tms.region(tag="inference_context"):
        again = model(x)
    assert torch.equal(again, ref_out)
    assert torch.all(synced == 2.0)
    kv.fill_(1.0)
    assert kv.float().sum().item() == kv.numel()
    print(f"megatron_rl: OK (held {held / MiB:.0f} MiB, released {released / MiB:.0f} MiB)")


def _rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable")


def _held(tms_tag):
    """Host bytes the backup arenas of a torch_memory_saver tag's vmstash tags hold."""
    import vmstash
    return sum(vmstash.tag_stats(t)["backup_arena_bytes"] for t in vmstash.tags()
               if t == tms_tag or t.startswith(tms_tag + ":"))


def test_backends():
    import torch
    from torch_memory_saver import torch_memory_saver as tms
    tms.hook_mode = "torch"
    size = 1024 * MiB
    disk_dir = tempfile.mkdtemp(prefix="vmstash_tms_disk_", dir=os.environ.get("VMSTASH_TEST_DISK_DIR"))
    tms.set_disk_backup_dir(disk_dir)
    tensors, refs = {}, {}
    settings = {"pinned": dict(enable_cpu_backup=True, cpu_backup_backend="pinned"),
                "mmap": dict(enable_cpu_backup=True, cpu_backup_backend="mmap"),
                "disk": dict(enable_disk_backup=True)}
    for i, (tag, kwargs) in enumerate(settings.items()):
        with tms.region(tag=tag, **kwargs):
            tensors[tag] = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda",
                                         generator=torch.Generator("cuda").manual_seed(i))
        refs[tag] = tensors[tag].clone()  # outside regions
    addresses = {t: x.data_ptr() for t, x in tensors.items()}
    for tag in settings:  # a first cycle: a pinned arena prepared in the background is given back
        tms.pause(tag)
        tms.resume(tag)
    report = []
    for retain in (False, True):
        tms.retain_cpu_backup = retain
        for tag in settings:
            torch.cuda.synchronize()
            free0, rss0, avail0, disk0 = _free(), _rss(), _available(), os.statvfs(disk_dir).f_bavail
            tms.pause(tag)
            free1, rss1, avail1, held1 = _free(), _rss(), _available(), _held(tag)
            disk1 = os.statvfs(disk_dir).f_bavail
            files = os.listdir(disk_dir)  # torch_memory_saver's layout: a file per backed-up allocation
            assert len(files) == (1 if tag == "disk" else 0) and all(f.startswith("vmstash-tms-") for f in files), files
            tms.resume(tag)
            assert os.listdir(disk_dir) == [], os.listdir(disk_dir)  # removed at the resume
            time.sleep(1.0)  # time for a background preparation, which must not pin the backup again
            rss2, avail2, held2 = _rss(), _available(), _held(tag)
            assert tensors[tag].data_ptr() == addresses[tag] and torch.equal(tensors[tag], refs[tag]), tag
            frsize = os.statvfs(disk_dir).f_frsize
            row = dict(tag=tag, retain=retain, device_freed=(free1 - free0) / MiB, rss_paused=(rss1 - rss0) / MiB,
                       rss_resumed=(rss2 - rss0) / MiB, avail_paused=(avail0 - avail1) / MiB,
                       avail_resumed=(avail0 - avail2) / MiB, disk_paused=(disk0 - disk1) * frsize / MiB,
                       held_paused=held1 / MiB, held_resumed=held2 / MiB)
            report.append(row)
            print("backends:", " ".join(f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in row.items()))
            assert row["device_freed"] >= 1000, row
            if tag == "disk":
                assert row["rss_paused"] < 200 and row["disk_paused"] >= 1000, row  # on disk, not in memory
            elif tag == "pinned":
                # In host memory. (Not visible in MemAvailable: memory the last resume handed back
                # lazily (MADV_FREE) stays counted as available after this pause pins it again,
                # until the kernel next scans it: Note [Pinned Pieces].)
                assert row["held_paused"] >= 1000, row
            else:
                assert row["avail_paused"] >= 900, row  # in host memory
            if tag == "mmap":
                # The 1 GiB backup in RSS, less the staging ring the last resume made (128 MiB
                # pinned, counted in rss0), freed once the pause is sealed (a paused tag holds
                # none: allocator/backup_arena.h, Note [Host Budget]).
                assert row["rss_paused"] >= 900 - 128, row
                if retain:
                    assert row["rss_resumed"] >= 900, row  # kept, readable after the resume
                else:
                    assert row["rss_resumed"] < 200, row  # RSS given back
            if tag == "pinned":
                if retain:
                    assert row["held_resumed"] >= 1000, row  # kept for the next pause
                else:
                    # Handed back after the resume (by the background thread, within the second
                    # slept above), counted as available again.
                    assert row["held_resumed"] == 0 and row["avail_resumed"] < 300, row
    tms.retain_cpu_backup = False
    for tag in settings:  # the retained arenas are given back at the next resume
        tms.pause(tag)
        tms.resume(tag)
    os.rmdir(disk_dir)
    print("backends: OK")


def _host_room():
    """Bytes another process can still take: MemAvailable, or less under a cgroup limit."""
    room = _available()
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            room = min(room, int(limit) - used)
    except OSError:
        pass
    return room


_TAKER = """
import mmap, sys
open("/proc/self/oom_score_adj", "w").write("1000")  # the one to go if anything must
left, held = int(sys.argv[1]), []
while left > 0:
    m = mmap.mmap(-1, min(left, 1 << 30), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(23)  # MADV_POPULATE_WRITE: every page faulted in, written
    except (OSError, ValueError):
        for off in range(0, len(m), 4096):
            m[off] = 1
    held.append(m)
    left -= len(m)
print("held", flush=True)
sys.stdin.readline()
"""


def _take_host_memory(nbytes, procs=8):
    """Has `procs` processes fault in `nbytes` of anonymous memory between them and hold it
    until they are told to go; returns a function that tells them. The kernel reclaims
    what it can first (pages given back with MADV_FREE among them)."""
    share = max(nbytes // procs, 1)
    takers = [subprocess.Popen([sys.executable, "-c", _TAKER, str(share)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    held = [t.stdout.readline().strip() == "held" for t in takers]

    def release():
        for t in takers:
            try:
                t.stdin.write("\n")
                t.stdin.flush()
            except OSError:
                pass
            t.wait(120)
    if not all(held):
        release()
        raise RuntimeError(f"the memory takers did not all get their share ({held})")
    return release


def test_backups_under_pressure():
    # Note [Pinned Pieces] (vmm/pinned_pieces.h): a pause faults the handed-back pages in
    # writable before registering them, so every page the copy engine then writes is dirty
    # for the kernel and never dropped silently. Here the kernel is made to reclaim.
    import torch
    from torch_memory_saver import torch_memory_saver as tms
    tms.hook_mode = "torch"
    size = 4096 * MiB
    tensors, refs = {}, {}
    for i, backend in enumerate(("pinned", "mmap")):
        with tms.region(tag=f"pressure_{backend}", enable_cpu_backup=True, cpu_backup_backend=backend):
            tensors[backend] = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda",
                                             generator=torch.Generator("cuda").manual_seed(10 + i))
        refs[backend] = tensors[backend].clone()
    with open("/proc/meminfo") as f:
        swap = [line.split()[1] for line in f if line.startswith("SwapTotal:")]
    print(f"pressure: host room {_host_room() / MiB:.0f} MiB, swap {swap} kB")
    for backend in tensors:
        tag = f"pressure_{backend}"
        tms.pause(tag)
        tms.resume(tag)  # the pinned backup is handed back lazily after this (background)
        deadline = time.monotonic() + 30
        while _held(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        rss0 = _rss()
        release = _take_host_memory(_host_room() - 2048 * MiB)  # the kernel takes the lazily freed pages
        release()
        rss1 = _rss()
        tms.pause(tag)  # into pages faulted in anew
        release = _take_host_memory(_host_room() - 2048 * MiB)  # while paused: nothing may be dropped
        release()
        tms.resume(tag)
        equal = torch.equal(tensors[backend], refs[backend])
        print(f"pressure: {backend}: RSS {rss0 / MiB:.0f} MiB before the first taking, {rss1 / MiB:.0f} after; "
              f"bytes equal after the resume: {equal}")
        assert equal, f"{backend}: the backup lost bytes under memory pressure"
        if backend == "pinned":
            # The first taking did reclaim the lazily given-back backup (else this tested nothing).
            assert rss0 - rss1 >= size // 2, (rss0, rss1)
    print("pressure: OK")


def install_dropin(folder):
    """Builds the wheel and unpacks it into `folder` (what pip install --target does)."""
    builder = os.path.join(ROOT, "scripts", "build_tms_dropin_wheel.py")
    wheel = subprocess.run([sys.executable, builder, "--out", folder], check=True, capture_output=True,
                           text=True).stdout.strip()
    site = os.path.join(folder, "site")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    for name in os.listdir(site):
        if name.endswith(".so"):
            os.chmod(os.path.join(site, name), 0o755)
    return site


def slime_preload_path(site, env):
    """The library slime puts into LD_PRELOAD: found next to the imported package."""
    probe = ("import os, torch_memory_saver\n"
             "d = os.path.dirname(os.path.dirname(torch_memory_saver.__file__))\n"
             "for n in ('torch_memory_saver_hook_mode_preload_cu13.abi3.so', "
             "'torch_memory_saver_hook_mode_preload_cu12.abi3.so', 'torch_memory_saver_hook_mode_preload.abi3.so'):\n"
             "    p = os.path.join(d, n)\n"
             "    if os.path.exists(p):\n"
             "        print(p); break\n")
    return subprocess.run([sys.executable, "-c", probe], env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


_dropin = {}


def child_env(name, env):
    """The environment of each test's fresh process (conftest.py), as the frameworks start
    theirs: the wheel built from this tree (once) and unpacked into a temporary folder, first
    on PYTHONPATH; slime's training actor with the preload library found as slime finds it
    and TMS_INIT_* set, its disk variant spilling into that folder."""
    if not _dropin:
        tmp = tempfile.mkdtemp(prefix="vmstash_dropin_")
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        _dropin.update(tmp=tmp, site=install_dropin(tmp))
    tmp, site = _dropin["tmp"], _dropin["site"]
    env["PYTHONPATH"] = os.pathsep.join([site, os.path.join(ROOT, "torch_plugin", "python")])
    env.pop("LD_PRELOAD", None)
    if name == "test_slime_training":
        env.update(LD_PRELOAD=slime_preload_path(site, env), TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
    elif name == "test_expandable_segments_with_regions":
        env.update(LD_PRELOAD=slime_preload_path(site, env), PYTORCH_ALLOC_CONF="expandable_segments:True")
    elif name == "test_expandable_segments_whole_process":
        env.update(LD_PRELOAD=slime_preload_path(site, env), TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
    elif name == "test_slime_training_disk":
        env.update(LD_PRELOAD=slime_preload_path(site, env), TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_DISK_BACKUP="1",
                   TMS_DISK_BACKUP_DIR=tmp)
    return env


if __name__ == "__main__":  # sglang_server's scheduler process: python3 gpu_tms_dropin_scenarios.py sglang_scheduler
    for function in sys.argv[1:]:
        globals()[function]()
