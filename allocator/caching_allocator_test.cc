#include "allocator/caching_allocator.h"

#include <cstdio>
#include <set>
#include <utility>
#include <vector>

#include "allocator/testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

using ::testing::HasSubstr;

// The tests of the allocator's own logic on the simulator; what must also hold on a GPU
// (reuse of freed blocks among them) is the conformance suite's (allocator_conformance.h).
class CachingAllocatorTest : public testing::SimAllocatorTest {
 protected:
  void SetUp() override { Make(SimDriverOptions{1, 1 * kGiB, 2 * kMiB, {}}); }
  void Make(SimDriverOptions sim_options, AllocatorOptions options = {}) {
    options.validate_each_op = true;
    MakeAllocator(std::move(sim_options), options);
  }
  DevicePtr Alloc(std::size_t size, Stream stream = nullptr, TagId tag = kDefaultTag) {
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(size, stream, tag);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *p : 0;
  }
  void Free(DevicePtr p) { ASSERT_TRUE(alloc_->Free(p).ok()); }
  const TagStats& Tag(const AllocatorStats& s, absl::string_view name) {
    for (const TagStats& t : s.tags) {
      if (t.name == name) return t;
    }
    static TagStats none;
    return none;
  }
};

TEST_F(CachingAllocatorTest, SplitAndMergeCoalesceNeighbours) {
  DevicePtr a = Alloc(4096), b = Alloc(4096), c = Alloc(4096), d = Alloc(4096);
  EXPECT_EQ(b, a + 4096);
  EXPECT_EQ(c, b + 4096);
  EXPECT_EQ(d, c + 4096);
  Free(b);
  Free(c);
  // b and c merged into one 8 KiB block: an 8 KiB request takes exactly that hole.
  EXPECT_EQ(Alloc(8192), b);
  Free(a);
  Free(b);
  Free(d);
  // Everything merged back into the chunk: one free block in one small segment.
  Snapshot snap = alloc_->TakeSnapshot();
  ASSERT_EQ(snap.segments.size(), 1u);
  ASSERT_EQ(snap.segments[0].blocks.size(), 1u);
  EXPECT_FALSE(snap.segments[0].blocks[0].live);
  EXPECT_EQ(snap.segments[0].blocks[0].size_bytes, 2 * kMiB);
}

TEST_F(CachingAllocatorTest, SmallAndLargeRequestsUseSeparateHeaps) {
  DevicePtr small = Alloc(kMiB);
  DevicePtr large = Alloc(kMiB + 512);
  Snapshot snap = alloc_->TakeSnapshot();
  std::set<std::string> heaps;
  for (const SegmentSnapshot& seg : snap.segments) heaps.insert(seg.heap);
  EXPECT_EQ(heaps, (std::set<std::string>{"small", "large"}));
  EXPECT_GE(large - small > 0 ? large - small : small - large, 2 * kMiB);
  AllocatorStats s = alloc_->Stats();
  // Small heap: one 2 MiB chunk; large heap: min_chunk (20 MiB).
  EXPECT_EQ(s.total.reserved_bytes.current, static_cast<std::int64_t>(22 * kMiB));
  Free(small);
  Free(large);
}

TEST_F(CachingAllocatorTest, LargeHeapGrowsGeometricallySoAHugePoolIsTensOfChunks) {
  Make(SimDriverOptions{1, 80 * kGiB, 2 * kMiB, {}});
  std::vector<DevicePtr> blocks;
  for (int i = 0; i < 64; ++i) blocks.push_back(Alloc(kGiB));
  AllocatorStats s = alloc_->Stats();
  EXPECT_LE(s.total.chunks, 80);
  EXPECT_GE(s.total.chunks, 10);
  // Over-reservation stays bounded (growth is 1/16 of the heap).
  EXPECT_LE(s.total.reserved_bytes.current, static_cast<std::int64_t>(64 * kGiB + 64 * kGiB / 16 + 2 * kGiB));
  for (DevicePtr p : blocks) Free(p);
  blocks.clear();
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  // Grown in small steps (8 MiB blocks), 64 GiB is still about a hundred chunks.
  for (int i = 0; i < 64 * 128; ++i) blocks.push_back(Alloc(8 * kMiB));
  s = alloc_->Stats();
  std::printf("64 GiB in 8 MiB blocks: %lld chunks\n", static_cast<long long>(s.total.chunks));
  EXPECT_LE(s.total.chunks, 130);
  for (DevicePtr p : blocks) Free(p);
  // A single request larger than max_chunk gets one chunk of its own size.
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  DevicePtr big = Alloc(5 * kGiB);
  EXPECT_EQ(alloc_->Stats().total.chunks, 1);
  Free(big);
}

