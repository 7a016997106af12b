"""Stand-in for vllm.platforms: current_platform for CUDA devices."""


class CudaPlatform:
    device_type = "cuda"
    device_name = "cuda"

    def is_cuda(self):
        return True

    def is_rocm(self):
        return False

    def is_xpu(self):
        return False

    def is_cpu(self):
        return False

    def is_cuda_alike(self):
        return True

    def is_sleep_mode_available(self):
        return True

    def is_cumem_allocator_available(self):
        return True

    def graph_pool_handle(self):
        import torch
        return torch.cuda.graph_pool_handle()

    def mem_get_info(self, device=None):
        import torch
        return torch.cuda.mem_get_info(device)

    def get_current_memory_usage(self, device=None):
        import torch
        free, total = torch.cuda.mem_get_info(device)
        return total - free


current_platform = CudaPlatform()
