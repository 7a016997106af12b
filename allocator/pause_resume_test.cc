#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "vmm/pinned_pieces.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

using ::testing::HasSubstr;
using Transition = CachingAllocator::Transition;

void FillPattern(DevicePtr p, std::size_t n, std::uint8_t seed) {
  auto* b = reinterpret_cast<std::uint8_t*>(p);
  for (std::size_t i = 0; i < n; i += 4093) b[i] = static_cast<std::uint8_t>(seed + i / 4093);
  b[n - 1] = static_cast<std::uint8_t>(seed ^ 0x5a);
}
bool HasPattern(DevicePtr p, std::size_t n, std::uint8_t seed) {
  auto* b = reinterpret_cast<const std::uint8_t*>(p);
  for (std::size_t i = 0; i < n; i += 4093) {
    if (b[i] != static_cast<std::uint8_t>(seed + i / 4093)) return false;
  }
  return b[n - 1] == static_cast<std::uint8_t>(seed ^ 0x5a);
}

class PauseResumeTest : public testing::SimAllocatorTest {
 protected:
  void SetUp() override { Make(SimDriverOptions{1, 2 * kGiB, 2 * kMiB, {}}); }
  // Background preparation is off unless a test asks: the others count driver calls.
  void Make(SimDriverOptions sim_options, AllocatorOptions options = {}, bool auto_prepare = false) {
    options.validate_each_op = true;
    options.auto_prepare = auto_prepare;
    MakeAllocator(std::move(sim_options), options);
    ASSERT_NE(alloc_, nullptr);
    weights_ = *InternTag("weights");
    kv_ = *InternTag("kv_cache");
    ASSERT_TRUE(alloc_->CreateTag(weights_, Policy::kBackup).ok());
    ASSERT_TRUE(alloc_->CreateTag(kv_, Policy::kDiscard).ok());
  }
  DevicePtr Alloc(std::size_t n, TagId tag) {
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(n, nullptr, tag);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *p : 0;
  }
  const TagStats& Stats(TagId tag) {
    stats_ = alloc_->Stats();
    for (const TagStats& t : stats_.tags) {
      if (t.name == TagName(tag)) return t;
    }
    static TagStats none;
    return none;
  }
  AllocatorStats stats_;
  TagId weights_ = 0, kv_ = 0;
};

TEST_F(PauseResumeTest, BackupRoundTripsAtTheSameAddressAndReleasesMemory) {
  std::vector<std::pair<DevicePtr, std::size_t>> blocks;
  std::size_t sizes[] = {512, 3000, kMiB, 5 * kMiB, 40 * kMiB, 700 * kMiB};
  for (std::size_t i = 0; i < 6; ++i) {
    DevicePtr p = Alloc(sizes[i], weights_);
    FillPattern(p, sizes[i], static_cast<std::uint8_t>(i * 17));
    blocks.emplace_back(p, sizes[i]);
  }
  DevicePtr other = Alloc(3 * kMiB, kDefaultTag);  // another tag stays untouched
  FillPattern(other, 3 * kMiB, 99);
  std::size_t used_before = sim_->UsedBytes(0);
  std::int64_t reserved = Stats(weights_).reserved_bytes.current;
  ASSERT_EQ(*alloc_->Pause(weights_), Transition::kDone);
  EXPECT_EQ(sim_->UsedBytes(0), used_before - static_cast<std::size_t>(reserved));
  const TagStats& paused = Stats(weights_);
  EXPECT_EQ(paused.state, "paused");
  EXPECT_EQ(paused.paused_bytes, reserved);
  EXPECT_EQ(paused.reserved_bytes.current, 0);
  EXPECT_EQ(paused.backed_up_bytes, static_cast<std::int64_t>(512 + 3000 + kMiB + 5 * kMiB + 40 * kMiB + 700 * kMiB));
  EXPECT_GT(paused.backup_arena_bytes, 0);
  EXPECT_TRUE(HasPattern(other, 3 * kMiB, 99));
  ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    EXPECT_TRUE(HasPattern(blocks[i].first, blocks[i].second, static_cast<std::uint8_t>(i * 17))) << i;
  }
  const TagStats& resumed = Stats(weights_);
  EXPECT_EQ(resumed.state, "active");
  EXPECT_EQ(resumed.paused_bytes, 0);
  EXPECT_EQ(resumed.pauses, 1u);
  EXPECT_EQ(resumed.resumes, 1u);
  // Re-chunked: one chunk for the small heap's cover; the large heap's 746 MiB cover comes
  // back in pipelined pieces of 64, 128, 256 MiB and the rest (a piece of 512 would leave
  // nothing after it).
  EXPECT_EQ(resumed.chunks, 5);
  for (auto [p, n] : blocks) ASSERT_TRUE(alloc_->Free(p).ok());
  ASSERT_TRUE(alloc_->Free(other).ok());
}

