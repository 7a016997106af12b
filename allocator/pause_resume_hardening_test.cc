// Regression tests for defects found in review (issue 16): each test failed (or hung, or
// crashed) before its fix. Items: 1 Prepare/ReleaseBackup on a paused tag, 2 pending
// frees recorded after a pause's synchronize, 3 hooks that free or pause their own tag,
// 4 ReadBackup ranges that wrap, 7 a rollback that cannot map memory back. Round 3
// (issue 28): a backup pause whose hints cover no live byte, a hook that transitions
// another tag while a switch holds that tag's lock and waits for the hook's.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <thread>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/testing.h"
#include "base/byte_pattern.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

using ::testing::HasSubstr;
using Transition = CachingAllocator::Transition;

// Runs `fn` on another thread; a call that does not return within 20 s is a hang, which
// ends the test binary at once (a hung thread cannot be joined).
template <typename Fn>
auto WithinDeadline(const char* what, Fn fn) {
  auto future = std::async(std::launch::async, fn);
  if (future.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    std::fprintf(stderr, "HANG: %s did not return within 20 s\n", what);
    std::fflush(stderr);
    std::_Exit(1);
  }
  return future.get();
}

class HardeningTest : public testing::SimAllocatorTest {
 protected:
  void SetUp() override { Make(); }
  void TearDown() override {
    if (sim_ != nullptr) sim_->SetAfterSynchronizeDevice(nullptr);
    SimAllocatorTest::TearDown();
  }
  void Make(bool auto_prepare = false, int settle_ms = 250) {
    AllocatorOptions options = testing::TestOptions();
    options.auto_prepare = auto_prepare;
    options.auto_prepare_settle_ms = settle_ms;
    MakeAllocator(SimDriverOptions{1, 2 * kGiB, 2 * kMiB, {}}, options);
    ASSERT_NE(alloc_, nullptr);
    weights_ = *InternTag("weights");
    kv_ = *InternTag("kv_cache");
    ASSERT_TRUE(alloc_->CreateTag(weights_, Policy::kBackup).ok());
    ASSERT_TRUE(alloc_->CreateTag(kv_, Policy::kDiscard).ok());
  }
  DevicePtr Alloc(std::size_t n, TagId tag, Stream stream = nullptr) {
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(n, stream, tag);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *p : 0;
  }
  TagStats StatsOf(TagId tag) {
    for (const TagStats& t : alloc_->Stats().tags) {
      if (t.name == TagName(tag)) return t;
    }
    return TagStats();
  }
  TagId weights_ = 0, kv_ = 0;
};

// Item 1: Prepare(tag, 0) on a paused backup tag re-reserved the arena holding the paused
// bytes; the resume then restored 2 MiB of garbage.
TEST_F(HardeningTest, PrepareAndReleaseBackupOfAPausedTagAreRefusedAndTheBytesSurvive) {
  DevicePtr p = Alloc(2 * kMiB, weights_);
  FillPattern(p, 2 * kMiB, 41);
  ASSERT_EQ(*alloc_->Pause(weights_), Transition::kDone);
  const std::int64_t arena = StatsOf(weights_).backup_arena_bytes;
  for (std::size_t bytes : {std::size_t{0}, 64 * kMiB, std::size_t{1}}) {
    absl::Status s = alloc_->Prepare(weights_, bytes);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << bytes << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr("weights"));
    EXPECT_THAT(s.message(), HasSubstr("paused"));
  }
  EXPECT_EQ(alloc_->ReleaseBackup(weights_).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(StatsOf(weights_).backup_arena_bytes, arena);
  ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
  EXPECT_EQ(WrongBytes(p, 2 * kMiB, 41), 0u);
  // Active again: both work.
  EXPECT_TRUE(alloc_->Prepare(weights_, 0).ok());
  EXPECT_TRUE(alloc_->ReleaseBackup(weights_).ok());
  ASSERT_TRUE(alloc_->Free(p).ok());
}

