// StashArena on the simulated driver (HostStashOps), in CI: a differential test against
// the CPU reference model (page_model.h) over random stash/restore/discard/reset
// sequences, and the arena's host-side logic: the pause refusal with live pages, an idle
// arena's pause releasing its memory and a reset after resume, Prepare's rollback under
// injected driver faults, the pause hook outliving the arena, and flags linked among
// arenas (Megatron-LM's shared overflow).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/testing.h"
#include "gtest/gtest.h"
#include "stash/arena.h"
#include "stash/page_model.h"
#include "vmm/sim_driver.h"

namespace vmstash::stash {
namespace {

constexpr std::uint64_t kRowBytes = 96;  // 16-byte multiple, not a power of two
constexpr std::uint32_t kP = 8;

class ArenaSimTest : public testing::SimAllocatorTest {
 protected:
  void SetUp() override {
    AllocatorOptions options;
    options.auto_prepare = false;
    MakeAllocator(SimDriverOptions{1, 256 * kMiB, 2 * kMiB, {}}, options);
  }
  void TearDown() override {
    arena_.reset();
    for (DevicePtr p : buffers_) EXPECT_TRUE(alloc_->Free(p).ok());
    SimAllocatorTest::TearDown();  // the allocator, then the leak check
  }
  std::uint8_t* Buffer(std::uint64_t bytes) {
    DevicePtr p = *alloc_->Allocate(bytes, nullptr, kDefaultTag);
    buffers_.push_back(p);
    return reinterpret_cast<std::uint8_t*>(p);
  }
  void MakeArena(std::uint64_t device_pages, std::uint64_t host_pages) {
    arena_ = *StashArena::Create(sim_.get(), alloc_.get(), StashArenaSpec{kRowBytes, kP, "stash"});
    ASSERT_TRUE(arena_->Prepare(device_pages, host_pages, nullptr).ok());
  }
  // The free list of `tier` in FIFO order, read from the state block.
  std::vector<std::uint32_t> FreeList(int tier) {
    const StashTier& t = arena_->state()->tier[tier];
    std::vector<std::uint32_t> out;
    for (std::uint64_t c = t.head; c < t.tail; ++c) out.push_back(t.free_list[c % t.cap]);
    return out;
  }

