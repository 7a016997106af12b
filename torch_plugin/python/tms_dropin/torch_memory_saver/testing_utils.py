"""torch_memory_saver.testing_utils on vmstash: what torch_memory_saver's own tests import
(not for programs), written for the drop-in.

  is_xpu()                          (from torch_memory_saver.utils)
  get_device()                      "xpu" on an Intel XPU, else "cuda"
  empty_cache()                     the device's cache emptied (torch.xpu / torch.cuda)
  get_and_print_gpu_memory(message, gpu_id=0)
                                    the device memory in use, in bytes, printed with the
                                    message: CUDA's device-wide figure
                                    (torch.cuda.device_memory_used), else total - free.
"""
import torch

from torch_memory_saver.utils import is_xpu

__all__ = ["is_xpu", "get_device", "empty_cache", "get_and_print_gpu_memory"]


def get_device() -> str:
    return "xpu" if is_xpu() else "cuda"


def empty_cache():
    (torch.xpu if is_xpu() else torch.cuda).empty_cache()


def _used_bytes(gpu_id):
    if not is_xpu() and not torch.version.hip and hasattr(torch.cuda, "device_memory_used"):
        try:
            return int(torch.cuda.device_memory_used(gpu_id))
        except Exception:  # no NVML: the runtime's figure below
            pass
    module = torch.xpu if is_xpu() else torch.cuda
    free, total = module.mem_get_info(gpu_id)
    return int(total - free)


def get_and_print_gpu_memory(message, gpu_id=0):
    used = _used_bytes(gpu_id)
    print(f"GPU {gpu_id} memory: {used / (1 << 30):.2f} GB ({message})")
    return used
