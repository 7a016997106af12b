// The fixture the host-budget tests share (host_cap_test, backup_account_test): a
// simulated allocator whose `backup` tags hold blocks filled with FillPattern (base/
// byte_pattern.h), checked by Intact(); a temporary directory for spills; the process's
// host budget limit reset after each test. Each test file makes its allocator (Make).
//
// Test-only. Thread-safety: one test's thread.
#ifndef VMSTASH_ALLOCATOR_BACKUP_TAGS_FIXTURE_H_
#define VMSTASH_ALLOCATOR_BACKUP_TAGS_FIXTURE_H_

#include <stdlib.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/host_budget.h"
#include "allocator/testing.h"
#include "base/byte_pattern.h"
#include "vmm/sim_driver.h"

namespace vmstash::testing {

class BackupTagsTest : public SimAllocatorTest {
 protected:
  void TearDown() override {
    HostBudget::Process().SetLimit(0);
    SimAllocatorTest::TearDown();
    if (!dir_.empty()) rmdir(dir_.c_str());
  }
  // A `backup` tag with blocks of `sizes`, filled with patterns Intact() checks.
  TagId AddTag(const char* name, std::vector<std::size_t> sizes, BackupRetention retention = {}) {
    const TagId tag = *InternTag(name);
    EXPECT_TRUE(alloc_->CreateTag(tag, Policy::kBackup).ok());
    EXPECT_TRUE(alloc_->SetBackupRetention(tag, retention).ok());
    for (std::size_t n : sizes) {
      DevicePtr p = *alloc_->Allocate(n, nullptr, tag);
      FillPattern(p, n, static_cast<std::uint8_t>(blocks_.size() + 1));
      blocks_.emplace_back(p, n);
    }
    return tag;
  }
  std::size_t Arena(TagId tag) const { return static_cast<std::size_t>(TagStatsOf(*alloc_, tag).backup_arena_bytes); }
  std::string State(TagId tag) const { return TagStatsOf(*alloc_, tag).state; }
  // The next call of `op` (and the `count` - 1 after it) fails; a rule counts the calls
  // made after it is armed (SimDriver::InjectFault).
  void FailNext(DriverOp op, int count = 1) {
    sim_->InjectFault(FaultRule{op, 1, count, absl::StatusCode::kInternal});
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

}  // namespace vmstash::testing

#endif  // VMSTASH_ALLOCATOR_BACKUP_TAGS_FIXTURE_H_
