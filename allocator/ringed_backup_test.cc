// Backups through a staging ring (vmm/staging_ring.h, Note [Staging Ring]) as the pageable
// and disk backup stores use it (allocator/backup_arena.h): the bytes of a pause reach the
// arena only at Seal() (or when a slot is reused), so every path that reads the arena
// before Seal, or fails between the copies and Seal, must not read stale host memory;
// and the ring's optional pinned memory must never make a pause fail that would fit
// without it (Note [Host Budget]).
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "allocator/backup_arena.h"
#include "allocator/caching_allocator.h"
#include "allocator/host_budget.h"
#include "allocator/switch_scenario.h"
#include "allocator/testing.h"
#include "base/byte_pattern.h"
#include "gtest/gtest.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

using Transition = CachingAllocator::Transition;
using ::vmstash::testing::TagStatsOf;

using Block = testing::PatternBlock;

std::vector<Block> Fill(CachingAllocator& a, TagId tag, const std::vector<std::size_t>& sizes, std::uint8_t seed) {
  return testing::FillBlocks(a, tag, sizes, seed);
}

std::size_t Wrong(const std::vector<Block>& blocks) { return testing::WrongBlocks(blocks); }

std::string StateOf(CachingAllocator& a, TagId tag) { return TagStatsOf(a, tag).state; }

std::string TempDir() {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string pattern = std::string(tmp != nullptr ? tmp : "/tmp") + "/vmstash_ringrev_XXXXXX";
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  if (mkdtemp(buf.data()) == nullptr) return "";
  return buf.data();
}

// switch_fault_test's scenario (testing::SwitchScenario) with the backup tags on `store`:
// out_b's bytes go D2H through its arena's staging ring while in_b's restore copies
// overwrite the chunks out_b hands over.
using SwitchFixture = testing::SwitchScenario;

SwitchFixture MakeSwitch(const BackupStore& store) { return testing::MakeSwitchScenario("ringrev_", &store); }

void FinishSwitch(SwitchFixture& f) { testing::FinishSwitchScenario(f); }

// Found by review, fixed (switch rollback read the arena before the ring delivered it;
// RollBack now seals the outgoing arena before reading it back).
// A switch whose outgoing tag has a pageable (or disk) store queues that tag's D2H copies
// into its staging ring; the bytes reach the arena only at Seal() (Execute, step 4). A
// failure after a restore copy overwrote a handed-over chunk (a later H2D copy, the
// stream synchronization, Seal itself) rolls back by copying the donor's bytes back
// "from the backup made by this very switch" (switch_transaction.cc RollBack) — but that
// backup is still in the ring: the arena holds zeros (or a previous pause's bytes), so the
// outgoing tag comes back "active, every tag as it was" with corrupted memory. A Seal
// whose Finish fails forgets the slots, losing them for good.
TEST(RingedSwitchTest, AFailedSwitchRestoresTheOutgoingTagFromBytesStillInTheRing) {
  const std::string dir = TempDir();
  ASSERT_FALSE(dir.empty());
  for (const BackupStore& store : {BackupStore{BackupStore::Kind::kPageable, ""},
                                   BackupStore{BackupStore::Kind::kDisk, dir}}) {
    SCOPED_TRACE(DescribeBackupStore(store));
    DriverCounters clean;
    {
      SwitchFixture f = MakeSwitch(store);
      const DriverCounters before = f.sim->Counters();
      ASSERT_EQ(*f.alloc->Switch({f.out_b, f.out_d}, {f.in_b, f.in_d}), Transition::kDone);
      ASSERT_EQ(Wrong(f.in_blocks), 0u);
      ASSERT_GT(f.alloc->Stats().handed_over_bytes, 0u);
      clean = f.sim->Counters();
      for (int i = 0; i < kNumDriverOps; ++i) clean.calls[i] -= before.calls[i];
      ASSERT_EQ(*f.alloc->Switch({f.in_b, f.in_d}, {f.out_b, f.out_d}), Transition::kDone);
      EXPECT_EQ(Wrong(std::vector<Block>(f.out_blocks.begin(), f.out_blocks.begin() + 5)), 0u);
      FinishSwitch(f);
    }
    int corrupted = 0;
    for (DriverOp op : {DriverOp::kCopyToDevice, DriverOp::kStreamWaitEvent, DriverOp::kSynchronizeStream,
                        DriverOp::kSynchronizeEvent, DriverOp::kRecordEvent, DriverOp::kUnmap}) {
      for (std::uint64_t nth = 1; nth <= clean.Calls(op); ++nth) {
        SCOPED_TRACE(std::string(DriverOpName(op)) + "@" + std::to_string(nth));
        SwitchFixture f = MakeSwitch(store);
        f.sim->InjectFault(FaultRule{op, static_cast<int>(nth), 1, absl::StatusCode::kInternal});
        absl::StatusOr<Transition> r = f.alloc->Switch({f.out_b, f.out_d}, {f.in_b, f.in_d});
        f.sim->ClearFaults();
        ASSERT_TRUE(f.alloc->Validate().ok()) << f.alloc->Validate();
        if (!r.ok()) {
          ASSERT_EQ(StateOf(*f.alloc, f.out_b), "active") << r.status();
          const std::size_t wrong = Wrong(f.out_blocks);
          EXPECT_EQ(wrong, 0u) << "the outgoing tag is 'active as it was' with " << wrong
                               << " wrong bytes after: " << r.status();
          if (wrong != 0) ++corrupted;
          ASSERT_EQ(*f.alloc->Switch({f.out_b, f.out_d}, {f.in_b, f.in_d}), Transition::kDone);
        }
        EXPECT_EQ(Wrong(f.in_blocks), 0u) << "the incoming backup lost bytes";
        ASSERT_EQ(*f.alloc->Switch({f.in_b, f.in_d}, {f.out_b, f.out_d}), Transition::kDone);
        FinishSwitch(f);
      }
    }
    std::printf("%s: %d failed switches left the outgoing tag corrupted\n", DescribeBackupStore(store).c_str(),
                corrupted);
  }
  rmdir(dir.c_str());
}

