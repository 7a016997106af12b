// Note [Pool-Backed Backups] (allocator/host_lease.h) on the simulator: a pinned backup
// leases its host memory from a source (here a stand-in for the node pool, registered in
// segments), cuts its copies at the segments, gives the lease back once the bytes are not
// needed (after a resume, a failed pause, a release; kept while retained), takes nothing
// ahead (Prepare), and falls back to its own pinned memory — saying so once — whenever the
// source refuses, so no pause fails for want of the pool.
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "allocator/caching_allocator.h"
#include "allocator/host_budget.h"
#include "allocator/host_lease.h"
#include "allocator/testing.h"
#include "base/log.h"
#include "gtest/gtest.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

using ::vmstash::testing::TagStatsOf;
using ::vmstash::testing::WritePattern;
using ::vmstash::testing::WrongBytesOnDevice;

// A stand-in for the node pool: one mapping registered with the simulator in segments,
// leased first fit in 2 MiB units.
class FakePool final : public HostLeaseSource {
 public:
  FakePool(SimDriver* sim, std::size_t bytes, std::size_t segment_bytes)
      : sim_(sim), bytes_(bytes), segment_bytes_(segment_bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    base_ = p == MAP_FAILED ? nullptr : static_cast<char*>(p);
    for (std::size_t at = 0; base_ != nullptr && at < bytes; at += segment_bytes) {
      registered_ok_ = registered_ok_ && sim_->HostRegister(0, base_ + at, std::min(segment_bytes, bytes - at)).ok();
    }
  }
  ~FakePool() override { Close(); }

  void Close() {
    if (base_ == nullptr) return;
    for (std::size_t at = 0; at < bytes_; at += segment_bytes_) (void)sim_->HostUnregister(0, base_ + at);
    munmap(base_, bytes_);
    base_ = nullptr;
  }

  absl::StatusOr<HostLease> Take(int device, std::size_t bytes, const std::string& owner) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++takes_;
    owners_.push_back(owner);
    if (!refusal_.ok()) return refusal_;
    const std::size_t want = (bytes + kUnit - 1) / kUnit * kUnit;
    std::size_t at = 0;
    for (const auto& [offset, lease] : leases_) {
      if (offset - at >= want) break;
      at = offset + lease.bytes;
    }
    if (at + want > bytes_) return absl::ResourceExhaustedError("the fake pool is full");
    HostLease lease{next_id_++, base_ + at, want - short_by_, base_, segment_bytes_};
    leases_[at] = lease;
    peak_ = std::max(peak_, LeasedLocked());
    return lease;
  }

  void Give(const HostLease& lease) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++gives_;
    auto it = leases_.find(static_cast<std::size_t>(lease.data - base_));
    if (it == leases_.end() || it->second.id != lease.id) ++bad_gives_;
    if (it != leases_.end()) leases_.erase(it);
  }

  std::string Describe() const override { return "the fake pool"; }
  bool Enabled() const override { return enabled_.load(); }
  void PrepareAhead(int device) override { prepared_ahead_.fetch_add(1); }
  int prepared_ahead() const { return prepared_ahead_.load(); }
  void Enable(bool on) { enabled_.store(on); }

  void Refuse(absl::Status why) {
    std::lock_guard<std::mutex> lock(mu_);
    refusal_ = std::move(why);
  }
  void ShortBy(std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    short_by_ = bytes;
  }
  std::size_t outstanding() {
    std::lock_guard<std::mutex> lock(mu_);
    return leases_.size();
  }
  std::size_t leased_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return LeasedLocked();
  }
  int takes() {
    std::lock_guard<std::mutex> lock(mu_);
    return takes_;
  }
  int gives() {
    std::lock_guard<std::mutex> lock(mu_);
    return gives_;
  }
  int bad_gives() {
    std::lock_guard<std::mutex> lock(mu_);
    return bad_gives_;
  }
  std::vector<std::string> owners() {
    std::lock_guard<std::mutex> lock(mu_);
    return owners_;
  }
  bool ready() const { return base_ != nullptr && registered_ok_; }

 private:
  static constexpr std::size_t kUnit = std::size_t{2} << 20;
  std::size_t LeasedLocked() const {
    std::size_t n = 0;
    for (const auto& entry : leases_) n += entry.second.bytes;
    return n;
  }

  SimDriver* const sim_;
  const std::size_t bytes_;
  const std::size_t segment_bytes_;
  char* base_ = nullptr;
  bool registered_ok_ = true;
  std::atomic<bool> enabled_{true};
  std::atomic<int> prepared_ahead_{0};
  std::mutex mu_;
  std::map<std::size_t, HostLease> leases_;  // by offset
  std::uint64_t next_id_ = 1;
  absl::Status refusal_;
  std::size_t short_by_ = 0;
  int takes_ = 0, gives_ = 0, bad_gives_ = 0;
  std::size_t peak_ = 0;
  std::vector<std::string> owners_;
};