  std::unique_ptr<StashArena> arena_;
  std::vector<DevicePtr> buffers_;
};

TEST_F(ArenaSimTest, UsesTheHostExecutorOnTheSimulatedDriver) {
  MakeArena(4, 0);
  EXPECT_STREQ(arena_->ops().Name(), "host");
}

TEST_F(ArenaSimTest, MatchesTheReferenceModelOverRandomSequences) {
  constexpr std::uint64_t kMaxRows = 5 * kP + 3;
  constexpr int kHandles = 6;
  for (std::uint64_t host_pages : {std::uint64_t{0}, std::uint64_t{9}}) {
    MakeArena(12, host_pages);
    PageModel model = *PageModel::Create(ArenaSpec{kRowBytes, kP, {12, host_pages}, true});
    std::uint8_t* src = Buffer(kMaxRows * kRowBytes);
    std::uint8_t* dst = Buffer(kMaxRows * kRowBytes);
    auto* n_dev = reinterpret_cast<std::int64_t*>(Buffer(8));
    std::vector<StashHandleHeader*> handles;
    std::vector<Handle> model_handles(kHandles);
    for (int i = 0; i < kHandles; ++i) handles.push_back(*arena_->NewHandle(kMaxRows));
    std::mt19937_64 rng(42 + host_pages);
    const std::uint64_t counts[] = {0, 1, kP - 1, kP, kP + 1, 2 * kP + 5, kMaxRows};
    for (int step = 0; step < 3000; ++step) {
      const int h = static_cast<int>(rng() % kHandles);
      const int op = static_cast<int>(rng() % 10);
      SCOPED_TRACE(::testing::Message() << "step " << step << " op " << op << " handle " << h);
      if (op < 5 && model_handles[h].status == HandleStatus::kEmpty) {
        const std::uint64_t n = rng() % 3 == 0 ? rng() % (kMaxRows + 1) : counts[rng() % 7];
        for (std::uint64_t i = 0; i < n * kRowBytes; ++i) src[i] = static_cast<std::uint8_t>(rng());
        *n_dev = static_cast<std::int64_t>(n);
        ASSERT_TRUE(arena_->Stash(nullptr, src, n_dev, kMaxRows, handles[h]).ok());
        ASSERT_TRUE(model.Stash(src, n, kMaxRows, &model_handles[h]).ok());
      } else if (op < 8 && model_handles[h].status != HandleStatus::kEmpty) {
        const bool zero_tail = rng() % 2 == 0;
        std::vector<std::uint8_t> want(kMaxRows * kRowBytes, 0xEE);
        std::memset(dst, 0xEE, kMaxRows * kRowBytes);
        ASSERT_TRUE(arena_->Restore(nullptr, handles[h], dst, kMaxRows, zero_tail).ok());
        ASSERT_TRUE(model.Restore(&model_handles[h], want.data(), kMaxRows, zero_tail).ok());
        ASSERT_EQ(0, std::memcmp(dst, want.data(), want.size()));
      } else if (op == 8 && model_handles[h].status != HandleStatus::kEmpty) {
        ASSERT_TRUE(arena_->Discard(nullptr, handles[h], kMaxRows).ok());
        ASSERT_TRUE(model.Discard(&model_handles[h]).ok());
      } else if (op == 9 && rng() % 8 == 0) {
        ASSERT_TRUE(arena_->Reset(nullptr).ok());
        model.Reset();
        for (int i = 0; i < kHandles; ++i) {
          // A reset forgets every stash: handles start over (the model's Reset does not
          // touch handles, so the test clears both sides alike).
          handles[i]->status = kHandleEmpty;
          model_handles[i] = Handle{};
        }
      }
      ASSERT_EQ(static_cast<int>(handles[h]->status), static_cast<int>(model_handles[h].status));
      StashFlags f = *arena_->ReadFlags(nullptr);
      ASSERT_EQ(f.overflow != 0, model.flags().overflow);
      ASSERT_EQ(f.host_spill != 0, model.flags().host_spill);
      ASSERT_EQ(f.overflow_count, model.flags().overflow_count);
      ASSERT_EQ(f.last_failed_pages, model.flags().last_failed_pages);
      for (int t = 0; t < 2; ++t) {
        ASSERT_EQ(f.peak_pages[t], model.flags().peak_pages[t]);
        ASSERT_EQ(FreeList(t), model.FreeList(t));
      }
    }
    for (StashHandleHeader* h : handles) ASSERT_TRUE(arena_->FreeHandle(h).ok());
    arena_.reset();
  }
}

TEST_F(ArenaSimTest, RestoreIntoASmallerBufferWritesAtMostMaxRows) {
  MakeArena(8, 0);
  std::uint8_t* src = Buffer(4 * kP * kRowBytes);
  std::uint8_t* dst = Buffer(4 * kP * kRowBytes);
  auto* n = reinterpret_cast<std::int64_t*>(Buffer(8));
  for (std::uint64_t i = 0; i < 4 * kP * kRowBytes; ++i) src[i] = static_cast<std::uint8_t>(i * 7);
  std::memset(dst, 0xAB, 4 * kP * kRowBytes);
  *n = 3 * kP;
  StashHandleHeader* h = *arena_->NewHandle(4 * kP);
  ASSERT_TRUE(arena_->Stash(nullptr, src, n, 4 * kP, h).ok());
  ASSERT_TRUE(arena_->Restore(nullptr, h, dst, kP + 1, /*zero_tail=*/true).ok());
  EXPECT_EQ(0, std::memcmp(dst, src, (kP + 1) * kRowBytes));
  EXPECT_EQ(dst[(kP + 1) * kRowBytes], 0xAB);  // past max_rows: untouched
  EXPECT_EQ(FreeList(0).size(), 8u);           // every page came back
  ASSERT_TRUE(arena_->FreeHandle(h).ok());
}

TEST_F(ArenaSimTest, LinkedFlagsAreSharedAmongArenasAsMegatronSharesItsOverflow) {
  // Megatron-LM keeps one int64 overflow and one host-spill flag for all its buffers
  // (one per dtype and hidden size): an overflow in any buffer makes every later stash
  // and restore of every buffer a no-op until the owner clears the flag and resets.
  MakeArena(2, 1);
  auto other = *StashArena::Create(sim_.get(), alloc_.get(), StashArenaSpec{2 * kRowBytes, kP, "stash"});
  ASSERT_TRUE(other->Prepare(4, 0, nullptr).ok());
  auto* flags = reinterpret_cast<std::int64_t*>(Buffer(16));
  std::int64_t* overflow = flags;
  std::int64_t* host_spill = flags + 1;
  overflow[0] = host_spill[0] = 0;
  ASSERT_TRUE(arena_->LinkFlags(nullptr, overflow, host_spill).ok());
  ASSERT_TRUE(other->LinkFlags(nullptr, overflow, host_spill).ok());

  std::uint8_t* src = Buffer(2 * kP * 2 * kRowBytes);
  std::uint8_t* dst = Buffer(2 * kP * 2 * kRowBytes);
  for (std::uint64_t i = 0; i < 2 * kP * 2 * kRowBytes; ++i) src[i] = static_cast<std::uint8_t>(i * 13 + 1);
  auto* n = reinterpret_cast<std::int64_t*>(Buffer(8));
  StashHandleHeader* b0 = *other->NewHandle(2 * kP);
  StashHandleHeader* b1 = *other->NewHandle(2 * kP);
  StashHandleHeader* a[3] = {*arena_->NewHandle(2 * kP), *arena_->NewHandle(2 * kP), *arena_->NewHandle(2 * kP)};

  *n = kP;
  ASSERT_TRUE(other->Stash(nullptr, src, n, 2 * kP, b0).ok());  // the other arena: device tier
  *n = 2 * kP;
  ASSERT_TRUE(arena_->Stash(nullptr, src, n, 2 * kP, a[0]).ok());  // both device pages
  *n = kP;
  ASSERT_TRUE(arena_->Stash(nullptr, src, n, 2 * kP, a[1]).ok());  // the host page
  EXPECT_EQ(a[1]->status, kHandleHost);
  EXPECT_EQ(*host_spill, 1);
  EXPECT_EQ(*overflow, 0);
  ASSERT_TRUE(arena_->Stash(nullptr, src, n, 2 * kP, a[2]).ok());  // no room anywhere
  EXPECT_EQ(*overflow, 1);

  // The other arena has room, but the shared overflow makes its stash and restore no-ops.
  ASSERT_TRUE(other->Stash(nullptr, src, n, 2 * kP, b1).ok());
  EXPECT_EQ(b1->status, kHandleOverflowed);
  std::memset(dst, 0xAB, 2 * kP * 2 * kRowBytes);
  ASSERT_TRUE(other->Restore(nullptr, b0, dst, 2 * kP, false).ok());
  EXPECT_EQ(dst[0], 0xAB);
  EXPECT_EQ(other->ReadFlags(nullptr)->overflow, 0u);  // its own flag: it did not overflow itself

  // A reset leaves the shared flags to their owner; with them cleared, all works again.
  ASSERT_TRUE(other->Reset(nullptr).ok());
  EXPECT_EQ(*overflow, 1);
  ASSERT_TRUE(other->Stash(nullptr, src, n, 2 * kP, b0).ok());
  EXPECT_EQ(b0->status, kHandleOverflowed);
  *overflow = 0;
  *host_spill = 0;
  ASSERT_TRUE(other->Reset(nullptr).ok());
  ASSERT_TRUE(arena_->Reset(nullptr).ok());
  *n = 2 * kP;
  ASSERT_TRUE(other->Stash(nullptr, src, n, 2 * kP, b0).ok());
  ASSERT_TRUE(other->Restore(nullptr, b0, dst, 2 * kP, false).ok());
  EXPECT_EQ(0, std::memcmp(dst, src, 2 * kP * 2 * kRowBytes));
  EXPECT_EQ(*overflow, 0);
  EXPECT_EQ(*host_spill, 0);

  // Unlinked, the arena no longer looks at the shared flag.
  ASSERT_TRUE(other->LinkFlags(nullptr, nullptr, nullptr).ok());
  *overflow = 1;
  ASSERT_TRUE(other->Stash(nullptr, src, n, 2 * kP, b0).ok());
  EXPECT_EQ(b0->status, kHandleDevice);
  ASSERT_TRUE(other->Discard(nullptr, b0, 2 * kP).ok());
  for (StashHandleHeader* h : {b0, b1}) ASSERT_TRUE(other->FreeHandle(h).ok());
  for (StashHandleHeader* h : a) ASSERT_TRUE(arena_->FreeHandle(h).ok());
  other.reset();
}

TEST_F(ArenaSimTest, PauseIsRefusedWithLivePagesAndReleasesAnIdleArena) {
  MakeArena(64, 0);  // 64 pages x 768 B
  std::uint8_t* src = Buffer(kP * kRowBytes);
  auto* n = reinterpret_cast<std::int64_t*>(Buffer(8));
  *n = kP;
  StashHandleHeader* h = *arena_->NewHandle(kP);
  ASSERT_TRUE(arena_->Stash(nullptr, src, n, kP, h).ok());
  absl::StatusOr<CachingAllocator::Transition> refused = alloc_->Pause(arena_->tag());
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("1 page(s)"), absl::string_view::npos) << refused.status();
  ASSERT_TRUE(arena_->Discard(nullptr, h, kP).ok());

