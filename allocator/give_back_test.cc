// The give_back retention (Note [Retained Backups] in allocator/tag_pool.h; Note [Pinned
// Pieces] in vmm/pinned_pieces.h) on the simulator: torch_memory_saver's default mode. Each
// resume gives the pinned arena's host memory back (nothing pinned, nothing held), the
// next pause pins it again, and the bytes survive every cycle; every driver call of a
// pause and a resume can fail without losing a byte or leaving a page pinned, and a retry
// succeeds.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <string>
#include <vector>

#include "allocator/auto_preparer.h"
#include "allocator/caching_allocator.h"
#include "allocator/host_budget.h"
#include "allocator/tag_pool.h"
#include "allocator/testing.h"
#include "base/byte_pattern.h"
#include "gtest/gtest.h"
#include "vmm/pinned_pieces.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

using ::vmstash::testing::TagStatsOf;

class GiveBackTest : public testing::SimAllocatorTest {
 protected:
  // `background`: the background thread gives the memory back after a resume (the
  // default); without it the resume does.
  void Make(bool background = false) {
    AllocatorOptions options = testing::TestOptions();
    options.auto_prepare = background;
    options.auto_prepare_settle_ms = 0;
    MakeAllocator(SimDriverOptions{1, 512 * kMiB, 2 * kMiB, {}}, options);
    tag_ = *InternTag("give_back");
    ASSERT_TRUE(alloc_->CreateTag(tag_, Policy::kBackup).ok());
    ASSERT_TRUE(alloc_->SetBackupRetention(tag_, BackupRetention{false, true, true}).ok());
    // 3 MiB, then 70 MiB across a piece bound, then 5 MiB: three pieces of arena.
    for (std::size_t n : {3 * kMiB, 70 * kMiB, 5 * kMiB}) {
      DevicePtr p = *alloc_->Allocate(n, nullptr, tag_);
      FillPattern(p, n, static_cast<std::uint8_t>(blocks_.size() + 1));
      blocks_.emplace_back(p, n);
    }
  }
  bool Intact() const {
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      if (WrongBytes(blocks_[i].first, blocks_[i].second, static_cast<std::uint8_t>(i + 1)) != 0) return false;
    }
    return true;
  }
  std::string State() const { return TagStatsOf(*alloc_, tag_).state; }
  std::int64_t Held() const { return TagStatsOf(*alloc_, tag_).backup_arena_bytes; }
  void FreeAllAndCheckNoLeaks() {
    for (auto [p, n] : blocks_) ASSERT_TRUE(alloc_->Free(p).ok());
    blocks_.clear();
    alloc_.reset();
    absl::Status leaks = sim_->CheckNoLeaks();  // a host registration left is a leak
    EXPECT_TRUE(leaks.ok()) << leaks;
  }

  TagId tag_ = 0;
  std::vector<std::pair<DevicePtr, std::size_t>> blocks_;
};

TEST_F(GiveBackTest, EachResumeGivesTheMemoryBackAndTheBytesSurvive) {
  Make();
  for (int cycle = 0; cycle < 3; ++cycle) {
    const std::uint64_t pins = sim_->Counters().Calls(DriverOp::kHostRegister);
    ASSERT_TRUE(alloc_->Pause(tag_).ok());
    EXPECT_EQ(sim_->Counters().Calls(DriverOp::kHostRegister) - pins, 2u) << "78 MiB: pieces 0 and 1";
    EXPECT_GT(Held(), 0);
    std::vector<std::uint8_t> buf(blocks_[1].second);
    ASSERT_TRUE(alloc_->ReadBackup(blocks_[1].first, buf.size(), buf.data()).ok());
    EXPECT_EQ(WrongBytes(buf.data(), buf.size(), 2), 0u);
    const std::uint64_t unpins = sim_->Counters().Calls(DriverOp::kHostUnregister);
    ASSERT_TRUE(alloc_->Resume(tag_).ok());
    EXPECT_EQ(sim_->Counters().Calls(DriverOp::kHostUnregister) - unpins, 2u);
    EXPECT_TRUE(Intact()) << "cycle " << cycle;
    EXPECT_EQ(Held(), 0) << "cycle " << cycle;
    // Nothing of the backup is readable after the resume (nothing retained).
    EXPECT_FALSE(alloc_->ReadBackup(blocks_[0].first, 4096, buf.data()).ok());
  }
  // A switch through the same arena, out and back.
  ASSERT_TRUE(alloc_->Switch({tag_}, {}).ok());
  ASSERT_TRUE(alloc_->Switch({}, {tag_}).ok());
  EXPECT_TRUE(Intact());
  EXPECT_EQ(Held(), 0);
  EXPECT_TRUE(alloc_->Validate().ok());
  FreeAllAndCheckNoLeaks();
}