// The narrowest case of the defect above: the switch's very last H2D copy fails.
TEST(RingedSwitchTest, ALastRestoreCopyFailingLeavesTheOutgoingPageableTagIntact) {
  DriverCounters clean;
  const BackupStore pageable{BackupStore::Kind::kPageable, ""};
  {
    SwitchFixture f = MakeSwitch(pageable);
    const std::uint64_t before = f.sim->Counters().Calls(DriverOp::kCopyToDevice);
    ASSERT_EQ(*f.alloc->Switch({f.out_b, f.out_d}, {f.in_b, f.in_d}), Transition::kDone);
    clean.calls[static_cast<int>(DriverOp::kCopyToDevice)] = f.sim->Counters().Calls(DriverOp::kCopyToDevice) - before;
    FinishSwitch(f);
  }
  SwitchFixture f = MakeSwitch(pageable);
  f.sim->InjectFault(FaultRule{DriverOp::kCopyToDevice, static_cast<int>(clean.Calls(DriverOp::kCopyToDevice)), 1,
                               absl::StatusCode::kInternal});
  absl::StatusOr<Transition> r = f.alloc->Switch({f.out_b, f.out_d}, {f.in_b, f.in_d});
  f.sim->ClearFaults();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(StateOf(*f.alloc, f.out_b), "active");
  EXPECT_EQ(Wrong(f.out_blocks), 0u) << "rolled back from a backup whose bytes were still in the staging ring";
  ASSERT_EQ(*f.alloc->Switch({f.out_b, f.out_d}, {f.in_b, f.in_d}), Transition::kDone);
  EXPECT_EQ(Wrong(f.in_blocks), 0u);
  ASSERT_EQ(*f.alloc->Switch({f.in_b, f.in_d}, {f.out_b, f.out_d}), Transition::kDone);
  FinishSwitch(f);
}

// --- The host budget: the ring is optional, the arena is not -----------------------------

