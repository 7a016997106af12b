"""Drop-in replacements for the APIs RL frameworks call today (see torch_memory_saver)."""