// With the background thread: the resume returns holding the memory, the thread gives it
// back; a pause right after a resume cancels what is left and keeps what is still pinned.
TEST_F(GiveBackTest, TheBackgroundThreadGivesItBackAndAPauseCancelsIt) {
  Make(/*background=*/true);
  alloc_->WaitForBackgroundPrepare();  // the arena prepared ahead of the first pause
  for (int cycle = 0; cycle < 4; ++cycle) {
    ASSERT_TRUE(alloc_->Pause(tag_).ok());
    ASSERT_TRUE(alloc_->Resume(tag_).ok());
    EXPECT_TRUE(Intact()) << "cycle " << cycle;
    if (cycle % 2 == 0) {
      alloc_->WaitForBackgroundPrepare();
      EXPECT_EQ(Held(), 0) << "cycle " << cycle;
    }  // odd cycles pause again at once, racing the hand-back
  }
  ASSERT_TRUE(alloc_->Pause(tag_).ok());
  ASSERT_TRUE(alloc_->Resume(tag_).ok());
  EXPECT_TRUE(Intact());
  alloc_->WaitForBackgroundPrepare();
  EXPECT_EQ(Held(), 0);
  EXPECT_TRUE(alloc_->Validate().ok());
  FreeAllAndCheckNoLeaks();
}

// Threads pausing and resuming the tag while the background thread gives its memory back
// and another thread allocates and frees in it: no byte lost, nothing left pinned.
TEST_F(GiveBackTest, ConcurrentCyclesAndAllocationsWithTheBackgroundHandBack) {
  Make(/*background=*/true);
  std::atomic<bool> stop{false};
  std::thread churn([&] {
    while (!stop.load()) {
      absl::StatusOr<DevicePtr> p = alloc_->Allocate(1 * kMiB, nullptr, tag_);
      if (p.ok()) {
        (void)alloc_->Free(*p);
      }
    }
  });
  for (int cycle = 0; cycle < 20; ++cycle) {
    absl::StatusOr<CachingAllocator::Transition> paused = alloc_->Pause(tag_);
    ASSERT_TRUE(paused.ok()) << paused.status();
    absl::StatusOr<CachingAllocator::Transition> resumed = alloc_->Resume(tag_);
    ASSERT_TRUE(resumed.ok()) << resumed.status();
    if (cycle % 3 == 0) alloc_->WaitForBackgroundPrepare();
  }
  stop = true;
  churn.join();
  alloc_->WaitForBackgroundPrepare();
  EXPECT_TRUE(Intact());
  EXPECT_EQ(Held(), 0);
  EXPECT_TRUE(alloc_->Validate().ok());
  FreeAllAndCheckNoLeaks();
}

