// vmm_bench: the physical limits later issues are measured against, through our Driver.
//
//   1. create + map + setAccess + unmap + release of TOTAL bytes (default 16 GiB) in
//      chunks of 2 MiB, 32 MiB, 512 MiB and 2 GiB (median of --reps runs, per phase);
//   2. pinning cost of host memory (HostAlloc), s/GiB;
//   3. pinned D2H and H2D copy bandwidth (--copy bytes, median of --reps, CUDA events).
//
//   vmm_bench [--total=16G] [--copy=4G] [--reps=3] [--device=0]
// Uses the driver VMSTASH_DRIVER/VMSTASH_CONF select (auto: the GPU when present).
// This is a benchmark, not a test: it prints figures and fails only on driver errors.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/types/span.h"
#include "vmm/chunk.h"
#include "vmm/driver_factory.h"
#include "vmm/mapping.h"
#include "runtime/runtime_options.h"
#include "vmm/pinned_host_buffer.h"
#include "vmm/reservation.h"
#include "base/status_macros.h"

namespace vmstash {
namespace {

using Clock = std::chrono::steady_clock;
double Ms(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct CycleTimes {
  std::vector<double> create, map, unmap, release, total;
};

absl::Status TimeCycle(Driver& d, int dev, const Reservation& r, std::size_t total, std::size_t chunk,
                       CycleTimes& out) {
  std::vector<Chunk> chunks;
  chunks.reserve(total / chunk);
  auto t0 = Clock::now();
  for (std::size_t off = 0; off < total; off += chunk) {
    VMSTASH_ASSIGN_OR_RETURN(Chunk c, Chunk::Create(&d, dev, chunk));
    chunks.push_back(std::move(c));
  }
  auto t1 = Clock::now();
  VMSTASH_ASSIGN_OR_RETURN(Mapping m, Mapping::Create(&d, dev, r.address(), chunks));
  auto t2 = Clock::now();
  VMSTASH_RETURN_IF_ERROR(m.Unmap());
  auto t3 = Clock::now();
  for (Chunk& c : chunks) VMSTASH_RETURN_IF_ERROR(c.Release());
  auto t4 = Clock::now();
  out.create.push_back(Ms(t0, t1));
  out.map.push_back(Ms(t1, t2));
  out.unmap.push_back(Ms(t2, t3));
  out.release.push_back(Ms(t3, t4));
  out.total.push_back(Ms(t0, t4));
  return absl::OkStatus();
}

absl::Status Run(Driver& d, int dev, std::size_t total, std::size_t copy, int reps) {
  VMSTASH_ASSIGN_OR_RETURN(DeviceMemoryInfo info, d.MemoryInfo(dev));
  VMSTASH_ASSIGN_OR_RETURN(std::size_t g, d.Granularity(dev, GranularityKind::kMinimum, {}));
  const std::size_t two_gib = std::size_t{2} << 30;
  if (total > info.free_bytes * 9 / 10) {
    std::size_t fit = info.free_bytes * 9 / 10 / two_gib * two_gib;
    std::printf("note: %.1f GiB requested but %.1f GiB free; measuring %.1f GiB\n", total / 1073741824.0,
                info.free_bytes / 1073741824.0, fit / 1073741824.0);
    total = fit;
  }
  std::printf("driver %s, device %d: %.1f GiB free of %.1f GiB, granularity %zu bytes\n",
              std::string(d.Name()).c_str(), dev, info.free_bytes / 1073741824.0, info.total_bytes / 1073741824.0, g);
  std::printf("\n== create+map+setAccess+unmap+release of %.1f GiB (median of %d) ==\n", total / 1073741824.0, reps);
  std::printf("%10s %8s %10s %12s %10s %10s %10s %10s\n", "chunk", "chunks", "create_ms", "map+acc_ms", "unmap_ms",
              "release_ms", "total_ms", "ms/GiB");
  VMSTASH_ASSIGN_OR_RETURN(Reservation r, Reservation::Create(&d, dev, total, two_gib));
  for (std::size_t chunk : {std::size_t{2} << 20, std::size_t{32} << 20, std::size_t{512} << 20, two_gib}) {
    if (chunk % g != 0 || chunk > total) continue;
    CycleTimes t;
    for (int i = 0; i < reps; ++i) VMSTASH_RETURN_IF_ERROR(TimeCycle(d, dev, r, total, chunk, t));
    std::printf("%8zuMiB %8zu %10.2f %12.2f %10.2f %10.2f %10.2f %10.3f\n", chunk >> 20, total / chunk,
                Median(t.create), Median(t.map), Median(t.unmap), Median(t.release), Median(t.total),
                Median(t.total) / (total / 1073741824.0));
  }

  std::printf("\n== release of %.1f GiB after use (map, memset, unmap; then time cuMemRelease) ==\n",
              total / 1073741824.0);
  for (auto [pieces, threads] : {std::pair<int, int>{1, 1}, {8, 1}, {8, 8}, {64, 8}}) {
    std::vector<double> ms;
    for (int rep = 0; rep < reps; ++rep) {
      std::vector<Chunk> cs(pieces);
      const std::size_t piece = total / pieces;
      for (auto& c : cs) {
        VMSTASH_ASSIGN_OR_RETURN(c, Chunk::Create(&d, dev, piece));
      }
      {
        VMSTASH_ASSIGN_OR_RETURN(Mapping mm, Mapping::Create(&d, dev, r.address(), cs));
        VMSTASH_RETURN_IF_ERROR(d.MemsetAsync(dev, r.address(), 1, total, nullptr));
        VMSTASH_RETURN_IF_ERROR(d.SynchronizeDevice(dev));
        VMSTASH_RETURN_IF_ERROR(mm.Unmap());
      }
      auto t0 = Clock::now();
      std::vector<std::thread> pool;
      std::atomic<int> next{0};
      for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&] {
          for (int i = next++; i < pieces; i = next++) (void)cs[i].Release();
        });
      }
      for (auto& th : pool) th.join();
      ms.push_back(Ms(t0, Clock::now()));
    }
    std::printf("%3d chunk(s), %d thread(s): release %.2f ms (median of %d)\n", pieces, threads, Median(ms), reps);
  }

