// The host-memory cap (VMSTASH_CONF host_max, allocator/host_budget.h) on backup arenas
// (Note [Host Budget] in allocator/backup_arena.h) on the simulator: a pause over the cap
// fails changing nothing, with ResourceExhausted naming host_max; with spill_dir the tag
// moves to the disk store there and its bytes survive; the account follows what the
// arenas hold through preparation, pause, give-back and release.
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/host_budget.h"
#include "allocator/tag_pool.h"
#include "allocator/testing.h"
#include "base/byte_pattern.h"
#include "gtest/gtest.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

using ::vmstash::testing::TagStatsOf;

class HostCapTest : public testing::SimAllocatorTest {
 protected:
  void TearDown() override {
    HostBudget::Process().SetLimit(0);
    SimAllocatorTest::TearDown();
    if (!dir_.empty()) rmdir(dir_.c_str());
  }
  void Make(std::string spill_dir = "", BackupRetention retention = {}) {
    AllocatorOptions options = testing::TestOptions();
    options.auto_prepare = false;
    options.spill_dir = spill_dir;
    MakeAllocator(SimDriverOptions{1, 512 * kMiB, 2 * kMiB, {}}, options);
    tag_ = *InternTag("capped");
    ASSERT_TRUE(alloc_->CreateTag(tag_, Policy::kBackup).ok());
    ASSERT_TRUE(alloc_->SetBackupRetention(tag_, retention).ok());
    for (std::size_t n : {30 * kMiB, 50 * kMiB}) {
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
  std::string MakeDir() {
    char name[] = "/tmp/vmstash_spill_XXXXXX";
    dir_ = mkdtemp(name);
    return dir_;
  }
  void FreeAll() {
    for (auto [p, n] : blocks_) ASSERT_TRUE(alloc_->Free(p).ok());
    blocks_.clear();
  }

  TagId tag_ = 0;
  std::string dir_;
  std::vector<std::pair<DevicePtr, std::size_t>> blocks_;
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

}  // namespace
}  // namespace vmstash
