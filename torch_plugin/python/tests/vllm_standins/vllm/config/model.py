"""Stand-in for vllm.config.model (vLLM 0.25's and later sleep-mode backend factory imports
ModelConfig from here)."""
from . import ModelConfig  # noqa: F401
