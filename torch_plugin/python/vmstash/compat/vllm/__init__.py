"""vLLM's sleep mode on vmstash (vLLM 0.33): the allocator, the backend, the plugin.

    pip install vmstash-*.whl           # registers the vllm.general_plugins entry point
    llm = LLM(model, enable_sleep_mode=True, sleep_mode_backend="vmstash")
    llm.sleep(level=1); ...; llm.wake_up(tags=["weights"]); ...; llm.wake_up(tags=["kv_cache"])

VmstashMemAllocator (allocator.py): vLLM's MemAllocator protocol on vmstash tags.
VmstashSleepBackend (backend.py, imports vLLM): the SleepModeBackend named "vmstash".
register / select (plugin.py): the entry point, and a process-wide override of the choice.
The decisions of every call: plan.py (Note [vLLM Sleep Semantics]).
"""
from .allocator import TAG_PREFIX, VmstashMemAllocator
from .plan import DEFERRABLE_TAGS
from .plugin import BACKEND_NAME, register, select, selected

__all__ = ["BACKEND_NAME", "DEFERRABLE_TAGS", "TAG_PREFIX", "VmstashMemAllocator", "VmstashSleepBackend",
           "register", "select", "selected"]


def __getattr__(name):
    if name == "VmstashSleepBackend":  # imports vLLM: only when asked for
        from .backend import VmstashSleepBackend
        return VmstashSleepBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