// Item 1, the background path: a preparation requested while the tag was active and due
// while it is paused leaves the paused bytes alone.
TEST_F(HardeningTest, BackgroundPreparationDueWhilePausedLeavesTheBackupAlone) {
  Make(/*auto_prepare=*/true, /*settle_ms=*/50);
  DevicePtr p = Alloc(2 * kMiB, weights_);
  FillPattern(p, 2 * kMiB, 17);
  ASSERT_EQ(*alloc_->Pause(weights_), Transition::kDone);  // the request is still settling
  const std::int64_t arena = StatsOf(weights_).backup_arena_bytes;
  DevicePtr grow = 0;
  alloc_->WaitForBackgroundPrepare();
  EXPECT_EQ(StatsOf(weights_).backup_arena_bytes, arena);
  ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
  EXPECT_EQ(WrongBytes(p, 2 * kMiB, 17), 0u);
  // Many pause/resume cycles racing growth-triggered preparations.
  for (int i = 0; i < 20; ++i) {
    grow = Alloc(std::size_t(i + 1) * 3 * kMiB, weights_);
    FillPattern(grow, 3 * kMiB, static_cast<std::uint8_t>(i));
    ASSERT_EQ(*alloc_->Pause(weights_), Transition::kDone);
    ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
    ASSERT_EQ(WrongBytes(p, 2 * kMiB, 17), 0u) << i;
    ASSERT_EQ(WrongBytes(grow, 3 * kMiB, static_cast<std::uint8_t>(i)), 0u) << i;
    ASSERT_TRUE(alloc_->Free(grow).ok());
  }
  alloc_->WaitForBackgroundPrepare();
  ASSERT_TRUE(alloc_->Free(p).ok());
}

// Item 2: a free recorded on another stream after the pause's device synchronize was
// taken as complete, and the block was handed out again while that stream still used it.
TEST_F(HardeningTest, FreesRecordedAfterThePauseSynchronizeStillWaitForTheirEvents) {
  Stream other = *sim_->CreateStream(0);
  DevicePtr w = Alloc(kMiB, weights_);
  // A block that fills its own chunk, so the only cached memory of that size is its own.
  DevicePtr p = Alloc(20 * kMiB, kv_);
  bool once = false;
  sim_->SetAfterSynchronizeDevice([&](int) {
    if (once) return;
    once = true;
    // Another thread's work in the window between Pause's synchronize and its use of the
    // pending frees: `other` keeps using p, and p is freed.
    sim_->HoldStream(0, other);
    ASSERT_TRUE(alloc_->RecordStream(p, other).ok());
    ASSERT_TRUE(alloc_->Free(p).ok());
  });
  ASSERT_EQ(*alloc_->Pause(weights_), Transition::kDone);
  sim_->SetAfterSynchronizeDevice(nullptr);
  ASSERT_TRUE(once);
  ASSERT_TRUE(sim_->StreamHeld(0, other));
  DevicePtr q = Alloc(20 * kMiB, kv_);
  EXPECT_NE(q, p) << "the block was reused while a stream recorded on it still runs";
  sim_->ReleaseStream(0, other);
  DevicePtr r = Alloc(20 * kMiB, kv_);  // its event completed: reusable now
  EXPECT_EQ(r, p);
  for (DevicePtr x : {q, r}) ASSERT_TRUE(alloc_->Free(x).ok());
  ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
  ASSERT_TRUE(alloc_->Free(w).ok());
  ASSERT_TRUE(sim_->DestroyStream(0, other).ok());
}

