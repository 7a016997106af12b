#include "allocator/tag_pool.h"

#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "allocator/testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

using ::testing::HasSubstr;

constexpr TagState kStates[] = {TagState::kActive, TagState::kPausing, TagState::kPaused, TagState::kResuming,
                                TagState::kBroken};

// The state machine of tag_pool.h, written out again: the test's own copy of the table.
const std::set<std::pair<TagState, TagState>>& Expected() {
  static const auto* table = new std::set<std::pair<TagState, TagState>>{
      {TagState::kActive, TagState::kPausing},  {TagState::kPausing, TagState::kPaused},
      {TagState::kPausing, TagState::kActive},  {TagState::kPausing, TagState::kBroken},
      {TagState::kPaused, TagState::kResuming}, {TagState::kResuming, TagState::kActive},
      {TagState::kResuming, TagState::kPaused},
  };
  return *table;
}

std::string ReasonFor(TagState to) { return to == TagState::kBroken ? "broken for the test" : ""; }

class TagPoolTest : public ::testing::Test {
 protected:
  // The test is the owner: it holds the owner's mu throughout, as the allocator does around
  // the calls made here (the pool checks it: Mutex::AssertHeld).
  void SetUp() override { owner_mu_.Lock(); }
  void TearDown() override { owner_mu_.Unlock(); }
  std::unique_ptr<TagPool> NewPool() {
    HeapConfig base;
    base.driver = &sim_;
    base.granularity_bytes = 2 * kMiB;
    base.va_bytes = 64 * kMiB;
    HeapConfig small = base;
    small.name = "tag_pool_test/small";
    small.small = true;
    small.small_chunk_bytes = 2 * kMiB;
    HeapConfig large = base;
    large.name = "tag_pool_test/large";
    large.min_chunk_bytes = 2 * kMiB;
    large.max_chunk_bytes = 8 * kMiB;
    return std::make_unique<TagPool>(kDefaultTag, Policy::kBackup, BackupStore{}, &sim_, 0, small, large,
                                     &owner_mu_);
  }
  // A pool in `state`, reached through allowed moves only.
  std::unique_ptr<TagPool> PoolIn(TagState state) {
    std::unique_ptr<TagPool> pool = NewPool();
    std::vector<TagState> path;
    switch (state) {
      case TagState::kActive: break;
      case TagState::kPausing: path = {TagState::kPausing}; break;
      case TagState::kPaused: path = {TagState::kPausing, TagState::kPaused}; break;
      case TagState::kResuming: path = {TagState::kPausing, TagState::kPaused, TagState::kResuming}; break;
      case TagState::kBroken: path = {TagState::kPausing, TagState::kBroken}; break;
    }
    for (TagState to : path) EXPECT_TRUE(pool->MoveTo(to, ReasonFor(to)).ok()) << TagStateName(to);
    EXPECT_EQ(pool->state(), state);
    return pool;
  }

  SimDriver sim_{SimDriverOptions{1, 256 * kMiB, 2 * kMiB, {}}};
  Mutex owner_mu_;
};

TEST_F(TagPoolTest, EveryMoveOutsideTheTableIsRefused) {
  int allowed = 0;
  for (TagState from : kStates) {
    for (TagState to : kStates) {
      const bool expected = Expected().count({from, to}) != 0;
      EXPECT_EQ(TagTransitionAllowed(from, to), expected) << TagStateName(from) << " -> " << TagStateName(to);
      std::unique_ptr<TagPool> pool = PoolIn(from);
      absl::Status moved = pool->MoveTo(to, ReasonFor(to));
      if (expected) {
        ++allowed;
        EXPECT_TRUE(moved.ok()) << TagStateName(from) << " -> " << TagStateName(to) << ": " << moved;
        EXPECT_EQ(pool->state(), to);
      } else {
        EXPECT_EQ(moved.code(), absl::StatusCode::kInternal) << TagStateName(from) << " -> " << TagStateName(to);
        EXPECT_THAT(moved.message(), HasSubstr("is not allowed"));
        EXPECT_EQ(pool->state(), from) << "a refused move changes nothing";
      }
    }
  }
  EXPECT_EQ(allowed, 7);
}

