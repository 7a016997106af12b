#include "tests/gpu/graph_kernels.h"

#include <cuda_runtime.h>

namespace vmstash::testing {
namespace {

__host__ __device__ inline std::uint64_t Mix(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 29;
  return x + 0x2545f4914f6cdd1dull;
}

__global__ void MixKernel(const std::uint64_t* in, std::uint64_t* out, std::size_t words) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += gridDim.x * blockDim.x) {
    out[i] = Mix(in[i]);
  }
}

}  // namespace

std::uint64_t MixValue(std::uint64_t x) { return Mix(x); }

int CaptureMixGraph(void* stream, std::uint64_t in, std::uint64_t out, std::size_t words, void** graph_exec) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t e = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
  if (e != cudaSuccess) return e;
  MixKernel<<<1024, 256, 0, s>>>(reinterpret_cast<const std::uint64_t*>(in), reinterpret_cast<std::uint64_t*>(out),
                                 words);
  cudaGraph_t graph = nullptr;
  e = cudaStreamEndCapture(s, &graph);
  if (e != cudaSuccess) return e;
  cudaGraphExec_t exec = nullptr;
  e = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (e != cudaSuccess) return e;
  *graph_exec = exec;
  return cudaSuccess;
}

int LaunchGraph(void* graph_exec, void* stream) {
  cudaError_t e = cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph_exec), static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return e;
  return cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
}

int DestroyGraph(void* graph_exec) { return cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph_exec)); }

}  // namespace vmstash::testing