// Log lines, for the fallback's message.
std::mutex g_lines_mu;
std::vector<std::pair<LogLevel, std::string>> g_lines;
void Capture(LogLevel level, absl::string_view line) {
  std::lock_guard<std::mutex> lock(g_lines_mu);
  g_lines.emplace_back(level, std::string(line));
}
int LinesWith(LogLevel level, absl::string_view text) {
  std::lock_guard<std::mutex> lock(g_lines_mu);
  return static_cast<int>(std::count_if(g_lines.begin(), g_lines.end(), [&](const auto& l) {
    return l.first == level && absl::StrContains(l.second, text);
  }));
}

class PoolBackupTest : public testing::SimAllocatorTest {
 protected:
  // A 4 MiB segment: the blocks below (5 and 9 MiB) cross several.
  // auto_prepare: a background thread (a resume then leaves the hand-back of a give_back tag to it).
  void Make(std::size_t pool_bytes = 64 * kMiB, std::size_t segment_bytes = 4 * kMiB, bool auto_prepare = false) {
    sim_ = std::make_unique<SimDriver>(SimDriverOptions{1, 512 * kMiB, 2 * kMiB, {}});
    pool_ = std::make_shared<FakePool>(sim_.get(), pool_bytes, segment_bytes);
    ASSERT_TRUE(pool_->ready());
    AllocatorOptions options = testing::TestOptions();
    options.auto_prepare = auto_prepare;
    options.host_leases = pool_;
    absl::StatusOr<std::unique_ptr<CachingAllocator>> made = CachingAllocator::Create(sim_.get(), 0, options);
    ASSERT_TRUE(made.ok()) << made.status();
    alloc_ = *std::move(made);
    a_ = *InternTag("pool_a");
    b_ = *InternTag("pool_b");
    ASSERT_TRUE(alloc_->CreateTag(a_, Policy::kBackup).ok());
    ASSERT_TRUE(alloc_->CreateTag(b_, Policy::kBackup).ok());
    {
      std::lock_guard<std::mutex> lock(g_lines_mu);
      g_lines.clear();
    }
    SetLogSink(&Capture);
  }
  void TearDown() override {
    SetLogSink(nullptr);
    alloc_.reset();  // every arena gives its lease back first
    if (pool_ != nullptr) {
      EXPECT_EQ(pool_->outstanding(), 0u);
      EXPECT_EQ(pool_->bad_gives(), 0);
      pool_->Close();
    }
    SimAllocatorTest::TearDown();
  }

  // Blocks of 5 and 9 MiB in `tag`, written with seeds `seed`, `seed`+1.
  std::vector<DevicePtr> Fill(TagId tag, std::uint8_t seed) {
    std::vector<DevicePtr> out;
    for (std::size_t n : kSizes) {
      DevicePtr p = *alloc_->Allocate(n, nullptr, tag);
      EXPECT_TRUE(WritePattern(*sim_, p, n, static_cast<std::uint8_t>(seed + out.size())).ok());
      out.push_back(p);
    }
    return out;
  }
  std::size_t Wrong(const std::vector<DevicePtr>& blocks, std::uint8_t seed) {
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      wrong += WrongBytesOnDevice(*sim_, blocks[i], kSizes[i], static_cast<std::uint8_t>(seed + i));
    }
    return wrong;
  }

  static constexpr std::size_t kSizes[2] = {5 * kMiB, 9 * kMiB};
  std::shared_ptr<FakePool> pool_;
  TagId a_ = 0, b_ = 0;
};

