// TagBackup on its own (tag_backup.h): the arena's table of moves, and its life through
// preparation, a pause, the resumes of each retention, the background hand-back and a
// release, with Validate checking the state against the tag's and the arena at each step.
#include "allocator/tag_backup.h"

#include <set>
#include <utility>
#include <vector>

#include "allocator/testing.h"
#include "base/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

using ::testing::HasSubstr;

constexpr ArenaState kStates[] = {ArenaState::kNone, ArenaState::kReady, ArenaState::kGivingBack,
                                  ArenaState::kHolding, ArenaState::kRetained};

// The arena's life of tag_backup.h, written out again: the test's own copy of the table.
const std::set<std::pair<ArenaState, ArenaState>>& Expected() {
  using S = ArenaState;
  static const auto* table = new std::set<std::pair<S, S>>{
      {S::kNone, S::kReady},          {S::kNone, S::kHolding},       {S::kReady, S::kHolding},
      {S::kReady, S::kNone},          {S::kGivingBack, S::kReady},   {S::kGivingBack, S::kHolding},
      {S::kGivingBack, S::kNone},     {S::kHolding, S::kReady},      {S::kHolding, S::kGivingBack},
      {S::kHolding, S::kRetained},    {S::kHolding, S::kNone},       {S::kRetained, S::kHolding},
      {S::kRetained, S::kReady},      {S::kRetained, S::kNone},
  };
  return *table;
}

TEST(ArenaMovesTest, TheTableIsExactlyTheDrawing) {
  for (ArenaState from : kStates) {
    for (ArenaState to : kStates) {
      const bool expected = from == to || Expected().count({from, to}) > 0;
      EXPECT_EQ(ArenaMoveAllowed(from, to), expected) << ArenaStateName(from) << " -> " << ArenaStateName(to);
    }
  }
}

class TagBackupTest : public ::testing::Test {
 protected:
  // The test is the tag's transition: it holds the transition lock throughout; the backup
  // takes the owner's mu itself where it writes its state.
  void SetUp() override { transition_mu_.Lock(); }
  void TearDown() override { transition_mu_.Unlock(); }
  absl::Status Valid(TagState tag) {
    MutexLock lock(&mu_);
    return backup_.ValidateWithArena(tag, static_cast<std::int64_t>(backup_.held_bytes()));
  }
  // A pause of `bytes` into the arena: the tag's state told as TagPool tells it.
  void Pause(std::size_t bytes) {
    ASSERT_TRUE(backup_.Reserve(bytes, {bytes}, "", nullptr).ok());
    EXPECT_EQ(backup_.state(), ArenaState::kHolding);
    EXPECT_TRUE(Valid(TagState::kPausing).ok()) << Valid(TagState::kPausing);
    MutexLock lock(&mu_);
    backup_.AfterPause();
  }

  SimDriver sim_{SimDriverOptions{1, 256 * kMiB, 2 * kMiB, {}}};
  Mutex transition_mu_;
  Mutex mu_;  // the owner's mu
  TagBackup backup_{&sim_, 0, "backup_test", BackupStore{}, &transition_mu_, &mu_};
};

TEST_F(TagBackupTest, APreparedArenaIsReadyAndItsStatisticIsWhatItHolds) {
  EXPECT_EQ(backup_.state(), ArenaState::kNone);
  EXPECT_TRUE(Valid(TagState::kActive).ok());
  std::size_t pin_to = 0;
  ASSERT_TRUE(backup_.ReserveForPrepare(8 * kMiB, /*background=*/false, &pin_to).ok());
  ASSERT_TRUE(backup_.Pin(pin_to).ok());
  EXPECT_EQ(backup_.state(), ArenaState::kReady);
  EXPECT_GE(backup_.held_bytes(), 8 * kMiB);
  EXPECT_TRUE(Valid(TagState::kActive).ok());
  absl::Status stale;
  {
    MutexLock lock(&mu_);
    stale = backup_.ValidateWithArena(TagState::kActive, 0);
  }
  EXPECT_THAT(stale.message(), HasSubstr("arena-bytes stat 0 but the arena holds"));
  ASSERT_TRUE(backup_.Release(std::nullopt).ok());
  EXPECT_EQ(backup_.state(), ArenaState::kNone);
  EXPECT_EQ(backup_.held_bytes(), 0u);
  EXPECT_TRUE(Valid(TagState::kActive).ok());
}

