// The host-memory cap (VMSTASH_CONF host_max, allocator/host_budget.h) on backup arenas
// (Note [Host Budget] in allocator/backup_arena.h) on the simulator: a pause over the cap
// fails changing nothing, with ResourceExhausted naming host_max; with spill_dir the tag
// moves to the disk store there and its bytes survive; the account follows what the
// arenas hold through preparation, pause, give-back and release. A failed multi-tag pause
// or switch gives back what it charged; a pause over the cap first takes back the arenas
// other active tags hold prepared; a release the driver refuses keeps its charge.
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "allocator/backup_arena.h"
#include "allocator/backup_tags_fixture.h"
#include "allocator/caching_allocator.h"
#include "allocator/host_budget.h"
#include "allocator/tag_pool.h"
#include "allocator/testing.h"
#include "base/byte_pattern.h"
#include "gtest/gtest.h"
#include "vmm/sim_driver.h"
#include "vmm/staging_ring.h"

namespace vmstash {
namespace {

using ::vmstash::testing::TagStatsOf;

class HostCapTest : public testing::BackupTagsTest {
 protected:
  void Make(std::string spill_dir = "", BackupRetention retention = {}, bool auto_prepare = false) {
    AllocatorOptions options = testing::TestOptions();
    options.auto_prepare = auto_prepare;
    options.auto_prepare_settle_ms = 0;
    options.spill_dir = spill_dir;
    MakeAllocator(SimDriverOptions{1, 512 * kMiB, 2 * kMiB, {}}, options);
    tag_ = AddTag("capped", {30 * kMiB, 50 * kMiB}, retention);
  }
};

TEST_F(HostCapTest, APauseOverTheCapFailsChangingNothing) {
  Make();
  const std::size_t base = HostBudget::Process().held();
  HostBudget::Process().SetLimit(base + 40 * kMiB);  // 80 MiB to back up
  absl::StatusOr<CachingAllocator::Transition> r = alloc_->Pause(tag_);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("host_max"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("capped"), std::string::npos) << r.status();
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).state, "active");
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).backup_arena_bytes, 0);
  EXPECT_EQ(HostBudget::Process().held(), base);
  EXPECT_TRUE(Intact());
  EXPECT_TRUE(alloc_->Validate().ok());
  // Raised: the pause goes through, charged; released: refunded.
  HostBudget::Process().SetLimit(0);
  ASSERT_TRUE(alloc_->Pause(tag_).ok());
  EXPECT_GE(HostBudget::Process().held(), base + 80 * kMiB);
  ASSERT_TRUE(alloc_->Resume(tag_).ok());
  EXPECT_TRUE(Intact());
  ASSERT_TRUE(alloc_->ReleaseBackup(tag_).ok());
  EXPECT_EQ(HostBudget::Process().held(), base);
  FreeAll();
}

TEST_F(HostCapTest, OverTheCapWithASpillDirTheTagMovesToDisk) {
  Make(MakeDir());
  const std::size_t base = HostBudget::Process().held();
  HostBudget::Process().SetLimit(base + 40 * kMiB);
  ASSERT_TRUE(alloc_->Pause(tag_).ok());
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).backup_store, "disk:" + dir_);
  EXPECT_EQ(HostBudget::Process().held(), base) << "a disk store charges nothing";
  ASSERT_TRUE(alloc_->Resume(tag_).ok());
  EXPECT_TRUE(Intact());
  ASSERT_TRUE(alloc_->Pause(tag_).ok());  // it stays on disk
  ASSERT_TRUE(alloc_->Resume(tag_).ok());
  EXPECT_TRUE(Intact());
  EXPECT_TRUE(alloc_->Validate().ok());
  FreeAll();
  ASSERT_TRUE(alloc_->ReleaseBackup(tag_).ok());
}