// The heap's segments are reserved as needed; a later reservation may lie below an
// earlier one (the simulated driver's mmap hands out addresses downwards). A pipelined
// resume restores the blocks of every segment whatever the segments' address order.
TEST_F(PauseResumeTest, BackupRoundTripsAcrossSegmentsInAnyAddressOrder) {
  AllocatorOptions options;
  options.heap_va_bytes = 64 * kMiB;
  options.resume_first_piece_bytes = 4 * kMiB;
  Make(SimDriverOptions{1, 2 * kGiB, 2 * kMiB, {}}, options);
  std::vector<DevicePtr> blocks;
  for (std::size_t i = 0; i < 6; ++i) {  // 40 MiB each: one per 64 MiB segment and a half
    blocks.push_back(Alloc(40 * kMiB, weights_));
    FillPattern(blocks.back(), 40 * kMiB, static_cast<std::uint8_t>(i * 29 + 3));
  }
  bool descending = false;
  for (std::size_t i = 1; i < blocks.size(); ++i) descending |= blocks[i] < blocks[i - 1];
  ASSERT_TRUE(descending) << "the test needs a segment reserved below an earlier one";
  ASSERT_EQ(*alloc_->Pause(weights_), Transition::kDone);
  ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    EXPECT_TRUE(HasPattern(blocks[i], 40 * kMiB, static_cast<std::uint8_t>(i * 29 + 3))) << i;
  }
  for (DevicePtr p : blocks) ASSERT_TRUE(alloc_->Free(p).ok());
}

TEST_F(PauseResumeTest, DiscardContentsAreNotKeptAndMemoryIsReleased) {
  DevicePtr p = Alloc(64 * kMiB, kv_);
  FillPattern(p, 64 * kMiB, 7);
  ASSERT_EQ(*alloc_->Pause(kv_), Transition::kDone);
  EXPECT_EQ(sim_->UsedBytes(0), 0u);
  EXPECT_EQ(Stats(kv_).backed_up_bytes, 0);
  EXPECT_EQ(sim_->Counters().Calls(DriverOp::kCopyToHost), 0u);
  ASSERT_EQ(*alloc_->Resume(kv_), Transition::kDone);
  EXPECT_FALSE(HasPattern(p, 64 * kMiB, 7));  // fresh physical memory: the old bytes are gone
  std::memset(reinterpret_cast<void*>(p), 1, 64 * kMiB);  // and it is usable at the same address
  ASSERT_TRUE(alloc_->Free(p).ok());
}