TEST_F(TagPoolTest, BrokenNeedsAReasonAndOnlyBrokenTakesOne) {
  std::unique_ptr<TagPool> pool = PoolIn(TagState::kPausing);
  EXPECT_EQ(pool->MoveTo(TagState::kBroken).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(pool->MoveTo(TagState::kActive, "why").code(), absl::StatusCode::kInternal);
  EXPECT_EQ(pool->state(), TagState::kPausing);
  ASSERT_TRUE(pool->MoveTo(TagState::kBroken, "the rollback failed").ok());
  EXPECT_EQ(pool->broken_reason(), "the rollback failed");
  EXPECT_EQ(pool->NotActiveError("resume it").message(), "the rollback failed");
  EXPECT_TRUE(pool->frozen());
  std::size_t allocated = 0, pending = 0;
  EXPECT_TRUE(pool->Validate(0, &allocated, &pending).ok()) << pool->Validate(0, &allocated, &pending);
}

TEST_F(TagPoolTest, ValidateNamesAStateItsPartsDisagreeWith) {
  std::size_t allocated = 0, pending = 0;
  std::unique_ptr<TagPool> pool = PoolIn(TagState::kActive);
  EXPECT_TRUE(pool->Validate(0, &allocated, &pending).ok());
  // Paused by the state machine alone: its heaps are still mapped.
  pool = PoolIn(TagState::kPaused);
  absl::Status valid = pool->Validate(0, &allocated, &pending);
  EXPECT_EQ(valid.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(valid.message(), HasSubstr("a heap is not paused"));
  // Paused for real: both heaps released and paused.
  absl::Status error;
  for (Heap* heap : pool->heaps()) heap->ReleaseAllAndPause(&error);
  ASSERT_TRUE(error.ok()) << error;
  EXPECT_TRUE(pool->Validate(0, &allocated, &pending).ok()) << pool->Validate(0, &allocated, &pending);
  // Resumed by the state machine alone: the heaps are still paused.
  ASSERT_TRUE(pool->MoveTo(TagState::kResuming).ok());
  ASSERT_TRUE(pool->MoveTo(TagState::kActive).ok());
  valid = pool->Validate(0, &allocated, &pending);
  EXPECT_THAT(valid.message(), HasSubstr("a heap is paused"));
}

TEST_F(TagPoolTest, StatsReportTheIdentityThePoolHolds) {
  std::unique_ptr<TagPool> pool = PoolIn(TagState::kPaused);
  TagStats stats;
  pool->FillStats(&stats);
  EXPECT_EQ(stats.name, "default");
  EXPECT_EQ(stats.policy, Policy::kBackup);
  EXPECT_EQ(stats.state, "paused");
  EXPECT_EQ(stats.backup_store, DescribeBackupStore(BackupStore{}));
  EXPECT_TRUE(pool->stats().name.empty()) << "the counters do not carry the identity";
}

// DropEmptyTag's test: a pool named in a transition or a switch (its control lock held,
// moving or not), in its transition (the transition lock), or holding a bypass allocation
// (a live block outside its heaps) is not empty; it is only once none of these holds.
TEST_F(TagPoolTest, APoolInUseIsNeverEmpty) {
  std::unique_ptr<TagPool> pool = NewPool();
  EXPECT_TRUE(pool->Empty());
  pool->control_mu()->Lock();
  EXPECT_FALSE(pool->Empty()) << "a switch that names the tag holds its control lock";
  pool->control_mu()->Unlock();
  pool->transition_mu()->Lock();
  EXPECT_FALSE(pool->Empty());
  pool->transition_mu()->Unlock();
  pool->NoteAllocated(4096, 4096);  // as a bypass allocation is counted
  EXPECT_FALSE(pool->Empty());
  pool->NoteFreed(4096, 4096);
  EXPECT_TRUE(pool->Empty());
}

}  // namespace
}  // namespace vmstash
