// allocator_bench: vmstash's caching allocator side by side with PyTorch's native CUDA
// caching allocator (when built with VMSTASH_TORCH_DIR), in one run on one GPU.
//
//   pair   cached malloc+free of one size (512 B, 1 MiB, 64 MiB), ns per pair
//   churn  256 live blocks, 7 sizes 512 B..50 MiB, random replacement, ns per op
//          (one op = free one block + allocate one)
//   trace  the synthetic training trace (tests/replay): peak reserved / peak allocated
//
// Each timed case runs 5 times; the median is printed. Driver: VMSTASH_CONF/VMSTASH_DRIVER.
#include <algorithm>
#include <functional>
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include "allocator/caching_allocator.h"
#include "tests/replay/caching_allocator_target.h"
#include "tests/replay/trace.h"
#include "torch_plugin/include/vmstash/vmstash.h"
#include "vmm/driver_factory.h"
#include "runtime/runtime_options.h"
#ifdef VMSTASH_BENCH_WITH_TORCH
#include "bench/torch_side.h"
#endif

namespace vmstash {
namespace {

using Clock = std::chrono::steady_clock;

struct Api {
  const char* name;
  std::function<void*(std::size_t)> alloc;
  std::function<void(void*)> free;
};

template <typename AllocFn, typename FreeFn>
double PairNs(AllocFn alloc, FreeFn free, std::size_t size, int iters) {
  free(alloc(size));  // warm the cache
  std::vector<double> runs;
  for (int r = 0; r < 5; ++r) {
    auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) free(alloc(size));
    runs.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / iters);
  }
  std::sort(runs.begin(), runs.end());
  return runs[2];
}

template <typename AllocFn, typename FreeFn>
double ChurnNs(AllocFn alloc, FreeFn free, int ops) {
  const std::size_t sizes[] = {512, 4096, 65536, 1 << 20, 4 << 20, 16 << 20, 50 << 20};
  std::vector<double> runs;
  for (int r = 0; r < 5; ++r) {
    std::mt19937_64 rng(42);
    std::vector<void*> live(256);
    for (auto& p : live) p = alloc(sizes[rng() % 7]);
    // Warm-up pass so the cache holds the working set, then the timed pass.
    for (int pass = 0; pass < 2; ++pass) {
      auto t0 = Clock::now();
      for (int i = 0; i < ops; ++i) {
        std::size_t slot = rng() % live.size();
        free(live[slot]);
        live[slot] = alloc(sizes[rng() % 7]);
      }
      if (pass == 1) runs.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / ops);
    }
    for (void* p : live) free(p);
  }
  std::sort(runs.begin(), runs.end());
  return runs[2];
}

#ifdef VMSTASH_BENCH_WITH_TORCH
class TorchTarget : public ReplayTarget {
 public:
  absl::StatusOr<std::uint64_t> Allocate(std::uint64_t size, int) override {
    return reinterpret_cast<std::uint64_t>(vmstash_bench::TorchAlloc(size));
  }
  absl::Status Free(std::uint64_t ptr) override {
    vmstash_bench::TorchFree(reinterpret_cast<void*>(ptr));
    return absl::OkStatus();
  }
  std::uint64_t PeakReservedBytes() override { return vmstash_bench::TorchPeakReservedBytes(); }
};
#endif