TEST_F(PauseResumeTest, PausePipelinesInStagesAndResumeMapsInPieces) {
  AllocatorOptions options;
  options.min_chunk_bytes = 20 * kMiB;
  options.max_chunk_bytes = 64 * kMiB;
  options.pause_stage_bytes = 32 * kMiB;
  options.resume_first_piece_bytes = 8 * kMiB;
  Make(SimDriverOptions{1, 2 * kGiB, 2 * kMiB, {}}, options);
  // 30 blocks of 9 MiB grow the large heap in 20 MiB chunks; blocks straddle chunk ends.
  std::vector<DevicePtr> blocks;
  for (int i = 0; i < 30; ++i) {
    blocks.push_back(Alloc(9 * kMiB, weights_));
    FillPattern(blocks.back(), 9 * kMiB, static_cast<std::uint8_t>(i));
  }
  const std::int64_t chunks_before = Stats(weights_).chunks;
  ASSERT_GT(chunks_before, 4);
  DriverCounters before = sim_->Counters();
  ASSERT_EQ(*alloc_->Pause(weights_), Transition::kDone);
  DriverCounters after = sim_->Counters();
  auto calls = [&](DriverOp op) { return after.Calls(op) - before.Calls(op); };
  // 270 MiB of live bytes in stages of >= 32 MiB of whole chunks: several stages, one
  // event each, every chunk unmapped once and released once.
  EXPECT_GE(calls(DriverOp::kRecordEvent), 5u);
  EXPECT_LE(calls(DriverOp::kRecordEvent), 9u);
  EXPECT_EQ(calls(DriverOp::kSynchronizeEvent), calls(DriverOp::kRecordEvent));
  EXPECT_EQ(calls(DriverOp::kUnmap), static_cast<std::uint64_t>(chunks_before));
  EXPECT_EQ(calls(DriverOp::kReleaseChunk), static_cast<std::uint64_t>(chunks_before));
  ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
  for (int i = 0; i < 30; ++i) EXPECT_TRUE(HasPattern(blocks[i], 9 * kMiB, static_cast<std::uint8_t>(i))) << i;
  // One 270 MiB cover in pieces of 8, 16, 32, 64, 64 MiB and the 86 MiB rest (a 22 MiB
  // tail joins the piece before it).
  EXPECT_EQ(Stats(weights_).chunks, 6);
  for (DevicePtr p : blocks) ASSERT_TRUE(alloc_->Free(p).ok());
  // A discard tag has nothing to copy: one chunk per cover.
  DevicePtr kv = Alloc(300 * kMiB, kv_);
  ASSERT_EQ(*alloc_->Pause(kv_), Transition::kDone);
  ASSERT_EQ(*alloc_->Resume(kv_), Transition::kDone);
  EXPECT_EQ(Stats(kv_).chunks, 1);
  ASSERT_TRUE(alloc_->Free(kv).ok());
}

TEST_F(PauseResumeTest, BackgroundThreadPreparesTheArenaAsTheTagGrows) {
  AllocatorOptions options;
  options.auto_prepare_settle_ms = 1000;
  Make(SimDriverOptions{1, 2 * kGiB, 2 * kMiB, {}}, options, /*auto_prepare=*/true);
  // A burst of growth (10 chunks) is prepared once, at its final size.
  std::vector<DevicePtr> burst;
  for (int i = 0; i < 10; ++i) burst.push_back(Alloc(30 * kMiB, weights_));
  ASSERT_GE(Stats(weights_).chunks, 10);
  alloc_->WaitForBackgroundPrepare();
  // Pinned once, piece by piece (Note [Pinned Pieces]).
  const std::int64_t arena = Stats(weights_).backup_arena_bytes;
  const std::int64_t piece = static_cast<std::int64_t>(PinnedPieces::kPieceBytes);
  EXPECT_EQ(sim_->Counters().Calls(DriverOp::kHostRegister), static_cast<std::uint64_t>((arena + piece - 1) / piece));
  for (DevicePtr p : burst) ASSERT_TRUE(alloc_->Free(p).ok());
  DevicePtr a = Alloc(100 * kMiB, weights_);
  FillPattern(a, 100 * kMiB, 3);
  DevicePtr kv = Alloc(100 * kMiB, kv_);  // discard tags get no arena
  alloc_->WaitForBackgroundPrepare();
  const TagStats prepared = Stats(weights_);
  const std::int64_t first = prepared.backup_arena_bytes;
  EXPECT_GE(first, prepared.reserved_bytes.current);
  EXPECT_EQ(Stats(kv_).backup_arena_bytes, 0);
  // The tag grows past the headroom: prepared again, larger.
  DevicePtr b = Alloc(300 * kMiB, weights_);
  FillPattern(b, 300 * kMiB, 4);
  alloc_->WaitForBackgroundPrepare();
  const TagStats grown = Stats(weights_);  // a copy: Stats() reuses its buffer
  EXPECT_GE(grown.backup_arena_bytes, grown.reserved_bytes.current);
  EXPECT_GT(Stats(weights_).backup_arena_bytes, first);
  // The pause pins nothing: the arena was ready.
  const std::uint64_t host_pins = sim_->Counters().Calls(DriverOp::kHostRegister);
  ASSERT_EQ(*alloc_->Pause(weights_), Transition::kDone);
  EXPECT_EQ(sim_->Counters().Calls(DriverOp::kHostRegister), host_pins);
  ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
  EXPECT_TRUE(HasPattern(a, 100 * kMiB, 3));
  EXPECT_TRUE(HasPattern(b, 300 * kMiB, 4));
  // Released on request; not prepared again until the tag grows.
  ASSERT_TRUE(alloc_->ReleaseBackup(weights_).ok());
  alloc_->WaitForBackgroundPrepare();
  EXPECT_EQ(Stats(weights_).backup_arena_bytes, 0);
  for (DevicePtr p : {a, b, kv}) ASSERT_TRUE(alloc_->Free(p).ok());
}