TEST_F(HostCapTest, APauseFailingAfterItsSpillMovesTheTagBack) {
  Make(MakeDir());
  const std::size_t base = HostBudget::Process().held();
  HostBudget::Process().SetLimit(base + 40 * kMiB);
  sim_->InjectFault(FaultRule{DriverOp::kCopyToHost, 1, 1, absl::StatusCode::kInternal});
  EXPECT_FALSE(alloc_->Pause(tag_).ok());
  sim_->ClearFaults();
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).state, "active");
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).backup_store, "pinned") << "a failed pause changes nothing";
  EXPECT_TRUE(Intact());
  ASSERT_TRUE(alloc_->Pause(tag_).ok());  // spilled again, for good this time
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).backup_store, "disk:" + dir_);
  ASSERT_TRUE(alloc_->Resume(tag_).ok());
  EXPECT_TRUE(Intact());
  FreeAll();
  ASSERT_TRUE(alloc_->ReleaseBackup(tag_).ok());
}

TEST_F(HostCapTest, ASpillDirThatIsGoneLeavesTheStoreAsItWas) {
  const std::string dir = MakeDir();
  Make(dir);
  rmdir(dir.c_str());
  const std::size_t base = HostBudget::Process().held();
  HostBudget::Process().SetLimit(base + 40 * kMiB);
  absl::StatusOr<CachingAllocator::Transition> r = alloc_->Pause(tag_);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  EXPECT_NE(r.status().message().find("host_max"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("failed too"), std::string::npos) << r.status();
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).backup_store, "pinned");
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).state, "active");
  EXPECT_EQ(HostBudget::Process().held(), base);
  EXPECT_TRUE(Intact());
  FreeAll();
}

TEST_F(HostCapTest, TheAccountFollowsPrepareGiveBackAndRelease) {
  Make("", BackupRetention{false, true, true});  // torch_memory_saver's default
  const std::size_t base = HostBudget::Process().held();
  ASSERT_TRUE(alloc_->Prepare(tag_).ok());
  const std::int64_t prepared = TagStatsOf(*alloc_, tag_).backup_arena_bytes;
  EXPECT_EQ(HostBudget::Process().held(), base + static_cast<std::size_t>(prepared));
  for (int cycle = 0; cycle < 2; ++cycle) {
    ASSERT_TRUE(alloc_->Pause(tag_).ok());
    EXPECT_EQ(HostBudget::Process().held(), base + static_cast<std::size_t>(TagStatsOf(*alloc_, tag_).backup_arena_bytes));
    ASSERT_TRUE(alloc_->Resume(tag_).ok());  // given back: refunded
    EXPECT_EQ(HostBudget::Process().held(), base) << "cycle " << cycle;
    EXPECT_TRUE(Intact());
  }
  // A cap between two pauses: the next pause is refused, then allowed again.
  HostBudget::Process().SetLimit(base + kMiB);
  EXPECT_EQ(alloc_->Pause(tag_).status().code(), absl::StatusCode::kResourceExhausted);
  HostBudget::Process().SetLimit(0);
  ASSERT_TRUE(alloc_->Pause(tag_).ok());
  FreeAll();  // the last free of a paused tag's blocks releases its backup
  EXPECT_EQ(HostBudget::Process().held(), base);
  ASSERT_TRUE(alloc_->Resume(tag_).ok());
}

std::size_t Held() { return HostBudget::Process().held(); }

// --- A failed transition gives back what it charged -----------------------------------

