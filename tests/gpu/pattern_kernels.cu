#include "tests/gpu/pattern_kernels.h"

#include <cuda_runtime.h>

namespace vmstash::testing {
namespace {

__host__ __device__ inline std::uint64_t Pattern(std::uint32_t seed, std::size_t i) {
  return (static_cast<std::uint64_t>(seed) << 40) ^ (0x9e3779b97f4a7c15ull * (i + 1));
}

__global__ void FillKernel(std::uint64_t* p, std::size_t words, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += gridDim.x * blockDim.x) {
    p[i] = Pattern(seed, i);
  }
}

__global__ void CheckKernel(const std::uint64_t* p, std::size_t words, std::uint32_t seed,
                            unsigned long long* mismatches) {
  unsigned long long local = 0;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += gridDim.x * blockDim.x) {
    local += p[i] != Pattern(seed, i);
  }
  if (local != 0) atomicAdd(mismatches, local);
}

}  // namespace

std::uint64_t PatternValue(std::uint32_t seed, std::size_t i) { return Pattern(seed, i); }

int LaunchFillPattern(void* stream, std::uint64_t ptr, std::size_t words, std::uint32_t seed) {
  FillKernel<<<1024, 256, 0, static_cast<cudaStream_t>(stream)>>>(reinterpret_cast<std::uint64_t*>(ptr), words,
                                                                  seed);
  return static_cast<int>(cudaGetLastError());
}

int LaunchCountMismatches(void* stream, std::uint64_t ptr, std::size_t words, std::uint32_t seed,
                          std::uint64_t mismatches_device) {
  CheckKernel<<<1024, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const std::uint64_t*>(ptr), words, seed,
      reinterpret_cast<unsigned long long*>(mismatches_device));
  return static_cast<int>(cudaGetLastError());
}

const char* ErrorName(int cuda_error) { return cudaGetErrorName(static_cast<cudaError_t>(cuda_error)); }

}  // namespace vmstash::testing
