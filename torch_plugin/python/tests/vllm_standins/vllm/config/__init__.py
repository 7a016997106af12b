"""Stand-in for vllm.config: the config objects vmstash's plugin reads, and the current
config (set during a worker's initialization in vLLM)."""
import contextlib
from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    enable_sleep_mode: bool = True
    sleep_mode_backend: str = "cumem"
    sleep_mode_offload_cudagraph: bool = False
    enable_cumem_allocator: bool = True


@dataclass
class CompilationConfig:
    cudagraph_mode: str = "FULL"


@dataclass
class VllmConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)

    @property
    def use_cumem_cudagraph_pool(self):
        """As vLLM 0.33 decides it: its cumem backend only."""
        m = self.model_config
        return (m is not None and m.sleep_mode_offload_cudagraph and m.enable_sleep_mode
                and m.sleep_mode_backend == "cumem" and self.compilation_config.cudagraph_mode != "NONE")


_current = None


@contextlib.contextmanager
def set_current_vllm_config(vllm_config, check_compile=False, prefix=None):
    global _current
    old, _current = _current, vllm_config
    try:
        yield
    finally:
        _current = old


def get_current_vllm_config_or_none():
    return _current


def get_current_vllm_config():
    if _current is None:
        raise AssertionError("Current vLLM config is not set.")
    return _current