// Item 3: a before-pause hook that frees a block of its own tag hung on the tag's
// transition lock.
TEST_F(HardeningTest, HooksMayFreeAndAllocateInTheirOwnTag) {
  DevicePtr keep = Alloc(3 * kMiB, weights_);
  FillPattern(keep, 3 * kMiB, 5);
  DevicePtr scratch = Alloc(kMiB, weights_);
  absl::Status freed, reallocated;
  DevicePtr after_block = 0;
  ASSERT_TRUE(alloc_
                  ->AddHooks(
                      weights_,
                      [&](TagId, int) {
                        freed = alloc_->Free(scratch);
                        return absl::OkStatus();
                      },
                      [&](TagId tag, int) {
                        absl::StatusOr<DevicePtr> b = alloc_->Allocate(4096, nullptr, tag);
                        reallocated = b.status();
                        if (b.ok()) after_block = *b;
                        return absl::OkStatus();
                      })
                  .ok());
  EXPECT_EQ(WithinDeadline("pause with a hook freeing its own tag's block", [&] { return alloc_->Pause(weights_); })
                .value(),
            Transition::kDone);
  EXPECT_TRUE(freed.ok()) << freed;
  EXPECT_EQ(StatsOf(weights_).backed_up_bytes, static_cast<std::int64_t>(3 * kMiB));
  EXPECT_EQ(WithinDeadline("resume with a hook allocating in its own tag", [&] { return alloc_->Resume(weights_); })
                .value(),
            Transition::kDone);
  EXPECT_TRUE(reallocated.ok()) << reallocated;
  EXPECT_EQ(WrongBytes(keep, 3 * kMiB, 5), 0u);
  for (DevicePtr x : {keep, after_block}) ASSERT_TRUE(alloc_->Free(x).ok());
}

// Item 3: a hook that pauses or resumes its own tag fails fast instead of waiting for
// itself; other tags may be paused from a hook.
TEST_F(HardeningTest, AHookPausingItsOwnTagFailsFastWithAClearError) {
  DevicePtr w = Alloc(kMiB, weights_);
  DevicePtr k = Alloc(kMiB, kv_);
  absl::Status own_pause, own_resume;
  absl::StatusOr<Transition> other = absl::UnknownError("not run");
  ASSERT_TRUE(alloc_
                  ->AddHooks(
                      weights_,
                      [&](TagId tag, int) {
                        own_pause = alloc_->Pause(tag).status();
                        other = alloc_->Pause(kv_);
                        return absl::OkStatus();
                      },
                      [&](TagId tag, int) {
                        own_resume = alloc_->Resume(tag).status();
                        return absl::OkStatus();
                      })
                  .ok());
  EXPECT_EQ(WithinDeadline("pause from its own hook", [&] { return alloc_->Pause(weights_); }).value(),
            Transition::kDone);
  EXPECT_EQ(own_pause.code(), absl::StatusCode::kFailedPrecondition) << own_pause;
  EXPECT_THAT(own_pause.message(), HasSubstr("from a hook of that tag"));
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(*other, Transition::kDone);
  EXPECT_EQ(WithinDeadline("resume from its own hook", [&] { return alloc_->Resume(weights_); }).value(),
            Transition::kDone);
  EXPECT_EQ(own_resume.code(), absl::StatusCode::kFailedPrecondition) << own_resume;
  ASSERT_EQ(*alloc_->Resume(kv_), Transition::kDone);
  for (DevicePtr x : {w, k}) ASSERT_TRUE(alloc_->Free(x).ok());
}