  std::printf("\n== create+map of %.1f GiB right after releasing %.1f GiB of used memory ==\n",
              total / 1073741824.0, total / 1073741824.0);
  for (int delay_ms : {0, 20, 50, 200}) {
    {
      VMSTASH_ASSIGN_OR_RETURN(Chunk used, Chunk::Create(&d, dev, total));
      VMSTASH_ASSIGN_OR_RETURN(Mapping mm, Mapping::Create(&d, dev, r.address(), absl::MakeConstSpan(&used, 1)));
      VMSTASH_RETURN_IF_ERROR(d.MemsetAsync(dev, r.address(), 1, total, nullptr));
      VMSTASH_RETURN_IF_ERROR(d.SynchronizeDevice(dev));
    }  // unmapped, then released
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    auto t0 = Clock::now();
    VMSTASH_ASSIGN_OR_RETURN(Chunk fresh, Chunk::Create(&d, dev, total));
    auto t1 = Clock::now();
    VMSTASH_ASSIGN_OR_RETURN(Mapping mm, Mapping::Create(&d, dev, r.address(), absl::MakeConstSpan(&fresh, 1)));
    auto t2 = Clock::now();
    VMSTASH_RETURN_IF_ERROR(d.MemsetAsync(dev, r.address(), 2, total, nullptr));
    VMSTASH_RETURN_IF_ERROR(d.SynchronizeDevice(dev));
    auto t3 = Clock::now();
    VMSTASH_RETURN_IF_ERROR(d.MemsetAsync(dev, r.address(), 3, total, nullptr));
    VMSTASH_RETURN_IF_ERROR(d.SynchronizeDevice(dev));
    auto t4 = Clock::now();
    std::printf("after %3d ms: create %.2f ms, map %.2f ms, first memset %.2f ms, second memset %.2f ms\n", delay_ms,
                Ms(t0, t1), Ms(t1, t2), Ms(t2, t3), Ms(t3, t4));
  }

