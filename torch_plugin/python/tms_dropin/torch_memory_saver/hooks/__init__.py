"""torch_memory_saver.hooks on vmstash: the hook modes are chosen with
torch_memory_saver.hook_mode ("preload" under the preload library, else "torch")."""
