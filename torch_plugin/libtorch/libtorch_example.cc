// A LibTorch program with vmstash as its CUDA allocator: weights in a `backup` tag and a
// KV cache in a `discard` tag, both paused and resumed at the same addresses while the
// program uses the freed memory. Exits non-zero on any mismatch. (label gpu)
#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <exception>

#include "torch_plugin/libtorch/vmstash_libtorch.h"

int main() {
  try {
    vmstash::libtorch::Install();
    at::Tensor w, kv;
    {
      vmstash::libtorch::TagScope tag("cpp_weights", "backup");
      w = at::randn({4096, 4096}, at::device(at::kCUDA));
    }
    {
      vmstash::libtorch::TagScope tag("cpp_kv", "discard");
      kv = at::zeros({1 << 28}, at::device(at::kCUDA));  // 1 GiB
    }
    const at::Tensor w_host = w.cpu();
    const void* w_address = w.data_ptr();
    size_t free_before = 0, free_paused = 0, total = 0;
    cudaMemGetInfo(&free_before, &total);
    if (!vmstash::libtorch::Pause("cpp_weights") || !vmstash::libtorch::Pause("cpp_kv")) {
      std::fprintf(stderr, "pause did nothing\n");
      return 1;
    }
    cudaMemGetInfo(&free_paused, &total);
    at::Tensor scratch = at::ones({1 << 28}, at::device(at::kCUDA));  // uses the freed memory
    const double scratch_sum = scratch.sum().item<double>();
    scratch = at::Tensor();
    vmstash::libtorch::Resume("cpp_weights");
    vmstash::libtorch::Resume("cpp_kv");
    kv.fill_(2.0f);
    const bool ok = at::equal(w.cpu(), w_host) && w.data_ptr() == w_address && scratch_sum == double(1 << 28) &&
                    kv.sum().item<double>() == 2.0 * (1 << 28) && free_paused > free_before + (1000u << 20);
    std::printf("libtorch example: pause freed %.2f GiB; weights bit-exact at the same address: %s\n",
                (double(free_paused) - double(free_before)) / (1 << 30), ok ? "yes" : "NO");
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "libtorch example: %s\n", e.what());
    return 1;
  }
}
