#include "allocator/free_index.h"

#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace vmstash {
namespace {

TEST(FreeIndexTest, ClassesAreMonotonic) {
  int pf = 0, ps = 0;
  for (std::size_t size = 512; size < (std::size_t{1} << 40); size += size / 7 + 512) {
    int f, s;
    FreeIndex::Classify(size, &f, &s);
    ASSERT_LT(f, FreeIndex::kFirstLevels);
    ASSERT_TRUE(f > pf || (f == pf && s >= ps)) << size;
    pf = f;
    ps = s;
  }
}

TEST(FreeIndexTest, FindReturnsAFittingBlockWheneverOneExists) {
  std::mt19937_64 rng(7);
  std::vector<Block> blocks(2000);
  FreeIndex index(nullptr);
  for (Block& b : blocks) {
    b.size_bytes = 512 * (1 + rng() % 20000);
    index.Insert(&b);
  }
  EXPECT_EQ(index.count(), blocks.size());
  for (int i = 0; i < 2000; ++i) {
    std::size_t want = 512 * (1 + rng() % 22000);
    Block* found = index.Find(want);
    std::size_t best = 0;
    for (const Block& b : blocks) {
      if (b.index == &index && b.size_bytes >= want && (best == 0 || b.size_bytes < best)) best = b.size_bytes;
    }
    if (best == 0) {
      EXPECT_EQ(found, nullptr) << want;
    } else {
      ASSERT_NE(found, nullptr) << want;
      EXPECT_GE(found->size_bytes, want);
      // Good fit: within one second-level class (1/16) of the best fit, or the best.
      EXPECT_LE(found->size_bytes, best + best / 8 + 8192) << want;
    }
    if (i % 3 == 0 && found != nullptr) index.Remove(found);
  }
}

TEST(FreeIndexTest, ExactFitIsPreferredAndRemoveUpdatesBitmaps) {
  Block a, b, c;
  a.size_bytes = 4096;
  b.size_bytes = 1 << 20;
  c.size_bytes = 3 << 20;
  FreeIndex index(nullptr);
  index.Insert(&a);
  index.Insert(&b);
  index.Insert(&c);
  EXPECT_EQ(index.Find(4096), &a);
  EXPECT_EQ(index.Find(1 << 20), &b);
  EXPECT_EQ(index.Find((1 << 20) + 512), &c);
  index.Remove(&c);
  EXPECT_EQ(index.Find((1 << 20) + 512), nullptr);
  EXPECT_EQ(index.bytes(), 4096u + (1 << 20));
  index.Remove(&a);
  index.Remove(&b);
  EXPECT_EQ(index.Find(512), nullptr);
  EXPECT_EQ(index.count(), 0u);
}

}  // namespace
}  // namespace vmstash