TEST_F(PoolBackupTest, APauseBacksUpIntoALeaseAndTheResumeGivesItBack) {
  Make();
  const std::size_t budget_before = HostBudget::Process().held();
  std::vector<DevicePtr> blocks = Fill(a_, 7);
  for (int cycle = 0; cycle < 3; ++cycle) {
    ASSERT_TRUE(alloc_->Pause(a_).ok());
    EXPECT_EQ(pool_->outstanding(), 1u);
    EXPECT_GE(pool_->leased_bytes(), 14 * kMiB);
    // The pool's bytes, not the process's: counted in the arena, not charged to the budget.
    EXPECT_EQ(static_cast<std::size_t>(TagStatsOf(*alloc_, a_).backup_arena_bytes), pool_->leased_bytes());
    EXPECT_EQ(HostBudget::Process().held(), budget_before);
    EXPECT_EQ(sim_->UsedBytes(0), 0u);
    ASSERT_TRUE(alloc_->Resume(a_).ok());
    EXPECT_EQ(Wrong(blocks, 7), 0u) << "cycle " << cycle;
    EXPECT_EQ(pool_->outstanding(), 0u) << "the lease goes back after the resume";
    EXPECT_EQ(TagStatsOf(*alloc_, a_).backup_arena_bytes, 0);
  }
  EXPECT_EQ(pool_->takes(), 3);
  EXPECT_EQ(pool_->gives(), 3);
  ASSERT_FALSE(pool_->owners().empty());
  EXPECT_TRUE(absl::StrContains(pool_->owners()[0], "pool_a")) << pool_->owners()[0];
  ASSERT_TRUE(alloc_->Validate().ok());
}

TEST_F(PoolBackupTest, CopiesAreCutAtTheSegments) {
  // 2 MiB segments: every block crosses several registrations (the simulator, as CUDA,
  // refuses a copy across two).
  Make(64 * kMiB, 2 * kMiB);
  std::vector<DevicePtr> blocks = Fill(a_, 40);
  ASSERT_TRUE(alloc_->Pause(a_).ok());
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  EXPECT_EQ(Wrong(blocks, 40), 0u);
}

TEST_F(PoolBackupTest, ARefusalFallsBackToTheProcesssOwnMemoryAndSaysSoOnce) {
  Make();
  const std::size_t budget_before = HostBudget::Process().held();
  std::vector<DevicePtr> blocks = Fill(a_, 3);
  pool_->Refuse(absl::UnavailableError("the node daemon is gone"));
  for (int cycle = 0; cycle < 2; ++cycle) {
    ASSERT_TRUE(alloc_->Pause(a_).ok());
    EXPECT_EQ(pool_->outstanding(), 0u);
    EXPECT_GT(TagStatsOf(*alloc_, a_).backup_arena_bytes, 0) << "its own pinned arena";
    ASSERT_TRUE(alloc_->Resume(a_).ok());
    EXPECT_EQ(Wrong(blocks, 3), 0u);
  }
  EXPECT_EQ(LinesWith(LogLevel::kWarning, "the fake pool cannot hold"), 1);
  EXPECT_EQ(LinesWith(LogLevel::kWarning, "the node daemon is gone"), 1);
  // The pool is back: the next pause leases again, and the own memory goes.
  EXPECT_GT(HostBudget::Process().held(), budget_before) << "the own arena, kept pinned, is charged";
  pool_->Refuse(absl::OkStatus());
  ASSERT_TRUE(alloc_->Pause(a_).ok());
  EXPECT_EQ(pool_->outstanding(), 1u);
  EXPECT_EQ(static_cast<std::size_t>(TagStatsOf(*alloc_, a_).backup_arena_bytes), pool_->leased_bytes());
  EXPECT_EQ(HostBudget::Process().held(), budget_before) << "the own memory went back when the pool served";
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  EXPECT_EQ(Wrong(blocks, 3), 0u);
}

TEST_F(PoolBackupTest, ALeaseShorterThanAskedIsGivenBackAndNotUsed) {
  Make();
  std::vector<DevicePtr> blocks = Fill(a_, 11);
  pool_->ShortBy(2 * kMiB);
  ASSERT_TRUE(alloc_->Pause(a_).ok());
  EXPECT_EQ(pool_->outstanding(), 0u);
  EXPECT_EQ(pool_->gives(), 1);
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  EXPECT_EQ(Wrong(blocks, 11), 0u);
}

TEST_F(PoolBackupTest, AFullPoolFallsBackForOneTagAndLeasesForTheOther) {
  Make(16 * kMiB);  // room for one tag's 14 MiB
  std::vector<DevicePtr> a = Fill(a_, 1), b = Fill(b_, 9);
  ASSERT_TRUE(alloc_->Pause(a_).ok());
  ASSERT_TRUE(alloc_->Pause(b_).ok());
  EXPECT_EQ(pool_->outstanding(), 1u);
  EXPECT_EQ(LinesWith(LogLevel::kWarning, "the fake pool is full"), 1);
  ASSERT_TRUE(alloc_->Resume(b_).ok());
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  EXPECT_EQ(Wrong(a, 1), 0u);
  EXPECT_EQ(Wrong(b, 9), 0u);
}

