"""torch_memory_saver.entrypoint on vmstash: the singleton's class."""
from vmstash.compat.torch_memory_saver import TorchMemorySaver

__all__ = ["TorchMemorySaver"]