TEST_F(TagBackupTest, APausedTagsArenaHoldsItsBytesUntilTheResume) {
  Pause(4 * kMiB);
  EXPECT_TRUE(Valid(TagState::kPaused).ok());
  EXPECT_THAT(Valid(TagState::kActive).message(), HasSubstr("the tag is not pausing, paused or resuming"));
  backup_.AfterResume(/*later=*/false);
  EXPECT_EQ(backup_.state(), ArenaState::kReady);  // kept for the next pause, contents dropped
  EXPECT_TRUE(Valid(TagState::kActive).ok());
}

TEST_F(TagBackupTest, AFailedPauseGivesBackWhatItAddedAndIsReady) {
  ASSERT_TRUE(backup_.Reserve(4 * kMiB, {4 * kMiB}, "", nullptr).ok());
  backup_.AfterFailedPause();
  EXPECT_EQ(backup_.state(), ArenaState::kReady);
  EXPECT_TRUE(Valid(TagState::kActive).ok());
}

TEST_F(TagBackupTest, AResumeKeepingTheBytesReadableIsRetainedForAnActiveTagOnly) {
  backup_.SetRetention(BackupRetention{/*keep_after_resume=*/true, false, false});
  Pause(4 * kMiB);
  backup_.AfterResume(false);
  EXPECT_EQ(backup_.state(), ArenaState::kRetained);
  EXPECT_TRUE(Valid(TagState::kActive).ok());
  EXPECT_THAT(Valid(TagState::kPaused).message(), HasSubstr("only an active tag's backup"));
  // The next pause writes over it: holding, nothing retained any more.
  Pause(4 * kMiB);
  EXPECT_TRUE(backup_.retained().empty());
  EXPECT_TRUE(Valid(TagState::kPaused).ok());
}

TEST_F(TagBackupTest, AHandBackLeftToTheBackgroundEndsReadyWithNothingHeld) {
  backup_.SetRetention(BackupRetention{false, false, /*give_back=*/true});
  Pause(12 * kMiB);
  backup_.AfterResume(/*later=*/true);
  EXPECT_EQ(backup_.state(), ArenaState::kGivingBack);
  EXPECT_TRUE(backup_.give_back_pending());
  EXPECT_GT(backup_.held_bytes(), 0u);
  EXPECT_TRUE(Valid(TagState::kActive).ok());
  int steps = 0;
  while (backup_.give_back_pending() && steps < 100) {
    ASSERT_TRUE(backup_.GiveBackStep(2 * kMiB).ok());
    ++steps;
  }
  EXPECT_LT(steps, 100);
  EXPECT_EQ(backup_.state(), ArenaState::kReady);
  EXPECT_EQ(backup_.held_bytes(), 0u);
  EXPECT_TRUE(Valid(TagState::kActive).ok());
}

TEST_F(TagBackupTest, APauseCancelsAPendingHandBackAndUsesWhatIsStillPinned) {
  backup_.SetRetention(BackupRetention{false, false, true});
  Pause(8 * kMiB);
  backup_.AfterResume(true);
  ASSERT_TRUE(backup_.give_back_pending());
  Pause(8 * kMiB);
  EXPECT_FALSE(backup_.give_back_pending());
  EXPECT_TRUE(Valid(TagState::kPaused).ok());
}

TEST_F(TagBackupTest, AReleaseMovesTheEpochSoABackgroundStepStops) {
  std::size_t pin_to = 0;
  ASSERT_TRUE(backup_.ReserveForPrepare(8 * kMiB, /*background=*/true, &pin_to).ok());
  const std::uint64_t epoch = backup_.epoch();
  ASSERT_TRUE(backup_.Release(0).ok());
  bool warmed = false, done = false, yield = false;
  ASSERT_TRUE(backup_.PinStep(epoch, pin_to, 2 * kMiB, [] { return false; }, &warmed, &done, &yield).ok());
  EXPECT_TRUE(done);
  EXPECT_FALSE(warmed) << "nothing faulted in for an arena that moved on";
  EXPECT_EQ(backup_.held_bytes(), 0u);
  EXPECT_EQ(backup_.state(), ArenaState::kNone);
}

}  // namespace
}  // namespace vmstash