  const std::size_t before = sim_->UsedBytes(0);
  ASSERT_TRUE(alloc_->Pause(arena_->tag()).ok());
  EXPECT_GT(before - sim_->UsedBytes(0), 0u);  // the arena's chunks went back
  ASSERT_TRUE(alloc_->Resume(arena_->tag()).ok());
  ASSERT_TRUE(arena_->Reset(nullptr).ok());  // rebuilds the state block (policy discard)
  ASSERT_TRUE(arena_->Stash(nullptr, src, n, kP, h).ok());
  EXPECT_EQ(h->status, kHandleDevice);
  EXPECT_EQ(FreeList(0).size(), 63u);
  ASSERT_TRUE(arena_->Discard(nullptr, h, kP).ok());
  ASSERT_TRUE(arena_->FreeHandle(h).ok());
}

TEST_F(ArenaSimTest, PrepareRollsBackUnderInjectedFaultsAndCanBeRetried) {
  for (DriverOp op : {DriverOp::kCreateChunk, DriverOp::kMap, DriverOp::kHostAlloc, DriverOp::kSynchronizeStream}) {
    for (int nth = 1; nth <= 4; ++nth) {
      SCOPED_TRACE(::testing::Message() << "op " << static_cast<int>(op) << " nth " << nth);
      arena_ = *StashArena::Create(sim_.get(), alloc_.get(), StashArenaSpec{kRowBytes, kP, "stash"});
      ASSERT_TRUE(alloc_->EmptyCache().ok());
      const std::size_t before = sim_->UsedBytes(0);
      sim_->InjectFault(FaultRule{op, nth, 1, absl::StatusCode::kResourceExhausted});
      // Large enough that every piece needs its own chunk (min_chunk is 2 MiB here).
      absl::Status s = arena_->Prepare(4096, 64, nullptr);
      sim_->ClearFaults();
      if (!s.ok()) {
        ASSERT_TRUE(alloc_->EmptyCache().ok());
        EXPECT_EQ(sim_->UsedBytes(0), before) << "a failed Prepare left memory behind: " << s;
        ASSERT_TRUE(arena_->Prepare(4096, 64, nullptr).ok());
      }
      StashFlags f = *arena_->ReadFlags(nullptr);
      EXPECT_EQ(f.overflow, 0u);
      EXPECT_EQ(FreeList(0).size(), 4096u);
      EXPECT_EQ(FreeList(1).size(), 64u);
      arena_.reset();
    }
  }
}

TEST_F(ArenaSimTest, BadArgumentsAreRejected) {
  EXPECT_EQ(StashArena::Create(sim_.get(), alloc_.get(), StashArenaSpec{0, kP, "s"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(StashArena::Create(sim_.get(), alloc_.get(), StashArenaSpec{kRowBytes, 12, "s"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(alloc_->CreateTag(*InternTag("weights_b"), Policy::kBackup).ok());
  EXPECT_EQ(StashArena::Create(sim_.get(), alloc_.get(), StashArenaSpec{kRowBytes, kP, "weights_b"}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  arena_ = *StashArena::Create(sim_.get(), alloc_.get(), StashArenaSpec{kRowBytes, kP, "stash"});
  auto* n = reinterpret_cast<std::int64_t*>(Buffer(8));
  EXPECT_EQ(arena_->Stash(nullptr, n, n, 1, nullptr).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(arena_->Prepare(0, 0, nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(arena_->Prepare(std::uint64_t{1} << 33, 0, nullptr).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(arena_->Prepare(4, 0, nullptr).ok());
  EXPECT_EQ(arena_->Prepare(4, 0, nullptr).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(arena_->Stash(nullptr, n, n, 1, nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(arena_->Restore(nullptr, nullptr, n, 1, false).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ArenaSimTest, APauseAfterTheArenaIsGoneIsNotRefusedAndDoesNotCrash) {
  MakeArena(4, 0);
  const TagId tag = arena_->tag();
  arena_.reset();
  EXPECT_TRUE(alloc_->Pause(tag).ok());
  EXPECT_TRUE(alloc_->Resume(tag).ok());
}

// Issue 16 item 11: handle misuse is refused on the host before anything is launched.
TEST_F(ArenaSimTest, HandleMisuseIsRefusedBeforeAnythingIsLaunched) {
  MakeArena(8, 0);
  std::uint8_t* src = Buffer(8 * kP * kRowBytes);
  std::uint8_t* dst = Buffer(8 * kP * kRowBytes);
  auto* n = reinterpret_cast<std::int64_t*>(Buffer(8));
  StashHandleHeader* h = *arena_->NewHandle(2 * kP);
  StashHandleHeader* other = *arena_->NewHandle(2 * kP);
  *n = 2 * kP;
  // More rows than the handle was created for: its page table would overflow.
  absl::Status s = arena_->Stash(nullptr, src, n, 8 * kP, h);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("created for"), absl::string_view::npos) << s;
  EXPECT_EQ(FreeList(0).size(), 8u);  // nothing taken
  // Not a handle of this arena.
  StashHandleHeader fake{};
  EXPECT_EQ(arena_->Stash(nullptr, src, n, 2 * kP, &fake).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(arena_->Restore(nullptr, &fake, dst, 2 * kP, false).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(arena_->FreeHandle(&fake).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(arena_->Stash(nullptr, src, n, 2 * kP, h).ok());
  EXPECT_EQ(arena_->Restore(nullptr, h, dst, 4 * kP, false).code(), absl::StatusCode::kInvalidArgument);
  // Stashing again into a handle that holds pages would lose them.
  EXPECT_EQ(arena_->Stash(nullptr, src, n, 2 * kP, h).code(), absl::StatusCode::kFailedPrecondition);
  // A handle stashed before a reset: the reset took its pages back; giving them back
  // again would put page ids twice into the free list (two handles sharing pages).
  ASSERT_TRUE(arena_->Reset(nullptr).ok());
  s = arena_->Restore(nullptr, h, dst, 2 * kP, false);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("reset"), absl::string_view::npos) << s;
  EXPECT_EQ(arena_->Discard(nullptr, h, 2 * kP).code(), absl::StatusCode::kFailedPrecondition);
  std::vector<std::uint32_t> free_list = FreeList(0);
  std::sort(free_list.begin(), free_list.end());
  EXPECT_EQ(std::unique(free_list.begin(), free_list.end()), free_list.end());  // no page twice
  EXPECT_EQ(free_list.size(), 8u);
  // After the reset both handles work again, and never share pages.
  ASSERT_TRUE(arena_->Stash(nullptr, src, n, 2 * kP, h).ok());
  ASSERT_TRUE(arena_->Stash(nullptr, src, n, 2 * kP, other).ok());
  const auto* ta = reinterpret_cast<const std::uint32_t*>(h + 1);
  const auto* tb = reinterpret_cast<const std::uint32_t*>(other + 1);
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 2; ++j) EXPECT_NE(ta[i], tb[j]);
  }
  ASSERT_TRUE(arena_->Restore(nullptr, h, dst, 2 * kP, false).ok());
  ASSERT_TRUE(arena_->Discard(nullptr, other, 2 * kP).ok());
  EXPECT_EQ(0, std::memcmp(dst, src, 2 * kP * kRowBytes));
  ASSERT_TRUE(arena_->FreeHandle(h).ok());
  ASSERT_TRUE(arena_->FreeHandle(other).ok());
  EXPECT_EQ(arena_->FreeHandle(h).code(), absl::StatusCode::kInvalidArgument);  // twice
}

// Issue 16 item 11: page_rows * row_bytes wrapping to 0 (a later division by zero).
TEST_F(ArenaSimTest, PageSizesThatOverflowAreRefusedAtCreation) {
  absl::StatusOr<std::unique_ptr<StashArena>> a =
      StashArena::Create(sim_.get(), alloc_.get(), StashArenaSpec{std::uint64_t{1} << 58, 64, "stash"});
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  a = StashArena::Create(sim_.get(), alloc_.get(), StashArenaSpec{(~std::uint64_t{0} / 64) + 1, 64, "stash"});
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  MakeArena(4, 0);
  EXPECT_EQ(arena_->NewHandle(~std::uint64_t{0} / 2).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace vmstash::stash
