// pause_bench: pause/resume of tags against the physical limit, in one run on one GPU.
//
//   limit     pinned D2H and H2D copies of the same size through the driver
//             (cuMemcpyAsync with page-locked host memory, what cudaMemcpyAsync does)
//   backup    pause+resume of SIZE in 1 block and in 1024 blocks: first cycle with the
//             arena prepared by the background thread (auto_prepare), later cycles; a
//             first cycle with nothing prepared (the pause pins); and cycles with the
//             pipelining off (one stage, one chunk per cover) to show what it buys;
//             first cycles meeting the background preparation 0-100% of the way through
//   discard   pause+resume of SIZE in 1024 blocks
//   half-free a tag of SIZE with every other block freed: pause time follows live bytes
//   prepare   an arena of SIZE made ready: cuMemHostAlloc, and pinned pieces faulted in by
//             1 and by N threads (Note [Pinned Pieces]); handed back, pinned again
//
// Usage: pause_bench [SIZE_GIB=16]. Driver from VMSTASH_CONF/VMSTASH_DRIVER.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "allocator/caching_allocator.h"
#include "base/log.h"
#include "bench/bench_check.h"
#include "vmm/driver_factory.h"
#include "runtime/runtime_options.h"
#include "vmm/pinned_host_buffer.h"
#include "vmm/pinned_pieces.h"

namespace vmstash {
namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }
double GBps(std::size_t bytes, double s) { return s > 0 ? bytes / s / 1e9 : 0; }

struct Cycle {
  double pause_s = 0, resume_s = 0;
};

absl::StatusOr<Cycle> PauseResume(CachingAllocator& a, TagId tag, double idle_s = 0) {
  Cycle c;
  auto t0 = Clock::now();
  absl::StatusOr<CachingAllocator::Transition> p = a.Pause(tag);
  if (idle_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(idle_s));
  auto t1 = Clock::now();
  if (!p.ok()) return p.status();
  absl::StatusOr<CachingAllocator::Transition> r = a.Resume(tag);
  auto t2 = Clock::now();
  if (!r.ok()) return r.status();
  c.pause_s = Seconds(t0, t1) - idle_s;
  c.resume_s = Seconds(t1, t2);
  return c;
}

