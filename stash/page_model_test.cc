// The paged stash reference model against its functional scenarios that need no
// GPU (docs/architecture.md §6): zero tail, 64-bit offsets, and the other CPU scenarios below.
#include "stash/page_model.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace vmstash::stash {
namespace {

constexpr std::uint64_t kRowBytes = 24;
constexpr std::uint32_t kP = 8;

std::vector<std::uint8_t> Rows(std::uint64_t n, std::uint8_t seed) {
  std::vector<std::uint8_t> v(n * kRowBytes);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::uint8_t>(seed * 31 + i * 7);
  return v;
}

PageModel Make(std::uint64_t device_pages, std::uint64_t host_pages = 0) {
  ArenaSpec spec;
  spec.row_bytes = kRowBytes;
  spec.page_rows = kP;
  spec.capacity_pages[0] = device_pages;
  spec.capacity_pages[1] = host_pages;
  return *PageModel::Create(spec);
}

void ExpectBalanced(const PageModel& m, int tier) {
  std::vector<std::uint32_t> free = m.FreeList(tier);
  EXPECT_EQ(m.tail(tier) - m.head(tier), m.spec().capacity_pages[tier]);
  std::sort(free.begin(), free.end());
  std::vector<std::uint32_t> all(m.spec().capacity_pages[tier]);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(free, all) << "the free list is a permutation of 0..cap-1";
}

TEST(PageModelTest, T1RoundTripsEveryCountReleasedOutOfOrder) {
  const std::uint64_t max_rows = 5 * kP + 3;
  PageModel m = Make(64);
  const std::uint64_t counts[] = {0, 1, kP - 1, kP, kP + 1, max_rows};
  std::vector<Handle> handles(6);
  std::vector<std::vector<std::uint8_t>> srcs;
  for (int i = 0; i < 6; ++i) {
    srcs.push_back(Rows(counts[i], static_cast<std::uint8_t>(i)));
    ASSERT_TRUE(m.Stash(srcs[i].data(), counts[i], max_rows, &handles[i]).ok());
    EXPECT_EQ(handles[i].status, HandleStatus::kDevice);
  }
  EXPECT_EQ(m.free_pages(0), 64u - (0 + 1 + 1 + 1 + 2 + 6));
  for (int i : {3, 0, 5, 1, 4, 2}) {  // not LIFO
    std::vector<std::uint8_t> dst(max_rows * kRowBytes, 0xee);
    ASSERT_TRUE(m.Restore(&handles[i], dst.data(), max_rows, /*zero_tail=*/false).ok());
    EXPECT_TRUE(std::equal(srcs[i].begin(), srcs[i].end(), dst.begin())) << "count " << counts[i];
    if (counts[i] < max_rows) {
      EXPECT_EQ(dst[counts[i] * kRowBytes], 0xee) << "rows past the count are left alone without zero_tail";
    }
  }
  ExpectBalanced(m, 0);
  EXPECT_FALSE(m.flags().overflow);
  EXPECT_EQ(m.flags().peak_pages[0], 11u);
}

TEST(PageModelTest, T2OverflowIsStickyWritesNothingAndResetClearsIt) {
  PageModel m = Make(4);
  auto a = Rows(3 * kP, 1), b = Rows(2 * kP, 2), c = Rows(1, 3);
  Handle ha, hb, hc;
  ASSERT_TRUE(m.Stash(a.data(), 3 * kP, 3 * kP, &ha).ok());
  const std::uint64_t head = m.head(0);
  ASSERT_TRUE(m.Stash(b.data(), 2 * kP, 2 * kP, &hb).ok());  // needs 2, 1 free
  EXPECT_TRUE(m.flags().overflow);
  EXPECT_EQ(hb.status, HandleStatus::kOverflowed);
  EXPECT_EQ(m.head(0), head);
  EXPECT_EQ(m.flags().last_failed_pages, 2u);
  ASSERT_TRUE(m.Stash(c.data(), 1, 1, &hc).ok());  // would fit, but overflow is sticky
  EXPECT_EQ(hc.status, HandleStatus::kOverflowed);
  EXPECT_EQ(m.head(0), head);
  std::vector<std::uint8_t> dst(3 * kP * kRowBytes, 0x11);
  ASSERT_TRUE(m.Restore(&ha, dst.data(), 3 * kP, /*zero_tail=*/true).ok());  // a no-op, tail zeroed
  EXPECT_TRUE(std::all_of(dst.begin(), dst.end(), [](std::uint8_t v) { return v == 0; }));
  EXPECT_EQ(m.tail(0), 4u) << "under overflow nothing goes back";
  m.Reset();
  EXPECT_FALSE(m.flags().overflow);
  ExpectBalanced(m, 0);
  Handle again;
  ASSERT_TRUE(m.Stash(b.data(), 2 * kP, 2 * kP, &again).ok());
  EXPECT_EQ(again.status, HandleStatus::kDevice);
}

TEST(PageModelTest, T3WholeTensorsSpillToTheHostTier) {
  PageModel m = Make(2, 8);
  auto a = Rows(kP, 1), b = Rows(3 * kP, 2);
  Handle ha, hb;
  ASSERT_TRUE(m.Stash(a.data(), kP, 4 * kP, &ha).ok());
  ASSERT_TRUE(m.Stash(b.data(), 3 * kP, 4 * kP, &hb).ok());  // 1 device page left: all 3 go to the host
  EXPECT_EQ(ha.status, HandleStatus::kDevice);
  EXPECT_EQ(hb.status, HandleStatus::kHost);
  EXPECT_TRUE(m.flags().host_spill);
  EXPECT_FALSE(m.flags().overflow);
  EXPECT_EQ(m.free_pages(0), 1u);
  EXPECT_EQ(m.free_pages(1), 5u);
  std::vector<std::uint8_t> dst(4 * kP * kRowBytes);
  ASSERT_TRUE(m.Restore(&hb, dst.data(), 4 * kP, true).ok());
  EXPECT_TRUE(std::equal(b.begin(), b.end(), dst.begin()));
  ASSERT_TRUE(m.Restore(&ha, dst.data(), 4 * kP, true).ok());
  ExpectBalanced(m, 0);
  ExpectBalanced(m, 1);
}

TEST(PageModelTest, T5ZeroTailAndSixtyFourBitOffsets) {
  PageModel m = Make(8);
  auto a = Rows(kP + 3, 5);
  Handle h;
  ASSERT_TRUE(m.Stash(a.data(), kP + 3, 4 * kP, &h).ok());
  std::vector<std::uint8_t> dst(4 * kP * kRowBytes, 0x77);
  ASSERT_TRUE(m.Restore(&h, dst.data(), 4 * kP, /*zero_tail=*/true).ok());
  EXPECT_TRUE(std::equal(a.begin(), a.end(), dst.begin()));
  EXPECT_TRUE(std::all_of(dst.begin() + a.size(), dst.end(), [](std::uint8_t v) { return v == 0; }));
  // Page 40000 of 64-row pages of 7168-byte rows lies past 2^34 bytes; 32-bit math would wrap.
  EXPECT_EQ(PageRowOffset(40000, 64, 63, 7168), (std::uint64_t{40000} * 64 + 63) * 7168);
  EXPECT_GT(PageRowOffset(40000, 64, 63, 7168), std::uint64_t{1} << 34);
  // An arena of more than 2^32 pages-worth of ids is refused; 2^31 rows of state are fine
  // when the bytes are not modelled.
  ArenaSpec big;
  big.row_bytes = 7168;
  big.page_rows = 64;
  big.capacity_pages[0] = std::uint64_t{1} << 33;
  EXPECT_EQ(PageModel::Create(big).status().code(), absl::StatusCode::kInvalidArgument);
  big.capacity_pages[0] = 1 << 20;  // 2^26 rows x 7 KiB = 448 GiB of arena, state only
  big.keep_data = false;
  absl::StatusOr<PageModel> huge = PageModel::Create(big);
  ASSERT_TRUE(huge.ok());
  Handle hh;
  ASSERT_TRUE(huge->Stash(nullptr, std::uint64_t{1} << 25, std::uint64_t{1} << 25, &hh).ok());
  EXPECT_EQ(huge->free_pages(0), (1u << 20) - (1u << 19));
}

TEST(PageModelTest, T8ProfilingSuggestsPageRoundedCapacityThatReplaysWithoutOverflow) {
  PageModel profiler = Make(1000);
  profiler.StartProfiling();
  std::mt19937 rng(7);
  std::vector<std::uint64_t> schedule;
  for (int i = 0; i < 40; ++i) schedule.push_back(std::uniform_int_distribution<std::uint64_t>(0, 5 * kP)(rng));
  // 1F1B-like: 4 in flight, released out of order.
  auto run = [&](PageModel& m) {
    std::vector<Handle> live;
    for (std::uint64_t rows : schedule) {
      Handle h;
      EXPECT_TRUE(m.Stash(nullptr, rows, 5 * kP, &h).ok());
      live.push_back(h);
      if (live.size() == 4) {
        EXPECT_TRUE(m.Discard(&live[1]).ok());
        live.erase(live.begin() + 1);
      }
    }
    for (Handle& h : live) EXPECT_TRUE(m.Discard(&h).ok());
  };
  run(profiler);
  const std::uint64_t peak = profiler.profiled_peak_pages();
  ASSERT_GT(peak, 0u);
  EXPECT_EQ(profiler.SuggestCapacity(1.1), static_cast<std::uint64_t>(std::ceil(1.1 * peak)));
  PageModel sized = Make(profiler.SuggestCapacity(1.0));
  run(sized);
  EXPECT_FALSE(sized.flags().overflow) << "a capacity of the page-rounded peak replays the profile";
  ExpectBalanced(sized, 0);
}

TEST(PageModelTest, T9DiscardReturnsPagesWithoutCopying) {
  PageModel m = Make(8);
  Handle h;
  ASSERT_TRUE(m.Stash(nullptr, 3 * kP, 3 * kP, &h).ok());
  EXPECT_EQ(m.free_pages(0), 5u);
  ASSERT_TRUE(m.Discard(&h).ok());
  EXPECT_EQ(h.status, HandleStatus::kEmpty);
  ExpectBalanced(m, 0);
}

TEST(PageModelTest, MisuseIsAnErrorNotACrash) {
  ArenaSpec bad;
  bad.row_bytes = 8;
  bad.page_rows = 48;  // not a power of two
  bad.capacity_pages[0] = 4;
  EXPECT_EQ(PageModel::Create(bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad.page_rows = 64;
  bad.capacity_pages[0] = 0;
  EXPECT_EQ(PageModel::Create(bad).status().code(), absl::StatusCode::kInvalidArgument);
  PageModel m = Make(4);
  Handle h;
  EXPECT_EQ(m.Stash(nullptr, 10, 5, &h).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(m.Stash(nullptr, 5, 5, &h).ok());
  EXPECT_EQ(m.Stash(nullptr, 5, 5, &h).code(), absl::StatusCode::kFailedPrecondition);  // still holds pages
  Handle empty;
  EXPECT_EQ(m.Restore(&empty, nullptr, 5, false).code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace vmstash::stash