TEST_F(PoolBackupTest, AFailedPauseGivesItsLeaseBackAndLeavesTheTagAsItWas) {
  Make();
  std::vector<DevicePtr> blocks = Fill(a_, 21);
  for (int nth = 1; nth <= 3; ++nth) {
    sim_->InjectFault(FaultRule{DriverOp::kCopyToHost, nth, 1, absl::StatusCode::kInternal});
    EXPECT_FALSE(alloc_->Pause(a_).ok()) << "copy " << nth;
    sim_->ClearFaults();
    EXPECT_EQ(pool_->outstanding(), 0u) << "copy " << nth;
    EXPECT_EQ(Wrong(blocks, 21), 0u) << "copy " << nth;
    ASSERT_TRUE(alloc_->Validate().ok());
  }
  ASSERT_TRUE(alloc_->Pause(a_).ok());
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  EXPECT_EQ(Wrong(blocks, 21), 0u);
}

TEST_F(PoolBackupTest, AFailedResumeKeepsTheLeaseWithTheBytes) {
  Make();
  std::vector<DevicePtr> blocks = Fill(a_, 5);
  ASSERT_TRUE(alloc_->Pause(a_).ok());
  sim_->InjectFault(FaultRule{DriverOp::kCopyToDevice, 1, 1, absl::StatusCode::kInternal});
  EXPECT_FALSE(alloc_->Resume(a_).ok());
  sim_->ClearFaults();
  EXPECT_EQ(pool_->outstanding(), 1u) << "the paused bytes are in it";
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  EXPECT_EQ(Wrong(blocks, 5), 0u);
  EXPECT_EQ(pool_->outstanding(), 0u);
}

TEST_F(PoolBackupTest, ARetainedBackupKeepsItsLeaseUntilReleased) {
  Make();
  std::vector<DevicePtr> blocks = Fill(a_, 13);
  ASSERT_TRUE(alloc_->SetBackupRetention(a_, BackupRetention{true, false, false}).ok());
  ASSERT_TRUE(alloc_->Pause(a_).ok());
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  EXPECT_EQ(pool_->outstanding(), 1u);
  std::vector<std::uint8_t> copy(kSizes[0]);
  ASSERT_TRUE(alloc_->ReadBackup(blocks[0], kSizes[0], copy.data()).ok());
  ASSERT_TRUE(alloc_->ReleaseBackup(a_).ok());
  EXPECT_EQ(pool_->outstanding(), 0u);
}

TEST_F(PoolBackupTest, TheGiveBackModeReturnsTheLeaseAtOnce) {
  Make(64 * kMiB, 4 * kMiB, /*auto_prepare=*/true);  // a background thread: the resume could leave the hand-back to it
  std::vector<DevicePtr> blocks = Fill(a_, 17);
  ASSERT_TRUE(alloc_->SetBackupRetention(a_, BackupRetention{false, false, true}).ok());
  ASSERT_TRUE(alloc_->Pause(a_).ok());
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  EXPECT_EQ(pool_->outstanding(), 0u);
  EXPECT_EQ(Wrong(blocks, 17), 0u);
}

TEST_F(PoolBackupTest, APauseThatKeepsNoBytesGivesARetainedLeaseBack) {
  Make();
  ASSERT_TRUE(alloc_->SetBackupRetention(a_, BackupRetention{true, false, false}).ok());
  std::vector<DevicePtr> blocks = Fill(a_, 19);
  ASSERT_TRUE(alloc_->Pause(a_).ok());
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  EXPECT_EQ(pool_->outstanding(), 1u) << "retained";
  for (DevicePtr p : blocks) ASSERT_TRUE(alloc_->Free(p).ok());
  ASSERT_TRUE(alloc_->Pause(a_).ok());  // nothing live: no bytes kept
  // Nothing is retained any more; the lease goes back at the resume, not under the
  // device's lock the pause's commit holds.
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  EXPECT_EQ(pool_->outstanding(), 0u) << "the lease went back";
  EXPECT_EQ(TagStatsOf(*alloc_, a_).backup_arena_bytes, 0);
  EXPECT_EQ(LinesWith(LogLevel::kError, "not allowed"), 0);
  ASSERT_TRUE(alloc_->Validate().ok());
}

