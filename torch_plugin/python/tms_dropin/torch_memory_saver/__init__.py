"""torch_memory_saver, served by vmstash.

This is vmstash's drop-in package (its version ends in "+vmstash.<vmstash version>"):
`import torch_memory_saver` gives vmstash.compat.torch_memory_saver, so a program written
against torch_memory_saver 0.0.10 runs on vmstash unchanged; torch_memory_saver's C entry
points (tms_*) are vmstash's library's. Modules: entrypoint, hooks (base, mode_preload,
mode_torch), utils and testing_utils (for torch_memory_saver's own tests). `pip uninstall
torch_memory_saver` removes it; reinstalling the original package brings that back.
"""
from vmstash.compat.torch_memory_saver import TorchMemorySaver, torch_memory_saver

from .hooks.mode_preload import configure_subprocess

__all__ = ["TorchMemorySaver", "configure_subprocess", "torch_memory_saver"]
served_by = "vmstash"
