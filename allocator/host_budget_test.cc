#include "allocator/host_budget.h"

#include <atomic>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "base/log.h"
#include "gtest/gtest.h"

namespace vmstash {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;

std::vector<std::string>* g_lines = nullptr;
void Capture(LogLevel, absl::string_view line) { g_lines->emplace_back(line); }

bool Contains(const absl::Status& s, absl::string_view part) {
  return s.message().find(part) != absl::string_view::npos;
}

TEST(HostBudgetTest, ChargesAndRefundsWithoutACap) {
  HostBudget budget;
  EXPECT_EQ(budget.limit(), 0u);
  EXPECT_EQ(budget.held(), 0u);
  ASSERT_TRUE(budget.Charge(3 * kGiB, "a").ok());
  ASSERT_TRUE(budget.Charge(5 * kGiB, "b").ok());
  EXPECT_EQ(budget.held(), 8 * kGiB);
  budget.Refund(3 * kGiB);
  EXPECT_EQ(budget.held(), 5 * kGiB);
  EXPECT_TRUE(budget.Charge(0, "nothing").ok());
  budget.Refund(0);
  EXPECT_EQ(budget.held(), 5 * kGiB);
  budget.Refund(5 * kGiB);
  EXPECT_EQ(budget.held(), 0u);
}

TEST(HostBudgetTest, CapIsAllOrNothingAndExactlyReachable) {
  HostBudget budget;
  budget.SetLimit(4 * kGiB);
  EXPECT_EQ(budget.limit(), 4 * kGiB);
  ASSERT_TRUE(budget.Charge(3 * kGiB, "a").ok());
  absl::Status over = budget.Charge(kGiB + 1, "b");
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted) << over;
  EXPECT_EQ(budget.held(), 3 * kGiB) << "a refused charge adds nothing";
  ASSERT_TRUE(budget.Charge(kGiB, "c").ok()) << "the cap itself is allowed";
  EXPECT_EQ(budget.held(), 4 * kGiB);
  EXPECT_EQ(budget.Charge(1, "d").code(), absl::StatusCode::kResourceExhausted);
  budget.Refund(kGiB);
  EXPECT_TRUE(budget.Charge(kGiB, "e").ok()) << "a refund makes room again";
  budget.SetLimit(0);
  EXPECT_TRUE(budget.Charge(100 * kGiB, "f").ok()) << "0 removes the cap";
  EXPECT_EQ(budget.held(), 104 * kGiB);
}

TEST(HostBudgetTest, RefusalNamesTheCapTheBytesTheHolderAndTheWayOut) {
  HostBudget budget;
  budget.SetLimit(64 * kGiB);
  ASSERT_TRUE(budget.Charge(62 * kGiB, "x").ok());
  absl::Status s = budget.Charge(3 * kGiB, "the backup of tag 'kv' on device 0");
  ASSERT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Contains(s, "host_max:64G")) << s;               // the cap as written in VMSTASH_CONF
  EXPECT_TRUE(Contains(s, "VMSTASH_CONF")) << s;
  EXPECT_TRUE(Contains(s, "3.00 GiB (3221225472 bytes)")) << s;   // asked
  EXPECT_TRUE(Contains(s, "62.00 GiB (66571993088 bytes)")) << s; // held
  EXPECT_TRUE(Contains(s, "the backup of tag 'kv' on device 0")) << s;
  EXPECT_TRUE(Contains(s, "raise host_max")) << s;
  EXPECT_TRUE(Contains(s, "spill_dir")) << s;
}

TEST(HostBudgetTest, LimitBelowHeldKeepsChargesAndRefusesNewOnes) {
  HostBudget budget;
  ASSERT_TRUE(budget.Charge(10 * kGiB, "a").ok());
  budget.SetLimit(4 * kGiB);
  EXPECT_EQ(budget.held(), 10 * kGiB) << "lowering the cap takes nothing back";
  EXPECT_EQ(budget.Charge(1, "b").code(), absl::StatusCode::kResourceExhausted);
  budget.Refund(7 * kGiB);
  EXPECT_EQ(budget.held(), 3 * kGiB);
  EXPECT_EQ(budget.Charge(kGiB + 1, "c").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(budget.Charge(kGiB, "d").ok());
  EXPECT_EQ(budget.held(), 4 * kGiB);
}

TEST(HostBudgetTest, OverRefundIsLoggedAndClampedNotACrash) {
  std::vector<std::string> lines;
  g_lines = &lines;
  SetLogSink(&Capture);
  HostBudget budget;
  ASSERT_TRUE(budget.Charge(kMiB, "a").ok());
  budget.Refund(2 * kMiB);
  SetLogSink(nullptr);
  g_lines = nullptr;
  EXPECT_EQ(budget.held(), 0u);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("[vmstash E "), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("refund of 2097152 bytes with only 1048576 bytes held"), std::string::npos) << lines[0];
  EXPECT_TRUE(budget.Charge(kMiB, "b").ok());
  EXPECT_EQ(budget.held(), kMiB);
}

TEST(HostBudgetTest, OverflowIsRefusedWithoutACap) {
  HostBudget budget;
  ASSERT_TRUE(budget.Charge(std::numeric_limits<std::size_t>::max() - 1, "a").ok());
  absl::Status s = budget.Charge(2, "b");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(Contains(s, "overflow")) << s;
  EXPECT_EQ(budget.held(), std::numeric_limits<std::size_t>::max() - 1);
}