// Switch({capped, other}, {}) reserves the first tag's arena, then the cap refuses the
// second: the first arena goes back with the failure, so nothing paused holds the cap.
TEST_F(HostCapTest, AMultiTagPauseRefusedPartWayGivesBackWhatItCharged) {
  Make();
  const TagId other = AddTag("other", {60 * kMiB});
  const std::size_t base = Held();
  HostBudget::Process().SetLimit(base + 100 * kMiB);  // room for 80 or 60 MiB, not both
  absl::StatusOr<CachingAllocator::Transition> r = alloc_->Switch({tag_, other}, {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_EQ(State(tag_), "active");
  EXPECT_EQ(State(other), "active");
  EXPECT_EQ(Held(), base) << "the arena reserved for the first tag is still charged";
  EXPECT_EQ(Arena(tag_), 0u);
  EXPECT_EQ(Arena(other), 0u);
  EXPECT_TRUE(Intact());
  EXPECT_TRUE(alloc_->Validate().ok());
  // Nothing is paused: either tag alone fits.
  ASSERT_TRUE(alloc_->Pause(other).ok());
  ASSERT_TRUE(alloc_->Resume(other).ok());
  ASSERT_TRUE(alloc_->ReleaseBackup(other).ok());
  ASSERT_TRUE(alloc_->Switch({tag_}, {}).ok());
  ASSERT_TRUE(alloc_->Switch({}, {tag_}).ok());
  EXPECT_TRUE(Intact());
  ASSERT_TRUE(alloc_->ReleaseBackup(tag_).ok());
  EXPECT_EQ(Held(), base);
  FreeAll();
}

// A switch whose copies fail after every outgoing arena was reserved and warmed: those
// arenas go back; the incoming tag stays paused with its backup, still charged.
TEST_F(HostCapTest, ASwitchFailingAfterItsReservationsGivesBackWhatItCharged) {
  Make();
  const TagId other = AddTag("other", {60 * kMiB});
  const TagId back = AddTag("back", {20 * kMiB});
  ASSERT_TRUE(alloc_->Pause(back).ok());
  const std::size_t base = Held();
  const std::size_t backup = Arena(back);
  ASSERT_GT(backup, 0u);
  FailNext(DriverOp::kCopyToHost);
  EXPECT_FALSE(alloc_->Switch({tag_, other}, {back}).ok());
  sim_->ClearFaults();
  EXPECT_EQ(State(tag_), "active");
  EXPECT_EQ(State(other), "active");
  EXPECT_EQ(State(back), "paused");
  EXPECT_EQ(Held(), base);
  EXPECT_EQ(Arena(tag_), 0u);
  EXPECT_EQ(Arena(other), 0u);
  EXPECT_EQ(Arena(back), backup);
  EXPECT_TRUE(alloc_->Validate().ok());
  ASSERT_TRUE(alloc_->Switch({tag_, other}, {back}).ok());
  ASSERT_TRUE(alloc_->Switch({back}, {tag_, other}).ok());
  ASSERT_TRUE(alloc_->Resume(back).ok());
  EXPECT_TRUE(Intact());
  FreeAll();
}

// An arena prepared before the failed switch keeps what it held (and its charge); the
// arena the switch made for the other tag goes back.
TEST_F(HostCapTest, AFailedSwitchLeavesAnArenaPreparedBeforeItAsItWas) {
  Make();
  const TagId other = AddTag("other", {60 * kMiB});
  const std::size_t base = Held();
  ASSERT_TRUE(alloc_->Prepare(tag_).ok());
  const std::size_t prepared = Arena(tag_);
  ASSERT_GE(prepared, 80 * kMiB);
  ASSERT_EQ(Held(), base + prepared);
  FailNext(DriverOp::kCopyToHost);
  EXPECT_FALSE(alloc_->Switch({tag_, other}, {}).ok());
  sim_->ClearFaults();
  EXPECT_EQ(Arena(tag_), prepared);
  EXPECT_EQ(Arena(other), 0u);
  EXPECT_EQ(Held(), base + prepared);
  ASSERT_TRUE(alloc_->Switch({tag_, other}, {}).ok());
  ASSERT_TRUE(alloc_->Switch({}, {tag_, other}).ok());
  EXPECT_TRUE(Intact());
  FreeAll();
}

// The arena level: a pause into a partly pinned arena is charged for its whole layout
// up front; when it fails, what it added goes back (warmed by its copies or not yet), and
// the pinned part is pinned again.
TEST(HostCapArenaTest, AFailedPauseGivesBackWhatItAddedToAPartlyPinnedArena) {
  SimDriver sim(SimDriverOptions{1, 512 * kMiB, 2 * kMiB, {}});
  HostBudget budget;
  {
    BackupArena arena(&sim, 0, BackupStore{}, "a test arena", &budget);
    ASSERT_TRUE(arena.Reserve(256 * kMiB).ok());
    ASSERT_TRUE(arena.Pin(64 * kMiB).ok());
    ASSERT_EQ(budget.held(), 64 * kMiB);
    const BackupArena::Holding before = arena.holding();
    ASSERT_TRUE(arena.ReserveLayout(200 * kMiB, {200 * kMiB}).ok());
    ASSERT_EQ(budget.held(), 256 * kMiB);
    EXPECT_EQ(arena.held_bytes(), 64 * kMiB);  // the copies warm the rest as they reach it
    // Failed before a copy reached the cold part: the charge of the layout goes back.
    arena.AfterFailedPause(before, /*give_back=*/false);
    EXPECT_EQ(budget.held(), 64 * kMiB);
    EXPECT_EQ(arena.held_bytes(), 64 * kMiB);
    EXPECT_EQ(arena.PinnedPrefixBytes(), 64 * kMiB);
    // Failed after its copies warmed and pinned the rest (Pin stands in for them).
    ASSERT_TRUE(arena.ReserveLayout(200 * kMiB, {200 * kMiB}).ok());
    ASSERT_TRUE(arena.Pin(200 * kMiB).ok());
    ASSERT_EQ(arena.held_bytes(), 256 * kMiB);
    arena.AfterFailedPause(before, /*give_back=*/false);
    EXPECT_EQ(budget.held(), 64 * kMiB);
    EXPECT_EQ(arena.held_bytes(), 64 * kMiB);
    EXPECT_EQ(arena.PinnedPrefixBytes(), 64 * kMiB);
    // Nothing added: nothing changes.
    const BackupArena::Holding again = arena.holding();
    ASSERT_TRUE(arena.ReserveLayout(32 * kMiB, {32 * kMiB}).ok());
    arena.AfterFailedPause(again, /*give_back=*/false);
    EXPECT_EQ(budget.held(), 64 * kMiB);
    EXPECT_EQ(arena.PinnedPrefixBytes(), 64 * kMiB);
    ASSERT_TRUE(arena.Release().ok());
  }
  EXPECT_EQ(budget.held(), 0u);
  absl::Status leaks = sim.CheckNoLeaks();
  EXPECT_TRUE(leaks.ok()) << leaks;
}

// --- A pause over the cap takes back what other active tags hold prepared -------------

TEST_F(HostCapTest, APauseOverTheCapTakesBackAnotherActiveTagsPreparedArena) {
  Make();
  const TagId other = AddTag("other", {60 * kMiB});
  const std::size_t base = Held();
  ASSERT_TRUE(alloc_->Prepare(other).ok());
  const std::size_t prepared = Arena(other);
  ASSERT_GE(prepared, 60 * kMiB);
  HostBudget::Process().SetLimit(base + prepared + 40 * kMiB);  // 80 MiB fit only without it
  absl::StatusOr<CachingAllocator::Transition> r = alloc_->Pause(tag_);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).backup_store, "pinned");
  EXPECT_EQ(State(other), "active");
  EXPECT_EQ(Arena(other), 0u) << "the prepared arena was given back";
  EXPECT_EQ(Held(), base + Arena(tag_));
  ASSERT_TRUE(alloc_->Resume(tag_).ok());
  EXPECT_TRUE(Intact());
  // In turn: the other tag's pause takes back the arena the first one keeps prepared.
  ASSERT_TRUE(alloc_->Pause(other).ok());
  EXPECT_EQ(Arena(tag_), 0u);
  ASSERT_TRUE(alloc_->Resume(other).ok());
  EXPECT_TRUE(Intact());
  EXPECT_TRUE(alloc_->Validate().ok());
  FreeAll();
}