int Run(int argc, char** argv) {
  const std::size_t gib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 16;
  const std::size_t size = gib << 30;
  absl::StatusOr<RuntimeOptions> options = RuntimeOptionsFromEnvironment();
  if (!options.ok()) return std::fprintf(stderr, "%s\n", options.status().ToString().c_str()), 1;
  SetLogLevel(options->vmm.log_level);  // log_level:debug prints each pause's warming and registering time
  absl::StatusOr<std::unique_ptr<Driver>> made = CreateDriver(options->vmm);
  if (!made.ok()) return std::fprintf(stderr, "%s\n", made.status().ToString().c_str()), 1;
  Driver& driver = **made;
  auto alloc_or = CachingAllocator::Create(&driver, 0, options->allocator);
  if (!alloc_or.ok()) return std::fprintf(stderr, "%s\n", alloc_or.status().ToString().c_str()), 1;
  CachingAllocator& alloc = **alloc_or;
  std::printf("pause_bench: driver %s, %zu GiB\n", std::string(driver.Name()).c_str(), gib);

  // The limit: pinned copies of the same size.
  double d2h = 0, h2d = 0, h2d_fresh = 0;
  {
    absl::StatusOr<PinnedHostBuffer> host = PinnedHostBuffer::Allocate(&driver, 0, size);
    if (!host.ok()) return std::fprintf(stderr, "%s\n", host.status().ToString().c_str()), 1;
    absl::StatusOr<DevicePtr> dev = alloc.Allocate(size, nullptr);
    if (!dev.ok()) return std::fprintf(stderr, "%s\n", dev.status().ToString().c_str()), 1;
    absl::StatusOr<Stream> stream = driver.CreateStream(0);
    {
      // Into physical memory never written since it was created (what a resume writes).
      auto t0 = Clock::now();
      BENCH_CHECK(driver.CopyToDeviceAsync(0, *dev, host->data(), size, *stream));
      BENCH_CHECK(driver.SynchronizeStream(0, *stream));
      h2d_fresh = GBps(size, Seconds(t0, Clock::now()));
    }
    for (int rep = 0; rep < 3; ++rep) {
      auto t0 = Clock::now();
      BENCH_CHECK(driver.CopyToHostAsync(0, host->data(), *dev, size, *stream));
      BENCH_CHECK(driver.SynchronizeStream(0, *stream));
      auto t1 = Clock::now();
      BENCH_CHECK(driver.CopyToDeviceAsync(0, *dev, host->data(), size, *stream));
      BENCH_CHECK(driver.SynchronizeStream(0, *stream));
      auto t2 = Clock::now();
      d2h = std::max(d2h, GBps(size, Seconds(t0, t1)));
      h2d = std::max(h2d, GBps(size, Seconds(t1, t2)));
    }
    BENCH_CHECK(driver.DestroyStream(0, *stream));
    BENCH_CHECK(alloc.Free(*dev));
    BENCH_CHECK(alloc.EmptyCache());
  }
  std::printf("limit: pinned D2H %.1f GB/s, H2D %.1f GB/s (best of 3, GB = 1e9 B); H2D into freshly created "
              "memory %.1f GB/s\n", d2h, h2d, h2d_fresh);
  // Preparing an arena ahead of the first pause (Note [Pinned Pieces]): faulted in by 1 and by
  // N threads and registered piece by piece, against one cuMemHostAlloc of the same size.
  {
    auto t0 = Clock::now();
    absl::StatusOr<PinnedHostBuffer> host = PinnedHostBuffer::Allocate(&driver, 0, size);
    const double alloc_s = Seconds(t0, Clock::now());
    BENCH_CHECK(host.status());
    t0 = Clock::now();
    BENCH_CHECK(host->Release());
    const double free_s = Seconds(t0, Clock::now());
    std::printf("prepare: cuMemHostAlloc %.2f s (%.1f GB/s), cuMemFreeHost %.2f s\n", alloc_s, GBps(size, alloc_s),
                free_s);
    for (int threads : {1, PinnedPieces::DefaultThreads()}) {
      PinnedPieces pieces(&driver, 0, threads);
      t0 = Clock::now();
      BENCH_CHECK(pieces.Reserve(size));
      BENCH_CHECK(pieces.Warm(size));
      const double warm_s = Seconds(t0, Clock::now());
      BENCH_CHECK(pieces.Pin(0, size));
      const double pin_s = Seconds(t0, Clock::now());
      t0 = Clock::now();
      BENCH_CHECK(pieces.HandBack(/*lazily=*/true));
      const double back_s = Seconds(t0, Clock::now());
      t0 = Clock::now();
      BENCH_CHECK(pieces.Pin(0, size));
      const double again_s = Seconds(t0, Clock::now());
      std::printf("prepare: pinned pieces, %2d thread%s: %.2f s (%.1f GB/s; faulting in %.2f s); handed back in "
                  "%.2f s; pinned again %.2f s (%.1f GB/s)\n",
                  threads, threads > 1 ? "s" : " ", pin_s, GBps(size, pin_s), warm_s, back_s, again_s,
                  GBps(size, again_s));
    }
  }
  std::printf("%-44s %10s %9s %7s %10s %9s %7s\n", "case", "pause ms", "GB/s", "%limit", "resume ms", "GB/s",
              "%limit");
  auto report = [&](const char* name, const Cycle& c, std::size_t bytes) {
    double pg = GBps(bytes, c.pause_s), rg = GBps(bytes, c.resume_s);
    std::printf("%-44s %10.1f %9.1f %6.1f%% %10.1f %9.1f %6.1f%%\n", name, c.pause_s * 1e3, pg,
                bytes ? 100 * pg / d2h : 0.0, c.resume_s * 1e3, rg, bytes ? 100 * rg / h2d : 0.0);
  };

  TagId backup = *InternTag("bench_backup"), cold = *InternTag("bench_cold"), discard = *InternTag("bench_discard");
  BENCH_CHECK(alloc.CreateTag(backup, Policy::kBackup));
  BENCH_CHECK(alloc.CreateTag(discard, Policy::kDiscard));

  // Backup, 1 block, arena prepared.
  {
    auto t0 = Clock::now();
    DevicePtr p = *alloc.Allocate(size, nullptr, backup);
    alloc.WaitForBackgroundPrepare();  // what a phase of real work would hide
    std::printf("background preparation of the arena (%.1f GiB pinned, ahead of the first pause): %.2f s\n",
                [&] {
                  for (const TagStats& t : alloc.Stats().tags) {
                    if (t.name == "bench_backup") return t.backup_arena_bytes / double(1 << 30);
                  }
                  return 0.0;
                }(),
                Seconds(t0, Clock::now()));
    for (int cycle = 1; cycle <= 3; ++cycle) {
      absl::StatusOr<Cycle> c = PauseResume(alloc, backup);
      BENCH_CHECK(c.status());
      report(cycle == 1 ? "backup, 1 block, cycle 1 (prepared)" : "backup, 1 block, later cycle", *c, size);
    }
    // In RL the resume comes a phase after the pause; the driver has had time to clean
    // the pages the pause gave back.
    absl::StatusOr<Cycle> idle = PauseResume(alloc, backup, 2.0);
    BENCH_CHECK(idle.status());
    report("backup, 1 block, resume 2 s after the pause", *idle, size);
    // How long after a pause a resume runs at link speed: the driver is still busy with
    // the memory the pause gave back (see README).
    for (int delay_ms : {0, 10, 20, 40, 80, 160}) {
      absl::StatusOr<Cycle> c = PauseResume(alloc, backup, delay_ms / 1000.0);
      BENCH_CHECK(c.status());
      std::printf("backup, 1 block, resume %3d ms after the pause: resume %.1f ms (%.1f%% of H2D)\n", delay_ms,
                  c->resume_s * 1e3, 100 * GBps(size, c->resume_s) / h2d);
    }
    BENCH_CHECK(alloc.Free(p));
    BENCH_CHECK(alloc.EmptyCache());
  }
  // Backup, 1024 blocks (same tag: the arena is reused).
  {
    std::vector<DevicePtr> blocks;
    for (int i = 0; i < 1024; ++i) blocks.push_back(*alloc.Allocate(size / 1024, nullptr, backup));
    for (int cycle = 1; cycle <= 3; ++cycle) {
      absl::StatusOr<Cycle> c = PauseResume(alloc, backup);
      BENCH_CHECK(c.status());
      report(cycle == 1 ? "backup, 1024 blocks, cycle 1 (prepared)" : "backup, 1024 blocks, later cycle", *c, size);
    }
    // Half of the blocks freed (cached, not live): pause copies only the live half.
    for (int i = 0; i < 1024; i += 2) BENCH_CHECK(alloc.Free(blocks[i]));
    absl::StatusOr<Cycle> c = PauseResume(alloc, backup);
    BENCH_CHECK(c.status());
    report("backup, 1024 blocks, half free (live bytes)", *c, size / 2);
    for (int i = 1; i < 1024; i += 2) BENCH_CHECK(alloc.Free(blocks[i]));
    BENCH_CHECK(alloc.ReleaseBackup(backup));
    BENCH_CHECK(alloc.EmptyCache());
  }
  // Without auto_prepare or pipelining: a second allocator on the same device.
  {
    AllocatorOptions plain = options->allocator;
    plain.auto_prepare = false;
    plain.pause_stage_bytes = ~std::size_t{0};  // one stage: unmap after all copies
    plain.resume_first_piece_bytes = 0;         // one chunk per cover
    auto other = CachingAllocator::Create(&driver, 0, plain);
    BENCH_CHECK(other.status());
    CachingAllocator& b = **other;
    BENCH_CHECK(b.CreateTag(cold, Policy::kBackup));
    DevicePtr p = *b.Allocate(size, nullptr, cold);
    absl::StatusOr<Cycle> c = PauseResume(b, cold);
    BENCH_CHECK(c.status());
    report("backup, 1 block, cycle 1 (not prepared)", *c, size);
    for (int cycle = 2; cycle <= 3; ++cycle) {
      c = PauseResume(b, cold);
      BENCH_CHECK(c.status());
      report("backup, 1 block, no pipelining", *c, size);
    }
    BENCH_CHECK(b.Free(p));
    std::vector<DevicePtr> blocks;
    for (int i = 0; i < 1024; ++i) blocks.push_back(*b.Allocate(size / 1024, nullptr, cold));
    for (int cycle = 1; cycle <= 2; ++cycle) {
      c = PauseResume(b, cold);
      BENCH_CHECK(c.status());
      report("backup, 1024 blocks, no pipelining", *c, size);
    }
    for (DevicePtr q : blocks) BENCH_CHECK(b.Free(q));
    BENCH_CHECK(b.ReleaseBackup(cold));
    BENCH_CHECK(b.EmptyCache());
  }
  // A first pause that meets its arena still in preparation (the background preparation
  // let run until a share of it is pinned): it should cost no more than the pause that
  // pins all of it itself ("cycle 1 (not prepared)"), and tend to the prepared one's.
  if (options->allocator.auto_prepare) {
    for (int percent : {0, 25, 50, 75, 100}) {
      const std::string name = "bench_part_" + std::to_string(percent);
      const TagId part = *InternTag(name);
      BENCH_CHECK(alloc.CreateTag(part, Policy::kBackup));
      DevicePtr p = *alloc.Allocate(size, nullptr, part);
      auto prepared = [&]() -> std::size_t {
        for (const TagStats& t : alloc.Stats().tags) {
          if (t.name == name) return static_cast<std::size_t>(t.backup_arena_bytes);
        }
        return 0;
      };
      const auto t0 = Clock::now();
      if (percent == 100) {
        alloc.WaitForBackgroundPrepare();
      } else if (percent > 0) {
        while (prepared() < size / 100 * percent && Seconds(t0, Clock::now()) < 120) {
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
      }
      const double gib_prepared = prepared() / double(1 << 30);
      absl::StatusOr<Cycle> c = PauseResume(alloc, part);
      BENCH_CHECK(c.status());
      char label[64];
      std::snprintf(label, sizeof label, "backup, 1 block, cycle 1, %4.1f GiB prepared", gib_prepared);
      report(label, *c, size);
      BENCH_CHECK(alloc.Free(p));
      BENCH_CHECK(alloc.ReleaseBackup(part));
      BENCH_CHECK(alloc.EmptyCache());
    }
  }
  // Discard, 1024 blocks.
  {
    std::vector<DevicePtr> blocks;
    for (int i = 0; i < 1024; ++i) blocks.push_back(*alloc.Allocate(size / 1024, nullptr, discard));
    for (int cycle = 1; cycle <= 3; ++cycle) {
      absl::StatusOr<Cycle> c = PauseResume(alloc, discard);
      BENCH_CHECK(c.status());
      std::printf("discard, 1024 blocks, cycle %d: pause %.2f ms + resume %.2f ms = %.2f ms\n", cycle,
                  c->pause_s * 1e3, c->resume_s * 1e3, (c->pause_s + c->resume_s) * 1e3);
    }
    for (DevicePtr p : blocks) BENCH_CHECK(alloc.Free(p));
  }
  for (const TagStats& t : alloc.Stats().tags) {
    if (t.pauses == 0) continue;
    std::printf("stats %s: pauses %llu, last pause %.1f ms (%.1f GiB/s), last resume %.1f ms (%.1f GiB/s)\n",
                t.name.c_str(), static_cast<unsigned long long>(t.pauses), t.last_pause_ms, t.last_pause_gib_per_s,
                t.last_resume_ms, t.last_resume_gib_per_s);
  }
  return 0;
}

}  // namespace
}  // namespace vmstash

int main(int argc, char** argv) { return vmstash::Run(argc, argv); }
