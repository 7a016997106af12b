// HostPoolLedger (host_pool.h): leases in units, first fit, returns only by the holder,
// everything of a dead client back at once, and the invariants after every step.
#include "node/host_pool.h"

#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace vmstash::node {
namespace {

using ::testing::HasSubstr;
constexpr std::size_t kUnit = HostPoolLedger::kUnitBytes;

TEST(HostPoolLedgerTest, LeasesAreWholeUnitsTakenFirstFit) {
  HostPoolLedger pool(10 * kUnit + 123);  // rounded down
  EXPECT_EQ(pool.capacity_bytes(), 10 * kUnit);
  absl::StatusOr<PoolLease> a = pool.Take(1, 1, "a");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->offset, 0u);
  EXPECT_EQ(a->bytes, kUnit);
  absl::StatusOr<PoolLease> b = pool.Take(2, 3 * kUnit, "b");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->offset, kUnit);
  ASSERT_TRUE(pool.Give(1, 0).ok());
  absl::StatusOr<PoolLease> c = pool.Take(2, kUnit, "c");  // the hole a left, first
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->offset, 0u);
  EXPECT_EQ(pool.stats().leased_bytes, 4 * kUnit);
  EXPECT_EQ(pool.stats().clients, 1u);
  EXPECT_TRUE(pool.Validate().ok()) << pool.Validate();
}

TEST(HostPoolLedgerTest, AFullPoolRefusesAndSaysWhatIsFree) {
  HostPoolLedger pool(4 * kUnit);
  ASSERT_TRUE(pool.Take(1, kUnit, "").ok());
  ASSERT_TRUE(pool.Take(1, kUnit, "").ok());
  ASSERT_TRUE(pool.Take(1, kUnit, "").ok());
  ASSERT_TRUE(pool.Give(1, kUnit).ok());  // free: [1, 2) and [3, 4): 2 units, no run of 2
  absl::StatusOr<PoolLease> big = pool.Take(2, 2 * kUnit, "");
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(big.status().message(), HasSubstr("the largest run 2097152"));
  EXPECT_EQ(pool.stats().refused, 1u);
  EXPECT_EQ(pool.Take(2, 0, "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool.Take(2, 5 * kUnit, "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(pool.Validate().ok()) << pool.Validate();
  HostPoolLedger empty(kUnit - 1);
  EXPECT_EQ(empty.Take(1, 1, "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(empty.Validate().ok());
}

TEST(HostPoolLedgerTest, OnlyTheHolderGivesALeaseBack) {
  HostPoolLedger pool(4 * kUnit);
  absl::StatusOr<PoolLease> a = pool.Take(1, kUnit, "kv");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(pool.Give(2, a->offset).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(pool.Give(1, a->offset + kUnit).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(pool.stats().leased_bytes, kUnit) << "a refused give changes nothing";
  ASSERT_TRUE(pool.Give(1, a->offset).ok());
  EXPECT_EQ(pool.Give(1, a->offset).code(), absl::StatusCode::kNotFound) << "given twice";
  EXPECT_TRUE(pool.Validate().ok()) << pool.Validate();
}

TEST(HostPoolLedgerTest, ADeadClientsLeasesAllComeBackAndMerge) {
  HostPoolLedger pool(8 * kUnit);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(pool.Take(i % 2 == 0 ? 7 : 9, kUnit, "").ok());
  EXPECT_EQ(pool.LeasesOf(7).size(), 2u);
  EXPECT_EQ(pool.GiveAll(7), 2 * kUnit);
  EXPECT_EQ(pool.GiveAll(7), 0u);
  EXPECT_TRUE(pool.LeasesOf(7).empty());
  EXPECT_EQ(pool.GiveAll(9), 2 * kUnit);
  const PoolStats s = pool.stats();
  EXPECT_EQ(s.leased_bytes, 0u);
  EXPECT_EQ(s.peak_bytes, 4 * kUnit);
  EXPECT_EQ(s.largest_free_bytes, 8 * kUnit) << "every run merged back into one";
  EXPECT_TRUE(pool.Validate().ok()) << pool.Validate();
}

// Random takes, gives and deaths of several clients against a simple model of who holds
// what: the invariants hold after every step, and the pool ends whole.
TEST(HostPoolLedgerTest, RandomOperationsKeepEveryInvariant) {
  std::mt19937 rng(20261129);
  HostPoolLedger pool(64 * kUnit);
  std::vector<std::vector<std::size_t>> held(5);
  for (int step = 0; step < 5000; ++step) {
    const ClientId c = rng() % held.size();
    const int op = static_cast<int>(rng() % 10);
    if (op < 6) {
      absl::StatusOr<PoolLease> l = pool.Take(c, 1 + rng() % (6 * kUnit), "t");
      if (l.ok()) held[c].push_back(l->offset);
      else ASSERT_EQ(l.status().code(), absl::StatusCode::kResourceExhausted) << l.status();
    } else if (op < 9 && !held[c].empty()) {
      const std::size_t i = rng() % held[c].size();
      ASSERT_TRUE(pool.Give(c, held[c][i]).ok());
      held[c].erase(held[c].begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      pool.GiveAll(c);
      held[c].clear();
    }
    ASSERT_TRUE(pool.Validate().ok()) << "step " << step << ": " << pool.Validate();
    std::size_t leases = 0;
    for (const auto& h : held) leases += h.size();
    ASSERT_EQ(pool.stats().leases, leases);
  }
  for (ClientId c = 0; c < held.size(); ++c) pool.GiveAll(c);
  EXPECT_EQ(pool.stats().largest_free_bytes, 64 * kUnit);
  EXPECT_GT(pool.stats().refused, 0u) << "the sequence reached a full pool";
}

}  // namespace
}  // namespace vmstash::node