TEST_F(CachingAllocatorTest, FreeTailIsExtendedInsteadOfMappingAWholeNewBlock) {
  // 30 MiB in a 20 MiB first chunk cannot fit; the heap maps the missing part right after.
  DevicePtr a = Alloc(10 * kMiB);
  Free(a);
  DevicePtr b = Alloc(30 * kMiB);
  EXPECT_EQ(b, a);  // same start: the free 20 MiB was extended
  AllocatorStats s = alloc_->Stats();
  EXPECT_EQ(s.total.chunks, 2);
  Free(b);
}

TEST_F(CachingAllocatorTest, TagsNeverShareAChunk) {
  TagId kv = *InternTag("kv_cache");
  TagId w = *InternTag("weights");
  ASSERT_TRUE(alloc_->CreateTag(w, Policy::kBackup).ok());
  DevicePtr a = Alloc(4096, nullptr, kv);
  DevicePtr b = Alloc(4096, nullptr, w);
  DevicePtr c;
  {
    ScopedTag scope(kv);
    c = *alloc_->Allocate(4096, nullptr);
  }
  EXPECT_EQ(c, a + 4096);
  Snapshot snap = alloc_->TakeSnapshot();
  for (const SegmentSnapshot& x : snap.segments) {
    for (const SegmentSnapshot& y : snap.segments) {
      if (&x == &y) continue;
      EXPECT_TRUE(x.address + x.va_bytes <= y.address || y.address + y.va_bytes <= x.address);
    }
  }
  EXPECT_EQ(*alloc_->TagPolicy(w), Policy::kBackup);
  EXPECT_EQ(*alloc_->TagPolicy(kv), Policy::kDiscard);  // implicit creation
  AllocatorStats s = alloc_->Stats();
  EXPECT_EQ(Tag(s, "kv_cache").allocated_bytes.current, 8192);
  EXPECT_EQ(Tag(s, "weights").allocated_bytes.current, 4096);
  EXPECT_EQ(Tag(s, "weights").policy, Policy::kBackup);
  Free(a);
  Free(b);
  Free(c);
}

