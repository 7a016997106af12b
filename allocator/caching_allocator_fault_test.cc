// Fault injection at every driver call the allocator makes: each injected failure comes
// back as the injected code (or is absorbed by the OOM ladder), the allocator stays valid
// after every step, a retry without faults succeeds, and nothing leaks.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/testing.h"
#include "gtest/gtest.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

struct Outcome {
  int failures = 0;  // steps that returned the injected code
  std::vector<std::string> unexpected;
};

// Runs the scenario; every step's status must be OK or `code`.
Outcome RunScenario(SimDriver& sim, CachingAllocator& alloc, Stream s1, Stream s2, absl::StatusCode code,
                    std::vector<DevicePtr>* live) {
  Outcome out;
  auto check = [&](const absl::Status& s, const char* step) {
    if (s.ok()) return true;
    if (s.code() == code) {
      ++out.failures;
      return false;
    }
    out.unexpected.push_back(std::string(step) + ": " + s.ToString());
    return false;
  };
  auto alloc_on = [&](std::size_t size, Stream s, const char* step) -> DevicePtr {
    absl::StatusOr<DevicePtr> p = alloc.Allocate(size, s, kDefaultTag);
    if (!check(p.status(), step)) return 0;
    live->push_back(*p);
    return *p;
  };
  auto free_ptr = [&](DevicePtr p, const char* step) {
    if (p == 0) return;
    if (check(alloc.Free(p), step)) live->erase(std::find(live->begin(), live->end(), p));
  };
  DevicePtr a = alloc_on(4096, s1, "alloc small");
  DevicePtr b = alloc_on(30 * kMiB, s1, "alloc large");
  DevicePtr c = alloc_on(30 * kMiB, s1, "alloc large 2");
  if (c != 0) check(alloc.RecordStream(c, s2), "record_stream");
  free_ptr(a, "free small");
  free_ptr(b, "free large");
  sim.HoldStream(0, s2);
  free_ptr(c, "free recorded");
  sim.ReleaseStream(0, s2);
  alloc_on(4096, s2, "alloc other stream");  // fences on s1
  alloc_on(8192, s1, "alloc after pending");  // pending free processed
  check(alloc.EmptyCache(), "empty_cache");
  alloc_on(60 * kMiB, s1, "alloc after empty");
  DevicePtr big = alloc_on(150 * kMiB, s2, "alloc big");  // near capacity: OOM ladder
  free_ptr(big, "free big");
  alloc_on(200 * kMiB, s1, "alloc needs ladder");
  check(alloc.Validate(), "validate");
  return out;
}