TEST_F(HostCapTest, PreparedArenasAreTakenBackBeforeTheTagSpillsToDisk) {
  Make(MakeDir());
  const TagId other = AddTag("other", {60 * kMiB});
  const std::size_t base = Held();
  ASSERT_TRUE(alloc_->Prepare(other).ok());
  HostBudget::Process().SetLimit(base + Arena(other) + 40 * kMiB);
  ASSERT_TRUE(alloc_->Pause(tag_).ok());
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).backup_store, "pinned") << "spilled although a prepared arena could go";
  EXPECT_EQ(Arena(other), 0u);
  ASSERT_TRUE(alloc_->Resume(tag_).ok());
  EXPECT_TRUE(Intact());
  FreeAll();
}

// The arena of a paused tag holds its backup: never taken back, even when the pause is
// then refused.
TEST_F(HostCapTest, APausedTagsBackupIsNeverTakenBack) {
  Make();
  const TagId other = AddTag("other", {60 * kMiB});
  const TagId paused = AddTag("paused", {40 * kMiB});
  const std::size_t base = Held();
  ASSERT_TRUE(alloc_->Pause(paused).ok());
  const std::size_t backup = Arena(paused);
  ASSERT_TRUE(alloc_->Prepare(other).ok());
  HostBudget::Process().SetLimit(base + backup + 60 * kMiB);  // 80 MiB do not fit beside the backup
  absl::StatusOr<CachingAllocator::Transition> r = alloc_->Pause(tag_);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_EQ(State(tag_), "active");
  EXPECT_EQ(State(paused), "paused");
  EXPECT_EQ(Arena(paused), backup);
  EXPECT_EQ(Held(), base + backup + Arena(other) + Arena(tag_));
  HostBudget::Process().SetLimit(0);
  ASSERT_TRUE(alloc_->Resume(paused).ok());
  EXPECT_TRUE(Intact());
  EXPECT_TRUE(alloc_->Validate().ok());
  FreeAll();
}