// Every call of a pause and of a resume fails once, in turn: a failed pause leaves the tag
// active and holds nothing; a failed resume leaves it paused with its backup, and the retry
// restores every byte; a failed hand-back after the resume keeps the memory pinned until
// the next cycle gives it back; nothing stays pinned.
TEST_F(GiveBackTest, EveryDriverCallOfAPauseAndAResumeFailsCleanly) {
  const DriverOp ops[] = {DriverOp::kHostRegister, DriverOp::kHostUnregister, DriverOp::kCopyToHost,
                          DriverOp::kCopyToDevice, DriverOp::kCreateEvent,    DriverOp::kRecordEvent,
                          DriverOp::kSynchronizeEvent, DriverOp::kSynchronizeStream, DriverOp::kUnmap,
                          DriverOp::kCreateChunk,  DriverOp::kMap};
  DriverCounters clean;
  {
    Make();
    const DriverCounters before = sim_->Counters();
    ASSERT_TRUE(alloc_->Pause(tag_).ok());
    ASSERT_TRUE(alloc_->Resume(tag_).ok());
    clean = sim_->Counters();
    for (int i = 0; i < kNumDriverOps; ++i) clean.calls[i] -= before.calls[i];
    FreeAllAndCheckNoLeaks();
  }
  ASSERT_EQ(clean.Calls(DriverOp::kHostUnregister), 2u);
  int cases = 0, failed = 0;
  for (DriverOp op : ops) {
    for (std::uint64_t nth = 1; nth <= clean.Calls(op); ++nth) {
      SCOPED_TRACE(std::string(DriverOpName(op)) + "@" + std::to_string(nth));
      Make();
      ++cases;
      sim_->InjectFault(FaultRule{op, static_cast<int>(nth), 1, absl::StatusCode::kInternal});
      if (!alloc_->Pause(tag_).ok()) {
        ++failed;
        EXPECT_EQ(State(), "active");
        EXPECT_TRUE(Intact());
        EXPECT_EQ(Held(), 0) << "a failed pause gives the memory back";
        sim_->ClearFaults();
        ASSERT_TRUE(alloc_->Pause(tag_).ok());
      }
      if (!alloc_->Resume(tag_).ok()) {
        ++failed;
        EXPECT_EQ(State(), "paused");
        sim_->ClearFaults();
        ASSERT_TRUE(alloc_->Resume(tag_).ok());
      }
      sim_->ClearFaults();
      EXPECT_EQ(State(), "active");
      EXPECT_TRUE(Intact());
      if (op == DriverOp::kHostUnregister) {
        // The hand-back after a committed resume failed (logged): the memory stays pinned
        // until the next cycle gives it back.
        ASSERT_TRUE(alloc_->Pause(tag_).ok());
        ASSERT_TRUE(alloc_->Resume(tag_).ok());
        EXPECT_TRUE(Intact());
      }
      EXPECT_EQ(Held(), 0);
      EXPECT_TRUE(alloc_->Validate().ok());
      FreeAllAndCheckNoLeaks();
    }
  }
  EXPECT_GT(cases, 20);
  EXPECT_GT(failed, cases / 2);
}

// Note [Background Steps Yield] (allocator/tag_pool.h): a pause that arrives while the
// background thread prepares the arena (or gives it back) in steps waits for the step in
// progress only, not for the whole loop. The tag's arena takes two steps (512 + 64 MiB);
// the background thread is held inside its first step's first driver call until the pause
// has been called, so the pause is waiting for the lock when that step ends.
class BackgroundStepsYieldTest : public testing::SimAllocatorTest {
 protected:
  static constexpr std::size_t kSize = TagPool::kPrepareStepBytes + PinnedPieces::kPieceBytes;