TEST(HostBudgetTest, ProcessIsOneInstance) {
  EXPECT_EQ(&HostBudget::Process(), &HostBudget::Process());
  EXPECT_EQ(HostCharge().budget(), &HostBudget::Process());
}

TEST(HostChargeTest, ResizeChargesTheIncreaseAndRefundsTheDecrease) {
  HostBudget budget;
  budget.SetLimit(8 * kGiB);
  {
    HostCharge charge(&budget);
    ASSERT_TRUE(charge.Resize(2 * kGiB, "a").ok());
    EXPECT_EQ(budget.held(), 2 * kGiB);
    ASSERT_TRUE(charge.Resize(6 * kGiB, "a").ok());
    EXPECT_EQ(budget.held(), 6 * kGiB);
    absl::Status s = charge.Resize(9 * kGiB, "the backup of tag 'w' on device 1");
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_TRUE(Contains(s, "3.00 GiB")) << "the increase is what is asked: " << s;
    EXPECT_EQ(charge.bytes(), 6 * kGiB) << "a refused resize keeps the charge";
    EXPECT_EQ(budget.held(), 6 * kGiB);
    ASSERT_TRUE(charge.Resize(kGiB, "a").ok());
    EXPECT_EQ(budget.held(), kGiB);
    HostCharge moved = std::move(charge);
    EXPECT_EQ(charge.bytes(), 0u);  // NOLINT(bugprone-use-after-move): a moved-from charge holds nothing
    EXPECT_EQ(moved.bytes(), kGiB);
    EXPECT_EQ(budget.held(), kGiB);
    HostCharge other(&budget);
    ASSERT_TRUE(other.Resize(2 * kGiB, "b").ok());
    EXPECT_EQ(budget.held(), 3 * kGiB);
    other = std::move(moved);  // refunds other's 2 GiB, takes moved's 1 GiB
    EXPECT_EQ(budget.held(), kGiB);
    EXPECT_EQ(other.bytes(), kGiB);
  }
  EXPECT_EQ(budget.held(), 0u) << "destruction refunds";
  HostCharge reset(&budget);
  ASSERT_TRUE(reset.Resize(kGiB, "c").ok());
  reset.Reset();
  EXPECT_EQ(budget.held(), 0u);
  EXPECT_EQ(reset.bytes(), 0u);
}

// Several threads charge and refund at random against one cap: `held` never passes the
// cap (sampled by a watcher and checked after each successful charge), every charge that
// fits under a quiet account succeeds, and the account ends at exactly zero.
TEST(HostBudgetTest, ConcurrentChargesNeverPassTheCap) {
  constexpr std::size_t kLimit = 64 * kMiB;
  constexpr int kThreads = 8;
  constexpr int kRounds = 20000;
  HostBudget budget;
  budget.SetLimit(kLimit);
  std::atomic<bool> stop{false};
  std::atomic<std::size_t> max_seen{0};
  std::atomic<long> refused{0};
  std::thread watcher([&] {
    while (!stop.load(std::memory_order_relaxed)) {
      const std::size_t h = budget.held();
      std::size_t m = max_seen.load(std::memory_order_relaxed);
      while (h > m && !max_seen.compare_exchange_weak(m, h, std::memory_order_relaxed)) {
      }
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(1234 + t);
      std::vector<std::size_t> mine;
      HostCharge charge(&budget);
      for (int i = 0; i < kRounds; ++i) {
        const unsigned op = rng() % 4;
        if (op < 2) {
          const std::size_t bytes = (rng() % (8 * kMiB)) + 1;
          absl::Status s = budget.Charge(bytes, "a test backup");
          if (s.ok()) {
            mine.push_back(bytes);
            EXPECT_LE(budget.held(), kLimit);
          } else {
            EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
            refused.fetch_add(1, std::memory_order_relaxed);
          }
        } else if (op == 2 && !mine.empty()) {
          budget.Refund(mine.back());
          mine.pop_back();
        } else {
          (void)charge.Resize(rng() % (4 * kMiB), "a test arena");  // refused or not, the charge stays consistent
        }
      }
      for (std::size_t bytes : mine) budget.Refund(bytes);
    });
  }
  for (std::thread& t : threads) t.join();
  stop.store(true);
  watcher.join();
  EXPECT_LE(max_seen.load(), kLimit);
  EXPECT_GT(refused.load(), 0) << "the cap was never reached: the test proves nothing";
  EXPECT_EQ(budget.held(), 0u) << "every charge was refunded exactly once";
  // With the account quiet, the whole cap can be charged at once.
  EXPECT_TRUE(budget.Charge(kLimit, "everything").ok());
}

// SetLimit racing charges: whatever the order, a charge that succeeds was within one of
// the limits in force during the call, so held stays within the larger one, and the
// account stays exact.
TEST(HostBudgetTest, SetLimitRacingCharges) {
  HostBudget budget;
  budget.SetLimit(16 * kMiB);
  std::atomic<bool> stop{false};
  std::thread setter([&] {
    std::mt19937_64 rng(7);
    while (!stop.load(std::memory_order_relaxed)) budget.SetLimit(((rng() % 2) + 1) * 16 * kMiB);
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(99 + t);
      for (int i = 0; i < 20000; ++i) {
        const std::size_t bytes = (rng() % kMiB) + 1;
        if (budget.Charge(bytes, "a test backup").ok()) {
          EXPECT_LE(budget.held(), 32 * kMiB);
          budget.Refund(bytes);
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  stop.store(true);
  setter.join();
  EXPECT_EQ(budget.held(), 0u);
}

}  // namespace
}  // namespace vmstash
