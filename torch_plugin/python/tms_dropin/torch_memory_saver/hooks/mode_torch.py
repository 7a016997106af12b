"""torch_memory_saver.hooks.mode_torch on vmstash: torch mode needs no set-up (regions use
vmstash's PyTorch MemPools)."""