  void SetUp() override {
    AllocatorOptions options = testing::TestOptions();
    options.auto_prepare = true;
    options.auto_prepare_settle_ms = 0;
    MakeAllocator(SimDriverOptions{1, kSize + 64 * kMiB, 2 * kMiB, {}}, options);
    tag_ = *InternTag("yield");
    ASSERT_TRUE(alloc_->CreateTag(tag_, Policy::kBackup).ok());
  }
  // Counts `op` by the thread that calls it; the background thread's first call of it
  // waits until pause_called_, then 100 ms more.
  void HoldTheBackgroundThreadAt(DriverOp op) {
    const std::thread::id me = std::this_thread::get_id();
    sim_->SetBeforeCall([this, op, me](DriverOp called) {
      if (called != op) return;
      if (std::this_thread::get_id() == me) {
        ++foreground_;
        return;
      }
      if (background_++ > 0) return;
      held_ = true;
      while (!pause_called_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    });
  }
  // Runs `call` once the background thread is held inside its first step.
  template <typename F>
  void CallOnceHeld(F call) {
    while (!held_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    pause_called_ = true;
    call();
  }
  void PauseOnceHeld() {
    CallOnceHeld([&] { ASSERT_TRUE(alloc_->Pause(tag_).ok()); });
  }
  static int Step() { return static_cast<int>(TagPool::kPrepareStepBytes / PinnedPieces::kPieceBytes); }

  TagId tag_ = 0;
  std::atomic<bool> held_{false}, pause_called_{false};
  std::atomic<int> foreground_{0}, background_{0};
};

TEST_F(BackgroundStepsYieldTest, APauseWaitsForOnePreparationStepNotForAll) {
  HoldTheBackgroundThreadAt(DriverOp::kHostRegister);
  DevicePtr p = *alloc_->Allocate(kSize, nullptr, tag_);  // the background preparation starts
  FillPattern(p, kMiB, 1);
  FillPattern(p + kSize - kMiB, kMiB, 2);
  PauseOnceHeld();
  sim_->SetBeforeCall(nullptr);
  const int step = static_cast<int>(TagPool::kPrepareStepBytes / PinnedPieces::kPieceBytes);
  EXPECT_EQ(background_.load(), step) << "the background thread pinned past its first step";
  EXPECT_EQ(foreground_.load(), 1) << "the pause pins the last piece itself";
  ASSERT_TRUE(alloc_->Resume(tag_).ok());
  EXPECT_EQ(WrongBytes(p, kMiB, 1), 0u);
  EXPECT_EQ(WrongBytes(p + kSize - kMiB, kMiB, 2), 0u);
  ASSERT_TRUE(alloc_->Free(p).ok());
}

TEST_F(BackgroundStepsYieldTest, APauseWaitsForOneHandBackStepNotForAll) {
  ASSERT_TRUE(alloc_->SetBackupRetention(tag_, BackupRetention{false, true, true}).ok());
  DevicePtr p = *alloc_->Allocate(kSize, nullptr, tag_);
  FillPattern(p, kMiB, 1);
  FillPattern(p + kSize - kMiB, kMiB, 2);
  alloc_->WaitForBackgroundPrepare();
  ASSERT_TRUE(alloc_->Pause(tag_).ok());
  HoldTheBackgroundThreadAt(DriverOp::kHostUnregister);
  ASSERT_TRUE(alloc_->Resume(tag_).ok());  // the background thread gives the memory back
  PauseOnceHeld();
  sim_->SetBeforeCall(nullptr);
  const int step = static_cast<int>(TagPool::kPrepareStepBytes / PinnedPieces::kPieceBytes);
  EXPECT_EQ(background_.load(), step) << "the background thread gave back past its first step";
  EXPECT_EQ(foreground_.load(), 0);
  ASSERT_TRUE(alloc_->Resume(tag_).ok());
  EXPECT_EQ(WrongBytes(p, kMiB, 1), 0u);
  EXPECT_EQ(WrongBytes(p + kSize - kMiB, kMiB, 2), 0u);
  alloc_->WaitForBackgroundPrepare();
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).backup_arena_bytes, 0);
  ASSERT_TRUE(alloc_->Free(p).ok());
}

// A preparation charges the whole arena for its first step (fault in all of it, then
// register step by step): under a host cap that refuses it, the steps pin what fits, as
// they did alone (found by review: the preparation pinned nothing).
TEST_F(BackgroundStepsYieldTest, UnderAHostCapAPreparationPinsTheStepsThatFit) {
  const std::size_t base = HostBudget::Process().held();
  HostBudget::Process().SetLimit(base + TagPool::kPrepareStepBytes + 16 * kMiB);
  DevicePtr p = *alloc_->Allocate(kSize, nullptr, tag_);
  alloc_->WaitForBackgroundPrepare();
  const std::size_t arena = static_cast<std::size_t>(TagStatsOf(*alloc_, tag_).backup_arena_bytes);
  const std::size_t charged = HostBudget::Process().held() - base;
  HostBudget::Process().SetLimit(0);
  EXPECT_EQ(arena, TagPool::kPrepareStepBytes);
  EXPECT_EQ(charged, arena);
  FillPattern(p, kMiB, 1);
  ASSERT_TRUE(alloc_->Pause(tag_).ok());
  ASSERT_TRUE(alloc_->Resume(tag_).ok());
  EXPECT_EQ(WrongBytes(p, kMiB, 1), 0u);
  ASSERT_TRUE(alloc_->Free(p).ok());
}