TEST_F(PauseResumeTest, LiveRangeHintCopiesOnlyTheBytesInsideIt) {
  // Like PyTorch's MemPool: a 20 MiB "segment" of ours with tensors at 1..3 MiB and
  // 10..11 MiB inside it, and a second segment with nothing live in it.
  DevicePtr seg = Alloc(20 * kMiB, weights_);
  DevicePtr empty = Alloc(20 * kMiB, weights_);
  FillPattern(seg + 1 * kMiB, 2 * kMiB, 5);
  FillPattern(seg + 10 * kMiB, 1 * kMiB, 6);
  CachingAllocator::LiveRanges live = {{seg + 10 * kMiB, kMiB}, {seg + 1 * kMiB, kMiB}, {seg + 2 * kMiB, kMiB}};
  ASSERT_EQ(*alloc_->Pause(weights_, &live), Transition::kDone);
  EXPECT_EQ(Stats(weights_).backed_up_bytes, static_cast<std::int64_t>(3 * kMiB));
  ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
  EXPECT_TRUE(HasPattern(seg + 1 * kMiB, 2 * kMiB, 5));
  EXPECT_TRUE(HasPattern(seg + 10 * kMiB, 1 * kMiB, 6));
  // Without a hint the whole requested bytes of each block are kept again.
  FillPattern(empty, 20 * kMiB, 7);
  ASSERT_EQ(*alloc_->Pause(weights_), Transition::kDone);
  EXPECT_EQ(Stats(weights_).backed_up_bytes, static_cast<std::int64_t>(40 * kMiB));
  // Freeing a paused block drops its backup bytes.
  ASSERT_TRUE(alloc_->Free(seg).ok());
  EXPECT_EQ(Stats(weights_).backed_up_bytes, static_cast<std::int64_t>(20 * kMiB));
  ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
  EXPECT_TRUE(HasPattern(empty, 20 * kMiB, 7));
  ASSERT_TRUE(alloc_->Free(empty).ok());
}