// An arena the background thread prepared goes back the same way, and is not prepared
// again until its tag grows.
TEST_F(HostCapTest, AnArenaTheBackgroundThreadPreparedIsTakenBackToo) {
  Make("", {}, /*auto_prepare=*/true);
  const TagId other = AddTag("other", {60 * kMiB});
  alloc_->WaitForBackgroundPrepare();
  ASSERT_TRUE(alloc_->ReleaseBackup(tag_).ok());  // the pausing tag's own arena: none
  const std::size_t prepared = Arena(other);
  ASSERT_GT(prepared, 0u);
  const std::size_t base = Held() - prepared;
  HostBudget::Process().SetLimit(base + prepared + 40 * kMiB);
  absl::StatusOr<CachingAllocator::Transition> r = alloc_->Pause(tag_);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(Arena(other), 0u);
  ASSERT_TRUE(alloc_->Resume(tag_).ok());
  alloc_->WaitForBackgroundPrepare();
  EXPECT_EQ(Arena(other), 0u) << "prepared again before it grew";
  EXPECT_TRUE(Intact());
  FreeAll();
}

// Pauses, switches and preparations of three tags at once, where a pause fits under the
// cap only by taking back what the other tags keep prepared (their transition locks
// tried, never waited for): no deadlock, every byte kept, the account what the arenas
// hold. A pause refused meanwhile (the other tags paused or busy) is allowed.
TEST_F(HostCapTest, PausesOverTheCapTakingBackEachOthersArenasNeverDeadlock) {
  Make();
  const TagId other = AddTag("other", {60 * kMiB});
  const TagId third = AddTag("third", {20 * kMiB});
  const std::size_t base = Held();
  HostBudget::Process().SetLimit(base + 110 * kMiB);  // 80 + 60 do not fit together
  auto tolerated = [](const absl::Status& s) {
    return s.ok() || absl::IsResourceExhausted(s) || absl::IsFailedPrecondition(s);
  };
  std::atomic<int> errors{0}, paused{0};
  auto cycle = [&](TagId tag) {
    for (int i = 0; i < 15; ++i) {
      absl::StatusOr<CachingAllocator::Transition> p = alloc_->Pause(tag);
      if (!tolerated(p.status())) ++errors;
      if (p.ok()) ++paused;
      if (!alloc_->Resume(tag).ok()) ++errors;
      std::this_thread::sleep_for(std::chrono::milliseconds(tag == tag_ ? 30 : 20));  // windows for the others
    }
  };
  std::thread a(cycle, tag_), b(cycle, other);
  std::thread both([&] {
    for (int i = 0; i < 10; ++i) {
      if (!tolerated(alloc_->Switch({other, third}, {}).status())) ++errors;
      if (!tolerated(alloc_->Switch({}, {third, other}).status())) ++errors;
    }
  });
  std::thread prepare([&] {
    for (int i = 0; i < 20; ++i) {
      if (!tolerated(alloc_->Prepare(i % 2 == 0 ? third : tag_))) ++errors;
    }
  });
  a.join();
  b.join();
  both.join();
  prepare.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_GT(paused.load(), 0);
  for (TagId t : {tag_, other, third}) ASSERT_TRUE(alloc_->Resume(t).ok());
  EXPECT_TRUE(Intact());
  EXPECT_TRUE(alloc_->Validate().ok());
  EXPECT_EQ(Held(), base + Arena(tag_) + Arena(other) + Arena(third));
  EXPECT_LE(Held(), base + 110 * kMiB);
  FreeAll();
}