int Run() {
  absl::StatusOr<RuntimeOptions> options = RuntimeOptionsFromEnvironment();
  if (!options.ok()) return std::fprintf(stderr, "%s\n", options.status().ToString().c_str()), 1;
  absl::StatusOr<std::unique_ptr<Driver>> driver = CreateDriver(options->vmm);
  if (!driver.ok()) return std::fprintf(stderr, "%s\n", driver.status().ToString().c_str()), 1;
  auto made = CachingAllocator::Create(driver->get(), 0, options->allocator);
  if (!made.ok()) return std::fprintf(stderr, "%s\n", made.status().ToString().c_str()), 1;
  CachingAllocator& ours = **made;
  auto ours_alloc = [&](std::size_t n) { return reinterpret_cast<void*>(*ours.Allocate(n, nullptr)); };
  auto ours_free = [&](void* p) { (void)ours.Free(reinterpret_cast<DevicePtr>(p)); };
  std::string conf = "driver:" + std::string((*driver)->Name());
  if (vmstash_init(nullptr) != 0) return std::fprintf(stderr, "vmstash_init: %s\n", vmstash_last_error()), 1;
  auto abi_alloc = [](std::size_t n) { return vmstash_malloc(n, 0, nullptr); };
  auto abi_free = [](void* p) { vmstash_free(p, 0, 0, nullptr); };
  bool torch = false;
#ifdef VMSTASH_BENCH_WITH_TORCH
  torch = vmstash_bench::TorchInit();
#endif
  std::printf("allocator_bench: driver %s, torch %s\n", std::string((*driver)->Name()).c_str(),
              torch ? "yes" : "no");
  std::printf("%-22s %14s %14s %14s %10s\n", "case", "vmstash C++", "vmstash C ABI", "torch", "torch/ours");
  const int kIters = 200000;
  for (std::size_t size : {std::size_t{512}, std::size_t{1} << 20, std::size_t{64} << 20}) {
    double a = PairNs(ours_alloc, ours_free, size, kIters);
    double b = PairNs(abi_alloc, abi_free, size, kIters);
    double t = 0;
#ifdef VMSTASH_BENCH_WITH_TORCH
    if (torch) t = PairNs(vmstash_bench::TorchAlloc, vmstash_bench::TorchFree, size, kIters);
#endif
    std::printf("pair %-17zu %11.1f ns %11.1f ns %11.1f ns %10.2f\n", size, a, b, t, t > 0 ? t / a : 0.0);
  }
  {
    double a = ChurnNs(ours_alloc, ours_free, 100000);
    double b = ChurnNs(abi_alloc, abi_free, 100000);
    double t = 0;
#ifdef VMSTASH_BENCH_WITH_TORCH
    if (torch) t = ChurnNs(vmstash_bench::TorchAlloc, vmstash_bench::TorchFree, 100000);
#endif
    std::printf("churn (ns/op)          %11.1f ns %11.1f ns %11.1f ns %10.2f\n", a, b, t, t > 0 ? t / a : 0.0);
  }
  // Trace replay: peak reserved / peak allocated, same trace for both.
  std::vector<TraceOp> trace = GenerateTrainingTrace(7, 8, 12, std::uint64_t{64} << 20);
  (void)ours.EmptyCache();
  ours.ResetPeaks();
  {
    CachingAllocatorTarget target(&ours);
    absl::StatusOr<ReplayResult> r = Replay(trace, target);
    if (!r.ok()) return std::fprintf(stderr, "replay: %s\n", r.status().ToString().c_str()), 1;
    std::printf("trace vmstash: %llu ops, peak allocated %.3f GiB, peak reserved %.3f GiB, ratio %.4f\n",
                static_cast<unsigned long long>(r->operations), r->peak_allocated_bytes / 1073741824.0,
                r->peak_reserved_bytes / 1073741824.0, r->ratio());
  }
  (void)ours.EmptyCache();
#ifdef VMSTASH_BENCH_WITH_TORCH
  if (torch) {
    vmstash_bench::TorchEmptyCacheAndResetPeaks();
    TorchTarget target;
    absl::StatusOr<ReplayResult> r = Replay(trace, target);
    if (!r.ok()) return std::fprintf(stderr, "replay: %s\n", r.status().ToString().c_str()), 1;
    std::printf("trace torch:   %llu ops, peak allocated %.3f GiB, peak reserved %.3f GiB, ratio %.4f "
                "(torch's own peak allocated %.3f GiB)\n",
                static_cast<unsigned long long>(r->operations), r->peak_allocated_bytes / 1073741824.0,
                r->peak_reserved_bytes / 1073741824.0, r->ratio(),
                vmstash_bench::TorchPeakAllocatedBytes() / 1073741824.0);
    vmstash_bench::TorchEmptyCacheAndResetPeaks();
  }
#endif
  vmstash_shutdown();
  return 0;
}

}  // namespace
}  // namespace vmstash

int main() { return vmstash::Run(); }
