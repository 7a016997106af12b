// A switch with an agreement (Note [Agreed Switch] in allocator/switch.h) on the simulated
// driver: `agree` runs exactly once on every path (refused requests, a veto, nothing to
// move, a failure of the transaction, success), with this process's outcome, while the
// switch is prepared but not committed; a "no" rolls back a prepared switch with every tag
// as it was (bytes, states, the host account), a "yes" commits it; a local failure rolls
// back whatever the agreement says; other tags' allocations go on while it waits.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/host_budget.h"
#include "allocator/switch_scenario.h"
#include "allocator/testing.h"
#include "base/byte_pattern.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

using ::testing::HasSubstr;
using ::vmstash::testing::TagStatsOf;

class AgreedSwitchTest : public testing::SimAllocatorTest {
 protected:
  void SetUp() override {
    AllocatorOptions options = testing::TestOptions();
    options.auto_prepare = false;
    options.switch_group_bytes = 4 * kMiB;
    MakeAllocator(SimDriverOptions{1, 512 * kMiB, 2 * kMiB, {}}, options);
    train_ = Tag("train", Policy::kBackup);
    kv_ = Tag("kv", Policy::kDiscard);
    weights_ = Tag("weights", Policy::kBackup);
    other_ = Tag("other", Policy::kBackup);
    train_blocks_ = testing::FillBlocks(*alloc_, train_, {24 * kMiB, 3 * kMiB + 4096}, 1);
    weights_blocks_ = testing::FillBlocks(*alloc_, weights_, {16 * kMiB, 5 * kMiB}, 40);
    (void)testing::FillBlocks(*alloc_, kv_, {32 * kMiB}, 80);
    // The rollout phase is paused: weights backed up, the KV cache dropped.
    EXPECT_TRUE(alloc_->Switch({weights_, kv_}, {}).ok());
  }
  TagId Tag(const char* name, Policy policy) {
    const TagId t = *InternTag(name);
    EXPECT_TRUE(alloc_->CreateTag(t, policy).ok());
    return t;
  }
  std::string State(TagId tag) const { return TagStatsOf(*alloc_, tag).state; }
  // An agreement that records each call and answers `answer`.
  CachingAllocator::SwitchAgree Recording(absl::Status answer) {
    return [this, answer](const absl::Status& local) {
      locals_.push_back(local);
      return answer;
    };
  }
  // The phase switch to training: the rollout's tags out, training's in... and back.
  absl::StatusOr<CachingAllocator::Transition> ToRollout(const CachingAllocator::SwitchAgree& agree) {
    return alloc_->Switch({train_}, {weights_, kv_}, nullptr, nullptr, &agree);
  }

  TagId train_ = 0, kv_ = 0, weights_ = 0, other_ = 0;
  std::vector<testing::PatternBlock> train_blocks_, weights_blocks_;
  std::vector<absl::Status> locals_;
};

TEST_F(AgreedSwitchTest, YesCommitsAfterOnePreparedCall) {
  const CachingAllocator::SwitchAgree agree = Recording(absl::OkStatus());
  ASSERT_TRUE(ToRollout(agree).ok());
  ASSERT_EQ(locals_.size(), 1u);
  EXPECT_TRUE(locals_[0].ok()) << locals_[0];
  EXPECT_EQ(State(train_), "paused");
  EXPECT_EQ(State(weights_), "active");
  EXPECT_EQ(State(kv_), "active");
  EXPECT_EQ(testing::WrongBlocks(weights_blocks_), 0u);
  ASSERT_TRUE(alloc_->Switch({weights_, kv_}, {train_}).ok());
  EXPECT_EQ(testing::WrongBlocks(train_blocks_), 0u);
  EXPECT_TRUE(alloc_->Validate().ok());
}