class RingBudgetTest : public testing::SimAllocatorTest {
 protected:
  void TearDown() override {
    HostBudget::Process().SetLimit(0);
    SimAllocatorTest::TearDown();
  }
  void Make(std::string spill_dir = "") {
    AllocatorOptions options = testing::TestOptions();
    options.auto_prepare = false;
    options.spill_dir = spill_dir;
    MakeAllocator(SimDriverOptions{1, 512 * kMiB, 2 * kMiB, {}}, options);
    tag_ = *InternTag("ringrev_budget");
    ASSERT_TRUE(alloc_->CreateTag(tag_, Policy::kBackup).ok());
    ASSERT_TRUE(alloc_->SetBackupStore(tag_, BackupStore{BackupStore::Kind::kPageable, ""}).ok());
    blocks_ = Fill(*alloc_, tag_, {30 * kMiB, 50 * kMiB}, 3);
  }
  std::size_t Held() const { return HostBudget::Process().held(); }
  void FreeAll() {
    for (const Block& b : blocks_) ASSERT_TRUE(alloc_->Free(b.address).ok());
    blocks_.clear();
  }
  TagId tag_ = 0;
  std::vector<Block> blocks_;
};

// Found by review, fixed (the optional ring starved the mandatory arena; ReserveLayout
// now charges the arena first).
// Note [Host Budget] and backup_arena.h: "a refusal only means no ring (the copies go
// through the driver directly), never a failed pause". But ReserveLayout charges the
// ring (StagingRing::kSlots x kSlotBytes = 128 MiB) BEFORE the pageable arena's own
// charge (backup_arena.cc ReserveLayout: TryRing(), then charge_.Resize): with host_max
// room for the 80 MiB arena but not for arena + ring, the ring takes the room and the
// pause fails with ResourceExhausted (or spills to disk when spill_dir is set), where
// without the ring it succeeds.
TEST_F(RingBudgetTest, APauseThatFitsWithoutTheRingIsNotRefusedBecauseOfIt) {
  Make();
  const std::size_t base = Held();
  // 80 MiB to back up: fits; the 128 MiB ring alone fits too, both together do not.
  HostBudget::Process().SetLimit(base + 150 * kMiB);
  absl::StatusOr<Transition> paused = alloc_->Pause(tag_);
  ASSERT_TRUE(paused.ok()) << "the ring's charge made the pause fail: " << paused.status();
  EXPECT_EQ(StateOf(*alloc_, tag_), "paused");
  ASSERT_TRUE(alloc_->Resume(tag_).ok());
  EXPECT_EQ(Wrong(blocks_), 0u);
  FreeAll();
}

// Same with a spill_dir: the pause spills to disk although host memory had the room.
TEST_F(RingBudgetTest, APauseThatFitsInHostMemoryDoesNotSpillBecauseOfTheRing) {
  const std::string dir = TempDir();
  ASSERT_FALSE(dir.empty());
  Make(dir);
  const std::size_t base = Held();
  HostBudget::Process().SetLimit(base + 150 * kMiB);
  ASSERT_TRUE(alloc_->Pause(tag_).ok());
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).backup_store, "pageable") << "spilled to disk only because of the ring";
  ASSERT_TRUE(alloc_->Resume(tag_).ok());
  EXPECT_EQ(Wrong(blocks_), 0u);
  FreeAll();
  rmdir(dir.c_str());
}

// Held: with room for arena + ring both are charged while the pause copies (the ring is
// made: one pinned allocation), the ring is freed once the pause is sealed (a paused tag
// holds none), and the pause round-trips.
TEST_F(RingBudgetTest, RoomForArenaAndRingChargesBoth) {
  Make();
  const std::size_t base = Held();
  HostBudget::Process().SetLimit(base + 80 * kMiB + 128 * kMiB);
  const std::uint64_t allocs = sim_->Counters().Calls(DriverOp::kHostAlloc);
  const std::size_t rings = HostBudget::Process().held_for(HostUse::kStagingRing);
  ASSERT_TRUE(alloc_->Pause(tag_).ok());
  EXPECT_EQ(sim_->Counters().Calls(DriverOp::kHostAlloc), allocs + 1) << "the pause copied through a ring";
  EXPECT_EQ(Held(), base + 80 * kMiB);
  EXPECT_EQ(HostBudget::Process().held_for(HostUse::kStagingRing), rings);
  ASSERT_TRUE(alloc_->Resume(tag_).ok());
  EXPECT_EQ(Wrong(blocks_), 0u);
  FreeAll();
}

