// Fault injection at every driver call of pause and resume: a failed pause leaves the tag
// active with its bytes; a failed resume leaves it paused with its backup; a retry without
// faults succeeds with every byte intact, and nothing leaks.
#include <cstdio>
#include <string>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/testing.h"
#include "gtest/gtest.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

using Transition = CachingAllocator::Transition;

struct Fixture {
  std::unique_ptr<SimDriver> sim;
  std::unique_ptr<CachingAllocator> alloc;
  std::vector<std::pair<DevicePtr, std::size_t>> blocks;
  TagId tag = 0;
};

void Write(DevicePtr p, std::size_t n, std::uint8_t v) {
  auto* b = reinterpret_cast<std::uint8_t*>(p);
  b[0] = v;
  b[n / 2] = static_cast<std::uint8_t>(v + 1);
  b[n - 1] = static_cast<std::uint8_t>(v + 2);
}
bool Check(DevicePtr p, std::size_t n, std::uint8_t v) {
  auto* b = reinterpret_cast<const std::uint8_t*>(p);
  return b[0] == v && b[n / 2] == static_cast<std::uint8_t>(v + 1) && b[n - 1] == static_cast<std::uint8_t>(v + 2);
}

Fixture Make(Policy policy) {
  Fixture f;
  f.sim = std::make_unique<SimDriver>(SimDriverOptions{1, 512 * kMiB, 2 * kMiB, {}});
  AllocatorOptions options = testing::TestOptions();
  options.auto_prepare = false;  // the test counts driver calls
  // Small stages and pieces, so the pipelined pause and resume have several of each.
  options.pause_stage_bytes = 8 * kMiB;
  options.resume_first_piece_bytes = 4 * kMiB;
  f.alloc = *CachingAllocator::Create(f.sim.get(), 0, options);
  f.tag = *InternTag(policy == Policy::kBackup ? "fault_backup" : "fault_discard");
  EXPECT_TRUE(f.alloc->CreateTag(f.tag, policy).ok());
  std::size_t sizes[] = {4096, 700 * 1024, 3 * kMiB, 30 * kMiB, 90 * kMiB};
  for (std::size_t i = 0; i < 5; ++i) {
    DevicePtr p = *f.alloc->Allocate(sizes[i], nullptr, f.tag);
    Write(p, sizes[i], static_cast<std::uint8_t>(10 * i + 1));
    f.blocks.emplace_back(p, sizes[i]);
  }
  DevicePtr dropped = *f.alloc->Allocate(5 * kMiB, nullptr, f.tag);  // a free cached block
  EXPECT_TRUE(f.alloc->Free(dropped).ok());
  return f;
}

bool AllIntact(const Fixture& f) {
  for (std::size_t i = 0; i < f.blocks.size(); ++i) {
    if (!Check(f.blocks[i].first, f.blocks[i].second, static_cast<std::uint8_t>(10 * i + 1))) return false;
  }
  return true;
}

std::string StateOf(CachingAllocator& a, TagId tag) {
  for (const TagStats& t : a.Stats().tags) {
    if (t.name == TagName(tag)) return t.state;
  }
  return "";
}

void Finish(Fixture& f) {
  for (auto [p, n] : f.blocks) ASSERT_TRUE(f.alloc->Free(p).ok());
  ASSERT_TRUE(f.alloc->EmptyCache().ok());
  EXPECT_EQ(f.sim->UsedBytes(0), 0u);
  f.alloc.reset();
  absl::Status leaks = f.sim->CheckNoLeaks();
  ASSERT_TRUE(leaks.ok()) << leaks;
}

TEST(PauseResumeFaultTest, EveryCallOfPauseAndResumeFailsCleanly) {
  const DriverOp ops[] = {DriverOp::kSynchronizeDevice, DriverOp::kHostRegister,  DriverOp::kHostUnregister,
                          DriverOp::kCreateStream,
                          DriverOp::kCopyToHost,        DriverOp::kSynchronizeStream, DriverOp::kUnmap,
                          DriverOp::kReleaseChunk,      DriverOp::kCreateChunk,   DriverOp::kMap,
                          DriverOp::kSetAccess,         DriverOp::kCopyToDevice,  DriverOp::kCreateEvent,
                          DriverOp::kRecordEvent,       DriverOp::kSynchronizeEvent};
  int cases = 0, pause_failures = 0, resume_failures = 0;
  for (Policy policy : {Policy::kBackup, Policy::kDiscard}) {
    // Calls of each op made by one pause + resume without faults.
    DriverCounters clean;
    {
      Fixture f = Make(policy);
      DriverCounters before = f.sim->Counters();
      ASSERT_EQ(*f.alloc->Pause(f.tag), Transition::kDone);
      ASSERT_EQ(*f.alloc->Resume(f.tag), Transition::kDone);
      if (policy == Policy::kBackup) ASSERT_TRUE(AllIntact(f));
      clean = f.sim->Counters();
      for (int i = 0; i < kNumDriverOps; ++i) clean.calls[i] -= before.calls[i];
      Finish(f);
    }
    for (DriverOp op : ops) {
      for (absl::StatusCode code : {absl::StatusCode::kInternal, absl::StatusCode::kResourceExhausted}) {
        for (std::uint64_t nth = 1; nth <= clean.Calls(op); ++nth) {
          SCOPED_TRACE(std::string(PolicyName(policy)) + " " + std::string(DriverOpName(op)) + "@" +
                       std::to_string(nth) + " " + absl::StatusCodeToString(code));
          Fixture f = Make(policy);
          f.sim->InjectFault(FaultRule{op, static_cast<int>(nth), 1, code});
          absl::StatusOr<Transition> paused = f.alloc->Pause(f.tag);
          if (!paused.ok()) {
            ++pause_failures;
            EXPECT_EQ(paused.status().code(), code) << paused.status();
            EXPECT_EQ(StateOf(*f.alloc, f.tag), "active");
            EXPECT_TRUE(AllIntact(f));  // the tag is exactly as it was
            f.sim->ClearFaults();
            ASSERT_EQ(*f.alloc->Pause(f.tag), Transition::kDone);
          } else {
            absl::StatusOr<Transition> resumed = f.alloc->Resume(f.tag);
            if (!resumed.ok()) {
              ++resume_failures;
              EXPECT_EQ(resumed.status().code(), code) << resumed.status();
              EXPECT_EQ(StateOf(*f.alloc, f.tag), "paused");
            }
          }
          f.sim->ClearFaults();
          ASSERT_TRUE(f.alloc->Validate().ok()) << f.alloc->Validate();
          absl::StatusOr<Transition> resumed = f.alloc->Resume(f.tag);
          ASSERT_TRUE(resumed.ok()) << resumed.status();
          if (policy == Policy::kBackup) EXPECT_TRUE(AllIntact(f));
          Finish(f);
          ++cases;
        }
      }
    }
  }
  std::printf("pause/resume fault cases: %d (pause failed %d, resume failed %d)\n", cases, pause_failures,
              resume_failures);
  EXPECT_GT(pause_failures, 0);
  EXPECT_GT(resume_failures, 0);
}

}  // namespace
}  // namespace vmstash
