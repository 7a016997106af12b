"""The torch_memory_saver drop-in on a GPU (label gpu): the wheel built from this tree is
installed into a fresh folder, and programs written against torch_memory_saver run
unchanged, each in a fresh process, the way the frameworks start them:
  slime_training   slime / AReaL's training actor: the preload library found as slime finds
                   it (next to the torch_memory_saver package), TMS_INIT_ENABLE=1,
                   TMS_INIT_ENABLE_CPU_BACKUP=1, no region for the model; model + Adam + a
                   step, pause(), a weight read through get_cpu_backup(zero_copy=True), a
                   weight update under disable() while paused, resume(), the next step
                   equal to a run that never paused
  sglang_server    SGLang: the parent enters configure_subprocess() and starts the
                   scheduler; the child (preload mode, the default there) holds weights,
                   kv_cache and a CUDA graph, releases kv_cache -> weights -> cuda_graph and
                   resumes in reverse

    python3 gpu_tms_dropin_scenarios.py            (VMSTASH_PRELOAD_LIBRARY: the library)
"""
import os
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
MiB = 1 << 20


def _free():
    import torch
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def slime_training():
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


def sglang_server():
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


SCENARIOS = [slime_training, sglang_server]


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


def main(names):
    if names:
        for n in names:
            globals()[n]()
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        site = install_dropin(tmp)
        base = dict(os.environ)
        base["PYTHONPATH"] = os.pathsep.join([site, os.path.join(ROOT, "torch_plugin", "python")])
        base.pop("LD_PRELOAD", None)
        envs = {
            "slime_training": dict(base, LD_PRELOAD=slime_preload_path(site, base), TMS_INIT_ENABLE="1",
                                   TMS_INIT_ENABLE_CPU_BACKUP="1"),
            "sglang_server": base,
        }
        failed = [f.__name__ for f in SCENARIOS
                  if subprocess.run([sys.executable, os.path.abspath(__file__), f.__name__],
                                    env=envs[f.__name__]).returncode != 0]
    print(f"{len(SCENARIOS) - len(failed)}/{len(SCENARIOS)} scenarios passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
