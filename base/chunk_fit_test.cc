// FitChunks (chunk_fit.h): the rule, case by case, and its invariants over many random inputs.
#include "base/chunk_fit.h"

#include <algorithm>
#include <random>

#include "gtest/gtest.h"

namespace vmstash {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

std::vector<FitChunk> Sizes(std::initializer_list<std::size_t> mib) {
  std::vector<FitChunk> out;
  for (std::size_t m : mib) out.push_back({m * kMiB, true});
  return out;
}

TEST(ChunkFit, BestFitLargestFirst) {
  // 8 goes to the 8 gap (the smallest that holds it), 4 and 4 to the 10 gap, 2 to what is left of it.
  const ChunkFit fit = FitChunks(Sizes({4, 8, 2, 4}), {{10 * kMiB, 0, false}, {8 * kMiB, 0, false}});
  EXPECT_EQ(fit.placed[1], (std::vector<int>{1}));
  EXPECT_EQ(fit.placed[0], (std::vector<int>{0, 3, 2}));
  EXPECT_EQ(fit.open_bytes, (std::vector<std::size_t>{0, 0}));
  EXPECT_TRUE(fit.unused.empty());
}

TEST(ChunkFit, TwoGapsOfFourTakeTwoChunksOfFourNotOneOfEight) {
  const ChunkFit fit = FitChunks(Sizes({8, 4, 4}), {{4 * kMiB, 0, false}, {4 * kMiB, 0, false}});
  EXPECT_EQ(fit.placed[0], (std::vector<int>{1}));
  EXPECT_EQ(fit.placed[1], (std::vector<int>{2}));
  EXPECT_EQ(fit.unused, (std::vector<int>{0}));
}

TEST(ChunkFit, AGapTakesTheSmallestChunkThatOverhangsItWithinItsAllowance) {
  // A 6 MiB gap that may be overrun by 2 MiB: the 8 fits (the 16 would overrun by 10).
  const ChunkFit fit = FitChunks(Sizes({16, 8}), {{6 * kMiB, 2 * kMiB, false}});
  EXPECT_EQ(fit.placed[0], (std::vector<int>{1}));
  EXPECT_EQ(fit.overhang[0], 2 * kMiB);
  EXPECT_EQ(fit.open_bytes[0], 0u);
  EXPECT_EQ(fit.unused, (std::vector<int>{0}));
  // Without the allowance, nothing fits.
  const ChunkFit none = FitChunks(Sizes({16, 8}), {{6 * kMiB, 0, false}});
  EXPECT_TRUE(none.placed[0].empty());
  EXPECT_EQ(none.open_bytes[0], 6 * kMiB);
  EXPECT_EQ(none.unused, (std::vector<int>{0, 1}));
}

TEST(ChunkFit, AnOverhangingChunkComesLastAfterTheChunksThatFitWhole) {
  const ChunkFit fit = FitChunks(Sizes({4, 4}), {{6 * kMiB, 2 * kMiB, false}});
  EXPECT_EQ(fit.placed[0], (std::vector<int>{0, 1}));
  EXPECT_EQ(fit.overhang[0], 2 * kMiB);
}

TEST(ChunkFit, StrictGapsTakeOnlyChunksThatMayGoAnywhere) {
  std::vector<FitChunk> chunks = {{4 * kMiB, false}, {4 * kMiB, true}};
  const ChunkFit fit = FitChunks(chunks, {{4 * kMiB, 0, true}, {4 * kMiB, 0, false}});
  EXPECT_EQ(fit.placed[0], (std::vector<int>{1}));  // the strict gap: the chunk that may go anywhere
  EXPECT_EQ(fit.placed[1], (std::vector<int>{0}));  // the other went first, and only here
}

TEST(ChunkFit, EmptyInputsAndZeroSizedChunks) {
  const ChunkFit empty = FitChunks({}, {});
  EXPECT_TRUE(empty.placed.empty());
  EXPECT_TRUE(empty.unused.empty());
  const ChunkFit zero = FitChunks({{0, true}}, {{4 * kMiB, 4 * kMiB, false}});
  EXPECT_TRUE(zero.placed[0].empty());
  EXPECT_EQ(zero.unused, (std::vector<int>{0}));
  const ChunkFit no_gaps = FitChunks(Sizes({2}), {});
  EXPECT_EQ(no_gaps.unused, (std::vector<int>{0}));
}

// Over random inputs: every chunk is placed at most once, or is unused; a gap is never
// overfilled beyond its allowance, and only its last chunk overhangs; strict gaps hold
// only chunks that may go anywhere; no unused chunk would fit whole into what a gap left
// open (the fit is maximal in that sense).
TEST(ChunkFit, InvariantsOverRandomInputs) {
  std::mt19937 rng(7);
  for (int round = 0; round < 2000; ++round) {
    std::vector<FitChunk> chunks(rng() % 12);
    for (FitChunk& c : chunks) c = {(rng() % 9) * kMiB, rng() % 3 != 0};
    std::vector<FitGap> gaps(rng() % 6);
    for (FitGap& g : gaps) g = {(1 + rng() % 20) * kMiB, (rng() % 4) * kMiB, rng() % 3 == 0};
    const ChunkFit fit = FitChunks(chunks, gaps);
    ASSERT_EQ(fit.placed.size(), gaps.size());
    std::vector<int> seen(chunks.size(), 0);
    for (int c : fit.unused) ++seen[c];
    for (std::size_t g = 0; g < gaps.size(); ++g) {
      std::size_t sum = 0;
      for (int c : fit.placed[g]) {
        ++seen[c];
        sum += chunks[c].size_bytes;
        if (gaps[g].strict) EXPECT_TRUE(chunks[c].anywhere);
        EXPECT_GT(chunks[c].size_bytes, 0u);
      }
      EXPECT_LE(fit.overhang[g], gaps[g].max_overhang_bytes);
      EXPECT_EQ(sum, gaps[g].size_bytes - fit.open_bytes[g] + fit.overhang[g]);
      if (fit.overhang[g] > 0) {
        EXPECT_EQ(fit.open_bytes[g], 0u);
        EXPECT_GT(chunks[fit.placed[g].back()].size_bytes, fit.overhang[g]);
      }
      for (int c : fit.unused) {
        const bool allowed = chunks[c].anywhere || !gaps[g].strict;
        if (allowed && chunks[c].size_bytes > 0) EXPECT_GT(chunks[c].size_bytes, fit.open_bytes[g]);
      }
    }
    for (int n : seen) EXPECT_EQ(n, 1);
    EXPECT_TRUE(std::is_sorted(fit.unused.begin(), fit.unused.end()));
  }
}

}  // namespace
}  // namespace vmstash