// Found by review, fixed (performance: a refused ring was retried on every copy of a
// resume; now once per pause).
// BackupArena::CopyOut calls TryRing() before each copy (backup_arena.cc CopyOut: "the
// arena may have been made before its store had a ring"). When the host refuses the
// ring's pinned memory, every CopyOut of the resume tries again: 8 CreateEvent, one
// 128 MiB HostAlloc (cudaHostAlloc of 128 MiB that fails is not cheap), 8 DestroyEvent
// and an info log line, per restored block. Once per transition would do (or remember
// the refusal until the next pause, as the header says: "the next pause tries again").
TEST_F(RingBudgetTest, ARefusedRingIsNotRetriedForEveryCopyOfAResume) {
  AllocatorOptions options = testing::TestOptions();
  options.auto_prepare = false;
  MakeAllocator(SimDriverOptions{1, 512 * kMiB, 2 * kMiB, {}}, options);
  tag_ = *InternTag("ringrev_budget_many");
  ASSERT_TRUE(alloc_->CreateTag(tag_, Policy::kBackup).ok());
  ASSERT_TRUE(alloc_->SetBackupStore(tag_, BackupStore{BackupStore::Kind::kPageable, ""}).ok());
  std::vector<std::size_t> sizes(24, 512 * 1024 + 4096);  // 24 blocks: 24 restore copies
  blocks_ = Fill(*alloc_, tag_, sizes, 9);
  sim_->InjectFault(FaultRule{DriverOp::kHostAlloc, 1, 1000000, absl::StatusCode::kResourceExhausted});
  ASSERT_TRUE(alloc_->Pause(tag_).ok());
  const std::uint64_t allocs = sim_->Counters().Calls(DriverOp::kHostAlloc);
  const std::uint64_t events = sim_->Counters().Calls(DriverOp::kCreateEvent);
  ASSERT_TRUE(alloc_->Resume(tag_).ok());
  sim_->ClearFaults();
  EXPECT_EQ(Wrong(blocks_), 0u);
  EXPECT_LE(sim_->Counters().Calls(DriverOp::kHostAlloc) - allocs, 1u)
      << "the refused ring was asked for again before each copy of one resume";
  EXPECT_LE(sim_->Counters().Calls(DriverOp::kCreateEvent) - events, 8u);
  FreeAll();
}

// --- Pause / resume faults with the ring: bytes intact, no stale ring bytes -------------

class RingPauseTest : public testing::SimAllocatorTest {
 protected:
  void SetUp() override {
    dir_ = TempDir();
    ASSERT_FALSE(dir_.empty());
    AllocatorOptions options = testing::TestOptions();
    options.auto_prepare = false;
    options.pause_stage_bytes = 8 * kMiB;
    options.resume_first_piece_bytes = 4 * kMiB;
    MakeAllocator(SimDriverOptions{1, 1024 * kMiB, 2 * kMiB, {}}, options);
    a_ = *InternTag("ringrev_a");
    b_ = *InternTag("ringrev_b");
    ASSERT_TRUE(alloc_->CreateTag(a_, Policy::kBackup).ok());
    ASSERT_TRUE(alloc_->CreateTag(b_, Policy::kBackup).ok());
  }
  void TearDown() override {
    SimAllocatorTest::TearDown();
    rmdir(dir_.c_str());
  }
  BackupStore Disk() const { return BackupStore{BackupStore::Kind::kDisk, dir_}; }
  std::string dir_;
  TagId a_ = 0, b_ = 0;
};

