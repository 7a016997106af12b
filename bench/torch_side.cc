#include "bench/torch_side.h"

#include <c10/core/Device.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include <cstdio>
#include <exception>

namespace vmstash_bench {

namespace alloc = c10::cuda::CUDACachingAllocator;

bool TorchInit() {
  try {
    int n = c10::cuda::device_count();
    if (n <= 0) {
      std::fprintf(stderr, "torch: no CUDA device\n");
      return false;
    }
    alloc::init(n);
    c10::cuda::set_device(0);
    return true;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torch: %s\n", e.what());
    return false;
  }
}

void* TorchAlloc(std::size_t size_bytes) { return alloc::raw_alloc_with_stream(size_bytes, nullptr); }
void TorchFree(void* ptr) { alloc::raw_delete(ptr); }

void TorchEmptyCacheAndResetPeaks() {
  alloc::emptyCache();
  alloc::resetPeakStats(0);
}

// Index 0 of the per-pool stat arrays is the aggregate over pools.
std::uint64_t TorchPeakReservedBytes() { return alloc::getDeviceStats(0).reserved_bytes[0].peak; }
std::uint64_t TorchPeakAllocatedBytes() { return alloc::getDeviceStats(0).allocated_bytes[0].peak; }

const char* TorchVersion() { return "c10 (LibTorch from VMSTASH_TORCH_DIR)"; }

}  // namespace vmstash_bench