// --- Staging rings --------------------------------------------------------------------

// A pageable tag holds a staging ring only during its own transitions: the two 60 MiB
// pauses fit a 200 MiB cap (each ring, 128 MiB, is freed once its pause is sealed); a
// resume makes its ring again and frees it at its end; a refusal counts rings apart from
// backups in its message.
TEST_F(HostCapTest, APausedPageableTagHoldsNoStagingRing) {
  MakeAllocator(SimDriverOptions{1, 512 * kMiB, 2 * kMiB, {}}, testing::TestOptions());
  const TagId a = AddTag("pageable_a", {60 * kMiB}), b = AddTag("pageable_b", {60 * kMiB});
  for (TagId t : {a, b}) ASSERT_TRUE(alloc_->SetBackupStore(t, BackupStore{BackupStore::Kind::kPageable, ""}).ok());
  HostBudget& budget = HostBudget::Process();
  const std::size_t base = Held(), rings = budget.held_for(HostUse::kStagingRing);
  budget.SetLimit(base + 200 * kMiB);
  ASSERT_TRUE(alloc_->Pause(a).ok());
  EXPECT_EQ(budget.held_for(HostUse::kStagingRing), rings) << "a paused tag keeps no ring";
  EXPECT_LE(Held(), base + 64 * kMiB);
  absl::StatusOr<CachingAllocator::Transition> second = alloc_->Pause(b);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(budget.held_for(HostUse::kStagingRing), rings);
  ASSERT_TRUE(alloc_->Resume(a).ok());  // no room for a ring beside both backups: direct copies
  EXPECT_EQ(budget.held_for(HostUse::kStagingRing), rings);
  budget.SetLimit(0);
  const std::uint64_t allocs = sim_->Counters().Calls(DriverOp::kHostAlloc);
  ASSERT_TRUE(alloc_->Resume(b).ok());  // through a ring of its own, freed at the end
  EXPECT_EQ(sim_->Counters().Calls(DriverOp::kHostAlloc), allocs + 1) << "the resume copied through a ring";
  EXPECT_EQ(budget.held_for(HostUse::kStagingRing), rings) << "a resumed tag keeps no ring";
  EXPECT_TRUE(Intact());
  EXPECT_TRUE(alloc_->Validate().ok());
  // A cap below what b's pause needs names both parts.
  budget.SetLimit(Held() + 10 * kMiB);
  absl::StatusOr<CachingAllocator::Transition> refused = alloc_->Pause(b);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("staging rings of pageable and disk stores"), std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find("(backups "), std::string::npos) << refused.status();
  EXPECT_EQ(State(b), "active");
  EXPECT_TRUE(Intact());
  budget.SetLimit(0);
  FreeAll();
  for (TagId t : {a, b}) ASSERT_TRUE(alloc_->ReleaseBackup(t).ok());
  EXPECT_EQ(Held(), base);
  EXPECT_EQ(budget.held_for(HostUse::kStagingRing), rings);
}

