"""Stand-in for vllm.utils.torch_utils."""
PIN_MEMORY = True