// Every call of a pageable / disk / disk-files pause and resume fails once in turn,
// with the ring wrapping (150 MiB through 128 MiB of slots): the tag is as it was, a retry
// brings every byte back, and a second pause with other bytes holds those, not a failed
// pause's leftovers (a slot drained into the arena late).
TEST_F(RingPauseTest, EveryFaultOfARingedPauseAndResumeRollsBackAndLeavesNoStaleBytes) {
  for (const BackupStore& store : {BackupStore{BackupStore::Kind::kPageable, ""}, Disk(),
                                   BackupStore{BackupStore::Kind::kDiskFiles, dir_}}) {
    SCOPED_TRACE(DescribeBackupStore(store));
    ASSERT_TRUE(alloc_->SetBackupStore(a_, store).ok());
    std::vector<Block> blocks = Fill(*alloc_, a_, {4096 + 3, 70 * kMiB + 5, 80 * kMiB - 4096}, 11);
    const DriverCounters before = sim_->Counters();
    ASSERT_EQ(*alloc_->Pause(a_), Transition::kDone);
    ASSERT_EQ(*alloc_->Resume(a_), Transition::kDone);
    ASSERT_EQ(Wrong(blocks), 0u);
    DriverCounters clean = sim_->Counters();
    for (int i = 0; i < kNumDriverOps; ++i) clean.calls[i] -= before.calls[i];
    int failures = 0;
    for (DriverOp op : {DriverOp::kCopyToHost, DriverOp::kCopyToDevice, DriverOp::kRecordEvent,
                        DriverOp::kSynchronizeEvent, DriverOp::kSynchronizeStream, DriverOp::kUnmap, DriverOp::kMap,
                        DriverOp::kCreateChunk}) {
      const std::uint64_t step = std::max<std::uint64_t>(1, (clean.Calls(op) + 2) / 3);  // ~3 per op
      for (std::uint64_t nth = 1; nth <= clean.Calls(op); nth += step) {
        SCOPED_TRACE(std::string(DriverOpName(op)) + "@" + std::to_string(nth));
        // Different bytes each round: a stale ring slot of an earlier round would show.
        const std::uint8_t seed = static_cast<std::uint8_t>(31 + failures * 7 + nth);
        for (Block& b : blocks) {
          FillPattern(b.address, b.size, seed);
          b.seed = seed;
        }
        sim_->InjectFault(FaultRule{op, static_cast<int>(nth), 1, absl::StatusCode::kInternal});  // relative to now
        absl::StatusOr<Transition> p = alloc_->Pause(a_);
        if (!p.ok()) {
          sim_->ClearFaults();
          ++failures;
          ASSERT_EQ(StateOf(*alloc_, a_), "active") << p.status();
          ASSERT_EQ(Wrong(blocks), 0u);
          ASSERT_EQ(*alloc_->Pause(a_), Transition::kDone);
        }
        absl::StatusOr<Transition> r = alloc_->Resume(a_);
        sim_->ClearFaults();
        if (!r.ok()) {
          ++failures;
          ASSERT_EQ(StateOf(*alloc_, a_), "paused") << r.status();
          ASSERT_EQ(*alloc_->Resume(a_), Transition::kDone);
        }
        ASSERT_EQ(Wrong(blocks), 0u);
        ASSERT_TRUE(alloc_->Validate().ok());
        ASSERT_TRUE(sim_->CheckOrdering().ok()) << sim_->CheckOrdering();
      }
    }
    EXPECT_GT(failures, 0);
    for (const Block& b : blocks) ASSERT_TRUE(alloc_->Free(b.address).ok());
    ASSERT_TRUE(alloc_->SetBackupStore(a_, BackupStore{}).ok());
  }
}

// Two tags with pageable stores paused and resumed from two threads at once (each has its
// own ring; the HostCopyPool is shared): every byte intact. Meant for TSAN too.
TEST_F(RingPauseTest, TwoRingedTagsPauseAndResumeFromTwoThreads) {
  const BackupStore pageable{BackupStore::Kind::kPageable, ""};
  ASSERT_TRUE(alloc_->SetBackupStore(a_, pageable).ok());
  ASSERT_TRUE(alloc_->SetBackupStore(b_, Disk()).ok());
  std::vector<Block> a = Fill(*alloc_, a_, {3 * kMiB + 1, 40 * kMiB}, 5);
  std::vector<Block> b = Fill(*alloc_, b_, {20 * kMiB, 9 * kMiB + 77}, 99);
  auto cycle = [&](TagId tag, const std::vector<Block>* blocks, std::string* err) {
    for (int i = 0; i < 6; ++i) {
      absl::StatusOr<Transition> p = alloc_->Pause(tag);
      if (!p.ok()) *err += "pause: " + p.status().ToString() + "\n";
      std::vector<std::uint8_t> host(blocks->front().size);
      absl::Status read = alloc_->ReadBackup(blocks->front().address, host.size(), host.data());
      if (!read.ok()) *err += "read: " + read.ToString() + "\n";
      if (WrongBytes(host.data(), host.size(), blocks->front().seed) != 0) *err += "paused backup wrong\n";
      absl::StatusOr<Transition> r = alloc_->Resume(tag);
      if (!r.ok()) *err += "resume: " + r.status().ToString() + "\n";
    }
  };
  std::string ea, eb;
  std::thread ta(cycle, a_, &a, &ea), tb(cycle, b_, &b, &eb);
  ta.join();
  tb.join();
  EXPECT_EQ(ea, "");
  EXPECT_EQ(eb, "");
  EXPECT_EQ(Wrong(a), 0u);
  EXPECT_EQ(Wrong(b), 0u);
  ASSERT_TRUE(sim_->CheckOrdering().ok()) << sim_->CheckOrdering();
  for (const auto* v : {&a, &b}) {
    for (const Block& blk : *v) ASSERT_TRUE(alloc_->Free(blk.address).ok());
  }
}