// A failed resume leaves the tag paused and holding no ring: one out of device memory after
// its first piece's copies went through the ring, and one whose wait for its copies fails.
TEST_F(HostCapTest, AFailedResumeLeavesNoRing) {
  MakeAllocator(SimDriverOptions{1, 1024 * kMiB, 2 * kMiB, {}}, testing::TestOptions());
  const TagId t = AddTag("pageable_big", {300 * kMiB});
  ASSERT_TRUE(alloc_->SetBackupStore(t, BackupStore{BackupStore::Kind::kPageable, ""}).ok());
  HostBudget& budget = HostBudget::Process();
  const std::size_t rings = budget.held_for(HostUse::kStagingRing);
  for (const FaultRule& fault : {FaultRule{DriverOp::kCreateChunk, 2, 1, absl::StatusCode::kResourceExhausted},
                                 FaultRule{DriverOp::kSynchronizeStream, 1, 1, absl::StatusCode::kInternal}}) {
    ASSERT_TRUE(alloc_->Pause(t).ok());
    const std::uint64_t allocs = sim_->Counters().Calls(DriverOp::kHostAlloc);
    sim_->InjectFault(fault);
    absl::StatusOr<CachingAllocator::Transition> resumed = alloc_->Resume(t);
    sim_->ClearFaults();
    ASSERT_FALSE(resumed.ok());
    EXPECT_EQ(State(t), "paused");
    EXPECT_EQ(sim_->Counters().Calls(DriverOp::kHostAlloc), allocs + 1) << "the failed resume made a ring";
    EXPECT_EQ(budget.held_for(HostUse::kStagingRing), rings) << resumed.status();
    EXPECT_TRUE(alloc_->Validate().ok()) << alloc_->Validate();
    ASSERT_TRUE(alloc_->Resume(t).ok());
    EXPECT_TRUE(Intact());
  }
  FreeAll();
  ASSERT_TRUE(alloc_->ReleaseBackup(t).ok());
}

// A switch that resumes a pageable tag and is rolled back (its agreement says no): the
// incoming tag is paused again, holding no ring.
TEST_F(HostCapTest, ARolledBackSwitchLeavesNoRingOnItsIncomingTag) {
  MakeAllocator(SimDriverOptions{1, 512 * kMiB, 2 * kMiB, {}}, testing::TestOptions());
  const TagId in = AddTag("pageable_in", {30 * kMiB, 50 * kMiB});
  const TagId out = AddTag("pinned_out", {20 * kMiB});
  ASSERT_TRUE(alloc_->SetBackupStore(in, BackupStore{BackupStore::Kind::kPageable, ""}).ok());
  HostBudget& budget = HostBudget::Process();
  const std::size_t rings = budget.held_for(HostUse::kStagingRing);
  ASSERT_TRUE(alloc_->Pause(in).ok());
  const CachingAllocator::SwitchAgree no = [](const absl::Status&) { return absl::AbortedError("a peer said no"); };
  absl::StatusOr<CachingAllocator::Transition> switched = alloc_->Switch({out}, {in}, nullptr, nullptr, &no);
  ASSERT_FALSE(switched.ok());
  EXPECT_EQ(State(in), "paused");
  EXPECT_EQ(State(out), "active");
  EXPECT_EQ(budget.held_for(HostUse::kStagingRing), rings);
  EXPECT_TRUE(alloc_->Validate().ok()) << alloc_->Validate();
  ASSERT_TRUE(alloc_->Resume(in).ok());
  EXPECT_TRUE(Intact());
  FreeAll();
  ASSERT_TRUE(alloc_->ReleaseBackup(in).ok());
}

// --- A release the driver refuses keeps its charge -------------------------------------