// Item 4: ptr + size wrapped, and ReadBackup copied SIZE_MAX - 15 bytes (segfault).
TEST_F(HardeningTest, ReadBackupRejectsRangesThatWrapTheAddressSpace) {
  DevicePtr p = Alloc(kMiB, weights_);
  FillPattern(p, kMiB, 3);
  ASSERT_EQ(*alloc_->Pause(weights_), Transition::kDone);
  std::vector<std::uint8_t> host(64);
  absl::Status s = alloc_->ReadBackup(p + 16, SIZE_MAX - 15, host.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(alloc_->ReadBackup(p, SIZE_MAX, host.data()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc_->ReadBackup(~DevicePtr{0}, 2, host.data()).code(), absl::StatusCode::kInvalidArgument);
  // One byte past the block is NotFound; the block's bytes are readable.
  EXPECT_EQ(alloc_->ReadBackup(p + kMiB - 32, 64, host.data()).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(alloc_->ReadBackup(p + 16, 64, host.data()).ok());
  EXPECT_EQ(host[0], static_cast<std::uint8_t>(3 + 16 * 7));
  ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
  ASSERT_TRUE(alloc_->Free(p).ok());
}

// Item 7: the rollback of a failed pause cannot map the memory back. The tag was left
// "active" with unmapped chunks; now it is "broken" and says so on every use.
TEST_F(HardeningTest, AFailedRollbackLeavesTheTagBrokenAndEveryUseSaysSo) {
  DevicePtr small = Alloc(4096, kv_);   // small heap: unmapped first
  DevicePtr large = Alloc(32 * kMiB, kv_);  // large heap: its unmap fails
  sim_->InjectFault(FaultRule{DriverOp::kUnmap, 2, 1, absl::StatusCode::kInternal});
  sim_->InjectFault(FaultRule{DriverOp::kMap, 1, 1, absl::StatusCode::kInternal});
  absl::StatusOr<Transition> paused = alloc_->Pause(kv_);
  ASSERT_FALSE(paused.ok());
  EXPECT_THAT(paused.status().message(), HasSubstr("kv_cache"));
  EXPECT_THAT(paused.status().message(), HasSubstr("broken"));
  sim_->ClearFaults();
  EXPECT_EQ(StatsOf(kv_).state, "broken");
  absl::StatusOr<DevicePtr> more = alloc_->Allocate(4096, nullptr, kv_);
  EXPECT_EQ(more.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(more.status().message(), HasSubstr("kv_cache"));
  EXPECT_THAT(more.status().message(), HasSubstr("restart"));
  EXPECT_EQ(alloc_->Pause(kv_).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(alloc_->Resume(kv_).status().code(), absl::StatusCode::kFailedPrecondition);
  // Other tags are unaffected; the broken tag's blocks can still be freed.
  DevicePtr w = Alloc(kMiB, weights_);
  ASSERT_EQ(*alloc_->Pause(weights_), Transition::kDone);
  ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
  for (DevicePtr x : {small, large, w}) ASSERT_TRUE(alloc_->Free(x).ok());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
}

// Item 7: a rollback that succeeds leaves the tag active and intact (not broken).
TEST_F(HardeningTest, ASuccessfulRollbackLeavesTheTagActive) {
  DevicePtr small = Alloc(4096, kv_);
  DevicePtr large = Alloc(32 * kMiB, kv_);
  sim_->InjectFault(FaultRule{DriverOp::kUnmap, 2, 1, absl::StatusCode::kInternal});
  EXPECT_EQ(alloc_->Pause(kv_).status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(StatsOf(kv_).state, "active");
  std::memset(reinterpret_cast<void*>(small), 1, 4096);  // mapped again
  ASSERT_EQ(*alloc_->Pause(kv_), Transition::kDone);
  ASSERT_EQ(*alloc_->Resume(kv_), Transition::kDone);
  for (DevicePtr x : {small, large}) ASSERT_TRUE(alloc_->Free(x).ok());
}

// Issue 28 item 1: a backup pause whose live ranges cover none of its live bytes (Python's
// hints right after the tensors were deleted: n = 0) made no arena but recorded an empty
// extent list per block; every resume then failed "its backup arena is gone", forever.
TEST_F(HardeningTest, ABackupPauseWhoseHintsCoverNoLiveByteCanBeResumed) {
  DevicePtr p = Alloc(3 * kMiB, weights_);
  const CachingAllocator::LiveRanges none;
  ASSERT_EQ(*alloc_->Pause(weights_, &none), Transition::kDone);
  EXPECT_EQ(StatsOf(weights_).backed_up_bytes, 0);
  absl::StatusOr<Transition> resumed = alloc_->Resume(weights_);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(*resumed, Transition::kDone);
  EXPECT_EQ(StatsOf(weights_).state, "active");
  // The same through a switch, out and back in, and out by switch then in by resume.
  const CachingAllocator::LiveRangesByTag hints = {{weights_, none}};
  ASSERT_EQ(*alloc_->Switch({weights_}, {}, &hints), Transition::kDone);
  absl::StatusOr<Transition> back = alloc_->Switch({}, {weights_});
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(*alloc_->Switch({weights_}, {}, &hints), Transition::kDone);
  ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
  // A block whose hint covers part of it still round-trips that part.
  FillPattern(p, 3 * kMiB, 9);
  const CachingAllocator::LiveRanges part = {{p, kMiB}};
  ASSERT_EQ(*alloc_->Pause(weights_, &part), Transition::kDone);
  ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
  EXPECT_EQ(WrongBytes(p, kMiB, 9), 0u);
  ASSERT_TRUE(alloc_->Free(p).ok());
}

// Issue 28 (suspected, shown): a before-pause hook of tag B that pauses tag A waited for
// A's control lock while holding B's; a switch of {A, B} that took A's lock first (ids in
// ascending order) waited for B's: deadlock. A hook now only tries a lock.
TEST_F(HardeningTest, AHookTransitioningAnotherTagNeverDeadlocksWithASwitch) {
  const TagId a = weights_ < kv_ ? weights_ : kv_;  // the lower id: a switch locks it first
  const TagId b = weights_ < kv_ ? kv_ : weights_;
  DevicePtr pa = Alloc(kMiB, a);
  DevicePtr pb = Alloc(kMiB, b);
  std::promise<void> in_hook;
  std::promise<void> switch_started;
  std::shared_future<void> started = switch_started.get_future().share();
  absl::StatusOr<Transition> from_hook = absl::UnknownError("not run");
  bool armed = true;
  ASSERT_TRUE(alloc_
                  ->AddHooks(
                      b,
                      [&](TagId, int) {
                        if (!armed) return absl::OkStatus();
                        armed = false;
                        in_hook.set_value();
                        started.wait();
                        // Give the switch time to take A's lock and block on B's.
                        std::this_thread::sleep_for(std::chrono::milliseconds(200));
                        from_hook = alloc_->Pause(a);
                        return absl::OkStatus();
                      },
                      nullptr)
                  .ok());
  auto pausing_b = std::async(std::launch::async, [&] { return alloc_->Pause(b); });
  in_hook.get_future().wait();
  auto switching = std::async(std::launch::async, [&] { return alloc_->Switch({a, b}, {}); });
  switch_started.set_value();
  absl::StatusOr<Transition> paused_b =
      WithinDeadline("a pause whose hook pauses another tag, beside a switch of both", [&] { return pausing_b.get(); });
  absl::StatusOr<Transition> switched = WithinDeadline("the switch", [&] { return switching.get(); });
  ASSERT_TRUE(paused_b.ok()) << paused_b.status();
  // Either the hook got A first (then the switch finds A and B paused) or the switch held
  // A and the hook was refused at once with a clear error.
  if (!from_hook.ok()) {
    EXPECT_EQ(from_hook.status().code(), absl::StatusCode::kFailedPrecondition) << from_hook.status();
    EXPECT_THAT(std::string(from_hook.status().message()), HasSubstr("another transition"));
  }
  ASSERT_TRUE(switched.ok()) << switched.status();
  EXPECT_EQ(StatsOf(a).state, "paused");
  EXPECT_EQ(StatsOf(b).state, "paused");
  for (TagId t : {a, b}) ASSERT_EQ(*alloc_->Resume(t), Transition::kDone);
  for (DevicePtr x : {pa, pb}) ASSERT_TRUE(alloc_->Free(x).ok());
}

}  // namespace
}  // namespace vmstash