// The arena grows between two pauses (Reserve replaces the mapping, the ring stays): the
// second pause's bytes land in the new mapping, and a read of the paused backup sees them.
TEST_F(RingPauseTest, AnArenaReplacedBetweenPausesGetsTheRingsBytes) {
  ASSERT_TRUE(alloc_->SetBackupStore(a_, BackupStore{BackupStore::Kind::kPageable, ""}).ok());
  std::vector<Block> blocks = Fill(*alloc_, a_, {5 * kMiB}, 1);
  ASSERT_EQ(*alloc_->Pause(a_), Transition::kDone);
  ASSERT_EQ(*alloc_->Resume(a_), Transition::kDone);
  std::vector<Block> more = Fill(*alloc_, a_, {60 * kMiB + 3, 2 * kMiB}, 77);
  blocks.insert(blocks.end(), more.begin(), more.end());
  ASSERT_EQ(*alloc_->Pause(a_), Transition::kDone);
  for (const Block& b : blocks) {
    std::vector<std::uint8_t> host(b.size);
    ASSERT_TRUE(alloc_->ReadBackup(b.address, b.size, host.data()).ok());
    EXPECT_EQ(WrongBytes(host.data(), host.size(), b.seed), 0u);
  }
  ASSERT_EQ(*alloc_->Resume(a_), Transition::kDone);
  EXPECT_EQ(Wrong(blocks), 0u);
  for (const Block& b : blocks) ASSERT_TRUE(alloc_->Free(b.address).ok());
}

// Switches between two pageable tags both ways (outgoing D2H and incoming H2D rings on
// two streams), many rounds, with the sim's ordering checker.
TEST_F(RingPauseTest, SwitchesBetweenRingedTagsKeepEveryByte) {
  ASSERT_TRUE(alloc_->SetBackupStore(a_, BackupStore{BackupStore::Kind::kPageable, ""}).ok());
  ASSERT_TRUE(alloc_->SetBackupStore(b_, Disk()).ok());
  std::vector<Block> a = Fill(*alloc_, a_, {3 * kMiB + 1, 70 * kMiB, 4096}, 5);
  std::vector<Block> b = Fill(*alloc_, b_, {100 * kMiB, 9 * kMiB + 77}, 99);
  ASSERT_EQ(*alloc_->Pause(b_), Transition::kDone);
  for (int i = 0; i < 4; ++i) {
    ASSERT_EQ(*alloc_->Switch({a_}, {b_}), Transition::kDone);
    ASSERT_EQ(Wrong(b), 0u);
    ASSERT_EQ(*alloc_->Switch({b_}, {a_}), Transition::kDone);
    ASSERT_EQ(Wrong(a), 0u);
    ASSERT_TRUE(sim_->CheckOrdering().ok()) << sim_->CheckOrdering();
  }
  ASSERT_EQ(*alloc_->Resume(b_), Transition::kDone);
  for (const auto* v : {&a, &b}) {
    for (const Block& blk : *v) ASSERT_TRUE(alloc_->Free(blk.address).ok());
  }
}

}  // namespace
}  // namespace vmstash