// The other foreground callers of the transition lock announce themselves too (found by
// review: ReleaseBackup and SetBackupStore meeting a preparation waited for it to pin
// everything, then released it all; the race failed 10 of 10 runs before the fix).
TEST_F(BackgroundStepsYieldTest, AReleaseBackupWaitsForOnePreparationStepNotForAll) {
  HoldTheBackgroundThreadAt(DriverOp::kHostRegister);
  DevicePtr p = *alloc_->Allocate(kSize, nullptr, tag_);  // the background preparation starts
  const std::size_t base = HostBudget::Process().held();
  CallOnceHeld([&] { ASSERT_TRUE(alloc_->ReleaseBackup(tag_).ok()); });
  sim_->SetBeforeCall(nullptr);
  alloc_->WaitForBackgroundPrepare();
  EXPECT_EQ(background_.load(), Step()) << "ReleaseBackup waited while the background thread pinned past its first "
                                           "step (all of it, to be unpinned at once)";
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).backup_arena_bytes, 0);
  EXPECT_LE(HostBudget::Process().held(), base);
  ASSERT_TRUE(alloc_->Free(p).ok());
}

TEST_F(BackgroundStepsYieldTest, ASetBackupStoreWaitsForOnePreparationStepNotForAll) {
  HoldTheBackgroundThreadAt(DriverOp::kHostRegister);
  DevicePtr p = *alloc_->Allocate(kSize, nullptr, tag_);
  CallOnceHeld([&] { ASSERT_TRUE(alloc_->SetBackupStore(tag_, BackupStore{BackupStore::Kind::kPageable, ""}).ok()); });
  sim_->SetBeforeCall(nullptr);
  alloc_->WaitForBackgroundPrepare();
  EXPECT_EQ(background_.load(), Step()) << "SetBackupStore waited while the background thread pinned past its first "
                                           "step (all of it, to be released at once)";
  ASSERT_TRUE(alloc_->Free(p).ok());
}

TEST_F(BackgroundStepsYieldTest, ASetBackupStoreWaitsForOneHandBackStepNotForAll) {
  ASSERT_TRUE(alloc_->SetBackupRetention(tag_, BackupRetention{false, true, true}).ok());
  DevicePtr p = *alloc_->Allocate(kSize, nullptr, tag_);
  alloc_->WaitForBackgroundPrepare();
  ASSERT_TRUE(alloc_->Pause(tag_).ok());
  HoldTheBackgroundThreadAt(DriverOp::kHostUnregister);
  ASSERT_TRUE(alloc_->Resume(tag_).ok());  // the background thread gives the memory back
  CallOnceHeld([&] { ASSERT_TRUE(alloc_->SetBackupStore(tag_, BackupStore{BackupStore::Kind::kPageable, ""}).ok()); });
  sim_->SetBeforeCall(nullptr);
  alloc_->WaitForBackgroundPrepare();
  EXPECT_EQ(background_.load(), Step()) << "SetBackupStore waited while the background thread gave back past its "
                                           "first step";
  ASSERT_TRUE(alloc_->Free(p).ok());
}

}  // namespace
}  // namespace vmstash

namespace vmstash {
namespace {

// The background thread runs its start function (the driver's RelaxStreamCaptureForThisThread)
// once, on itself, before any work: its pins and hand-backs then never invalidate a graph
// captured in global mode by another thread.
TEST(AutoPreparerThreadTest, TheThreadStartFunctionRunsOnceOnTheThreadBeforeItsWork) {
  std::atomic<int> starts{0};
  std::thread::id start_thread, work_thread;
  std::atomic<bool> started_before_work{false};
  {
    AutoPreparer preparer(
        [&](TagId, std::size_t, bool) {
          work_thread = std::this_thread::get_id();
          started_before_work = starts.load() == 1;
          return absl::OkStatus();
        },
        std::chrono::milliseconds(0), [&] {
          start_thread = std::this_thread::get_id();
          ++starts;
        });
    preparer.Request(TagId{1}, 1 << 20);
    preparer.WaitIdle();
    preparer.Request(TagId{2}, 1 << 20);
    preparer.WaitIdle();
  }
  EXPECT_EQ(starts.load(), 1);
  EXPECT_TRUE(started_before_work.load());
  EXPECT_EQ(start_thread, work_thread);
  EXPECT_NE(start_thread, std::this_thread::get_id());
}

}  // namespace
}  // namespace vmstash
