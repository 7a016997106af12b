// switch_bench: a phase switch (CachingAllocator::Switch, Note [Switch Protocol]) against
// the same tags paused and resumed one after the other, and against the link, in one run
// on one GPU.
//
//   limit       pinned D2H of X GiB concurrent with pinned H2D of Y GiB on two streams
//               (cuMemcpyAsync with page-locked memory), best of 3; also the two copies
//               one after the other (the sequential path's limit)
//   backup      tag A (backup, X GiB) active, tag B (backup, Y GiB) paused with its backup;
//               switch(pause A, resume B) and back, and pause(A)+resume(B) and back; each
//               direction's median of REPS; the first bytes of each tag checked after
//   Each timed transition starts kIdleS after the one before, as a phase of work separates
//   them in RL (memory created right after a large release waits on the driver for tens
//   of ms: pause_bench measures it); both paths alike.
//   discard     the same with two discard tags of 16 GiB (nothing copied): what is left is
//               the handover of physical memory, in two layouts: as a resume leaves a tag
//               (one chunk per run) and as 1024 allocations grew it (many chunks)
//
// Usage: switch_bench [X_GIB=8] [Y_GIB=8] [REPS=5] [DISCARD=1]. Driver from VMSTASH_CONF/VMSTASH_DRIVER.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "allocator/caching_allocator.h"
#include "bench/bench_check.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "runtime/runtime_options.h"
#include "vmm/driver_factory.h"
#include "vmm/pinned_host_buffer.h"