TEST_F(PauseResumeTest, BackupBytesAreReadableWhilePaused) {
  DevicePtr p = Alloc(5 * kMiB, weights_);
  FillPattern(p, 5 * kMiB, 9);
  std::vector<std::uint8_t> host(kMiB);
  EXPECT_EQ(alloc_->ReadBackup(p, kMiB, host.data()).code(), absl::StatusCode::kNotFound);  // not paused
  ASSERT_EQ(*alloc_->Pause(weights_), Transition::kDone);
  ASSERT_TRUE(alloc_->ReadBackup(p + 2 * kMiB, kMiB, host.data()).ok());
  for (std::size_t i = 0; i < kMiB; i += 4093) {
    const std::size_t at = 2 * kMiB + i;
    if (at % 4093 == 0) EXPECT_EQ(host[i], static_cast<std::uint8_t>(9 + at / 4093)) << i;
  }
  EXPECT_EQ(alloc_->ReadBackup(p + 4 * kMiB, 2 * kMiB, host.data()).code(), absl::StatusCode::kNotFound);  // past it
  // Without a copy: the address of the same bytes in the backup.
  absl::StatusOr<const void*> at = alloc_->BackupAddress(p + 2 * kMiB, kMiB);
  ASSERT_TRUE(at.ok()) << at.status();
  EXPECT_EQ(std::memcmp(*at, host.data(), kMiB), 0);
  EXPECT_EQ(alloc_->BackupAddress(p + 4 * kMiB, 2 * kMiB).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(alloc_->BackupAddress(p + 16, SIZE_MAX - 15).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
  EXPECT_EQ(alloc_->BackupAddress(p, kMiB).status().code(), absl::StatusCode::kNotFound);  // resumed
  ASSERT_TRUE(alloc_->Free(p).ok());
}

TEST_F(PauseResumeTest, MemoryMarginRefusesGrowthThatWouldCutIntoIt) {
  // The simulated device has 2 GiB; keep 1.5 GiB free.
  alloc_->SetMemoryMargin(1536 * kMiB);
  DevicePtr small = Alloc(256 * kMiB, kv_);
  absl::StatusOr<DevicePtr> big = alloc_->Allocate(512 * kMiB, nullptr, kv_);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(big.status().message().find("memory margin"), absl::string_view::npos) << big.status();
  alloc_->SetMemoryMargin(0);
  big = alloc_->Allocate(512 * kMiB, nullptr, kv_);
  ASSERT_TRUE(big.ok()) << big.status();
  ASSERT_TRUE(alloc_->Free(*big).ok());
  ASSERT_TRUE(alloc_->Free(small).ok());
}

TEST_F(PauseResumeTest, StoppedBackgroundWorkPreparesNothing) {
  AllocatorOptions options;
  options.auto_prepare_settle_ms = 0;
  Make(SimDriverOptions{1, 2 * kGiB, 2 * kMiB, {}}, options, /*auto_prepare=*/true);
  alloc_->StopBackgroundWork();  // what the C ABI does at process exit
  DevicePtr p = Alloc(100 * kMiB, weights_);
  alloc_->WaitForBackgroundPrepare();
  EXPECT_EQ(Stats(weights_).backup_arena_bytes, 0);
  EXPECT_EQ(sim_->Counters().Calls(DriverOp::kHostRegister), 0u);
  ASSERT_TRUE(alloc_->Free(p).ok());
}

// A backup released after each resume (ReleaseBackup): the background preparer must not pin
// it again at once, only when the tag grows.
TEST_F(PauseResumeTest, AReleasedBackupIsNotPreparedAgainUntilTheTagGrows) {
  AllocatorOptions options;
  options.auto_prepare_settle_ms = 0;
  Make(SimDriverOptions{1, 2 * kGiB, 2 * kMiB, {}}, options, /*auto_prepare=*/true);
  DevicePtr p = Alloc(100 * kMiB, weights_);
  alloc_->WaitForBackgroundPrepare();
  EXPECT_GT(Stats(weights_).backup_arena_bytes, 0);
  for (int cycle = 0; cycle < 3; ++cycle) {
    const std::uint64_t pins = sim_->Counters().Calls(DriverOp::kHostRegister);
    ASSERT_EQ(*alloc_->Pause(weights_), Transition::kDone);
    const std::uint64_t paused_pins = sim_->Counters().Calls(DriverOp::kHostRegister) - pins;
    ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
    alloc_->WaitForBackgroundPrepare();  // a request made by the resume would run now
    // Cycle 0 pauses into the prepared arena; later ones pin what they need, in the pause
    // itself; the resume's background request pins nothing.
    EXPECT_EQ(paused_pins, cycle == 0 ? 0u : 2u) << "cycle " << cycle;  // 100 MiB: two pieces
    EXPECT_EQ(sim_->Counters().Calls(DriverOp::kHostRegister) - pins, paused_pins) << "cycle " << cycle;
    ASSERT_TRUE(alloc_->ReleaseBackup(weights_).ok());
    alloc_->WaitForBackgroundPrepare();
    EXPECT_EQ(Stats(weights_).backup_arena_bytes, 0) << "cycle " << cycle;
  }
  DevicePtr more = Alloc(200 * kMiB, weights_);  // grown: prepared again
  alloc_->WaitForBackgroundPrepare();
  EXPECT_GT(Stats(weights_).backup_arena_bytes, static_cast<std::int64_t>(300 * kMiB));
  ASSERT_TRUE(alloc_->Free(more).ok());
  ASSERT_TRUE(alloc_->Free(p).ok());
}

TEST_F(PauseResumeTest, OnlyLiveBytesAreCopiedFreeCachedBlocksAreDropped) {
  std::vector<DevicePtr> blocks;
  for (int i = 0; i < 20; ++i) blocks.push_back(Alloc(10 * kMiB, weights_));
  for (int i = 0; i < 20; i += 2) ASSERT_TRUE(alloc_->Free(blocks[i]).ok());
  ASSERT_EQ(*alloc_->Pause(weights_), Transition::kDone);
  EXPECT_EQ(sim_->Counters().bytes_to_host, 10 * 10 * kMiB);
  EXPECT_EQ(Stats(weights_).backed_up_bytes, static_cast<std::int64_t>(100 * kMiB));
  ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
  EXPECT_EQ(sim_->Counters().bytes_to_device, 10 * 10 * kMiB);
  // Resumed memory covers the live blocks only (10 separate covers of 10 MiB).
  EXPECT_EQ(Stats(weights_).reserved_bytes.current, static_cast<std::int64_t>(100 * kMiB));
  for (int i = 1; i < 20; i += 2) ASSERT_TRUE(alloc_->Free(blocks[i]).ok());
  // The holes are usable again after resume.
  DevicePtr again = Alloc(10 * kMiB, weights_);
  ASSERT_TRUE(alloc_->Free(again).ok());
}

TEST_F(PauseResumeTest, NoOpsAllocationIntoPausedTagAndFreeWhilePaused) {
  DevicePtr a = Alloc(4 * kMiB, weights_);
  DevicePtr b = Alloc(4 * kMiB, weights_);
  FillPattern(a, 4 * kMiB, 1);
  EXPECT_EQ(*alloc_->Resume(weights_), Transition::kAlreadyInState);
  ASSERT_EQ(*alloc_->Pause(weights_), Transition::kDone);
  EXPECT_EQ(*alloc_->Pause(weights_), Transition::kAlreadyInState);
  absl::StatusOr<DevicePtr> refused = alloc_->Allocate(512, nullptr, weights_);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("'weights' is paused"));
  ASSERT_TRUE(alloc_->Free(b).ok());  // drops its backup bytes
  EXPECT_EQ(Stats(weights_).backed_up_bytes, static_cast<std::int64_t>(4 * kMiB));
  EXPECT_EQ(alloc_->ReleaseBackup(weights_).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
  EXPECT_EQ(*alloc_->Resume(weights_), Transition::kAlreadyInState);
  EXPECT_TRUE(HasPattern(a, 4 * kMiB, 1));
  EXPECT_EQ(Stats(weights_).reserved_bytes.current, static_cast<std::int64_t>(4 * kMiB));
  ASSERT_TRUE(alloc_->Free(a).ok());
  ASSERT_TRUE(alloc_->ReleaseBackup(weights_).ok());
  EXPECT_EQ(Stats(weights_).backup_arena_bytes, 0);
}

// Issue 16 item 6: a tag with no pool here (a typo in `vmstash pause PID TAG`) is
// NotFound; it is not created paused, so later allocations into it still work.
TEST_F(PauseResumeTest, PauseOrResumeOfATagNeverUsedHereIsNotFoundAndCreatesNothing) {
  TagId fresh = *InternTag("never_used");
  absl::StatusOr<Transition> paused = alloc_->Pause(fresh);
  EXPECT_EQ(paused.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(paused.status().message(), HasSubstr("never_used"));
  EXPECT_EQ(alloc_->Resume(fresh).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(alloc_->Prepare(fresh).code(), absl::StatusCode::kNotFound);
  for (const TagStats& t : alloc_->Stats().tags) EXPECT_NE(t.name, "never_used");
  DevicePtr p = Alloc(512, fresh);  // the name still works for allocation
  ASSERT_NE(p, 0u);
  ASSERT_TRUE(alloc_->Free(p).ok());
}

TEST_F(PauseResumeTest, ResumeOutOfMemoryRollsBackAndARetrySucceeds) {
  DevicePtr w = Alloc(800 * kMiB, weights_);
  FillPattern(w, 800 * kMiB, 3);
  ASSERT_EQ(*alloc_->Pause(weights_), Transition::kDone);
  DevicePtr hog = Alloc(1500 * kMiB, kDefaultTag);  // the device is now too full to resume
  std::size_t used = sim_->UsedBytes(0);
  absl::StatusOr<Transition> r = alloc_->Resume(weights_);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(sim_->UsedBytes(0), used);  // nothing kept from the failed attempt
  EXPECT_EQ(Stats(weights_).state, "paused");
  EXPECT_EQ(Stats(weights_).backed_up_bytes, static_cast<std::int64_t>(800 * kMiB));
  ASSERT_TRUE(alloc_->Free(hog).ok());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
  EXPECT_TRUE(HasPattern(w, 800 * kMiB, 3));
  ASSERT_TRUE(alloc_->Free(w).ok());
}

TEST_F(PauseResumeTest, HooksRunAroundTransitionsAndCanVetoAPause) {
  std::vector<std::string> calls;
  bool veto = true;
  ASSERT_TRUE(alloc_
                  ->AddHooks(
                      weights_,
                      [&](TagId t, int d) {
                        calls.push_back("before " + std::string(TagName(t)) + " " + std::to_string(d));
                        return veto ? absl::UnavailableError("NCCL busy") : absl::OkStatus();
                      },
                      [&](TagId t, int) {
                        calls.push_back("after " + std::string(TagName(t)));
                        return absl::OkStatus();
                      })
                  .ok());
  DevicePtr p = Alloc(kMiB, weights_);
  absl::StatusOr<Transition> vetoed = alloc_->Pause(weights_);
  EXPECT_EQ(vetoed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(vetoed.status().message()), HasSubstr("NCCL busy"));
  EXPECT_EQ(Stats(weights_).state, "active");
  veto = false;
  ASSERT_EQ(*alloc_->Pause(weights_), Transition::kDone);
  ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
  EXPECT_EQ(calls, (std::vector<std::string>{"before weights 0", "before weights 0", "after weights"}));
  ASSERT_TRUE(alloc_->Free(p).ok());
}

TEST_F(PauseResumeTest, PrepareMakesTheFirstPausePinNothing) {
  DevicePtr p = Alloc(300 * kMiB, weights_);
  ASSERT_TRUE(alloc_->Prepare(weights_).ok());
  EXPECT_GE(Stats(weights_).backup_arena_bytes, static_cast<std::int64_t>(300 * kMiB));
  std::uint64_t pins = sim_->Counters().Calls(DriverOp::kHostRegister);
  ASSERT_EQ(*alloc_->Pause(weights_), Transition::kDone);
  ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
  ASSERT_EQ(*alloc_->Pause(weights_), Transition::kDone);  // later cycles reuse the arena too
  ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
  EXPECT_EQ(sim_->Counters().Calls(DriverOp::kHostRegister), pins);
  EXPECT_EQ(alloc_->Prepare(kv_).code(), absl::StatusCode::kFailedPrecondition);  // discard: no arena
  ASSERT_TRUE(alloc_->Free(p).ok());
}

TEST_F(PauseResumeTest, PageableBackupRoundTrips) {
  AllocatorOptions options;
  options.backup_store.kind = BackupStore::Kind::kPageable;
  Make(SimDriverOptions{1, 2 * kGiB, 2 * kMiB, {}}, options);
  DevicePtr p = Alloc(50 * kMiB, weights_);
  FillPattern(p, 50 * kMiB, 11);
  ASSERT_EQ(*alloc_->Pause(weights_), Transition::kDone);
  EXPECT_EQ(sim_->Counters().Calls(DriverOp::kHostRegister), 0u);
  ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
  EXPECT_TRUE(HasPattern(p, 50 * kMiB, 11));
  ASSERT_TRUE(alloc_->Free(p).ok());
}

TEST_F(PauseResumeTest, SnapshotAndStatsShowThePausedTag) {
  DevicePtr p = Alloc(8 * kMiB, weights_);
  ASSERT_EQ(*alloc_->Pause(weights_), Transition::kDone);
  std::string snap = SnapshotToJson(alloc_->TakeSnapshot());
  EXPECT_THAT(snap, HasSubstr("\"name\":\"weights\",\"policy\":\"backup\",\"state\":\"paused\""));
  EXPECT_THAT(snap, HasSubstr("\"live\":true"));
  std::string stats = StatsToJson(alloc_->Stats());
  EXPECT_THAT(stats, HasSubstr("\"state\":\"paused\""));
  EXPECT_THAT(stats, HasSubstr("\"backed_up_bytes\":8388608"));
  ASSERT_EQ(*alloc_->Resume(weights_), Transition::kDone);
  ASSERT_TRUE(alloc_->Free(p).ok());
}

}  // namespace
}  // namespace vmstash
