// A CUDA graph for GPU tests: out[i] = Mix(in[i]) over `words` 64-bit words, captured
// once on a stream and replayed later — the pattern RL rollouts depend on: a graph
// captured on buffers of a tag must replay after pause + resume at the same addresses.
// Plain C++ interface (no CUDA headers); streams are CUstream values passed as void*.
#ifndef VMSTASH_TESTS_GPU_GRAPH_KERNELS_H_
#define VMSTASH_TESTS_GPU_GRAPH_KERNELS_H_

#include <cstddef>
#include <cstdint>

namespace vmstash::testing {

// Captures and instantiates the graph; *graph_exec receives a cudaGraphExec_t. Returns a
// cudaError_t (0 = ok).
int CaptureMixGraph(void* stream, std::uint64_t in, std::uint64_t out, std::size_t words, void** graph_exec);
int LaunchGraph(void* graph_exec, void* stream);
int DestroyGraph(void* graph_exec);
std::uint64_t MixValue(std::uint64_t x);

}  // namespace vmstash::testing

#endif  // VMSTASH_TESTS_GPU_GRAPH_KERNELS_H_
