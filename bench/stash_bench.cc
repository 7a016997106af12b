// stash_bench: the paged stash kernels against the same-run physical limits
// (docs/architecture.md §6): device tier vs a device-to-device cudaMemcpyAsync of the same bytes,
// host tier vs a pinned device-to-host copy, GPU time of an empty stash, host launch cost.
//
// Usage: stash_bench [GRID THREADS]...   (GPU required; rows of 14336 bytes = bf16 hidden
// 7168, P = 64). Each GRID THREADS pair is a launch shape to measure (default 2048 256).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "allocator/caching_allocator.h"
#include "stash/arena.h"
#include "stash/stash_kernels.h"
#include "vmm/cuda_driver.h"

namespace vmstash::stash {
namespace {

constexpr std::uint64_t kRowBytes = 14336;
constexpr std::uint32_t kP = 64;

#define CK(x)                                                                  \
  do {                                                                         \
    auto _r = (x);                                                             \
    if (!_r.ok()) return std::fprintf(stderr, "%s: %s\n", #x, _r.ToString().c_str()), 1; \
  } while (0)

template <typename Fn>
float BestMs(cudaStream_t s, int reps, Fn fn) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  float best = 1e30f;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a, s);
    fn();
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    best = std::min(best, ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return best;
}

int Run() {
  absl::StatusOr<std::unique_ptr<CudaDriver>> d = CudaDriver::Create();
  if (!d.ok()) return std::fprintf(stderr, "%s\n", d.status().ToString().c_str()), 1;
  AllocatorOptions options;
  options.auto_prepare = false;
  auto alloc = *CachingAllocator::Create(d->get(), 0, options);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  Stream st = reinterpret_cast<Stream>(s);
  std::printf("stash_bench: rows of %llu bytes, page %u rows; GB = 1e9 bytes; best of 5\n",
              static_cast<unsigned long long>(kRowBytes), kP);
  std::printf("%10s %12s %12s %8s %12s %8s\n", "MB", "D2D GB/s", "stash GB/s", "%D2D", "restore GB/s", "%D2D");
  for (std::uint64_t mb : {28, 64, 128, 512, 2048}) {
    const std::uint64_t rows = mb * 1000000 / kRowBytes, bytes = rows * kRowBytes;
    StashArenaSpec spec{kRowBytes, kP, "bench_stash_" + std::to_string(mb)};
    auto arena = *StashArena::Create(d->get(), alloc.get(), spec);
    CK(arena->Prepare((rows + kP - 1) / kP + 1, 0, st));
    void* src = reinterpret_cast<void*>(*alloc->Allocate(bytes, st, kDefaultTag));
    void* dst = reinterpret_cast<void*>(*alloc->Allocate(bytes, st, kDefaultTag));
    auto* n = reinterpret_cast<std::int64_t*>(*alloc->Allocate(8, st, kDefaultTag));
    std::int64_t count = static_cast<std::int64_t>(rows);
    cudaMemcpyAsync(n, &count, 8, cudaMemcpyHostToDevice, s);
    cudaMemsetAsync(src, 7, bytes, s);
    StashHandleHeader* h = *arena->NewHandle(rows);
    const float d2d = BestMs(s, 5, [&] { cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s); });
    float stash = 1e30f, restore = 1e30f;
    for (int i = 0; i < 5; ++i) {
      (void)arena->Reset(st);
      stash = std::min(stash, BestMs(s, 1, [&] { (void)arena->Stash(st, src, n, rows, h); }));
      restore = std::min(restore, BestMs(s, 1, [&] { (void)arena->Restore(st, h, dst, rows, false); }));
    }
    auto gbs = [&](float ms) { return bytes / (ms / 1e3) / 1e9; };
    std::printf("%10llu %12.1f %12.1f %7.1f%% %12.1f %7.1f%%\n", static_cast<unsigned long long>(mb), gbs(d2d),
                gbs(stash), 100 * d2d / stash, gbs(restore), 100 * d2d / restore);
    CK(arena->FreeHandle(h));
    for (void* p : {src, dst, static_cast<void*>(n)}) CK(alloc->Free(reinterpret_cast<DevicePtr>(p)));
    arena.reset();
    CK(alloc->EmptyCache());
  }
  // Host tier: 512 MB spilled to pinned host pages vs a pinned D2H copy.
  {
    const std::uint64_t rows = 512000000 / kRowBytes, bytes = rows * kRowBytes;
    StashArenaSpec spec{kRowBytes, kP, "bench_stash_host"};
    auto arena = *StashArena::Create(d->get(), alloc.get(), spec);
    CK(arena->Prepare(1, (rows + kP - 1) / kP + 1, st));
    void* src = reinterpret_cast<void*>(*alloc->Allocate(bytes, st, kDefaultTag));
    auto* n = reinterpret_cast<std::int64_t*>(*alloc->Allocate(8, st, kDefaultTag));
    std::int64_t count = static_cast<std::int64_t>(rows);
    cudaMemcpyAsync(n, &count, 8, cudaMemcpyHostToDevice, s);
    void* pinned = nullptr;
    cudaHostAlloc(&pinned, bytes, cudaHostAllocDefault);
    StashHandleHeader* h = *arena->NewHandle(rows);
    const float d2h = BestMs(s, 5, [&] { cudaMemcpyAsync(pinned, src, bytes, cudaMemcpyDeviceToHost, s); });
    float stash = 1e30f;
    for (int i = 0; i < 5; ++i) {
      (void)arena->Reset(st);
      stash = std::min(stash, BestMs(s, 1, [&] { (void)arena->Stash(st, src, n, rows, h); }));
    }
    StashFlags f = *arena->ReadFlags(st);
    std::printf("host tier, 512 MB: pinned D2H %.1f GB/s, stash to host pages %.1f GB/s = %.1f%% (host_spill=%u)\n",
                bytes / (d2h / 1e3) / 1e9, bytes / (stash / 1e3) / 1e9, 100 * d2h / stash, f.host_spill);
    cudaFreeHost(pinned);
    CK(arena->FreeHandle(h));
    for (void* p : {src, static_cast<void*>(n)}) CK(alloc->Free(reinterpret_cast<DevicePtr>(p)));
  }
  // Empty stash: GPU time per launch (1000 in a row) and host launch cost from C++.
  {
    StashArenaSpec spec{kRowBytes, kP, "bench_stash_empty"};
    auto arena = *StashArena::Create(d->get(), alloc.get(), spec);
    CK(arena->Prepare(64, 0, st));
    auto* n = reinterpret_cast<std::int64_t*>(*alloc->Allocate(8, st, kDefaultTag));
    std::int64_t zero = 0;
    cudaMemcpyAsync(n, &zero, 8, cudaMemcpyHostToDevice, s);
    void* src = reinterpret_cast<void*>(*alloc->Allocate(4096 * kRowBytes, st, kDefaultTag));
    StashHandleHeader* h = *arena->NewHandle(4096);
    const float gpu = BestMs(s, 3, [&] {
      for (int i = 0; i < 1000; ++i) (void)arena->Stash(st, src, n, 4096, h);
    });
    cudaStreamSynchronize(s);
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 1000; ++i) (void)arena->Stash(st, src, n, 4096, h);
    auto t1 = std::chrono::steady_clock::now();
    cudaStreamSynchronize(s);
    std::printf("empty stash (0 of max 4096 rows): %.2f us GPU time per launch; %.2f us host launch cost from C++\n",
                gpu * 1e3 / 1000, std::chrono::duration<double, std::micro>(t1 - t0).count() / 1000);
    CK(arena->FreeHandle(h));
    for (void* p : {src, static_cast<void*>(n)}) CK(alloc->Free(reinterpret_cast<DevicePtr>(p)));
  }
  cudaStreamDestroy(s);
  return 0;
}

}  // namespace
}  // namespace vmstash::stash

int main(int argc, char** argv) {
  if (argc == 1) return vmstash::stash::Run();
  for (int i = 1; i + 1 < argc; i += 2) {
    const unsigned grid = static_cast<unsigned>(std::strtoul(argv[i], nullptr, 10));
    const unsigned threads = static_cast<unsigned>(std::strtoul(argv[i + 1], nullptr, 10));
    vmstash::stash::SetLaunchShape(grid, threads);
    std::printf("\n== launch shape: at most %u blocks of %u threads ==\n", grid, threads);
    if (int rc = vmstash::stash::Run(); rc != 0) return rc;
  }
  return 0;
}
