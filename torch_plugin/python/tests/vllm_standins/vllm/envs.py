"""Stand-in for vllm.envs: VLLM_PLUGINS, which vLLM's plugin loader (vllm/plugins/__init__.py)
reads: the comma-separated names of the plugins to load, None (unset) for all."""
import os


def __getattr__(name):
    if name == "VLLM_PLUGINS":
        raw = os.environ.get("VLLM_PLUGINS")
        return None if raw is None else raw.split(",")
    raise AttributeError(f"module 'vllm.envs' (stand-in) has no attribute {name!r}")
