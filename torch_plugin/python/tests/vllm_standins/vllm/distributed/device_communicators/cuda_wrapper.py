"""Stand-in for vllm.distributed.device_communicators.cuda_wrapper: the CUDA runtime calls
CuMemAllocator makes, through the libcudart that PyTorch loaded."""
import ctypes

from vllm.utils.system_utils import find_loaded_library

_DEFAULT = 4  # cudaMemcpyDefault


class CudaRTLibrary:
    def __init__(self, so_file=None):
        if so_file is None:
            import torch  # noqa: F401  (loads libcudart)
            so_file = find_loaded_library("libcudart")
        if so_file is None:
            raise RuntimeError("CudaRTLibrary: no libcudart is loaded in this process")
        self.lib = ctypes.CDLL(so_file)
        self.lib.cudaGetErrorString.restype = ctypes.c_char_p

    def _check(self, code, what):
        if code != 0:
            raise RuntimeError(f"CUDA error in {what}: {self.lib.cudaGetErrorString(code).decode()}")

    def cudaMemcpy(self, dst, src, count):
        self._check(self.lib.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(count),
                                        ctypes.c_int(_DEFAULT)), "cudaMemcpy")

    def cudaMemset(self, ptr, value, count):
        self._check(self.lib.cudaMemset(ctypes.c_void_p(ptr), ctypes.c_int(value), ctypes.c_size_t(count)),
                    "cudaMemset")

    def cudaDeviceSynchronize(self):
        self._check(self.lib.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