TEST_F(PoolBackupTest, AGiveBackTagsPauseWithNoBytesHandsItsMemoryBackWithoutARefusedMove) {
  Make(64 * kMiB, 4 * kMiB, /*auto_prepare=*/true);
  pool_->Enable(false);  // not pool-backed: the process's own pinned memory
  ASSERT_TRUE(alloc_->SetBackupRetention(a_, BackupRetention{false, false, true}).ok());
  std::vector<DevicePtr> blocks = Fill(a_, 23);
  ASSERT_TRUE(alloc_->Pause(a_).ok());
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  for (DevicePtr p : blocks) ASSERT_TRUE(alloc_->Free(p).ok());
  ASSERT_TRUE(alloc_->Pause(a_).ok());  // nothing live: no bytes kept
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  EXPECT_EQ(LinesWith(LogLevel::kError, "not allowed"), 0);
  EXPECT_EQ(TagStatsOf(*alloc_, a_).backup_arena_bytes, 0) << "handed back (give_back)";
  ASSERT_TRUE(alloc_->Validate().ok());
}

TEST_F(PoolBackupTest, PrepareTakesNothingFromThePool) {
  Make();
  std::vector<DevicePtr> blocks = Fill(a_, 2);
  const std::size_t budget_before = HostBudget::Process().held();
  ASSERT_TRUE(alloc_->Prepare(a_).ok());
  EXPECT_EQ(pool_->takes(), 0);
  EXPECT_EQ(pool_->prepared_ahead(), 1) << "told instead (node_pin pins the pool then)";
  EXPECT_EQ(TagStatsOf(*alloc_, a_).backup_arena_bytes, 0);
  EXPECT_EQ(HostBudget::Process().held(), budget_before);
}

TEST_F(PoolBackupTest, ASourceNotEnabledIsNotTriedAndPrepareWorksAsBefore) {
  Make();
  pool_->Enable(false);
  std::vector<DevicePtr> blocks = Fill(a_, 23);
  ASSERT_TRUE(alloc_->Prepare(a_).ok());
  EXPECT_GT(TagStatsOf(*alloc_, a_).backup_arena_bytes, 0) << "prepared in its own memory";
  ASSERT_TRUE(alloc_->Pause(a_).ok());
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  EXPECT_EQ(Wrong(blocks, 23), 0u);
  EXPECT_EQ(pool_->takes(), 0);
  EXPECT_EQ(LinesWith(LogLevel::kWarning, "cannot hold"), 0);
  // Enabled later (a connect after the first pauses): the next pause leases, and the
  // memory the tag kept pinned goes back.
  pool_->Enable(true);
  ASSERT_TRUE(alloc_->Pause(a_).ok());
  EXPECT_EQ(pool_->outstanding(), 1u);
  EXPECT_EQ(static_cast<std::size_t>(TagStatsOf(*alloc_, a_).backup_arena_bytes), pool_->leased_bytes());
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  EXPECT_EQ(Wrong(blocks, 23), 0u);
}

TEST_F(PoolBackupTest, ASwitchBacksUpIntoLeasesBothWays) {
  Make();
  std::vector<DevicePtr> a = Fill(a_, 30), b = Fill(b_, 60);
  ASSERT_TRUE(alloc_->Pause(b_).ok());
  for (int round = 0; round < 4; ++round) {
    const bool to_b = round % 2 == 0;
    ASSERT_TRUE(alloc_->Switch({to_b ? a_ : b_}, {to_b ? b_ : a_}).ok()) << round;
    EXPECT_EQ(pool_->outstanding(), 1u) << "only the paused tag's backup, round " << round;
    EXPECT_EQ(Wrong(to_b ? b : a, to_b ? 60 : 30), 0u) << round;
  }
  ASSERT_TRUE(alloc_->Resume(b_).ok());
  EXPECT_EQ(Wrong(a, 30), 0u);
  EXPECT_EQ(Wrong(b, 60), 0u);
}

TEST_F(PoolBackupTest, ManyTagsPauseAndResumeAtOnceThroughOnePool) {
  Make(128 * kMiB);
  constexpr int kTags = 4;
  std::vector<TagId> tags;
  std::vector<std::vector<DevicePtr>> blocks;
  for (int t = 0; t < kTags; ++t) {
    tags.push_back(*InternTag(absl::StrCat("pool_many_", t)));
    ASSERT_TRUE(alloc_->CreateTag(tags.back(), Policy::kBackup).ok());
    blocks.push_back(Fill(tags.back(), static_cast<std::uint8_t>(50 + 10 * t)));
  }
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kTags; ++t) {
    threads.emplace_back([&, t] {
      for (int cycle = 0; cycle < 10; ++cycle) {
        if (!alloc_->Pause(tags[t]).ok() || !alloc_->Resume(tags[t]).ok()) ++failures;
        if (Wrong(blocks[t], static_cast<std::uint8_t>(50 + 10 * t)) != 0) ++failures;
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(pool_->outstanding(), 0u);
  EXPECT_EQ(pool_->takes(), 4 * 10);
}

}  // namespace
}  // namespace vmstash