// The agreement runs with the switch prepared: the outgoing tag's bytes are in its backup
// and its memory unmapped, the incoming tags' memory mapped and restored, nothing published.
TEST_F(AgreedSwitchTest, TheAgreementRunsWithTheSwitchPreparedNotCommitted) {
  std::vector<std::uint8_t> backup(train_blocks_[0].size);
  const CachingAllocator::SwitchAgree agree = [&](const absl::Status& local) {
    locals_.push_back(local);
    // Only the sim is read here (the agreement may not call the allocator).
    EXPECT_EQ(WrongBytes(weights_blocks_[0].address, weights_blocks_[0].size, weights_blocks_[0].seed), 0u)
        << "the incoming bytes are restored before the agreement";
    return absl::AbortedError("rank 1 of 2 failed: out of memory");
  };
  const std::size_t held = HostBudget::Process().held();
  absl::StatusOr<CachingAllocator::Transition> r = ToRollout(agree);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(r.status().message(), HasSubstr("rank 1 of 2 failed"));
  EXPECT_THAT(r.status().message(), HasSubstr("every tag is as it was"));
  ASSERT_EQ(locals_.size(), 1u);
  EXPECT_TRUE(locals_[0].ok());
  // Every tag as it was: training active with its bytes, the rollout's tags paused.
  EXPECT_EQ(State(train_), "active");
  EXPECT_EQ(State(weights_), "paused");
  EXPECT_EQ(State(kv_), "paused");
  EXPECT_EQ(testing::WrongBlocks(train_blocks_), 0u);
  EXPECT_EQ(HostBudget::Process().held(), held);
  EXPECT_TRUE(alloc_->Validate().ok());
  // The retry, agreed, goes through; the weights' backup survived the rollback.
  const CachingAllocator::SwitchAgree yes = Recording(absl::OkStatus());
  ASSERT_TRUE(ToRollout(yes).ok());
  EXPECT_EQ(testing::WrongBlocks(weights_blocks_), 0u);
  ASSERT_TRUE(alloc_->Switch({weights_, kv_}, {train_}).ok());
  EXPECT_EQ(testing::WrongBlocks(train_blocks_), 0u);
}

// Every refused request, a veto and a switch with nothing to move still call the agreement
// once, with the refusal (or OK), so that the other processes are not left waiting.
TEST_F(AgreedSwitchTest, EveryPathCallsTheAgreementOnce) {
  const CachingAllocator::SwitchAgree yes = Recording(absl::OkStatus());
  struct Case {
    const char* what;
    std::vector<TagId> pause, resume;
    absl::StatusCode local;
  };
  const TagId unknown = *InternTag("agreed_switch_never_created");
  const std::vector<Case> cases = {
      {"nothing", {}, {}, absl::StatusCode::kInvalidArgument},
      {"twice", {train_, train_}, {}, absl::StatusCode::kInvalidArgument},
      {"both", {train_}, {train_}, absl::StatusCode::kInvalidArgument},
      {"unknown", {unknown}, {}, absl::StatusCode::kNotFound},
      {"nothing moves", {weights_}, {train_}, absl::StatusCode::kOk},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    locals_.clear();
    absl::StatusOr<CachingAllocator::Transition> r = alloc_->Switch(c.pause, c.resume, nullptr, nullptr, &yes);
    ASSERT_EQ(locals_.size(), 1u);
    EXPECT_EQ(locals_[0].code(), c.local) << locals_[0];
    EXPECT_EQ(r.status().code(), c.local);
  }
  // Nothing to move, but another process said no: the call reports it (nothing changed).
  locals_.clear();
  const CachingAllocator::SwitchAgree no = Recording(absl::AbortedError("rank 0 refused"));
  absl::StatusOr<CachingAllocator::Transition> r = alloc_->Switch({weights_}, {train_}, nullptr, nullptr, &no);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted);
  ASSERT_EQ(locals_.size(), 1u);
  // A before-pause hook's veto.
  ASSERT_TRUE(alloc_->AddHooks(train_, [](TagId, int) { return absl::AbortedError("not now"); }, nullptr).ok());
  locals_.clear();
  r = ToRollout(yes);
  EXPECT_FALSE(r.ok());
  ASSERT_EQ(locals_.size(), 1u);
  EXPECT_THAT(locals_[0].message(), HasSubstr("not now"));
  EXPECT_EQ(State(train_), "active");
  EXPECT_EQ(State(weights_), "paused");
  EXPECT_EQ(testing::WrongBlocks(train_blocks_), 0u);
}