TEST(CachingAllocatorFaultTest, EveryDriverCallSiteFailsCleanly) {
  const DriverOp ops[] = {DriverOp::kReserveAddress, DriverOp::kFreeAddress,     DriverOp::kCreateChunk,
                          DriverOp::kReleaseChunk,   DriverOp::kMap,             DriverOp::kUnmap,
                          DriverOp::kSetAccess,      DriverOp::kCreateEvent,     DriverOp::kRecordEvent,
                          DriverOp::kQueryEvent,     DriverOp::kSynchronizeDevice};
  SimDriverOptions sim_options{1, 320 * kMiB, 2 * kMiB, {}};
  // Count each op's calls in a clean run.
  DriverCounters clean;
  {
    SimDriver sim(sim_options);
    Stream s1 = *sim.CreateStream(0), s2 = *sim.CreateStream(0);
    AllocatorOptions options = testing::TestOptions();
    auto alloc = *CachingAllocator::Create(&sim, 0, options);
    DriverCounters before = sim.Counters();
    std::vector<DevicePtr> live;
    Outcome o = RunScenario(sim, *alloc, s1, s2, absl::StatusCode::kOk, &live);
    ASSERT_TRUE(o.unexpected.empty()) << o.unexpected[0];
    clean = sim.Counters();
    for (int i = 0; i < kNumDriverOps; ++i) clean.calls[i] -= before.calls[i];
    for (DevicePtr p : live) ASSERT_TRUE(alloc->Free(p).ok());
    alloc.reset();
    ASSERT_TRUE(sim.DestroyStream(0, s1).ok());
    ASSERT_TRUE(sim.DestroyStream(0, s2).ok());
    ASSERT_TRUE(sim.CheckNoLeaks().ok());
  }
  int cases = 0, failed_steps = 0;
  for (DriverOp op : ops) {
    ASSERT_GT(clean.Calls(op), 0u) << DriverOpName(op) << " is never called: the scenario misses a call site";
    for (absl::StatusCode code : {absl::StatusCode::kInternal, absl::StatusCode::kResourceExhausted}) {
      for (std::uint64_t nth = 1; nth <= clean.Calls(op); ++nth) {
        SCOPED_TRACE(std::string(DriverOpName(op)) + "@" + std::to_string(nth) + " " + absl::StatusCodeToString(code));
        SimDriver sim(sim_options);
        Stream s1 = *sim.CreateStream(0), s2 = *sim.CreateStream(0);
        AllocatorOptions options = testing::TestOptions();
        auto alloc = *CachingAllocator::Create(&sim, 0, options);
        sim.InjectFault(FaultRule{op, static_cast<int>(nth), 1, code});
        std::vector<DevicePtr> live;
        Outcome o = RunScenario(sim, *alloc, s1, s2, code, &live);
        for (const std::string& u : o.unexpected) ADD_FAILURE() << u;
        failed_steps += o.failures;
        sim.ClearFaults();
        ASSERT_TRUE(alloc->Validate().ok()) << alloc->Validate();
        // Retry without faults: the allocator still works, then everything goes back.
        absl::StatusOr<DevicePtr> retry = alloc->Allocate(8 * kMiB, s1);
        ASSERT_TRUE(retry.ok()) << retry.status();
        live.push_back(*retry);
        for (DevicePtr p : live) ASSERT_TRUE(alloc->Free(p).ok());
        ASSERT_TRUE(alloc->EmptyCache().ok());
        EXPECT_EQ(alloc->Stats().total.reserved_bytes.current, 0);
        EXPECT_EQ(sim.UsedBytes(0), 0u);
        alloc.reset();
        ASSERT_TRUE(sim.DestroyStream(0, s1).ok());
        ASSERT_TRUE(sim.DestroyStream(0, s2).ok());
        absl::Status leaks = sim.CheckNoLeaks();
        ASSERT_TRUE(leaks.ok()) << leaks;
        ++cases;
      }
    }
  }
  std::printf("fault cases: %d, steps failed with the injected code: %d\n", cases, failed_steps);
  EXPECT_GT(cases, 50);
  EXPECT_GT(failed_steps, 0);
}

}  // namespace
}  // namespace vmstash

namespace vmstash {
namespace {

TEST(CachingAllocatorFaultTest, CreateFailsCleanlyWhenTheDriverRefusesTheQueries) {
  for (DriverOp op : {DriverOp::kDeviceCount, DriverOp::kGranularity, DriverOp::kMemoryInfo}) {
    SimDriver sim;
    sim.InjectFault(FaultRule{op, 1, 1, absl::StatusCode::kInternal});
    absl::StatusOr<std::unique_ptr<CachingAllocator>> a = CachingAllocator::Create(&sim, 0, {});
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInternal) << DriverOpName(op);
    EXPECT_TRUE(sim.CheckNoLeaks().ok());
  }
}

TEST(CachingAllocatorFaultTest, OomMessageSurvivesAFailingMemoryInfo) {
  SimDriver sim(SimDriverOptions{1, 64 * kMiB, 2 * kMiB, {}});
  auto alloc = *CachingAllocator::Create(&sim, 0, {});
  sim.InjectFault(FaultRule{DriverOp::kMemoryInfo, 1, 100, absl::StatusCode::kInternal});
  absl::StatusOr<DevicePtr> p = alloc->Allocate(128 * kMiB, nullptr);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(p.status().message().find("tried to allocate 128.00 MiB"), absl::string_view::npos);
}

TEST(CachingAllocatorFaultTest, DestructorNeverFailsWhenTheDriverRefusesTeardown) {
  SimDriver sim;
  Stream s = *sim.CreateStream(0);
  {
    auto alloc = *CachingAllocator::Create(&sim, 0, {});
    DevicePtr p = *alloc->Allocate(4096, s);
    ASSERT_TRUE(alloc->Free(p).ok());
    ASSERT_TRUE(alloc->Allocate(4096, nullptr).ok());  // fence event on s goes to the pool
    sim.InjectFault(FaultRule{DriverOp::kDestroyEvent, 1, 100, absl::StatusCode::kInternal});
    sim.InjectFault(FaultRule{DriverOp::kSynchronizeDevice, 1, 100, absl::StatusCode::kInternal});
  }  // logged, not thrown, not aborted
  sim.ClearFaults();
  // The refused event is the only thing left behind, and the leak check names it.
  absl::Status leaks = sim.CheckNoLeaks();
  EXPECT_EQ(leaks.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(leaks.message().find("event"), absl::string_view::npos) << leaks;
  EXPECT_EQ(sim.UsedBytes(0), 0u);
}

}  // namespace
}  // namespace vmstash
