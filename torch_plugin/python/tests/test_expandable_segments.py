"""PyTorch's expandable segments and the torch_memory_saver drop-in, without a GPU
(vmstash/_alloc_conf.py): the setting read as PyTorch reads it (PYTORCH_ALLOC_CONF before
PYTORCH_CUDA_ALLOC_CONF, the last occurrence winning); whole-process mode refused at the
first use when the setting is on, naming the variable; region mode left to work (tags'
pools never use expandable segments); a whole-process pause refused, with nothing paused,
when PyTorch's expandable segments hold live tensors (the setting turned on at run time);
only a warning when they hold nothing live. Each drop-in case runs in a fresh Python (the
TMS_INIT_* variables are read once) on the simulated driver, PyTorch stood in by its
memory snapshot and the preload library by its name."""
import os
import subprocess
import sys

from vmstash import _alloc_conf

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20


def test_the_setting_is_read_as_pytorch_reads_it():
    assert _alloc_conf.env_setting({}) == (None, False)
    assert _alloc_conf.env_setting({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) == \
        ("PYTORCH_CUDA_ALLOC_CONF", True)
    # The accelerator-wide variable wins, whatever the CUDA one says.
    both = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert _alloc_conf.env_setting(both) == ("PYTORCH_ALLOC_CONF", False)
    assert _alloc_conf.env_setting({"PYTORCH_ALLOC_CONF": "", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) \
        == ("PYTORCH_ALLOC_CONF", False)  # set though empty, it is the one PyTorch reads
    assert _alloc_conf.flag("max_split_size_mb:512, expandable_segments : True")
    assert not _alloc_conf.flag("expandable_segments:True,expandable_segments:False")  # the last one wins
    assert not _alloc_conf.flag("expandable_segments_x:True")
    segments = [{"is_expandable": True, "allocated_size": 3 * MiB, "total_size": 20 * MiB},
                {"is_expandable": False, "allocated_size": 5 * MiB, "total_size": 8 * MiB},
                {"is_expandable": True, "allocated_size": 0, "total_size": 20 * MiB}]
    assert _alloc_conf.expandable_bytes(segments) == (3 * MiB, 40 * MiB)
    assert _alloc_conf.pause_refusal(segments[1:]) is None
    assert "3 MiB of live tensors" in _alloc_conf.pause_refusal(segments)


# A fresh Python: the preload library stood in by its name in LD_PRELOAD's place (the
# drop-in checks that one was given), PyTorch by the memory snapshot the pause reads.
_PRELUDE = r"""
import sys, types, warnings
import vmstash
from vmstash import _lib
_lib.lib()  # libvmstash.so: the C ABI library, loaded before the preload library is stood in
_real = _lib.library_path()
_lib.library_path = lambda: _real
_lib.preloaded_library = lambda: "/opt/libvmstash_preload.so"
SEGMENTS = []
sys.modules["torch"] = types.SimpleNamespace(cuda=types.SimpleNamespace(memory_snapshot=lambda: list(SEGMENTS),
                                                                        is_initialized=lambda: True))
# The preload library names its process tag at load; here a tag of the simulated runtime.
vmstash.create_tag("cpu_process", "backup")
_lib.lib().vmstash_tms_process_tag = lambda: b"cpu_process"
from vmstash.compat.torch_memory_saver import torch_memory_saver as tms
"""


def _run(code, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("TMS_", "PYTORCH_"))}
    full.update(PYTHONPATH=os.pathsep.join([os.path.dirname(HERE)] + sys.path), **env)
    r = subprocess.run([sys.executable, "-c", _PRELUDE + code], env=full, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


def test_whole_process_mode_is_refused_at_the_first_use_naming_the_variable():
    out = _run(r"""
try:
    tms.pause()
except RuntimeError as e:
    print("refused:", e)
""", TMS_INIT_ENABLE="1", PYTORCH_ALLOC_CONF="expandable_segments:True")
    assert "refused:" in out and "PYTORCH_ALLOC_CONF sets expandable_segments:True" in out, out
    assert "whole-process mode" in out


def test_region_mode_works_with_the_setting_on():
    # Not whole-process: the tags' pools have vmstash's allocator, which PyTorch never
    # grows with expandable segments; the drop-in starts and pauses.
    out = _run(r"""
tms.pause()
tms.resume()
print("ok")
""", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    assert out.strip().endswith("ok"), out


def test_a_whole_process_pause_with_live_expandable_tensors_is_refused_and_pauses_nothing():
    out = _run(r"""
from vmstash import _lib
l = _lib.lib()
name = l.vmstash_tms_tag(b"kv", b"discard").decode()
vmstash.set_current_tag(name)
assert l.vmstash_malloc(4 << 20, 0, None)
vmstash.set_current_tag("default")
SEGMENTS.append({"is_expandable": True, "allocated_size": 64 << 20, "total_size": 80 << 20, "device": 0})
SEGMENTS.append({"is_expandable": False, "allocated_size": 8 << 20, "total_size": 8 << 20, "device": 0})
try:
    tms.pause()
except _lib.Error as e:
    print("refused:", e.code == _lib.FAILED_PRECONDITION, e)
print("state:", vmstash.tag_stats(name, 0)["state"])
tms.pause("kv")  # a tag of its own is not the process's memory: no refusal
print("kv:", vmstash.tag_stats(name, 0)["state"])
tms.resume()
# Any other path to the process tag's pause meets the guard: a veto, the reason on stderr.
vmstash.set_current_tag("cpu_process")
assert l.vmstash_malloc(2 << 20, 0, None)
vmstash.set_current_tag("default")
SEGMENTS[0]["device"] = 1  # live expandable tensors on another device: this one pauses
vmstash.pause("cpu_process", 0)
print("other device:", vmstash.tag_stats("cpu_process", 0)["state"])
vmstash.resume("cpu_process", 0)
SEGMENTS[0]["device"] = 0
try:
    vmstash.pause("cpu_process")
except _lib.Error as e:
    print("vetoed:", e.code_name)
print("process tag:", vmstash.tag_stats("cpu_process", 0)["state"])
SEGMENTS[0]["allocated_size"] = 0  # freed, still cached: only a warning
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    tms.pause()
print("warned:", [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)])
tms.resume()
""", TMS_INIT_ENABLE="1")
    assert "refused: True" in out and "64 MiB of live tensors" in out and "Nothing was paused" in out, out
    assert "state: active" in out and "kv: paused" in out, out
    assert "other device: paused" in out, out
    assert "vetoed: ABORTED" in out and "process tag: active" in out, out
    assert out.count("MiB of live tensors") >= 2, out  # the guard's reason, on stderr
    assert "warned:" in out and "80 MiB cached" in out and "torch.cuda.empty_cache()" in out, out


def test_the_guard_waits_for_the_process_tag_and_never_makes_it():
    """Hooks registered for a tag with no pool yet would make it with policy discard; the
    preload library makes its process tag at the first routed allocation (backup with
    TMS_INIT_ENABLE_CPU_BACKUP=1). So the guard is registered only once the tag exists."""
    out = _run(r"""
_lib.lib().vmstash_tms_process_tag = lambda: b"late_process"
tms.pause()  # the first use: no process tag yet, no guard
print("guard before:", len(__import__("vmstash.compat.torch_memory_saver", fromlist=["x"])._guard))
vmstash.create_tag("late_process", "backup")  # as the preload library makes it
print("policy:", vmstash.backup_store("late_process") is not None)
tms.resume()
tms.pause()  # now it is registered
print("guard after:", len(__import__("vmstash.compat.torch_memory_saver", fromlist=["x"])._guard))
tms.resume()
""", TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
    assert "guard before: 0" in out and "policy: True" in out and "guard after: 1" in out, out