  std::printf("\n== pinned host memory and copies, %.1f GiB ==\n", copy / 1073741824.0);
  auto p0 = Clock::now();
  VMSTASH_ASSIGN_OR_RETURN(PinnedHostBuffer host, PinnedHostBuffer::Allocate(&d, dev, copy));
  auto p1 = Clock::now();
  std::printf("HostAlloc (pinning): %.3f s/GiB\n", Ms(p0, p1) / 1000.0 / (copy / 1073741824.0));
  std::size_t copy_dev = (copy + g - 1) / g * g;
  VMSTASH_ASSIGN_OR_RETURN(Reservation cr, Reservation::Create(&d, dev, copy_dev));
  std::vector<Chunk> chunks;
  VMSTASH_ASSIGN_OR_RETURN(Chunk c, Chunk::Create(&d, dev, copy_dev));
  chunks.push_back(std::move(c));
  VMSTASH_ASSIGN_OR_RETURN(Mapping m, Mapping::Create(&d, dev, cr.address(), chunks));
  VMSTASH_ASSIGN_OR_RETURN(Stream s, d.CreateStream(dev));
  VMSTASH_ASSIGN_OR_RETURN(Event e0, d.CreateEvent(dev, true));
  VMSTASH_ASSIGN_OR_RETURN(Event e1, d.CreateEvent(dev, true));
  std::vector<double> d2h, h2d;
  for (int i = 0; i < reps + 1; ++i) {  // the first round warms up
    for (int dir = 0; dir < 2; ++dir) {
      VMSTASH_RETURN_IF_ERROR(d.RecordEvent(dev, e0, s));
      if (dir == 0) {
        VMSTASH_RETURN_IF_ERROR(d.CopyToHostAsync(dev, host.data(), cr.address(), copy, s));
      } else {
        VMSTASH_RETURN_IF_ERROR(d.CopyToDeviceAsync(dev, cr.address(), host.data(), copy, s));
      }
      VMSTASH_RETURN_IF_ERROR(d.RecordEvent(dev, e1, s));
      VMSTASH_RETURN_IF_ERROR(d.SynchronizeEvent(dev, e1));
      VMSTASH_ASSIGN_OR_RETURN(float ms, d.ElapsedMs(dev, e0, e1));
      if (i > 0) (dir == 0 ? d2h : h2d).push_back(copy / (ms * 1e6));
    }
  }
  std::printf("pinned D2H: %.1f GB/s   pinned H2D: %.1f GB/s   (median of %d, GB = 1e9 bytes)\n", Median(d2h),
              Median(h2d), reps);
  VMSTASH_RETURN_IF_ERROR(d.DestroyEvent(dev, e0));
  VMSTASH_RETURN_IF_ERROR(d.DestroyEvent(dev, e1));
  VMSTASH_RETURN_IF_ERROR(d.DestroyStream(dev, s));
  VMSTASH_RETURN_IF_ERROR(m.Unmap());
  return absl::OkStatus();
}

}  // namespace
}  // namespace vmstash

int main(int argc, char** argv) {
  std::size_t total = std::size_t{16} << 30;
  std::size_t copy = std::size_t{4} << 30;
  int reps = 3;
  int device = 0;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    bool ok = false;
    if (absl::StartsWith(arg, "--total=") || absl::StartsWith(arg, "--copy=")) {
      absl::StatusOr<std::uint64_t> v = vmstash::ParseSize(arg.substr(arg.find('=') + 1));
      ok = v.ok() && *v > 0;
      if (ok) (absl::StartsWith(arg, "--total=") ? total : copy) = *v;
    } else if (absl::StartsWith(arg, "--reps=")) {
      ok = absl::SimpleAtoi(arg.substr(7), &reps) && reps > 0;
    } else if (absl::StartsWith(arg, "--device=")) {
      ok = absl::SimpleAtoi(arg.substr(9), &device) && device >= 0;
    }
    if (!ok) {
      std::fprintf(stderr, "usage: vmm_bench [--total=16G] [--copy=4G] [--reps=3] [--device=0]\n");
      return 2;
    }
  }
  absl::StatusOr<vmstash::RuntimeOptions> options = vmstash::RuntimeOptionsFromEnvironment();
  if (!options.ok()) {
    std::fprintf(stderr, "vmm_bench: %s\n", options.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<std::unique_ptr<vmstash::Driver>> driver = vmstash::CreateDriver(options->vmm);
  if (!driver.ok()) {
    std::fprintf(stderr, "vmm_bench: %s\n", driver.status().ToString().c_str());
    return 1;
  }
  absl::Status status = vmstash::Run(**driver, device, total, copy, reps);
  if (!status.ok()) {
    std::fprintf(stderr, "vmm_bench: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
