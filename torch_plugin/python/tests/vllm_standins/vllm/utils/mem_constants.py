"""Stand-in for vllm.utils.mem_constants."""
MiB_bytes = 1 << 20
GiB_bytes = 1 << 30
