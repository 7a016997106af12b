// Kernels that write and check a position-dependent pattern directly in device memory,
// so GPU tests prove that mapped VMM ranges are usable by kernels (not only by the copy
// engines), and that graphs/kernels see restored bytes at the same address.
// Plain C++ interface (no CUDA headers): streams are passed as void* (a CUstream).
#ifndef VMSTASH_TESTS_GPU_PATTERN_KERNELS_H_
#define VMSTASH_TESTS_GPU_PATTERN_KERNELS_H_

#include <cstddef>
#include <cstdint>

namespace vmstash::testing {

// Writes word i of [ptr, ptr + 8*words) as PatternValue(seed, i). Returns a cudaError_t (0 = ok).
int LaunchFillPattern(void* stream, std::uint64_t ptr, std::size_t words, std::uint32_t seed);
// Adds the number of words that differ from the pattern to *mismatches_device (a device
// counter the caller zeroes). Returns a cudaError_t.
int LaunchCountMismatches(void* stream, std::uint64_t ptr, std::size_t words, std::uint32_t seed,
                          std::uint64_t mismatches_device);
std::uint64_t PatternValue(std::uint32_t seed, std::size_t i);
const char* ErrorName(int cuda_error);

}  // namespace vmstash::testing

#endif  // VMSTASH_TESTS_GPU_PATTERN_KERNELS_H_
