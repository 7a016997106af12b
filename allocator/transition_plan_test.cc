// Tests of the pure pause/resume plans (transition_plan.h): each function alone, then a
// randomized round trip that executes the plans on a byte array standing in for device
// memory and checks that every backed-up byte comes back at its address.
#include "allocator/transition_plan.h"

#include <algorithm>
#include <cstdint>
#include <deque>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace vmstash {
namespace {

constexpr std::size_t kGran = 4096;

// Blocks with stable addresses for the plans to point at.
class Blocks {
 public:
  const Block* Add(DevicePtr address, std::size_t size_bytes, std::size_t requested_bytes) {
    Block& b = store_.emplace_back();
    b.address = address;
    b.size_bytes = size_bytes;
    b.requested_bytes = requested_bytes;
    b.allocated = true;
    return &b;
  }

 private:
  std::deque<Block> store_;
};

TEST(TransitionPlanTest, NormalizeRangesSortsMergesAndDropsEmpty) {
  EXPECT_EQ(NormalizeRanges({{300, 10}, {100, 50}, {120, 10}, {150, 5}, {500, 0}, {200, 1}}),
            (ByteRanges{{100, 55}, {200, 1}, {300, 10}}));
  EXPECT_TRUE(NormalizeRanges({}).empty());
  EXPECT_TRUE(NormalizeRanges({{7, 0}}).empty());
}

TEST(TransitionPlanTest, LayoutCopiesRequestedBytesInAddressOrderAtPageAlignedOffsets) {
  Blocks blocks;
  const Block* high = blocks.Add(0x20000, 8192, 5000);
  const Block* low = blocks.Add(0x10000, 1024, 100);
  const BackupLayout layout = PlanBackupLayout({high, low}, nullptr);
  EXPECT_EQ(layout.in_order, (std::vector<BackupExtent>{{0x10000, 100, 0}, {0x20000, 5000, kBackupAlignBytes}}));
  EXPECT_EQ(layout.arena_bytes, kBackupAlignBytes + 2 * kBackupAlignBytes);
  EXPECT_EQ(layout.by_block.at(low), (std::vector<BackupExtent>{{0x10000, 100, 0}}));
  EXPECT_EQ(layout.by_block.at(high), (std::vector<BackupExtent>{{0x20000, 5000, kBackupAlignBytes}}));
}

TEST(TransitionPlanTest, LayoutWithAHintCopiesOnlyTheHintedPartsOfLiveBlocks) {
  Blocks blocks;
  const Block* a = blocks.Add(0x1000, 0x1000, 0x1000);
  const Block* b = blocks.Add(0x3000, 0x1000, 0x800);
  const Block* c = blocks.Add(0x5000, 0x1000, 0x1000);
  // One range across a's tail and b's head (and the gap between), one past b's requested
  // bytes, one inside c twice (overlapping), one outside every block.
  const ByteRanges hint = {{0x1800, 0x1900}, {0x3900, 0x100}, {0x5100, 0x10}, {0x5108, 0x10}, {0x9000, 0x100}};
  const BackupLayout layout = PlanBackupLayout({c, a, b}, &hint);
  EXPECT_EQ(layout.by_block.at(a), (std::vector<BackupExtent>{{0x1800, 0x800, 0}}));
  EXPECT_EQ(layout.by_block.at(b), (std::vector<BackupExtent>{{0x3000, 0x100, kBackupAlignBytes}}));
  EXPECT_EQ(layout.by_block.at(c), (std::vector<BackupExtent>{{0x5100, 0x18, 2 * kBackupAlignBytes}}));
  EXPECT_EQ(layout.arena_bytes, 3 * kBackupAlignBytes);

  const ByteRanges nothing = {{0x9000, 0x100}};
  const BackupLayout empty = PlanBackupLayout({a, b}, &nothing);
  EXPECT_EQ(empty.arena_bytes, 0u);
  EXPECT_TRUE(empty.in_order.empty());
  EXPECT_TRUE(empty.by_block.at(a).empty());  // known to the plan, nothing to copy
}

TEST(TransitionPlanTest, StagesCoverEveryChunkOnceAndSplitABlockAcrossChunks) {
  Blocks blocks;
  // Chunks of 4 pages at 0x100000.. (given out of order); a block spans chunks 1 and 2,
  // chunk 3 holds no live byte.
  const std::vector<ChunkSpan> chunks = {
      {0x104000, 0x4000}, {0x100000, 0x4000}, {0x10c000, 0x4000}, {0x108000, 0x4000}};
  const Block* small = blocks.Add(0x100000, 0x1000, 0x1000);
  const Block* spanning = blocks.Add(0x106000, 0x4000, 0x4000);
  const BackupLayout layout = PlanBackupLayout({small, spanning}, nullptr);
  const std::vector<PauseStage> stages = PlanPauseStages(layout, chunks, 0x2000);
  ASSERT_EQ(stages.size(), 3u);
  EXPECT_EQ(stages[0].chunks, (std::vector<std::size_t>{1, 0}));  // 0x1000 + 0x2000 bytes: closed
  EXPECT_EQ(stages[0].copies,
            (std::vector<CopyStep>{{0x100000, 0, 0x1000}, {0x106000, kBackupAlignBytes, 0x2000}}));
  EXPECT_EQ(stages[0].bytes, 0x3000u);
  EXPECT_EQ(stages[1].chunks, (std::vector<std::size_t>{3}));
  EXPECT_EQ(stages[1].copies, (std::vector<CopyStep>{{0x108000, kBackupAlignBytes + 0x2000, 0x2000}}));
  EXPECT_EQ(stages[2].chunks, (std::vector<std::size_t>{2}));  // no live bytes: unmapped all the same
  EXPECT_TRUE(stages[2].copies.empty());
}

TEST(TransitionPlanTest, StageSizeIsAtLeastASixteenthOfTheBackup) {
  Blocks blocks;
  std::vector<ChunkSpan> chunks;
  std::vector<const Block*> live;
  for (int i = 0; i < 64; ++i) {
    const DevicePtr at = 0x1000000 + i * 0x10000;
    chunks.push_back({at, 0x10000});
    live.push_back(blocks.Add(at, 0x10000, 0x10000));
  }
  const BackupLayout layout = PlanBackupLayout(live, nullptr);
  const std::vector<PauseStage> stages = PlanPauseStages(layout, chunks, /*min_stage_bytes=*/1);
  EXPECT_EQ(stages.size(), kMaxPauseStages);
  for (const PauseStage& s : stages) EXPECT_EQ(s.chunks.size(), 4u);
  EXPECT_EQ(PlanPauseStages(layout, chunks, ~std::size_t{0}).size(), 1u);  // one stage: no pipelining
}

TEST(TransitionPlanTest, CoversRoundToGranulesMergeTouchingRunsAndNeverCrossSegments) {
  Blocks blocks;
  // Segment 0 lies above segment 1 (reservations need not come in address order).
  const std::vector<ChunkSpan> segments = {{0x800000, 0x100000}, {0x100000, 0x100000}};
  const std::vector<const Block*> live = {
      blocks.Add(0x800200, 0x200, 0x200),   // granule 0x800000
      blocks.Add(0x801000, 0x1000, 0x800),  // touches: merged
      blocks.Add(0x805000, 0x200, 0x200),   // a gap: new cover
      blocks.Add(0x1ff000, 0x1000, 0x1000), // segment 1, ends at its top
  };
  absl::StatusOr<std::vector<CoverSpan>> covers = PlanCovers(live, segments, kGran);
  ASSERT_TRUE(covers.ok()) << covers.status();
  ASSERT_EQ(covers->size(), 3u);
  EXPECT_EQ((*covers)[0].segment, 0u);
  EXPECT_EQ((*covers)[0].address, 0x800000u);
  EXPECT_EQ((*covers)[0].size_bytes, 0x2000u);
  EXPECT_EQ((*covers)[0].first_block, 0u);
  EXPECT_EQ((*covers)[0].end_block, 2u);
  EXPECT_EQ((*covers)[1].address, 0x805000u);
  EXPECT_EQ((*covers)[1].size_bytes, kGran);
  EXPECT_EQ((*covers)[2].segment, 1u);
  EXPECT_EQ((*covers)[2].address, 0x1ff000u);
  EXPECT_EQ((*covers)[2].first_block, 3u);
  EXPECT_EQ((*covers)[2].end_block, 4u);
  EXPECT_TRUE(PlanCovers({}, segments, kGran)->empty());
}

TEST(TransitionPlanTest, CoversRefuseBlocksOutsideTheSegmentsOrTheirOrder) {
  Blocks blocks;
  const std::vector<ChunkSpan> segments = {{0x100000, 0x10000}, {0x200000, 0x10000}};
  const Block* in0 = blocks.Add(0x100000, 0x1000, 0x1000);
  const Block* in1 = blocks.Add(0x200000, 0x1000, 0x1000);
  const Block* outside = blocks.Add(0x300000, 0x1000, 0x1000);
  const Block* straddling = blocks.Add(0x10f000, 0x2000, 0x2000);
  const Block* in0_low = blocks.Add(0x100000, 0x800, 0x800);
  const Block* in0_high = blocks.Add(0x108000, 0x800, 0x800);
  for (const std::vector<const Block*>& live : std::vector<std::vector<const Block*>>{
           {in0, outside}, {in1, in0}, {straddling}, {in0_high, in0_low}}) {
    absl::StatusOr<std::vector<CoverSpan>> covers = PlanCovers(live, segments, kGran);
    EXPECT_EQ(covers.status().code(), absl::StatusCode::kInternal);
  }
  EXPECT_TRUE(PlanCovers({in0_low, in0_high, in1}, segments, kGran).ok());
}

TEST(TransitionPlanTest, PiecesGrowGeometricallyUpToTheMaximumAndJoinAShortTail) {
  constexpr std::size_t M = kGran;
  EXPECT_EQ(PlanPieces(64 * M, 0, 16 * M, M), (std::vector<std::size_t>{64 * M}));
  EXPECT_EQ(PlanPieces(64 * M, 8 * M, 64 * M, M), (std::vector<std::size_t>{8 * M, 16 * M, 40 * M}));
  EXPECT_EQ(PlanPieces(64 * M, 8 * M, 16 * M, M), (std::vector<std::size_t>{8 * M, 16 * M, 16 * M, 16 * M, 8 * M}));
  EXPECT_EQ(PlanPieces(3 * M, 8 * M, 16 * M, M), (std::vector<std::size_t>{3 * M}));
  EXPECT_EQ(PlanPieces(4 * M, 1, 1, M), (std::vector<std::size_t>{M, M, M, M}));  // rounded up to a granule
  EXPECT_TRUE(PlanPieces(0, 8 * M, 16 * M, M).empty());
}

TEST(TransitionPlanTest, RestoreCopiesFollowThePiecesAndRefuseAPieceOutsideTheCovers) {
  Blocks blocks;
  const std::vector<ChunkSpan> segments = {{0x100000, 0x100000}};
  const Block* a = blocks.Add(0x100000, 0x3000, 0x3000);
  const Block* b = blocks.Add(0x103000, 0x1000, 0x100);
  const std::vector<const Block*> live = {a, b};
  const BackupLayout layout = PlanBackupLayout(live, nullptr);
  absl::StatusOr<std::vector<CoverSpan>> covers = PlanCovers(live, segments, kGran);
  ASSERT_TRUE(covers.ok());
  RestorePlanner planner(live, *covers, &layout.by_block);
  absl::StatusOr<std::vector<CopyStep>> first = planner.CopiesInto(0x100000, 0x2000);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(*first, (std::vector<CopyStep>{{0x100000, 0, 0x2000}}));
  absl::StatusOr<std::vector<CopyStep>> second = planner.CopiesInto(0x102000, 0x2000);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(*second, (std::vector<CopyStep>{{0x102000, 0x2000, 0x1000}, {0x103000, 0x3000, 0x100}}));
  EXPECT_EQ(planner.CopiesInto(0x500000, 0x1000).status().code(), absl::StatusCode::kInvalidArgument);
}

// Three possible segments of kSegmentBytes each, kSegmentStride apart.
constexpr DevicePtr kSegmentStride = 0x1000000;
constexpr std::size_t kSegmentBytes = 0x20000;

// One random tag: segments (in random address order), chunks tiling each segment's used
// part, live blocks with random requested bytes, and maybe a hint.
struct RandomTag {
  std::vector<ChunkSpan> segments;
  std::vector<ChunkSpan> chunks;
  std::vector<const Block*> live;  // segment by segment, address order inside
  ByteRanges hint;
  bool use_hint = false;
};

RandomTag MakeRandomTag(std::mt19937_64& rng, Blocks& blocks) {
  RandomTag t;
  const int n_segments = 1 + static_cast<int>(rng() % 3);
  std::vector<DevicePtr> bases = {kSegmentStride, 2 * kSegmentStride, 3 * kSegmentStride};
  std::shuffle(bases.begin(), bases.end(), rng);
  for (int s = 0; s < n_segments; ++s) {
    const DevicePtr base = bases[s];
    t.segments.push_back({base, kSegmentBytes});
    DevicePtr at = base;
    const int n_chunks = 1 + static_cast<int>(rng() % 4);
    for (int c = 0; c < n_chunks; ++c) {
      const std::size_t size = kGran * (1 + rng() % 4);
      t.chunks.push_back({at, size});
      at += size;
    }
    for (DevicePtr b = base; b < at;) {  // blocks tile the chunks, some live
      const std::size_t size = std::min<std::size_t>(512 * (1 + rng() % 40), at - b);
      if (rng() % 3 != 0) t.live.push_back(blocks.Add(b, size, 1 + rng() % size));
      b += size;
    }
  }
  t.use_hint = rng() % 2 == 0;
  for (int i = 0; t.use_hint && i < 10; ++i) {
    const ChunkSpan& seg = t.segments[rng() % t.segments.size()];
    t.hint.emplace_back(seg.address + rng() % 0x10000, rng() % 0x3000);
  }
  std::shuffle(t.chunks.begin(), t.chunks.end(), rng);
  return t;
}

TEST(TransitionPlanTest, RandomRoundTripsRestoreEveryBackedUpByteAndOnlyThose) {
  std::mt19937_64 rng(20261123);
  for (int iteration = 0; iteration < 300; ++iteration) {
    Blocks blocks;
    const RandomTag t = MakeRandomTag(rng, blocks);
    const BackupLayout layout = PlanBackupLayout(t.live, t.use_hint ? &t.hint : nullptr);
    // "Device memory": the three possible segments side by side.
    auto index = [](DevicePtr va) { return (va / kSegmentStride - 1) * kSegmentBytes + va % kSegmentStride; };
    std::vector<std::uint8_t> device(3 * kSegmentBytes);
    for (std::size_t i = 0; i < device.size(); ++i) {
      device[i] = static_cast<std::uint8_t>((i * 131 + iteration * 7) ^ (i >> 8));
    }
    const std::vector<std::uint8_t> before = device;
    std::vector<std::uint8_t> arena(layout.arena_bytes, 0);
    std::vector<int> copied_times(device.size(), 0);

    // Pause: every chunk in exactly one stage, every copy inside its stage's chunks.
    const std::vector<PauseStage> stages = PlanPauseStages(layout, t.chunks, kGran * (1 + rng() % 8));
    std::vector<int> chunk_seen(t.chunks.size(), 0);
    for (const PauseStage& stage : stages) {
      std::size_t bytes = 0;
      for (std::size_t c : stage.chunks) ++chunk_seen[c];
      for (const CopyStep& copy : stage.copies) {
        ASSERT_TRUE(std::any_of(stage.chunks.begin(), stage.chunks.end(), [&](std::size_t c) {
          return copy.device >= t.chunks[c].address &&
                 copy.device + copy.size_bytes <= t.chunks[c].address + t.chunks[c].size_bytes;
        }));
        ASSERT_LE(copy.arena_offset + copy.size_bytes, arena.size());
        for (std::size_t k = 0; k < copy.size_bytes; ++k) {
          arena[copy.arena_offset + k] = device[index(copy.device + k)];
          ++copied_times[index(copy.device + k)];
        }
        bytes += copy.size_bytes;
      }
      EXPECT_EQ(stage.bytes, bytes);
    }
    EXPECT_LE(stages.size(), kMaxPauseStages + 1);
    for (int seen : chunk_seen) ASSERT_EQ(seen, 1);
    std::fill(device.begin(), device.end(), 0xEE);  // memory released

    // Expected: the bytes of every extent, each copied exactly once, and nothing else.
    std::vector<bool> backed(device.size(), false);
    for (const BackupExtent& e : layout.in_order) {
      ASSERT_EQ(e.arena_offset % kBackupAlignBytes, 0u);
      for (std::size_t k = 0; k < e.size_bytes; ++k) backed[index(e.address + k)] = true;
    }
    std::size_t wrong_copies = 0;
    for (std::size_t i = 0; i < device.size(); ++i) wrong_copies += copied_times[i] != (backed[i] ? 1 : 0);
    ASSERT_EQ(wrong_copies, 0u) << "iteration " << iteration;

    // Resume: covers over the live blocks, pieces tiling each cover, restore copies.
    absl::StatusOr<std::vector<CoverSpan>> covers = PlanCovers(t.live, t.segments, kGran);
    ASSERT_TRUE(covers.ok()) << covers.status();
    RestorePlanner planner(t.live, *covers, &layout.by_block);
    std::vector<bool> mapped(device.size(), false);
    for (const CoverSpan& cover : *covers) {
      DevicePtr va = cover.address;
      for (std::size_t size : PlanPieces(cover.size_bytes, kGran * (rng() % 3), kGran * 4, kGran)) {
        ASSERT_EQ(size % kGran, 0u);
        for (std::size_t k = 0; k < size; ++k) mapped[index(va + k)] = true;
        absl::StatusOr<std::vector<CopyStep>> copies = planner.CopiesInto(va, size);
        ASSERT_TRUE(copies.ok()) << copies.status();
        for (const CopyStep& copy : *copies) {
          ASSERT_GE(copy.device, va);
          ASSERT_LE(copy.device + copy.size_bytes, va + size);
          for (std::size_t k = 0; k < copy.size_bytes; ++k) {
            device[index(copy.device + k)] = arena[copy.arena_offset + k];
          }
        }
        va += size;
      }
      ASSERT_EQ(va, cover.address + cover.size_bytes);
    }
    std::size_t unmapped = 0, lost = 0;
    for (const Block* b : t.live) {
      for (std::size_t k = 0; k < b->size_bytes; ++k) unmapped += !mapped[index(b->address + k)];
    }
    for (std::size_t i = 0; i < device.size(); ++i) lost += backed[i] && device[i] != before[i];
    ASSERT_EQ(unmapped, 0u) << "iteration " << iteration;
    ASSERT_EQ(lost, 0u) << "iteration " << iteration;
  }
}

// Issue 28 (review of round 3): a hint {address, SIZE_MAX} ("live from here on") wrapped
// past the end of the address space, was skipped, and the block was backed up with 0
// bytes: lost at the resume.
TEST(NormalizeRangesTest, ARangeRunningPastTheEndOfMemoryIsCutThereNotWrapped) {
  const DevicePtr a = 0x7f0000000000;
  const ByteRanges r = NormalizeRanges({{a, ~std::size_t{0}}, {a - 100, 50}});
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0], (std::pair<DevicePtr, std::size_t>{a - 100, 50}));
  EXPECT_EQ(r[1], (std::pair<DevicePtr, std::size_t>{a, ~DevicePtr{0} - a}));
  Block b;
  b.address = a + 4096;
  b.requested_bytes = 1 << 20;
  const ByteRanges hint = {{a, ~std::size_t{0}}};
  const BackupLayout layout = PlanBackupLayout({&b}, &hint);
  ASSERT_EQ(layout.by_block.at(&b).size(), 1u);
  EXPECT_EQ(layout.by_block.at(&b)[0].size_bytes, std::size_t{1} << 20);
}

}  // namespace
}  // namespace vmstash