// A failure of the transaction itself: the agreement hears it once; the switch rolls back
// even when the others said yes.
TEST_F(AgreedSwitchTest, ALocalFailureRollsBackWhateverTheAgreementSays) {
  const DriverOp ops[] = {DriverOp::kCopyToHost, DriverOp::kCopyToDevice, DriverOp::kHostRegister,
                          DriverOp::kSynchronizeStream, DriverOp::kUnmap, DriverOp::kMap};
  int failed = 0;
  std::string missed;
  for (DriverOp op : ops) {
    SCOPED_TRACE(DriverOpName(op));
    locals_.clear();
    const std::size_t held = HostBudget::Process().held();
    sim_->InjectFault(FaultRule{op, 1, 1, absl::StatusCode::kInternal});  // its next call
    const CachingAllocator::SwitchAgree yes = Recording(absl::OkStatus());
    absl::StatusOr<CachingAllocator::Transition> r = ToRollout(yes);
    sim_->ClearFaults();
    ASSERT_EQ(locals_.size(), 1u);
    if (r.ok()) {  // the fault hit a call the switch did not make; switch back and go on
      EXPECT_TRUE(locals_[0].ok());
      missed += std::string(DriverOpName(op)) + " ";
      ASSERT_TRUE(alloc_->Switch({weights_, kv_}, {train_}).ok());
      continue;
    }
    ++failed;
    EXPECT_FALSE(locals_[0].ok());
    EXPECT_EQ(State(train_), "active");
    EXPECT_EQ(State(weights_), "paused");
    EXPECT_EQ(testing::WrongBlocks(train_blocks_), 0u);
    EXPECT_EQ(HostBudget::Process().held(), held);
    EXPECT_TRUE(alloc_->Validate().ok());
  }
  EXPECT_GE(failed, 5) << "the faults missed the switch: " << missed;
  const CachingAllocator::SwitchAgree yes = Recording(absl::OkStatus());
  ASSERT_TRUE(ToRollout(yes).ok());
  EXPECT_EQ(testing::WrongBlocks(weights_blocks_), 0u);
}

// While the agreement waits (for other processes), the switch's tags are held, other tags
// are not: another thread allocates, writes and frees in one, and the agreement sees it.
TEST_F(AgreedSwitchTest, OtherTagsWorkWhileTheAgreementWaits) {
  std::atomic<bool> waiting{false}, other_done{false};
  std::thread worker([&] {
    while (!waiting.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(4 * kMiB, nullptr, other_);
    ASSERT_TRUE(p.ok()) << p.status();
    FillPattern(*p, 4 * kMiB, 7);
    EXPECT_EQ(WrongBytes(*p, 4 * kMiB, 7), 0u);
    ASSERT_TRUE(alloc_->Free(*p).ok());
    other_done = true;
  });
  const CachingAllocator::SwitchAgree agree = [&](const absl::Status& local) {
    waiting = true;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!other_done.load() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return local;
  };
  absl::StatusOr<CachingAllocator::Transition> r = ToRollout(agree);
  worker.join();
  EXPECT_TRUE(other_done.load()) << "another tag's allocation waited for the agreement";
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(alloc_->Switch({weights_, kv_}, {train_}).ok());
  EXPECT_EQ(testing::WrongBlocks(train_blocks_), 0u);
}

}  // namespace
}  // namespace vmstash