namespace vmstash {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::size_t kGiB = std::size_t{1} << 30;
double Ms(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }

constexpr double kIdleS = 0.2;
void Idle() { std::this_thread::sleep_for(std::chrono::duration<double>(kIdleS)); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The limits for X out and Y in: concurrent and one after the other (best of 3).
struct Limits {
  double concurrent_ms = 1e30;
  double sequential_ms = 1e30;
};
absl::StatusOr<Limits> MeasureLimits(Driver& d, DevicePtr dev_out, DevicePtr dev_in, char* host_out, char* host_in,
                                     std::size_t x, std::size_t y, Stream s1, Stream s2) {
  Limits l;
  for (int rep = 0; rep < 3; ++rep) {
    auto t0 = Clock::now();
    if (x) VMSTASH_RETURN_IF_ERROR(d.CopyToHostAsync(0, host_out, dev_out, x, s1));
    if (y) VMSTASH_RETURN_IF_ERROR(d.CopyToDeviceAsync(0, dev_in, host_in, y, s2));
    VMSTASH_RETURN_IF_ERROR(d.SynchronizeStream(0, s1));
    VMSTASH_RETURN_IF_ERROR(d.SynchronizeStream(0, s2));
    auto t1 = Clock::now();
    if (x) VMSTASH_RETURN_IF_ERROR(d.CopyToHostAsync(0, host_out, dev_out, x, s1));
    VMSTASH_RETURN_IF_ERROR(d.SynchronizeStream(0, s1));
    if (y) VMSTASH_RETURN_IF_ERROR(d.CopyToDeviceAsync(0, dev_in, host_in, y, s1));
    VMSTASH_RETURN_IF_ERROR(d.SynchronizeStream(0, s1));
    auto t2 = Clock::now();
    l.concurrent_ms = std::min(l.concurrent_ms, Ms(t0, t1));
    l.sequential_ms = std::min(l.sequential_ms, Ms(t1, t2));
  }
  return l;
}

// Times `fn` (one transition), `reps` times, running `back` (untimed) after each.
absl::StatusOr<double> TimeMedian(int reps, const std::function<absl::Status()>& fn,
                                  const std::function<absl::Status()>& back) {
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    Idle();
    auto t0 = Clock::now();
    VMSTASH_RETURN_IF_ERROR(fn());
    ms.push_back(Ms(t0, Clock::now()));
    VMSTASH_RETURN_IF_ERROR(back());
  }
  return Median(ms);
}

absl::Status Done(const absl::StatusOr<CachingAllocator::Transition>& t) { return t.status(); }

struct Marker {
  std::vector<char> bytes;
  DevicePtr at = 0;
};
// Writes a 1 MiB marker at `at` (through `staging`), to check after the switches.
absl::StatusOr<Marker> Mark(Driver& d, DevicePtr at, char* staging, Stream s, char seed) {
  Marker m;
  m.at = at;
  m.bytes.resize(1 << 20);
  for (std::size_t i = 0; i < m.bytes.size(); ++i) m.bytes[i] = static_cast<char>(seed + i * 31);
  std::memcpy(staging, m.bytes.data(), m.bytes.size());
  VMSTASH_RETURN_IF_ERROR(d.CopyToDeviceAsync(0, at, staging, m.bytes.size(), s));
  VMSTASH_RETURN_IF_ERROR(d.SynchronizeStream(0, s));
  return m;
}
absl::StatusOr<bool> Intact(Driver& d, const Marker& m, char* staging, Stream s) {
  VMSTASH_RETURN_IF_ERROR(d.CopyToHostAsync(0, staging, m.at, m.bytes.size(), s));
  VMSTASH_RETURN_IF_ERROR(d.SynchronizeStream(0, s));
  return std::memcmp(staging, m.bytes.data(), m.bytes.size()) == 0;
}

// Fills a tag with `bytes` in `blocks` allocations; returns them.
absl::StatusOr<std::vector<DevicePtr>> FillTag(CachingAllocator& a, TagId tag, std::size_t bytes, int blocks) {
  std::vector<DevicePtr> out;
  for (int i = 0; i < blocks; ++i) {
    VMSTASH_ASSIGN_OR_RETURN(DevicePtr p, a.Allocate(bytes / blocks, nullptr, tag));
    out.push_back(p);
  }
  return out;
}

// One more transition, with the driver calls it made: what a switch did, not only how long.
absl::Status Explain(Driver& d, const char* name, const std::function<absl::Status()>& fn) {
  Idle();
  const DriverCounters before = d.Counters();
  auto t0 = Clock::now();
  VMSTASH_RETURN_IF_ERROR(fn());
  const double ms = Ms(t0, Clock::now());
  const DriverCounters after = d.Counters();
  auto n = [&](DriverOp op) { return static_cast<unsigned long long>(after.Calls(op) - before.Calls(op)); };
  std::printf("  %s: %.1f ms; driver calls: create %llu, release %llu, map %llu, unmap %llu, D2H %llu, H2D %llu, "
              "stream waits %llu, memsets %llu\n", name, ms, n(DriverOp::kCreateChunk), n(DriverOp::kReleaseChunk),
              n(DriverOp::kMap), n(DriverOp::kUnmap), n(DriverOp::kCopyToHost), n(DriverOp::kCopyToDevice),
              n(DriverOp::kStreamWaitEvent), n(DriverOp::kMemset));
  return absl::OkStatus();
}

std::int64_t Chunks(CachingAllocator& a, TagId tag) {
  for (const TagStats& t : a.Stats().tags) {
    if (t.name == TagName(tag)) return t.chunks;
  }
  return 0;
}

int Run(int argc, char** argv) {
  const std::size_t x = (argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 8) * kGiB;
  const std::size_t y = (argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 8) * kGiB;
  const int reps = std::max(1, argc > 3 ? std::atoi(argv[3]) : 5);
  const bool discard_cases = argc > 4 ? std::atoi(argv[4]) != 0 : true;
  absl::StatusOr<RuntimeOptions> options = RuntimeOptionsFromEnvironment();
  if (!options.ok()) return std::fprintf(stderr, "%s\n", options.status().ToString().c_str()), 1;
  SetLogLevel(options->vmm.log_level);  // log_level:debug prints each switch's timeline
  absl::StatusOr<std::unique_ptr<Driver>> made = CreateDriver(options->vmm);
  if (!made.ok()) return std::fprintf(stderr, "%s\n", made.status().ToString().c_str()), 1;
  Driver& driver = **made;
  AllocatorOptions aopt = options->allocator;
  aopt.auto_prepare = false;  // arenas prepared explicitly below
  auto alloc_or = CachingAllocator::Create(&driver, 0, aopt);
  if (!alloc_or.ok()) return std::fprintf(stderr, "%s\n", alloc_or.status().ToString().c_str()), 1;
  CachingAllocator& alloc = **alloc_or;
  std::printf("switch_bench: driver %s, X = %zu GiB out, Y = %zu GiB in, median of %d, each timed transition "
              "%.0f ms after the one before\n", std::string(driver.Name()).c_str(), x / kGiB, y / kGiB, reps, kIdleS * 1e3);
  absl::StatusOr<Stream> s1 = driver.CreateStream(0), s2 = driver.CreateStream(0);
  BENCH_CHECK(s1.status());
  BENCH_CHECK(s2.status());
  absl::StatusOr<PinnedHostBuffer> staging = PinnedHostBuffer::Allocate(&driver, 0, 1 << 20);
  BENCH_CHECK(staging.status());

  // The limits, each direction (X out Y in, and back).
  Limits fwd, rev;
  {
    const std::size_t big = std::max(x, y);
    absl::StatusOr<PinnedHostBuffer> h1 = PinnedHostBuffer::Allocate(&driver, 0, big);
    absl::StatusOr<PinnedHostBuffer> h2 = PinnedHostBuffer::Allocate(&driver, 0, big);
    BENCH_CHECK(h1.status());
    BENCH_CHECK(h2.status());
    absl::StatusOr<DevicePtr> d1 = alloc.Allocate(big, nullptr), d2 = alloc.Allocate(big, nullptr);
    BENCH_CHECK(d1.status());
    BENCH_CHECK(d2.status());
    absl::StatusOr<Limits> l = MeasureLimits(driver, *d1, *d2, static_cast<char*>(h1->data()), static_cast<char*>(h2->data()), x, y, *s1, *s2);
    BENCH_CHECK(l.status());
    fwd = *l;
    l = MeasureLimits(driver, *d1, *d2, static_cast<char*>(h1->data()), static_cast<char*>(h2->data()), y, x, *s1, *s2);
    BENCH_CHECK(l.status());
    rev = *l;
    BENCH_CHECK(alloc.Free(*d1));
    BENCH_CHECK(alloc.Free(*d2));
    BENCH_CHECK(alloc.EmptyCache());
  }
  std::printf("limit: D2H %zu GiB || H2D %zu GiB: %.1f ms concurrent, %.1f ms one after the other\n", x / kGiB,
              y / kGiB, fwd.concurrent_ms, fwd.sequential_ms);
  std::printf("limit: D2H %zu GiB || H2D %zu GiB: %.1f ms concurrent, %.1f ms one after the other\n", y / kGiB,
              x / kGiB, rev.concurrent_ms, rev.sequential_ms);
  std::printf("%-40s %9s %11s %9s %12s %10s\n", "case (backed up both ways)", "switch ms", "sequential", "limit ms",
              "switch-limit", "seq/switch");
  auto row = [](const std::string& name, double sw, double seq, double limit) {
    std::printf("%-40s %9.1f %11.1f %9.1f %+11.1f  %9.2fx\n", name.c_str(), sw, seq, limit, sw - limit, seq / sw);
  };

  // Backup both ways, in 1 block and in 256 blocks per tag.
  int case_index = 0;
  for (int blocks : {1, 256}) {
    const std::string suffix = std::to_string(case_index++);
    TagId a = *InternTag("swb_a" + suffix), b = *InternTag("swb_b" + suffix);
    BENCH_CHECK(alloc.CreateTag(a, Policy::kBackup));
    BENCH_CHECK(alloc.CreateTag(b, Policy::kBackup));
    absl::StatusOr<std::vector<DevicePtr>> bb = FillTag(alloc, b, y, blocks);
    BENCH_CHECK(bb.status());
    absl::StatusOr<Marker> mb = Mark(driver, bb->front(), static_cast<char*>(staging->data()), *s1, 7);
    BENCH_CHECK(mb.status());
    BENCH_CHECK(alloc.Prepare(b));
    BENCH_CHECK(Done(alloc.Pause(b)));
    absl::StatusOr<std::vector<DevicePtr>> ab = FillTag(alloc, a, x, blocks);
    BENCH_CHECK(ab.status());
    absl::StatusOr<Marker> ma = Mark(driver, ab->front(), static_cast<char*>(staging->data()), *s1, 3);
    BENCH_CHECK(ma.status());
    BENCH_CHECK(alloc.Prepare(a));
    auto sw_fwd = [&] { return Done(alloc.Switch({a}, {b})); };
    auto sw_rev = [&] { return Done(alloc.Switch({b}, {a})); };
    auto seq_fwd = [&]() -> absl::Status {
      VMSTASH_RETURN_IF_ERROR(Done(alloc.Pause(a)));
      return Done(alloc.Resume(b));
    };
    auto seq_rev = [&]() -> absl::Status {
      VMSTASH_RETURN_IF_ERROR(Done(alloc.Pause(b)));
      return Done(alloc.Resume(a));
    };
    BENCH_CHECK(sw_fwd());  // warm-up: streams, events, the arenas touched once
    BENCH_CHECK(sw_rev());
    BENCH_CHECK(Explain(driver, "one more switch out of A (chunks as allocated)", sw_fwd));
    BENCH_CHECK(Explain(driver, "one more switch back", sw_rev));
    const std::int64_t chunks_a = Chunks(alloc, a);
    absl::StatusOr<double> t_sw_fwd = TimeMedian(reps, sw_fwd, sw_rev);
    BENCH_CHECK(t_sw_fwd.status());
    absl::StatusOr<double> t_seq_fwd = TimeMedian(reps, seq_fwd, seq_rev);
    BENCH_CHECK(t_seq_fwd.status());
    // The other direction: timed after an untimed forward transition.
    std::vector<double> back;
    for (int i = 0; i < reps; ++i) {
      BENCH_CHECK(seq_fwd());
      Idle();
      auto t0 = Clock::now();
      BENCH_CHECK(seq_rev());
      back.push_back(Ms(t0, Clock::now()));
    }
    std::vector<double> rev_sw;
    for (int i = 0; i < reps; ++i) {
      BENCH_CHECK(sw_fwd());
      Idle();
      auto t0 = Clock::now();
      BENCH_CHECK(sw_rev());
      rev_sw.push_back(Ms(t0, Clock::now()));
    }
    BENCH_CHECK(Explain(driver, "one more switch out of A (chunks as resumes left them)", sw_fwd));
    BENCH_CHECK(Explain(driver, "one more switch back", sw_rev));
    absl::StatusOr<bool> ok_a = Intact(driver, *ma, static_cast<char*>(staging->data()), *s1);
    BENCH_CHECK(sw_fwd());
    absl::StatusOr<bool> ok_b = Intact(driver, *mb, static_cast<char*>(staging->data()), *s1);
    BENCH_CHECK(ok_a.status());
    BENCH_CHECK(ok_b.status());
    const std::string label = std::to_string(blocks) + (blocks == 1 ? " block" : " blocks");
    row(std::to_string(x / kGiB) + " GiB out, " + std::to_string(y / kGiB) + " GiB in, " + label, *t_sw_fwd,
        *t_seq_fwd, fwd.concurrent_ms);
    row(std::to_string(y / kGiB) + " GiB out, " + std::to_string(x / kGiB) + " GiB in, " + label, Median(rev_sw),
        Median(back), rev.concurrent_ms);
    std::printf("  %s: chunks of the tags %lld, bytes intact after the switches: %s; handed over so far %.1f GiB\n",
                label.c_str(), static_cast<long long>(chunks_a), *ok_a && *ok_b ? "yes" : "NO",
                alloc.Stats().handed_over_bytes / double(kGiB));
    BENCH_CHECK(Done(alloc.Resume(a)));
    for (DevicePtr p : *ab) BENCH_CHECK(alloc.Free(p));
    for (DevicePtr p : *bb) BENCH_CHECK(alloc.Free(p));
    BENCH_CHECK(alloc.ReleaseBackup(a));
    BENCH_CHECK(alloc.ReleaseBackup(b));
    BENCH_CHECK(alloc.EmptyCache());
  }

  // Discard both ways, 16 GiB each: nothing to copy, the handover of physical memory alone.
  std::printf("%-50s %9s %11s %9s\n", "case (discard, 16 GiB out, 16 GiB in)", "switch ms", "sequential", "chunks");
  AllocatorOptions no_zero_options = aopt;
  no_zero_options.switch_zero = false;
  auto no_zero_or = CachingAllocator::Create(&driver, 0, no_zero_options);
  BENCH_CHECK(no_zero_or.status());
  for (int variant = 0; variant < 4 && discard_cases; ++variant) {
    const bool regrown = variant % 2 == 1, zero = variant < 2;
    CachingAllocator& alloc = zero ? **alloc_or : **no_zero_or;  // switch_zero:1 (default) or 0
    const std::string suffix = std::string(regrown ? "g" : "r") + (zero ? "z" : "n");
    TagId a = *InternTag("swd_a" + suffix), b = *InternTag("swd_b" + suffix);
    BENCH_CHECK(alloc.CreateTag(a, Policy::kDiscard));
    BENCH_CHECK(alloc.CreateTag(b, Policy::kDiscard));
    absl::StatusOr<std::vector<DevicePtr>> bb = FillTag(alloc, b, 16 * kGiB, 1024);
    BENCH_CHECK(bb.status());
    BENCH_CHECK(Done(alloc.Pause(b)));
    absl::StatusOr<std::vector<DevicePtr>> ab = FillTag(alloc, a, 16 * kGiB, 1024);
    BENCH_CHECK(ab.status());
    if (!regrown) {  // as a resume leaves a tag: one chunk per run
      BENCH_CHECK(Done(alloc.Pause(a)));
      BENCH_CHECK(Done(alloc.Resume(a)));
    }
    const std::int64_t chunks = Chunks(alloc, a);
    auto sw_fwd = [&] { return Done(alloc.Switch({a}, {b})); };
    auto sw_rev = [&] { return Done(alloc.Switch({b}, {a})); };
    BENCH_CHECK(sw_fwd());
    BENCH_CHECK(sw_rev());
    absl::StatusOr<double> t_sw = TimeMedian(reps, sw_fwd, sw_rev);
    BENCH_CHECK(t_sw.status());
    absl::StatusOr<double> t_seq = TimeMedian(
        reps,
        [&]() -> absl::Status {
          VMSTASH_RETURN_IF_ERROR(Done(alloc.Pause(a)));
          return Done(alloc.Resume(b));
        },
        [&]() -> absl::Status {
          VMSTASH_RETURN_IF_ERROR(Done(alloc.Pause(b)));
          return Done(alloc.Resume(a));
        });
    BENCH_CHECK(t_seq.status());
    const std::string name = std::string(regrown ? "grown by 1024 allocations" : "as a resume leaves it (1 chunk)") +
                             (zero ? ", zeroed" : ", switch_zero:0");
    std::printf("%-50s %9.2f %11.2f %9lld\n", name.c_str(), *t_sw, *t_seq, static_cast<long long>(chunks));
    for (DevicePtr p : *ab) BENCH_CHECK(alloc.Free(p));
    BENCH_CHECK(Done(alloc.Resume(b)));
    for (DevicePtr p : *bb) BENCH_CHECK(alloc.Free(p));
    BENCH_CHECK(alloc.EmptyCache());
  }
  const AllocatorStats stats = alloc.Stats();
  std::printf("switches %llu, handed over %.1f GiB in all\n", static_cast<unsigned long long>(stats.switches),
              stats.handed_over_bytes / double(kGiB));
  BENCH_CHECK(driver.DestroyStream(0, *s1));
  BENCH_CHECK(driver.DestroyStream(0, *s2));
  return 0;
}

}  // namespace
}  // namespace vmstash

int main(int argc, char** argv) { return vmstash::Run(argc, argv); }