TEST_F(CachingAllocatorTest, CreateTagPolicyConflictAndUnknownIds) {
  TagId t = *InternTag("optimizer");
  ASSERT_TRUE(alloc_->CreateTag(t, Policy::kBackup).ok());
  EXPECT_TRUE(alloc_->CreateTag(t, Policy::kBackup).ok());
  EXPECT_EQ(alloc_->CreateTag(t, Policy::kDiscard).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(alloc_->Allocate(512, nullptr, kMaxTags + 5).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc_->Allocate(512, nullptr, -2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc_->TagPolicy(*InternTag("never_used_here")).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CachingAllocatorTest, BadInputIsRejectedWithClearErrors) {
  EXPECT_EQ(*alloc_->Allocate(0, nullptr), 0u);
  EXPECT_TRUE(alloc_->Free(0).ok());
  EXPECT_EQ(alloc_->Allocate(std::size_t{1} << 50, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  DevicePtr p = Alloc(4096);
  absl::Status inside = alloc_->Free(p + 512);
  EXPECT_EQ(inside.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(inside.message()), HasSubstr("not a live allocation"));
  Free(p);
  EXPECT_EQ(alloc_->Free(p).code(), absl::StatusCode::kInvalidArgument);  // double free
  EXPECT_EQ(alloc_->RecordStream(p, nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CachingAllocator::Create(sim_.get(), 3, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CachingAllocator::Create(nullptr, 0, {}).status().code(), absl::StatusCode::kInvalidArgument);
  AllocatorOptions bad;
  bad.min_chunk_bytes = 4 * kGiB;
  EXPECT_EQ(CachingAllocator::Create(sim_.get(), 0, bad).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CachingAllocatorTest, SameStreamReusesAtOnceOtherStreamsOnlyAfterAnEvent) {
  AllocatorOptions options;  // one 2 MiB chunk per block, so reuse is visible by address
  options.min_chunk_bytes = options.max_chunk_bytes = 2 * kMiB;
  Make(SimDriverOptions{1, 1 * kGiB, 2 * kMiB, {}}, options);
  Stream s1 = NewStream(), s2 = NewStream();
  DevicePtr p = Alloc(2 * kMiB, s1);
  Free(p);
  sim_->HoldStream(0, s1);  // s1's work is still running on the "GPU"
  EXPECT_EQ(Alloc(2 * kMiB, s1), p);  // same stream: ordered after the user's last use
  Free(p);
  DevicePtr q = Alloc(2 * kMiB, s2);  // other stream: must not take p while s1 is busy
  EXPECT_NE(q, p);
  sim_->ReleaseStream(0, s1);  // the fence recorded on s1 completes
  DevicePtr r = Alloc(2 * kMiB, s2);
  EXPECT_EQ(r, p);
  EXPECT_GE(alloc_->Stats().fence_reuses, 1u);
  Free(q);
  Free(r);
}

TEST_F(CachingAllocatorTest, RecordStreamDelaysReuseUntilThatStreamPassesTheFree) {
  Stream s1 = NewStream(), s2 = NewStream();
  DevicePtr p = Alloc(8192, s1);
  ASSERT_TRUE(alloc_->RecordStream(p, s2).ok());
  ASSERT_TRUE(alloc_->RecordStream(p, s1).ok());  // its own stream: nothing to do
  sim_->HoldStream(0, s2);
  Free(p);
  EXPECT_EQ(alloc_->Stats().pending_frees, 1u);
  DevicePtr q = Alloc(8192, s1);
  EXPECT_NE(q, p);  // s2 may still read p
  sim_->ReleaseStream(0, s2);
  DevicePtr r = Alloc(8192, s1);
  EXPECT_EQ(r, p);
  EXPECT_EQ(alloc_->Stats().pending_frees, 0u);
  Free(q);
  Free(r);
}

TEST_F(CachingAllocatorTest, EmptyCacheReleasesWholeFreeChunksPerTagOrAll) {
  TagId kv = *InternTag("kv_cache");
  DevicePtr a = Alloc(100 * kMiB, nullptr, kv);
  DevicePtr b = Alloc(100 * kMiB);
  DevicePtr keep = Alloc(4096);
  Free(a);
  Free(b);
  std::size_t used_before = sim_->UsedBytes(0);
  ASSERT_TRUE(alloc_->EmptyCache(kv).ok());
  AllocatorStats s = alloc_->Stats();
  EXPECT_EQ(Tag(s, "kv_cache").reserved_bytes.current, 0);
  EXPECT_GT(Tag(s, "default").reserved_bytes.current, static_cast<std::int64_t>(100 * kMiB));
  EXPECT_LT(sim_->UsedBytes(0), used_before);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  s = alloc_->Stats();
  // Only the small chunk holding `keep` is left.
  EXPECT_EQ(s.total.reserved_bytes.current, static_cast<std::int64_t>(2 * kMiB));
  EXPECT_EQ(sim_->UsedBytes(0), 2 * kMiB);
  EXPECT_EQ(s.total.allocated_bytes.current, 4096);
  // Memory comes back after EmptyCache, in the holes first.
  DevicePtr again = Alloc(100 * kMiB, nullptr, kv);
  EXPECT_NE(again, 0u);
  Free(again);
  Free(keep);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(sim_->UsedBytes(0), 0u);
  EXPECT_EQ(alloc_->Stats().total.reserved_bytes.current, 0);
}

TEST_F(CachingAllocatorTest, EmptyCacheCutsChunksOutOfPartlyLiveRuns) {
  // Three chunks in one run: live block in the first, the rest free.
  AllocatorOptions options;
  options.min_chunk_bytes = 4 * kMiB;
  options.max_chunk_bytes = 4 * kMiB;
  Make(SimDriverOptions{1, 1 * kGiB, 2 * kMiB, {}}, options);
  DevicePtr a = Alloc(2 * kMiB + 512);
  DevicePtr b = Alloc(6 * kMiB);
  DevicePtr c = Alloc(3 * kMiB);
  Free(b);
  Free(c);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  EXPECT_EQ(alloc_->Stats().total.chunks, 1);
  EXPECT_EQ(sim_->UsedBytes(0), 4 * kMiB);
  Free(a);
}

TEST_F(CachingAllocatorTest, FragmentedHolesAreReusedBeforeGrowing) {
  std::vector<DevicePtr> blocks;
  for (int i = 0; i < 60; ++i) blocks.push_back(Alloc(3 * kMiB));
  std::int64_t reserved = alloc_->Stats().total.reserved_bytes.current;
  for (int i = 0; i < 60; i += 2) Free(blocks[i]);
  for (int i = 0; i < 30; ++i) blocks[2 * i] = Alloc(3 * kMiB);
  EXPECT_EQ(alloc_->Stats().total.reserved_bytes.current, reserved);
  // Smaller requests split the holes instead of growing.
  for (int i = 0; i < 60; i += 2) Free(blocks[i]);
  std::vector<DevicePtr> halves;
  for (int i = 0; i < 60; ++i) halves.push_back(Alloc(3 * kMiB / 2));
  EXPECT_EQ(alloc_->Stats().total.reserved_bytes.current, reserved);
  for (DevicePtr p : halves) Free(p);
  for (int i = 1; i < 60; i += 2) Free(blocks[i]);
  Snapshot snap = alloc_->TakeSnapshot();
  for (const SegmentSnapshot& seg : snap.segments) {
    for (const BlockSnapshot& b : seg.blocks) EXPECT_FALSE(b.live);
  }
}

TEST_F(CachingAllocatorTest, OomLadderReleasesOtherTagsCacheThenFailsWithAFullMessage) {
  Make(SimDriverOptions{1, 256 * kMiB, 2 * kMiB, {}});
  TagId kv = *InternTag("kv_cache");
  TagId w = *InternTag("weights");
  DevicePtr a = Alloc(200 * kMiB, nullptr, kv);
  Free(a);  // cached in kv_cache
  DevicePtr b = Alloc(200 * kMiB, nullptr, w);  // needs kv_cache's chunks released
  ASSERT_NE(b, 0u);
  EXPECT_EQ(Tag(alloc_->Stats(), "kv_cache").reserved_bytes.current, 0);
  absl::StatusOr<DevicePtr> too_much = alloc_->Allocate(100 * kMiB, nullptr, w);
  ASSERT_EQ(too_much.status().code(), absl::StatusCode::kResourceExhausted);
  std::string message(too_much.status().message());
  EXPECT_THAT(message, HasSubstr("tried to allocate 100.00 MiB in tag 'weights'"));
  EXPECT_THAT(message, HasSubstr("of 256.00 MiB"));
  EXPECT_THAT(message, HasSubstr("vmstash reserves 200.00 MiB (paused 0 B)"));
  EXPECT_THAT(message, HasSubstr("weights (discard): allocated 200.00 MiB"));
  EXPECT_THAT(message, HasSubstr("kv_cache (discard)"));
  EXPECT_EQ(alloc_->Stats().ooms, 1u);
  Free(b);
}

TEST_F(CachingAllocatorTest, GrowthFallsBackToTheNeededSizeWhenTheDeviceIsNearlyFull) {
  Make(SimDriverOptions{1, 1 * kGiB, 2 * kMiB, {}});
  DevicePtr a = Alloc(600 * kMiB);  // heap is now ~600 MiB: growth wants 75+ MiB more
  DevicePtr b = Alloc(400 * kMiB);  // growth would overshoot the device; the exact size fits
  ASSERT_NE(b, 0u);
  Free(a);
  Free(b);
}

TEST_F(CachingAllocatorTest, StatsAndSnapshotJson) {
  DevicePtr p = Alloc(4096);
  std::string stats = StatsToJson(alloc_->Stats());
  EXPECT_THAT(stats, HasSubstr("\"allocated_bytes\":{\"current\":4096,\"peak\":4096}"));
  EXPECT_THAT(stats, HasSubstr("\"driver\":\"sim\""));
  EXPECT_THAT(stats, HasSubstr("\"create_chunk\":1"));
  std::string snap = SnapshotToJson(alloc_->TakeSnapshot());
  EXPECT_THAT(snap, HasSubstr("\"version\":1"));
  EXPECT_THAT(snap, HasSubstr("\"heap\":\"small\""));
  EXPECT_THAT(snap, HasSubstr("\"live\":true"));
  EXPECT_THAT(snap, HasSubstr("\"mapped\":true"));
  Free(p);
  alloc_->ResetPeaks();
  EXPECT_EQ(alloc_->Stats().total.allocated_bytes.peak, 0);
}

TEST_F(CachingAllocatorTest, BypassGivesEachAllocationItsOwnChunk) {
  AllocatorOptions options;
  options.bypass = true;
  Make(SimDriverOptions{1, 1 * kGiB, 2 * kMiB, {}}, options);
  DevicePtr a = Alloc(512);
  DevicePtr b = Alloc(3 * kMiB);
  EXPECT_EQ(sim_->UsedBytes(0), 6 * kMiB);
  EXPECT_EQ(alloc_->Stats().total.chunks, 2);
  EXPECT_EQ(alloc_->TakeSnapshot().segments.size(), 2u);
  Free(a);
  EXPECT_EQ(sim_->UsedBytes(0), 4 * kMiB);
  EXPECT_EQ(alloc_->Free(a).code(), absl::StatusCode::kInvalidArgument);
  Free(b);
  EXPECT_EQ(sim_->UsedBytes(0), 0u);
  EXPECT_TRUE(alloc_->Validate().ok());
}

// A tag holding bypass allocations (each its own chunk, outside the tag's heaps) refuses a
// pause and a switch pausing it, naming the option: nothing is copied or released, the
// statistics stay right and Validate (run after every operation here) keeps passing. Once
// they are freed, the tag pauses and resumes; an empty tag pauses under bypass:1 too.
TEST_F(CachingAllocatorTest, APauseOfATagHoldingBypassAllocationsIsRefusedNamingTheOption) {
  AllocatorOptions options;
  options.bypass = true;
  Make(SimDriverOptions{1, 1 * kGiB, 2 * kMiB, {}}, options);
  const TagId kv = *InternTag("bypass_kv"), other = *InternTag("bypass_other");
  ASSERT_TRUE(alloc_->CreateTag(kv, Policy::kBackup).ok());
  ASSERT_TRUE(alloc_->CreateTag(other, Policy::kDiscard).ok());
  DevicePtr a = Alloc(3 * kMiB, nullptr, kv);
  DevicePtr b = Alloc(4096, nullptr, other);
  const std::int64_t reserved = Tag(alloc_->Stats(), "bypass_kv").reserved_bytes.current;
  ASSERT_EQ(reserved, 4 * kMiB);
  absl::StatusOr<CachingAllocator::Transition> paused = alloc_->Pause(kv);
  ASSERT_EQ(paused.status().code(), absl::StatusCode::kFailedPrecondition) << paused.status();
  EXPECT_THAT(std::string(paused.status().message()), HasSubstr("bypass:1"));
  EXPECT_THAT(std::string(paused.status().message()), HasSubstr("1 allocation(s)"));
  absl::StatusOr<CachingAllocator::Transition> switched = alloc_->Switch({other}, {});
  ASSERT_EQ(switched.status().code(), absl::StatusCode::kFailedPrecondition) << switched.status();
  EXPECT_THAT(std::string(switched.status().message()), HasSubstr("bypass_other"));
  const AllocatorStats stats = alloc_->Stats();
  EXPECT_EQ(Tag(stats, "bypass_kv").reserved_bytes.current, reserved);
  EXPECT_EQ(Tag(stats, "bypass_kv").state, "active");
  EXPECT_EQ(sim_->UsedBytes(0), 6 * kMiB);
  EXPECT_TRUE(alloc_->Validate().ok()) << alloc_->Validate();
  Free(b);  // an unrelated free after the refusal (validated after the operation)
  Free(a);
  ASSERT_TRUE(alloc_->Pause(kv).ok());
  ASSERT_TRUE(alloc_->Switch({other}, {kv}).ok());
  EXPECT_TRUE(alloc_->Validate().ok()) << alloc_->Validate();
  EXPECT_EQ(sim_->UsedBytes(0), 0u);
}

TEST_F(CachingAllocatorTest, DestroyingWithLiveBlocksReleasesEverything) {
  Alloc(4096);
  Alloc(50 * kMiB);
  Stream s = NewStream();
  DevicePtr p = Alloc(4096, s);
  ASSERT_TRUE(alloc_->RecordStream(p, nullptr).ok());
  sim_->HoldStream(0, nullptr);
  Free(p);  // pending on a held stream
  alloc_.reset();
  EXPECT_EQ(sim_->UsedBytes(0), 0u);  // TearDown checks for leaks
}

// A tag id never interned is refused by every call that would make its pool, and the
// error names the call that was made.
TEST_F(CachingAllocatorTest, AnUninternedTagIdIsRefusedNamingTheCall) {
  const TagId bogus = 1 << 20;
  absl::Status created = alloc_->CreateTag(bogus, Policy::kBackup);
  EXPECT_EQ(created.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(created.message()), HasSubstr("create_tag: unknown tag id"));
  absl::Status hooked = alloc_->AddHooks(bogus, nullptr, nullptr);
  EXPECT_EQ(hooked.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(hooked.message()), HasSubstr("add_hooks: unknown tag id"));
  absl::StatusOr<DevicePtr> p = alloc_->Allocate(4096, nullptr, bogus);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("allocate: unknown tag id"));
}

}  // namespace
}  // namespace vmstash