// A pageable arena's staging ring whose pinned slots the driver does not free at the end
// of a resume: the resume is done all the same, the ring still held and charged; a release
// the driver refuses again fails, and a retry gives it back.
TEST_F(HostCapTest, ARingTheDriverDoesNotFreeStaysCharged) {
  Make();
  ASSERT_TRUE(alloc_->SetBackupStore(tag_, BackupStore{BackupStore::Kind::kPageable, ""}).ok());
  const std::size_t base = Held();
  ASSERT_TRUE(alloc_->Pause(tag_).ok());
  FailNext(DriverOp::kHostFree);
  ASSERT_TRUE(alloc_->Resume(tag_).ok());
  sim_->ClearFaults();
  EXPECT_TRUE(Intact());
  const std::size_t ring = Held() - base;
  EXPECT_EQ(ring, StagingRing::kSlots * StagingRing::kSlotBytes) << "the ring's pinned slots are still allocated";
  FailNext(DriverOp::kHostFree);
  EXPECT_FALSE(alloc_->ReleaseBackup(tag_).ok());
  sim_->ClearFaults();
  EXPECT_EQ(Held(), base + ring);
  ASSERT_TRUE(alloc_->ReleaseBackup(tag_).ok());
  EXPECT_EQ(Held(), base);
  FreeAll();
}

// A pinned arena the driver does not unregister: ReleaseBackup and a new store fail,
// changing nothing, the arena still charged; a retry releases it.
TEST_F(HostCapTest, AnArenaTheDriverDoesNotUnpinStaysCharged) {
  Make();
  const std::size_t base = Held();
  ASSERT_TRUE(alloc_->Prepare(tag_).ok());
  const std::size_t prepared = Arena(tag_);
  FailNext(DriverOp::kHostUnregister);
  EXPECT_FALSE(alloc_->ReleaseBackup(tag_).ok());
  EXPECT_EQ(Held(), base + prepared);
  FailNext(DriverOp::kHostUnregister);
  EXPECT_FALSE(alloc_->SetBackupStore(tag_, BackupStore{BackupStore::Kind::kPageable, ""}).ok());
  sim_->ClearFaults();
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).backup_store, "pinned");
  EXPECT_EQ(Arena(tag_), prepared);
  EXPECT_EQ(Held(), base + prepared);
  ASSERT_TRUE(alloc_->SetBackupStore(tag_, BackupStore{BackupStore::Kind::kPageable, ""}).ok());
  EXPECT_EQ(Held(), base);
  ASSERT_TRUE(alloc_->Pause(tag_).ok());
  ASSERT_TRUE(alloc_->Resume(tag_).ok());
  EXPECT_TRUE(Intact());
  FreeAll();
  ASSERT_TRUE(alloc_->ReleaseBackup(tag_).ok());
  EXPECT_EQ(Held(), base);
}

// A hand-back after a resume that the driver refuses keeps what is still pinned charged;
// the next cycle gives it back.
TEST_F(HostCapTest, AHandBackTheDriverRefusesKeepsWhatItCouldNotGiveBack) {
  Make("", BackupRetention{false, false, true});  // give_back; the resume hands back
  const std::size_t base = Held();
  ASSERT_TRUE(alloc_->Pause(tag_).ok());
  FailNext(DriverOp::kHostUnregister);
  ASSERT_TRUE(alloc_->Resume(tag_).ok());  // the hand-back failed (logged)
  sim_->ClearFaults();
  EXPECT_GT(Arena(tag_), 0u);
  EXPECT_EQ(Held(), base + Arena(tag_));
  ASSERT_TRUE(alloc_->Pause(tag_).ok());
  ASSERT_TRUE(alloc_->Resume(tag_).ok());
  EXPECT_EQ(Held(), base);
  EXPECT_TRUE(Intact());
  FreeAll();
}

// An arena destroyed with its tag (the allocator's end) whose memory the driver does not
// unregister: the pages stay pinned for good, and so does their charge.
TEST_F(HostCapTest, AnArenaDestroyedWithoutItsReleaseStaysCharged) {
  Make();
  const std::size_t base = Held();
  ASSERT_TRUE(alloc_->Prepare(tag_).ok());
  const std::size_t prepared = Arena(tag_);
  FreeAll();
  FailNext(DriverOp::kHostUnregister, 1000);
  alloc_.reset();
  EXPECT_EQ(Held(), base + prepared) << "refunded while the memory is still pinned";
  sim_.reset();  // its registrations are left: no leak check
}

}  // namespace
}  // namespace vmstash
