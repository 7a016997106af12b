// Note [Retired Ranges] (vmm/retired_ranges.h): a retired range gives its pages back, keeps
// its addresses from later mappings, and the oldest go when the bound is passed.
#include "vmm/retired_ranges.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace vmstash {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

char* MapWritten(std::size_t n) {
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  std::memset(p, 0x5a, n);
  return static_cast<char*>(p);
}

// Whether anything is mapped at the page holding `p` (a new mapping could not take it).
bool Taken(const void* p) {
  const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  void* at = reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(p) / page * page);
  void* got = mmap(at, page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
  if (got == MAP_FAILED) return errno == EEXIST;
  munmap(got, page);
  return got != at;  // a kernel without MAP_FIXED_NOREPLACE places it elsewhere when taken
}

// Resident bytes of [p, p + n) (p page-aligned).
std::size_t Resident(const void* p, std::size_t n) {
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> in((n + page - 1) / page);
  if (mincore(const_cast<void*>(p), n, in.data()) != 0) return ~std::size_t{0};
  std::size_t resident = 0;
  for (unsigned char c : in) resident += (c & 1) ? page : 0;
  return resident;
}

TEST(RetiredRangesTest, ARetiredRangeHoldsNoMemoryAndNoNewMappingTakesIt) {
  RetiredRanges retired(64 * kMiB, 4);
  char* p = MapWritten(4 * kMiB);
  ASSERT_NE(p, nullptr);
  ASSERT_EQ(Resident(p, 4 * kMiB), 4 * kMiB);
  ASSERT_TRUE(retired.Retire(p, 4 * kMiB).ok());
  EXPECT_EQ(Resident(p, 4 * kMiB), 0u) << "its pages went back";
  EXPECT_TRUE(Taken(p));
  EXPECT_TRUE(Taken(p + 4 * kMiB - 1));
  // Mappings of the same size made afterwards (munmap would have let the first one land here).
  for (int i = 0; i < 4; ++i) {
    char* q = MapWritten(4 * kMiB);
    ASSERT_NE(q, nullptr);
    EXPECT_TRUE(q + 4 * kMiB <= p || q >= p + 4 * kMiB) << "a new mapping took the retired range";
    munmap(q, 4 * kMiB);
  }
  EXPECT_EQ(retired.bytes(), 4 * kMiB);
  EXPECT_EQ(retired.ranges(), 1u);
  retired.Clear();
  EXPECT_FALSE(Taken(p)) << "cleared: unmapped";
  EXPECT_EQ(retired.ranges(), 0u);
}

TEST(RetiredRangesTest, TheOldestGoBeyondTheBoundTheNewestStays) {
  RetiredRanges retired(8 * kMiB, 3);
  std::vector<char*> maps;
  for (int i = 0; i < 4; ++i) {
    maps.push_back(MapWritten(2 * kMiB));
    ASSERT_NE(maps.back(), nullptr);
    ASSERT_TRUE(retired.Retire(maps.back(), 2 * kMiB).ok());
  }
  EXPECT_EQ(retired.ranges(), 3u) << "at most max_ranges";
  EXPECT_EQ(retired.bytes(), 6 * kMiB);
  EXPECT_FALSE(Taken(maps[0])) << "the oldest was unmapped";
  for (int i = 1; i < 4; ++i) EXPECT_TRUE(Taken(maps[i])) << i;
  // One range larger than the whole bound: kept, the others unmapped.
  char* big = MapWritten(16 * kMiB);
  ASSERT_NE(big, nullptr);
  ASSERT_TRUE(retired.Retire(big, 16 * kMiB).ok());
  EXPECT_EQ(retired.ranges(), 1u);
  EXPECT_EQ(retired.bytes(), 16 * kMiB);
  EXPECT_TRUE(Taken(big));
  for (int i = 1; i < 4; ++i) EXPECT_FALSE(Taken(maps[i])) << i;
  retired.Clear();
}

TEST(RetiredRangesTest, NothingToRetire) {
  RetiredRanges retired(8 * kMiB, 3);
  EXPECT_TRUE(retired.Retire(nullptr, 0).ok());
  EXPECT_EQ(retired.ranges(), 0u);
}

// Threads retiring at once (each release of a backup arena runs under its own tag's lock).
TEST(RetiredRangesTest, ConcurrentRetires) {
  RetiredRanges retired(64 * kMiB, 16);
  std::atomic<int> failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 25; ++i) {
        char* p = MapWritten(2 * kMiB);
        if (p == nullptr || !retired.Retire(p, 2 * kMiB).ok()) failed.fetch_add(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(retired.ranges(), 16u);
  EXPECT_EQ(retired.bytes(), 32 * kMiB);
  retired.Clear();
}

}  // namespace
}  // namespace vmstash
