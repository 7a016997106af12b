"""vmstash as a vLLM sleep-mode backend: the SleepModeBackend named "vmstash" (vLLM 0.33).

Selected with the model config's sleep_mode_backend="vmstash" (`--sleep-mode-backend vmstash`
or LLM(..., enable_sleep_mode=True, sleep_mode_backend="vmstash")) once the wheel is
installed: its vllm.general_plugins entry point (plugin.py) registers it and routes vLLM's
allocations to VmstashMemAllocator.

Levels as vLLM's CuMemBackend defines them: level 1 keeps weights, runtime and cudagraph
and drops the rest; level 2 keeps runtime and cudagraph and drops weights too (vLLM's
worker reloads them). resume(tags) wakes as the allocator's wake_up does.

state(): "RUNNING" when every tag is awake, "SUSPENDED" after a suspend or a discard,
"RESUMING" while a resume runs and after a selective resume that left a tag asleep (the
engine cannot serve yet). A failed call leaves the state what it was (every call is all or
nothing). Capability flags say what vmstash does: communicators and compiled artifacts are
not touched (kept); graphs with collectives are not promised (NCCL may have registered
graph-pool memory that a suspend replaces); nothing outlives the process.
"""
from vllm.device_allocator.sleep_mode_backend import SleepModeBackend

from .allocator import VmstashMemAllocator

_LEVEL_KEPT = {1: ("weights", "runtime", "cudagraph"), 2: ("runtime", "cudagraph")}


class VmstashSleepBackend(SleepModeBackend):

    def __init__(self):
        super().__init__()
        self._allocator = VmstashMemAllocator.get_instance()

    @property
    def allocator(self):
        return self._allocator

    def suspend(self, level=1):
        if isinstance(level, bool) or level not in _LEVEL_KEPT:
            raise ValueError(f"vmstash sleep-mode backend: level must be 1 or 2, got {level!r}")
        _check_routed(self._allocator)
        self._allocator.sleep(offload_tags=_LEVEL_KEPT[level])
        self._state = "SUSPENDED"

    def resume(self, tags=None):
        before = self._state
        self._state = "RESUMING"
        try:
            self._allocator.wake_up(tags)
        except BaseException:
            self._state = before
            raise
        self._state = "RESUMING" if self._allocator.asleep_tags() else "RUNNING"

    def discard(self, tags):
        self._allocator.discard(tags)
        if self._allocator.asleep_tags():
            self._state = "SUSPENDED"

    @classmethod
    def is_supported(cls):
        try:
            import torch
            if not torch.cuda.is_available():
                return False
            from ... import _lib
            _lib.lib()
            return True
        except Exception:
            return False

    @classmethod
    def preserves_communicators(cls):
        return True

    @classmethod
    def preserves_compiled_artifacts(cls):
        return True

    @classmethod
    def preserves_graphs_with_communicators(cls):
        return False

    @classmethod
    def supports_durable_storage(cls):
        return False


def _check_routed(allocator):
    """A suspend that would leave memory of vLLM's in CuMemAllocator (the plugin's routing did
    not take effect for all of it) raises instead of reporting success: vLLM allows one
    sleep-mode engine per process, so memory there is this engine's."""
    import sys
    cumem = sys.modules.get("vllm.device_allocator.cumem")
    other = getattr(getattr(cumem, "CuMemAllocator", None), "instance", None)
    held = other.get_current_usage() if other is not None else 0
    if held > 0:
        raise RuntimeError(
            f"vmstash sleep-mode backend: vLLM allocated {held} bytes through CuMemAllocator, not vmstash "
            f"(vmstash holds tags {sorted(allocator.tag_names())}), so a suspend would not free them. The vmstash "
            "plugin routes vLLM's allocations when it is loaded before the model (vllm.general_plugins entry "
            "point 'vmstash', allowed by VLLM_PLUGINS) and sleep_mode_backend is 'vmstash'; or call "
            "vmstash.compat.vllm.select() before loading.")
