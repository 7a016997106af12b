// PyTorch's native CUDA caching allocator behind plain functions, so the benchmark's main
// translation unit needs no torch headers (torch_side.cc is built only where LibTorch's
// c10 libraries are found: CMake option VMSTASH_TORCH_DIR).
#ifndef VMSTASH_BENCH_TORCH_SIDE_H_
#define VMSTASH_BENCH_TORCH_SIDE_H_

#include <cstddef>
#include <cstdint>

namespace vmstash_bench {

bool TorchInit();  // false (with a message on stderr) when torch's allocator cannot start
void* TorchAlloc(std::size_t size_bytes);  // raw_alloc_with_stream on the default stream
void TorchFree(void* ptr);                 // raw_delete
void TorchEmptyCacheAndResetPeaks();
std::uint64_t TorchPeakReservedBytes();
std::uint64_t TorchPeakAllocatedBytes();
const char* TorchVersion();

}  // namespace vmstash_bench

#endif  // VMSTASH_BENCH_TORCH_SIDE_H_
