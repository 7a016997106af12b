// The allocator conformance suite's cases (see allocator_conformance.h). Where a case
// came from a simulator-only or a GPU-only test, it replaced that test.
#include "allocator/allocator_conformance.h"

#include <string>
#include <utility>

#include "gmock/gmock.h"

namespace vmstash {
namespace {

using ::testing::HasSubstr;
using Transition = CachingAllocator::Transition;
using testing::TagStatsOf;
using testing::WrongBytesOnDevice;

constexpr int kDevice = 0;

// `later - earlier` as a signed count (device free memory may also fall).
std::int64_t Rise(std::size_t earlier, std::size_t later) {
  return static_cast<std::int64_t>(later) - static_cast<std::int64_t>(earlier);
}

}  // namespace

std::vector<AllocatorConformanceTest::Live> AllocatorConformanceTest::Fill(TagId tag,
                                                                           const std::vector<std::size_t>& sizes,
                                                                           std::uint8_t seed) {
  std::vector<Live> out;
  for (std::size_t n : sizes) {
    DevicePtr p = Alloc(n, tag);
    if (p == 0) break;
    absl::Status written = testing::WritePattern(*driver_, p, n, seed);
    EXPECT_TRUE(written.ok()) << written;
    out.push_back({p, n, seed++});
  }
  return out;
}

std::size_t AllocatorConformanceTest::Wrong(const std::vector<Live>& blocks) {
  std::size_t wrong = 0;
  for (const Live& b : blocks) wrong += WrongBytesOnDevice(*driver_, b.address, b.size, b.seed);
  return wrong;
}

void AllocatorConformanceTest::FreeAll(const std::vector<Live>& blocks) {
  for (const Live& b : blocks) ASSERT_TRUE(alloc_->Free(b.address).ok());
}

TagId AllocatorConformanceTest::Tag(const char* name, Policy policy) {
  TagId t = *InternTag(name);
  EXPECT_TRUE(alloc_->CreateTag(t, policy).ok());
  return t;
}

std::size_t AllocatorConformanceTest::FreeBytes() {
  absl::StatusOr<DeviceMemoryInfo> info = driver_->MemoryInfo(kDevice);
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? info->free_bytes : 0;
}

void AllocatorConformanceTest::UseMeanwhile(std::int64_t released_bytes) {
  const std::int64_t usable = released_bytes - static_cast<std::int64_t>(64 * kMiB);
  ASSERT_GT(usable, 0);
  DevicePtr other = Alloc(static_cast<std::size_t>(usable), kDefaultTag);
  ASSERT_NE(other, 0u);
  ASSERT_TRUE(driver_->MemsetAsync(kDevice, other, 0xee, static_cast<std::size_t>(usable), nullptr).ok());
  ASSERT_TRUE(driver_->SynchronizeStream(kDevice, nullptr).ok());
  ASSERT_TRUE(alloc_->Free(other).ok());
  ASSERT_TRUE(alloc_->EmptyCache(kDefaultTag).ok());
}

AllocatorOptions AllocatorConformanceTest::SwitchOptions(bool zero) {
  AllocatorOptions options = testing::TestOptions();
  options.auto_prepare = false;
  options.pause_stage_bytes = 8 * kMiB;
  options.switch_group_bytes = 4 * kMiB;
  options.switch_zero = zero;
  options.resume_first_piece_bytes = 4 * kMiB;
  return options;
}

// --- Allocation, reuse, EmptyCache, streams -------------------------------------------

TEST_P(AllocatorConformanceTest, FreedBlockIsReusedAndAligned) {
  for (std::size_t size : {std::size_t{1}, std::size_t{512}, std::size_t{1000}, kMiB, kMiB + 1, 64 * kMiB}) {
    DevicePtr p = Alloc(size);
    EXPECT_EQ(p % CachingAllocator::kAlignmentBytes, 0u) << size;
    // The device can write it.
    ASSERT_TRUE(driver_->MemsetAsync(kDevice, p, 0xab, size, nullptr).ok()) << size;
    ASSERT_TRUE(driver_->SynchronizeStream(kDevice, nullptr).ok());
    ASSERT_TRUE(alloc_->Free(p).ok());
    DevicePtr again = Alloc(size);
    EXPECT_EQ(again, p) << size;
    ASSERT_TRUE(alloc_->Free(again).ok());
  }
  AllocatorStats s = alloc_->Stats();
  EXPECT_EQ(s.total.allocated_bytes.current, 0);
  EXPECT_EQ(s.cache_hits + s.grows, 12u);
  EXPECT_GE(s.cache_hits, 6u);
  EXPECT_EQ(s.total.allocations, 12u);
  EXPECT_EQ(s.total.frees, 12u);
}

TEST_P(AllocatorConformanceTest, BlocksAreUsableAndKeepTheirBytesAcrossChurn) {
  TagId kv = *InternTag("kv_cache");
  std::vector<std::pair<DevicePtr, std::size_t>> blocks;
  for (std::size_t size : {std::size_t{512}, std::size_t{4096}, kMiB, 3 * kMiB, 100 * kMiB}) {
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(size, nullptr, kv);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(driver_->MemsetAsync(kDevice, *p, static_cast<std::uint8_t>(size % 251), size, nullptr).ok());
    blocks.emplace_back(*p, size);
  }
  // Churn in another tag.
  for (int i = 0; i < 200; ++i) {
    absl::StatusOr<DevicePtr> q = alloc_->Allocate((i % 7 + 1) * 3 * kMiB, nullptr, kDefaultTag);
    ASSERT_TRUE(q.ok()) << q.status();
    ASSERT_TRUE(driver_->MemsetAsync(kDevice, *q, 0xff, (i % 7 + 1) * 3 * kMiB, nullptr).ok());
    ASSERT_TRUE(alloc_->Free(*q).ok());
  }
  for (auto [p, size] : blocks) {
    std::vector<std::uint8_t> host(size);
    ASSERT_TRUE(driver_->CopyToHostAsync(kDevice, host.data(), p, size, nullptr).ok());
    ASSERT_TRUE(driver_->SynchronizeStream(kDevice, nullptr).ok());
    for (std::size_t i = 0; i < size; i += 509) ASSERT_EQ(host[i], size % 251) << size;
    ASSERT_TRUE(alloc_->Free(p).ok());
  }
}

TEST_P(AllocatorConformanceTest, EmptyCacheReturnsMemoryToTheDevice) {
  constexpr std::size_t kBytes = 4 * kGiB;
  const std::size_t before = FreeBytes();
  DevicePtr p = Alloc(kBytes);
  ASSERT_NE(p, 0u);
  const std::size_t during = FreeBytes();
  ASSERT_TRUE(alloc_->Free(p).ok());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  const std::size_t after = FreeBytes();
  EXPECT_LE(during + kBytes, before + 64 * kMiB);
  EXPECT_GE(after + 64 * kMiB, before);
  EXPECT_EQ(alloc_->Stats().total.reserved_bytes.current, 0);
}

TEST_P(AllocatorConformanceTest, CrossStreamReuseAndRecordStream) {
  Stream s1 = NewStream(), s2 = NewStream();
  // The same stream reuses a freed block at once: it orders the reuse after the free.
  DevicePtr first = Alloc(8 * kMiB, kDefaultTag, s1);
  ASSERT_TRUE(alloc_->Free(first).ok());
  DevicePtr same = Alloc(8 * kMiB, kDefaultTag, s1);
  EXPECT_EQ(same, first);
  ASSERT_TRUE(alloc_->Free(same).ok());
  // A block used on s2 too is freed while s2's work on it may still run.
  DevicePtr p = Alloc(8 * kMiB, kDefaultTag, s1);
  ASSERT_TRUE(alloc_->RecordStream(p, s2).ok());
  ASSERT_TRUE(driver_->MemsetAsync(kDevice, p, 1, 8 * kMiB, s2).ok());
  ASSERT_TRUE(alloc_->Free(p).ok());
  ASSERT_TRUE(driver_->SynchronizeDevice(kDevice).ok());
  for (int i = 0; i < 100; ++i) {
    DevicePtr q = Alloc(8 * kMiB, kDefaultTag, i % 2 ? s1 : s2);
    ASSERT_TRUE(driver_->MemsetAsync(kDevice, q, 2, 8 * kMiB, i % 2 ? s1 : s2).ok());
    ASSERT_TRUE(alloc_->Free(q).ok());
  }
  ASSERT_TRUE(alloc_->Validate().ok());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  // TearDown destroys the allocator before the streams.
}

TEST_P(AllocatorConformanceTest, DestroyingWithLiveBlocksReleasesEverything) {
  const std::size_t before = FreeBytes();
  Stream s = NewStream();
  ASSERT_NE(Alloc(4096), 0u);
  ASSERT_NE(Alloc(50 * kMiB), 0u);
  DevicePtr p = Alloc(4096, kDefaultTag, s);
  ASSERT_TRUE(alloc_->RecordStream(p, nullptr).ok());
  ASSERT_TRUE(driver_->MemsetAsync(kDevice, p, 3, 4096, nullptr).ok());
  ASSERT_TRUE(alloc_->Free(p).ok());  // pending on the default stream's work
  alloc_.reset();
  EXPECT_GE(FreeBytes() + 64 * kMiB, before);  // and TearDown checks for leaks
}

TEST_P(AllocatorConformanceTest, OutOfMemoryIsAnErrorAndTheAllocatorGoesOn) {
  const TagId tag = Tag("conformance_oom", Policy::kDiscard);
  absl::StatusOr<DeviceMemoryInfo> info = driver_->MemoryInfo(kDevice);
  ASSERT_TRUE(info.ok()) << info.status();
  DevicePtr cached = Alloc(64 * kMiB, tag);
  ASSERT_TRUE(alloc_->Free(cached).ok());  // given back by the ladder, then still too little
  absl::StatusOr<DevicePtr> too_much = alloc_->Allocate(info->total_bytes + kGiB, nullptr, tag);
  ASSERT_EQ(too_much.status().code(), absl::StatusCode::kResourceExhausted) << too_much.status();
  const std::string message(too_much.status().message());
  EXPECT_THAT(message, HasSubstr("tried to allocate"));
  EXPECT_THAT(message, HasSubstr("in tag 'conformance_oom'"));
  EXPECT_EQ(alloc_->Stats().ooms, 1u);
  absl::Status valid = alloc_->Validate();
  EXPECT_TRUE(valid.ok()) << valid;
  // What fits is still served, and usable.
  DevicePtr p = Alloc(64 * kMiB, tag);
  ASSERT_NE(p, 0u);
  ASSERT_TRUE(testing::WritePattern(*driver_, p, 64 * kMiB, 5).ok());
  EXPECT_EQ(WrongBytesOnDevice(*driver_, p, 64 * kMiB, 5), 0u);
  ASSERT_TRUE(alloc_->Free(p).ok());
}

// --- Pause and resume ------------------------------------------------------------------

TEST_P(AllocatorConformanceTest, PausingADiscardTagReleasesItsMemoryAndResumeMapsTheSameAddresses) {
  AllocatorOptions options = testing::TestOptions();
  options.auto_prepare = false;
  MakeAllocator(options);
  const TagId kv = Tag("conformance_kv", Policy::kDiscard);
  std::vector<Live> blocks = Fill(kv, {4096, 64 * kMiB, 192 * kMiB}, 7);
  ASSERT_EQ(blocks.size(), 3u);
  const std::int64_t reserved = TagStatsOf(*alloc_, kv).reserved_bytes.current;
  const std::size_t free_before = FreeBytes();
  const std::uint64_t copies = Calls(DriverOp::kCopyToHost);
  ASSERT_EQ(*alloc_->Pause(kv), Transition::kDone);
  EXPECT_EQ(Calls(DriverOp::kCopyToHost), copies) << "a discard tag's bytes are not copied";
  const std::int64_t released = Rise(free_before, FreeBytes());
  EXPECT_GE(static_cast<double>(released), 0.95 * static_cast<double>(reserved));
  const TagStats paused = TagStatsOf(*alloc_, kv);
  EXPECT_EQ(paused.state, "paused");
  EXPECT_EQ(paused.reserved_bytes.current, 0);
  EXPECT_EQ(paused.backed_up_bytes, 0);
  UseMeanwhile(released);
  // Resumed: the same addresses, fresh memory the device can write and read back.
  ASSERT_EQ(*alloc_->Resume(kv), Transition::kDone);
  EXPECT_EQ(TagStatsOf(*alloc_, kv).state, "active");
  for (Live& b : blocks) {
    b.seed = static_cast<std::uint8_t>(b.seed + 100);
    ASSERT_TRUE(testing::WritePattern(*driver_, b.address, b.size, b.seed).ok());
  }
  EXPECT_EQ(Wrong(blocks), 0u);
  FreeAll(blocks);
}

TEST_P(AllocatorConformanceTest, PausingABackupTagKeepsItsBytesAtTheSameAddresses) {
  AllocatorOptions options = testing::TestOptions();
  options.auto_prepare = false;
  MakeAllocator(options);
  const TagId weights = Tag("conformance_weights", Policy::kBackup);
  const std::vector<std::size_t> sizes = {512, 3000, kMiB, 5 * kMiB, 40 * kMiB, 200 * kMiB};
  std::vector<Live> blocks = Fill(weights, sizes, 17);
  ASSERT_EQ(blocks.size(), sizes.size());
  std::vector<Live> other = Fill(kDefaultTag, {3 * kMiB}, 99);  // another tag stays untouched
  const std::int64_t reserved = TagStatsOf(*alloc_, weights).reserved_bytes.current;
  const std::size_t free_before = FreeBytes();
  ASSERT_EQ(*alloc_->Pause(weights), Transition::kDone);
  const std::int64_t released = Rise(free_before, FreeBytes());
  EXPECT_GE(static_cast<double>(released), 0.95 * static_cast<double>(reserved));
  const TagStats paused = TagStatsOf(*alloc_, weights);
  EXPECT_EQ(paused.state, "paused");
  EXPECT_EQ(paused.paused_bytes, reserved);
  EXPECT_EQ(paused.reserved_bytes.current, 0);
  EXPECT_EQ(paused.backed_up_bytes, static_cast<std::int64_t>(512 + 3000 + kMiB + 5 * kMiB + 40 * kMiB + 200 * kMiB));
  EXPECT_GT(paused.backup_arena_bytes, 0);
  EXPECT_EQ(Wrong(other), 0u);
  UseMeanwhile(released);  // the resume restores into memory that was someone else's
  ASSERT_EQ(*alloc_->Resume(weights), Transition::kDone);
  for (const Live& b : blocks) EXPECT_EQ(WrongBytesOnDevice(*driver_, b.address, b.size, b.seed), 0u) << b.size;
  const TagStats resumed = TagStatsOf(*alloc_, weights);
  EXPECT_EQ(resumed.state, "active");
  EXPECT_EQ(resumed.paused_bytes, 0);
  EXPECT_EQ(resumed.pauses, 1u);
  EXPECT_EQ(resumed.resumes, 1u);
  FreeAll(blocks);
  FreeAll(other);
}

// --- Switch ----------------------------------------------------------------------------

// Same sizes both ways: every chunk changes hands (no create, no release, so the device's
// used memory stays as it was), the bytes and addresses of both tags survive three switches.
TEST_P(AllocatorConformanceTest, SwitchKeepsAddressesAndBackedUpBytesBothWays) {
  MakeAllocator(SwitchOptions(/*zero=*/true));
  TagId train = Tag("sw_train", Policy::kBackup);
  TagId roll = Tag("sw_roll", Policy::kBackup);
  std::vector<Live> t = Fill(train, {64 * kMiB, 64 * kMiB, 32 * kMiB}, 1);
  ASSERT_EQ(*alloc_->Pause(train), Transition::kDone);
  std::vector<Live> r = Fill(roll, {64 * kMiB, 64 * kMiB, 32 * kMiB}, 50);
  const std::uint64_t creates = Calls(DriverOp::kCreateChunk), releases = Calls(DriverOp::kReleaseChunk);

  ASSERT_EQ(*alloc_->Switch({roll}, {train}), Transition::kDone);
  EXPECT_EQ(TagStatsOf(*alloc_, roll).state, "paused");
  EXPECT_EQ(TagStatsOf(*alloc_, train).state, "active");
  EXPECT_EQ(Wrong(t), 0u);  // restored at the same addresses, into the rollout tag's chunks
  EXPECT_EQ(Calls(DriverOp::kCreateChunk), creates) << "memory changing hands must not be created";
  EXPECT_EQ(Calls(DriverOp::kReleaseChunk), releases) << "memory changing hands must not be released";
  EXPECT_EQ(alloc_->Stats().handed_over_bytes, 160 * kMiB);

  ASSERT_EQ(*alloc_->Switch({train}, {roll}), Transition::kDone);
  EXPECT_EQ(Wrong(r), 0u);
  ASSERT_EQ(*alloc_->Switch({roll}, {train}), Transition::kDone);
  EXPECT_EQ(Wrong(t), 0u);
  EXPECT_EQ(Calls(DriverOp::kCreateChunk), creates);
  ASSERT_TRUE(alloc_->Validate().ok());
  EXPECT_EQ(TagStatsOf(*alloc_, train).switches, 3u);
  ASSERT_EQ(*alloc_->Resume(roll), Transition::kDone);
  EXPECT_EQ(Wrong(r), 0u);
  FreeAll(t);
  FreeAll(r);
}

TEST_P(AllocatorConformanceTest, DiscardSwitchNeedsNoCreateReleaseOrCopy) {
  MakeAllocator(SwitchOptions(/*zero=*/true));
  TagId kv = Tag("sw_kv", Policy::kDiscard);
  TagId act = Tag("sw_act", Policy::kDiscard);
  std::vector<Live> a = Fill(act, {128 * kMiB, 64 * kMiB}, 3);
  ASSERT_EQ(*alloc_->Pause(act), Transition::kDone);
  std::vector<Live> k = Fill(kv, {128 * kMiB, 64 * kMiB}, 9);
  const DriverCounters before = driver_->Counters();
  ASSERT_EQ(*alloc_->Switch({kv}, {act}), Transition::kDone);
  const DriverCounters after = driver_->Counters();
  EXPECT_EQ(after.Calls(DriverOp::kCreateChunk), before.Calls(DriverOp::kCreateChunk));
  EXPECT_EQ(after.Calls(DriverOp::kReleaseChunk), before.Calls(DriverOp::kReleaseChunk));
  EXPECT_EQ(after.Calls(DriverOp::kCopyToHost), before.Calls(DriverOp::kCopyToHost));
  EXPECT_EQ(after.Calls(DriverOp::kCopyToDevice), before.Calls(DriverOp::kCopyToDevice));
  // Handed-over memory reads as zeros (switch_zero), not as the other tag's bytes.
  for (const Live& b : a) {
    std::vector<std::uint8_t> host(b.size);
    ASSERT_TRUE(driver_->CopyToHostAsync(kDevice, host.data(), b.address, b.size, nullptr).ok());
    ASSERT_TRUE(driver_->SynchronizeStream(kDevice, nullptr).ok());
    std::size_t nonzero = 0;
    for (std::size_t i = 0; i < b.size; i += 4096) nonzero += host[i] != 0;
    EXPECT_EQ(nonzero, 0u);
  }
  // The addresses are usable again.
  for (const Live& b : a) ASSERT_TRUE(testing::WritePattern(*driver_, b.address, b.size, b.seed).ok());
  EXPECT_EQ(Wrong(a), 0u);
  ASSERT_EQ(*alloc_->Resume(kv), Transition::kDone);
  FreeAll(a);
  FreeAll(k);
}

TEST_P(AllocatorConformanceTest, WithoutZeroingADiscardTagSeesTheOldBytesOfTheChunksItWasHanded) {
  MakeAllocator(SwitchOptions(/*zero=*/false));
  TagId kv = Tag("sw_kv_nz", Policy::kDiscard), act = Tag("sw_act_nz", Policy::kDiscard);
  std::vector<Live> a = Fill(act, {64 * kMiB}, 3);
  ASSERT_EQ(*alloc_->Pause(act), Transition::kDone);
  std::vector<Live> k = Fill(kv, {64 * kMiB}, 9);
  const std::uint64_t memsets = Calls(DriverOp::kMemset);
  ASSERT_EQ(*alloc_->Switch({kv}, {act}), Transition::kDone);
  EXPECT_EQ(Calls(DriverOp::kMemset), memsets);
  EXPECT_EQ(WrongBytesOnDevice(*driver_, a[0].address, a[0].size, k[0].seed), 0u)
      << "the same physical memory, not a copy";
  ASSERT_EQ(*alloc_->Resume(kv), Transition::kDone);
  FreeAll(a);
  FreeAll(k);
}

}  // namespace vmstash
