// The pinned backup in pieces (vmm/pinned_pieces.h, Note [Pinned Pieces]) and the
// give_back retention (allocator/tag_pool.h, Note [Retained Backups]) on the simulator:
// switches whose every driver call fails in turn; give_back without release_with_blocks (a failed pause hands the memory
// back instead of releasing it); retention flipped between a pause and its resume; a
// failed resume after the pieces were unpinned; the statistic in every state; the last
// free of a paused tag; a store change while pieces are pinned; foreground and background
// preparations failing half-way or racing transitions; a tag not prepared ahead;
// PinnedPieces' bounds.
#include <atomic>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/tag_pool.h"
#include "allocator/testing.h"
#include "base/byte_pattern.h"
#include "gtest/gtest.h"
#include "vmm/pinned_pieces.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

using ::vmstash::testing::TagStatsOf;

constexpr BackupRetention kTms{false, true, true};        // torch_memory_saver, retain_cpu_backup off
constexpr BackupRetention kTmsRetain{true, true, false};  // retain_cpu_backup on
constexpr BackupRetention kGiveBackOnly{false, false, true};

struct Blocks {
  std::vector<std::pair<DevicePtr, std::size_t>> list;
  std::uint8_t seed = 0;
};

class PinnedBackupTest : public testing::SimAllocatorTest {
 protected:
  void Make(BackupRetention retention, std::size_t device_bytes = 512 * kMiB, bool auto_prepare = false) {
    blocks_.clear();
    AllocatorOptions options = testing::TestOptions();
    options.auto_prepare = auto_prepare;
    options.auto_prepare_settle_ms = 0;
    MakeAllocator(SimDriverOptions{1, device_bytes, 2 * kMiB, {}}, options);
    a_ = *InternTag("review_a");
    b_ = *InternTag("review_b");
    for (TagId t : {a_, b_}) {
      ASSERT_TRUE(alloc_->CreateTag(t, Policy::kBackup).ok());
      ASSERT_TRUE(alloc_->SetBackupRetention(t, retention).ok());
    }
  }
  // Blocks of `tag` of the given sizes, each filled with its own pattern.
  void Fill(TagId tag, std::initializer_list<std::size_t> sizes) {
    for (std::size_t n : sizes) {
      DevicePtr p = *alloc_->Allocate(n, nullptr, tag);
      const auto seed = static_cast<std::uint8_t>(blocks_.size() * 13 + 1);
      FillPattern(p, n, seed);
      blocks_.push_back({tag, p, n, seed});
    }
  }
  // Every block of an active tag holds its pattern on the device; every block of a paused
  // tag in its backup (ReadBackup).
  bool Intact(TagId tag) {
    const bool paused = State(tag) == "paused";
    for (const Block& b : blocks_) {
      if (b.tag != tag) continue;
      if (!paused) {
        if (WrongBytes(b.p, b.n, b.seed) != 0) return false;
        continue;
      }
      std::vector<std::uint8_t> buf(b.n);
      if (!alloc_->ReadBackup(b.p, b.n, buf.data()).ok()) return false;
      if (WrongBytes(buf.data(), b.n, b.seed) != 0) return false;
    }
    return true;
  }
  std::string State(TagId tag) const { return TagStatsOf(*alloc_, tag).state; }
  std::int64_t Held(TagId tag) const { return TagStatsOf(*alloc_, tag).backup_arena_bytes; }
  // Host registrations the driver holds now (successful registers less successful
  // unregisters; only meaningful without injected faults on those two).
  std::int64_t Registered() const {
    const DriverCounters c = sim_->Counters();
    return static_cast<std::int64_t>(c.Calls(DriverOp::kHostRegister)) -
           static_cast<std::int64_t>(c.Calls(DriverOp::kHostUnregister));
  }
  void FreeAllAndCheckNoLeaks() {
    for (const Block& b : blocks_) ASSERT_TRUE(alloc_->Free(b.p).ok());
    blocks_.clear();
    alloc_.reset();
    absl::Status leaks = sim_->CheckNoLeaks();  // a host registration left is a leak
    EXPECT_TRUE(leaks.ok()) << leaks;
  }

  struct Block {
    TagId tag;
    DevicePtr p;
    std::size_t n;
    std::uint8_t seed;
  };
  TagId a_ = 0, b_ = 0;
  std::vector<Block> blocks_;
};

// The calls a clean run of `body` makes, by operation.
template <typename F>
DriverCounters CallsOf(SimDriver& sim, F body) {
  const DriverCounters before = sim.Counters();
  body();
  DriverCounters after = sim.Counters();
  for (int i = 0; i < kNumDriverOps; ++i) after.calls[i] -= before.calls[i];
  return after;
}

// The calls to fail of an operation made `n` times: the first and the last.
std::vector<std::uint64_t> Nths(std::uint64_t n) {
  std::vector<std::uint64_t> out;
  if (n >= 1) out.push_back(1);
  if (n > 1) out.push_back(n);
  return out;
}

const DriverOp kTransitionOps[] = {
    DriverOp::kHostRegister,  DriverOp::kHostUnregister,   DriverOp::kCopyToHost,        DriverOp::kCopyToDevice,
    DriverOp::kCreateEvent,   DriverOp::kRecordEvent,      DriverOp::kSynchronizeEvent,  DriverOp::kSynchronizeStream,
    DriverOp::kUnmap,         DriverOp::kCreateChunk,      DriverOp::kMap,               DriverOp::kStreamWaitEvent,
    DriverOp::kSynchronizeDevice, DriverOp::kSetAccess,    DriverOp::kCreateStream,      DriverOp::kMemset};

// A switch out of A (give_back) into B (give_back, paused with a backup across a piece
// bound): every driver call of the switch fails once in turn, then of the switch back. A
// failed switch leaves A active with its bytes and B paused with its backup; the retry
// succeeds; no bytes are lost, nothing stays pinned or held once both are resumed.

TEST_F(PinnedBackupTest, EveryDriverCallOfASwitchFailsCleanlyWithGiveBack) {
  for (BackupRetention retention : {kTms, kGiveBackOnly}) {
    SCOPED_TRACE(retention.release_with_blocks ? "tms" : "give_back only");
    auto setup = [&] {
      Make(retention);
      Fill(a_, {3 * kMiB, 66 * kMiB});
      Fill(b_, {66 * kMiB, 4 * kMiB});
      ASSERT_EQ(*alloc_->Pause(b_), CachingAllocator::Transition::kDone);
    };
    setup();
    const DriverCounters out_in = CallsOf(*sim_, [&] { ASSERT_TRUE(alloc_->Switch({a_}, {b_}).ok()); });
    const DriverCounters back = CallsOf(*sim_, [&] { ASSERT_TRUE(alloc_->Switch({b_}, {a_}).ok()); });
    EXPECT_TRUE(Intact(a_));
    EXPECT_TRUE(Intact(b_));
    FreeAllAndCheckNoLeaks();
    int cases = 0, failed = 0;
    for (int leg = 0; leg < 2; ++leg) {
      // One leg per retention, to keep the test's time down: A->B with tms, B->A without
      // release_with_blocks.
      if ((leg == 0) != retention.release_with_blocks) continue;
      const DriverCounters& clean = leg == 0 ? out_in : back;
      for (DriverOp op : kTransitionOps) {
        for (std::uint64_t nth : Nths(clean.Calls(op))) {
          SCOPED_TRACE(std::string(leg == 0 ? "A->B " : "B->A ") + std::string(DriverOpName(op)) + "@" +
                       std::to_string(nth));
          setup();
          if (leg == 1) ASSERT_TRUE(alloc_->Switch({a_}, {b_}).ok());
          const TagId out = leg == 0 ? a_ : b_, in = leg == 0 ? b_ : a_;
          ++cases;
          sim_->InjectFault(FaultRule{op, static_cast<int>(nth), 1, absl::StatusCode::kInternal});
          absl::StatusOr<CachingAllocator::Transition> s = alloc_->Switch({out}, {in});
          sim_->ClearFaults();
          if (!s.ok()) {
            ++failed;
            EXPECT_EQ(State(out), "active") << s.status();
            EXPECT_EQ(State(in), "paused") << s.status();
            EXPECT_TRUE(Intact(out));
            EXPECT_TRUE(Intact(in));
            EXPECT_EQ(Held(out), 0) << "a failed switch-out hands (or gives) its memory back";
            ASSERT_TRUE(alloc_->Switch({out}, {in}).ok());
          }
          EXPECT_EQ(State(in), "active");
          EXPECT_TRUE(Intact(in));
          EXPECT_TRUE(Intact(out));
          // Held(in) is not checked here: a failed hand-back after the commit keeps the pieces
          // pinned until the next cycle (AFailedHandBackKeepsThePiecesPinnedUntilTheNextCycle).
          ASSERT_TRUE(alloc_->Resume(out).ok());
          EXPECT_TRUE(Intact(out));
          EXPECT_EQ(Held(out), 0);
          EXPECT_TRUE(alloc_->Validate().ok());
          FreeAllAndCheckNoLeaks();
        }
      }
    }
    EXPECT_GT(cases, 10);
    EXPECT_GT(failed, cases / 3);
  }
}

// A failed hand-back after a committed switch-in or resume (a HostUnregister refused): the
// transition has succeeded (the device has its bytes), so the failure is logged and the
// memory stays pinned and held until the tag's next cycle gives it back (Note [Retained
// Backups], give_back); nothing leaks.
TEST_F(PinnedBackupTest, AFailedHandBackKeepsThePiecesPinnedUntilTheNextCycle) {
  for (bool by_switch : {true, false}) {
    SCOPED_TRACE(by_switch ? "switch" : "resume");
    Make(kTms);
    Fill(b_, {66 * kMiB, 4 * kMiB});
    ASSERT_TRUE(alloc_->Pause(b_).ok());
    sim_->InjectFault(FaultRule{DriverOp::kHostUnregister, 1, 1, absl::StatusCode::kInternal});
    ASSERT_TRUE(by_switch ? alloc_->Switch({}, {b_}).ok() : alloc_->Resume(b_).ok());
    sim_->ClearFaults();
    EXPECT_TRUE(Intact(b_));
    EXPECT_GT(Held(b_), 0) << "the refused piece (and those after it) stay pinned";
    ASSERT_TRUE(alloc_->Pause(b_).ok());
    ASSERT_TRUE(alloc_->Resume(b_).ok());
    EXPECT_TRUE(Intact(b_));
    EXPECT_EQ(Held(b_), 0);
    FreeAllAndCheckNoLeaks();
  }
}

// give_back without release_with_blocks: a failed pause keeps the arena and hands its
// memory back (DropContents(give_back) -> HandBack), which no other test takes. Every call
// of a pause and of a resume fails in turn; the bytes survive, nothing is held afterwards,
// nothing leaks.
TEST_F(PinnedBackupTest, GiveBackWithoutReleaseWithBlocksEveryCallFails) {
  DriverCounters clean;
  {
    Make(kGiveBackOnly);
    Fill(a_, {3 * kMiB, 70 * kMiB});
    clean = CallsOf(*sim_, [&] {
      ASSERT_TRUE(alloc_->Pause(a_).ok());
      ASSERT_TRUE(alloc_->Resume(a_).ok());
    });
    FreeAllAndCheckNoLeaks();
  }
  int cases = 0, failed = 0;
  for (DriverOp op : kTransitionOps) {
    // A failed unregister in the resume's hand-back is logged, not returned (see
    // AFailedHandBackKeepsThePiecesPinnedUntilTheNextCycle).
    if (op == DriverOp::kHostUnregister) continue;
    for (std::uint64_t nth : Nths(clean.Calls(op))) {
      SCOPED_TRACE(std::string(DriverOpName(op)) + "@" + std::to_string(nth));
      Make(kGiveBackOnly);
      Fill(a_, {3 * kMiB, 70 * kMiB});
      ++cases;
      sim_->InjectFault(FaultRule{op, static_cast<int>(nth), 1, absl::StatusCode::kInternal});
      if (!alloc_->Pause(a_).ok()) {
        ++failed;
        sim_->ClearFaults();
        EXPECT_EQ(State(a_), "active");
        EXPECT_TRUE(Intact(a_));
        EXPECT_EQ(Held(a_), 0) << "a failed pause hands the memory back";
        if (op != DriverOp::kHostRegister) EXPECT_EQ(Registered(), 0);  // a failed call is counted
        ASSERT_TRUE(alloc_->Pause(a_).ok());
      }
      EXPECT_TRUE(Intact(a_));
      if (!alloc_->Resume(a_).ok()) {
        ++failed;
        sim_->ClearFaults();
        EXPECT_EQ(State(a_), "paused");
        EXPECT_TRUE(Intact(a_)) << "a failed resume keeps the backup readable";
        ASSERT_TRUE(alloc_->Resume(a_).ok());
      }
      sim_->ClearFaults();
      EXPECT_EQ(State(a_), "active");
      EXPECT_TRUE(Intact(a_));
      EXPECT_EQ(Held(a_), 0);
      // The handed-back arena serves the next cycle.
      ASSERT_TRUE(alloc_->Pause(a_).ok());
      ASSERT_TRUE(alloc_->Resume(a_).ok());
      EXPECT_TRUE(Intact(a_));
      EXPECT_EQ(Held(a_), 0);
      FreeAllAndCheckNoLeaks();
    }
  }
  EXPECT_GT(cases, 15);
  EXPECT_GT(failed, cases / 3);
}

// The drop-in sets the retention before every pause and every resume, so the flags a
// pause ran with need not be those of its resume.
TEST_F(PinnedBackupTest, RetentionFlippedBetweenPauseAndResumeLosesNoByte) {
  Make(kTms);
  Fill(a_, {3 * kMiB, 70 * kMiB, 5 * kMiB});
  // Paused giving back, resumed retaining: kept pinned and readable.
  ASSERT_TRUE(alloc_->Pause(a_).ok());
  ASSERT_TRUE(alloc_->SetBackupRetention(a_, kTmsRetain).ok());
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  EXPECT_TRUE(Intact(a_));
  EXPECT_GT(Held(a_), 0);
  EXPECT_GT(Registered(), 0);
  std::vector<std::uint8_t> buf(blocks_[1].n);
  ASSERT_TRUE(alloc_->ReadBackup(blocks_[1].p, buf.size(), buf.data()).ok()) << "retained";
  EXPECT_EQ(WrongBytes(buf.data(), buf.size(), blocks_[1].seed), 0u);
  // The retained arena with give_back set again, then a background-like foreground
  // Prepare: the retained bytes stay readable.
  ASSERT_TRUE(alloc_->SetBackupRetention(a_, kTms).ok());
  ASSERT_TRUE(alloc_->ReadBackup(blocks_[1].p, buf.size(), buf.data()).ok());
  EXPECT_EQ(WrongBytes(buf.data(), buf.size(), blocks_[1].seed), 0u);
  // Paused retaining, resumed giving back: nothing held, nothing pinned, nothing readable.
  ASSERT_TRUE(alloc_->SetBackupRetention(a_, kTmsRetain).ok());
  ASSERT_TRUE(alloc_->Pause(a_).ok());
  ASSERT_TRUE(alloc_->SetBackupRetention(a_, kTms).ok());
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  EXPECT_TRUE(Intact(a_));
  EXPECT_EQ(Held(a_), 0);
  EXPECT_EQ(Registered(), 0);
  EXPECT_FALSE(alloc_->ReadBackup(blocks_[1].p, 4096, buf.data()).ok());
  // And a retained arena, flipped to give_back, paused and resumed in a switch.
  ASSERT_TRUE(alloc_->SetBackupRetention(a_, kTmsRetain).ok());
  ASSERT_TRUE(alloc_->Pause(a_).ok());
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  ASSERT_TRUE(alloc_->SetBackupRetention(a_, kTms).ok());
  ASSERT_TRUE(alloc_->Switch({a_}, {}).ok());
  EXPECT_TRUE(Intact(a_));
  ASSERT_TRUE(alloc_->Switch({}, {a_}).ok());
  EXPECT_TRUE(Intact(a_));
  EXPECT_EQ(Held(a_), 0);
  EXPECT_EQ(Registered(), 0);
  FreeAllAndCheckNoLeaks();
}

// A resume whose final stream synchronize fails, after every restore copy was queued from
// the pinned pieces: the tag is paused, its backup readable, and the retry restores every
// byte and gives the memory back.
TEST_F(PinnedBackupTest, FailedResumeAtItsLastSyncKeepsTheBackupAndTheRetryRestores) {
  Make(kTms);
  Fill(a_, {3 * kMiB, 70 * kMiB, 60 * kMiB});
  ASSERT_TRUE(alloc_->Pause(a_).ok());
  const std::int64_t held = Held(a_);
  const std::uint64_t to_device = sim_->Counters().Calls(DriverOp::kCopyToDevice);
  bool armed = false;
  sim_->SetBeforeCall([&](DriverOp op) {
    // The stream synchronize after the restore copies were queued fails, once.
    if (!armed && op == DriverOp::kSynchronizeStream && sim_->Counters().Calls(DriverOp::kCopyToDevice) > to_device) {
      armed = true;
      sim_->InjectFault(FaultRule{DriverOp::kSynchronizeStream, 1, 1, absl::StatusCode::kInternal});
    }
  });
  EXPECT_FALSE(alloc_->Resume(a_).ok());
  sim_->SetBeforeCall(nullptr);
  sim_->ClearFaults();
  EXPECT_TRUE(armed);
  EXPECT_EQ(State(a_), "paused");
  EXPECT_EQ(Held(a_), held);
  EXPECT_TRUE(Intact(a_)) << "readable from the pieces";
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  EXPECT_TRUE(Intact(a_));
  EXPECT_EQ(Held(a_), 0);
  EXPECT_EQ(Registered(), 0);
  FreeAllAndCheckNoLeaks();
}

// backup_arena_bytes (held_bytes) in every state of a pinned arena, and of a pageable one.
TEST_F(PinnedBackupTest, TheStatisticInEveryState) {
  Make(kTms);
  EXPECT_EQ(Held(a_), 0) << "no arena";
  Fill(a_, {3 * kMiB, 70 * kMiB});  // 73 MiB: two pieces
  ASSERT_TRUE(alloc_->Pause(a_).ok());
  const std::int64_t paused = Held(a_);
  EXPECT_GE(paused, static_cast<std::int64_t>(73 * kMiB));
  EXPECT_EQ(Registered(), 2);
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  EXPECT_EQ(Held(a_), 0) << "given back";
  ASSERT_TRUE(alloc_->Prepare(a_, 0).ok());  // a foreground preparation pins it all
  EXPECT_GE(Held(a_), static_cast<std::int64_t>(73 * kMiB));
  EXPECT_EQ(Registered(), 2);
  ASSERT_TRUE(alloc_->ReleaseBackup(a_).ok());
  EXPECT_EQ(Held(a_), 0);
  EXPECT_EQ(Registered(), 0);
  // Retaining: held after the resume.
  ASSERT_TRUE(alloc_->SetBackupRetention(a_, kTmsRetain).ok());
  ASSERT_TRUE(alloc_->Pause(a_).ok());
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  EXPECT_GE(Held(a_), static_cast<std::int64_t>(73 * kMiB));
  // A new store drops the pinned arena.
  ASSERT_TRUE(alloc_->SetBackupStore(a_, BackupStore{BackupStore::Kind::kPageable, ""}).ok());
  EXPECT_EQ(Held(a_), 0);
  EXPECT_EQ(Registered(), 0);
  ASSERT_TRUE(alloc_->SetBackupRetention(a_, kTms).ok());
  ASSERT_TRUE(alloc_->Pause(a_).ok());
  EXPECT_GE(Held(a_), static_cast<std::int64_t>(73 * kMiB)) << "pageable, paused";
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  EXPECT_EQ(Held(a_), 0) << "pageable, its pages dropped after the resume";
  EXPECT_TRUE(Intact(a_));
  FreeAllAndCheckNoLeaks();
}

// The last free of a paused tag's block releases a pinned arena (release_with_blocks):
// no piece stays registered, nothing is held, and the resume has nothing to restore.
TEST_F(PinnedBackupTest, LastFreeOfAPausedTagUnpinsAndReleasesItsPieces) {
  Make(kTms);
  Fill(a_, {3 * kMiB, 70 * kMiB, 60 * kMiB});
  ASSERT_TRUE(alloc_->Pause(a_).ok());
  EXPECT_EQ(Registered(), 3);  // 133 MiB: three pieces
  ASSERT_TRUE(alloc_->Free(blocks_[0].p).ok());
  ASSERT_TRUE(alloc_->Free(blocks_[1].p).ok());
  EXPECT_EQ(Registered(), 3) << "one block still backed up";
  ASSERT_TRUE(alloc_->Free(blocks_[2].p).ok());
  blocks_.clear();
  EXPECT_EQ(Registered(), 0);
  EXPECT_EQ(Held(a_), 0);
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  EXPECT_EQ(State(a_), "active");
  // Give-back only (the arena stays): the resume with nothing to restore hands it back.
  ASSERT_TRUE(alloc_->SetBackupRetention(a_, kGiveBackOnly).ok());
  Fill(a_, {70 * kMiB});
  ASSERT_TRUE(alloc_->Pause(a_).ok());
  ASSERT_TRUE(alloc_->Free(blocks_[0].p).ok());
  blocks_.clear();
  EXPECT_EQ(Registered(), 2) << "kept: release_with_blocks is off";
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  EXPECT_EQ(Registered(), 0);
  EXPECT_EQ(Held(a_), 0);
  FreeAllAndCheckNoLeaks();
}

// A foreground preparation whose n-th registration fails: an error, the tag active, the
// statistic what is held; the next pause pins the rest and every byte survives.
TEST_F(PinnedBackupTest, ForegroundPrepareFailingHalfWay) {
  for (int nth = 1; nth <= 3; ++nth) {
    SCOPED_TRACE(nth);
    Make(kTms);
    Fill(a_, {3 * kMiB, 130 * kMiB});  // three pieces of arena
    sim_->InjectFault(FaultRule{DriverOp::kHostRegister, nth, 1, absl::StatusCode::kInternal});
    EXPECT_FALSE(alloc_->Prepare(a_, 0).ok());
    sim_->ClearFaults();
    EXPECT_EQ(State(a_), "active");
    EXPECT_GT(Held(a_), 0);
    ASSERT_TRUE(alloc_->Pause(a_).ok());
    ASSERT_TRUE(alloc_->Resume(a_).ok());
    EXPECT_TRUE(Intact(a_));
    EXPECT_EQ(Held(a_), 0);
    FreeAllAndCheckNoLeaks();  // no registration left
  }
}

// Background preparations (auto_prepare, steps of kPrepareStepBytes) racing pauses,
// resumes, switches, store changes, backup releases and frees of the same tag on other
// threads: no byte lost, nothing left pinned or leaked at the end.
TEST_F(PinnedBackupTest, BackgroundPreparationRacingEverything) {
  Make(kTms, 2 * kGiB, /*auto_prepare=*/true);
  Fill(a_, {3 * kMiB, 520 * kMiB});  // the request rounds to 704 MiB: two steps
  Fill(b_, {8 * kMiB});
  std::atomic<bool> stop{false};
  std::thread churn([&] {  // grows and shrinks a_ so that requests keep coming
    for (int i = 0; !stop.load(); ++i) {
      absl::StatusOr<DevicePtr> p = alloc_->Allocate((i % 5 + 1) * 40 * kMiB, nullptr, a_);
      if (p.ok()) (void)alloc_->Free(*p);
      std::this_thread::yield();
    }
  });
  for (int round = 0; round < 6; ++round) {
    SCOPED_TRACE(round);
    switch (round % 6) {
      case 0:
      case 3:
        ASSERT_TRUE(alloc_->Pause(a_).ok());
        EXPECT_TRUE(Intact(a_));
        ASSERT_TRUE(alloc_->Resume(a_).ok());
        break;
      case 1:
        ASSERT_TRUE(alloc_->Switch({a_}, {}).ok());
        ASSERT_TRUE(alloc_->Switch({}, {a_}).ok());
        break;
      case 2:
        (void)alloc_->ReleaseBackup(a_);
        break;
      case 4:
        ASSERT_TRUE(alloc_->SetBackupStore(a_, BackupStore{BackupStore::Kind::kPageable, ""}).ok());
        ASSERT_TRUE(alloc_->Pause(a_).ok());
        ASSERT_TRUE(alloc_->Resume(a_).ok());
        ASSERT_TRUE(alloc_->SetBackupStore(a_, BackupStore{}).ok());
        break;
      case 5:
        ASSERT_TRUE(alloc_->Switch({a_}, {}).ok());
        ASSERT_TRUE(alloc_->Switch({b_}, {a_}).ok());
        ASSERT_TRUE(alloc_->Resume(b_).ok());
        break;
    }
    EXPECT_TRUE(Intact(a_));
    EXPECT_TRUE(Intact(b_));
  }
  stop = true;
  churn.join();
  alloc_->WaitForBackgroundPrepare();
  EXPECT_TRUE(alloc_->Validate().ok());
  FreeAllAndCheckNoLeaks();
}

// SetPrepareAhead: a tag not prepared ahead holds no pinned memory however it grows (its
// first pause makes the arena, and keeps every byte); the arena is kept when the flag goes
// off; on again, the tag's present size is prepared. The other tag is prepared meanwhile.
TEST_F(PinnedBackupTest, ATagNotPreparedAheadPinsNothingUntilItsPause) {
  Make(BackupRetention{}, 1 * kGiB, /*auto_prepare=*/true);
  ASSERT_TRUE(alloc_->SetPrepareAhead(a_, false).ok());
  Fill(a_, {96 * kMiB});
  Fill(b_, {32 * kMiB});
  alloc_->WaitForBackgroundPrepare();
  EXPECT_EQ(TagStatsOf(*alloc_, a_).backup_arena_bytes, 0);
  EXPECT_GE(TagStatsOf(*alloc_, b_).backup_arena_bytes, static_cast<std::int64_t>(32 * kMiB));
  ASSERT_TRUE(alloc_->Pause(a_).ok());  // made on first need
  EXPECT_TRUE(Intact(a_));
  ASSERT_TRUE(alloc_->Resume(a_).ok());
  EXPECT_TRUE(Intact(a_));
  EXPECT_GE(TagStatsOf(*alloc_, a_).backup_arena_bytes, static_cast<std::int64_t>(96 * kMiB));  // kept (retention)
  ASSERT_TRUE(alloc_->SetPrepareAhead(a_, true).ok());
  alloc_->WaitForBackgroundPrepare();
  const std::int64_t kept = TagStatsOf(*alloc_, a_).backup_arena_bytes;
  ASSERT_TRUE(alloc_->SetPrepareAhead(a_, false).ok());  // off again: the arena stays as it is
  alloc_->WaitForBackgroundPrepare();
  EXPECT_EQ(TagStatsOf(*alloc_, a_).backup_arena_bytes, kept);
  ASSERT_TRUE(alloc_->ReleaseBackup(a_).ok());
  Fill(a_, {64 * kMiB});
  alloc_->WaitForBackgroundPrepare();
  EXPECT_EQ(TagStatsOf(*alloc_, a_).backup_arena_bytes, 0);
  ASSERT_TRUE(alloc_->SetPrepareAhead(a_, true).ok());  // on: the present 160 MiB, with headroom
  alloc_->WaitForBackgroundPrepare();
  EXPECT_GE(TagStatsOf(*alloc_, a_).backup_arena_bytes, static_cast<std::int64_t>(160 * kMiB));
  // Released, then asked for again without growing: the release's floor does not hold it back.
  ASSERT_TRUE(alloc_->ReleaseBackup(a_).ok());
  ASSERT_TRUE(alloc_->SetPrepareAhead(a_, false).ok());
  ASSERT_TRUE(alloc_->SetPrepareAhead(a_, true).ok());
  alloc_->WaitForBackgroundPrepare();
  EXPECT_GE(TagStatsOf(*alloc_, a_).backup_arena_bytes, static_cast<std::int64_t>(160 * kMiB));
  EXPECT_EQ(alloc_->SetPrepareAhead(*InternTag("review_none"), false).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(alloc_->Validate().ok());
  FreeAllAndCheckNoLeaks();
}

// PinnedPieces' bounds: an arena smaller than a piece, a capacity not a multiple of the
// piece, zero sizes, offsets at piece bounds and past the end, a size that overflows.
TEST(PinnedPiecesBoundsTest, SmallOddAndEmptyArenas) {
  SimDriver sim;
  constexpr std::size_t kPiece = PinnedPieces::kPieceBytes;
  const std::size_t dev = kPiece + 8 * kMiB;
  const DevicePtr va = sim.ReserveAddress(0, dev, 0).value();
  const ChunkHandle chunk = sim.CreateChunk(0, dev, {}).value();
  ASSERT_TRUE(sim.Map(va, dev, chunk).ok());
  ASSERT_TRUE(sim.SetAccess(va, dev, 0).ok());
  const Stream stream = sim.CreateStream(0).value();
  FillPattern(va, dev, 9);
  {
    PinnedPieces p(&sim, 0, 3);
    // Empty: every call is a no-op or a range error.
    EXPECT_TRUE(p.Reserve(0).ok());
    EXPECT_EQ(p.capacity_bytes(), 0u);
    EXPECT_TRUE(p.Warm(0).ok());
    EXPECT_TRUE(p.Pin(0, 0).ok());
    EXPECT_TRUE(p.CopyIn(0, va, 0, stream).ok());
    EXPECT_TRUE(p.CopyOut(va, 0, 0, stream).ok());
    EXPECT_FALSE(p.CopyIn(0, va, 1, stream).ok());
    EXPECT_TRUE(p.Unpin().ok());
    EXPECT_TRUE(p.HandBack(true).ok());
    // Smaller than a piece: one piece of 2 MiB.
    ASSERT_TRUE(p.Reserve(1).ok());
    EXPECT_EQ(p.capacity_bytes(), 2 * kMiB);
    EXPECT_EQ(p.piece_count(), 1u);
    EXPECT_EQ(p.resident_bytes(), 0u);
    EXPECT_TRUE(p.CopyIn(2 * kMiB, va, 0, stream).ok()) << "an empty copy at the end";
    EXPECT_FALSE(p.CopyIn(2 * kMiB + 1, va, 0, stream).ok()) << "past the end";
    EXPECT_FALSE(p.CopyIn(kMiB, va, kMiB + 1, stream).ok());
    EXPECT_FALSE(p.Pin(std::numeric_limits<std::size_t>::max(), 2).ok());
    EXPECT_FALSE(p.CopyOut(va, 0, 4096, stream).ok()) << "a cold piece is never read";
    ASSERT_TRUE(p.CopyIn(0, va, 2 * kMiB, stream).ok());
    EXPECT_EQ(p.pinned_bytes(), 2 * kMiB);
    EXPECT_EQ(p.pinned_prefix_bytes(), 2 * kMiB);
    EXPECT_EQ(WrongBytes(p.data(), 2 * kMiB, 9), 0u);
    // A capacity not a multiple of the piece: 64 MiB + 6 MiB.
    ASSERT_TRUE(p.Reserve(kPiece + 5 * kMiB + 1).ok());
    EXPECT_EQ(p.capacity_bytes(), kPiece + 6 * kMiB);
    EXPECT_EQ(p.piece_count(), 2u);
    // A copy starting exactly at the piece bound pins only the second piece.
    ASSERT_TRUE(p.CopyIn(kPiece, va + kPiece, 6 * kMiB, stream).ok());
    EXPECT_EQ(p.pinned_bytes(), 6 * kMiB);
    EXPECT_EQ(p.pinned_prefix_bytes(), 0u) << "piece 0 is not pinned";
    // One ending exactly at the bound pins only the first.
    ASSERT_TRUE(p.CopyIn(0, va, kPiece, stream).ok());
    EXPECT_EQ(p.pinned_prefix_bytes(), kPiece + 6 * kMiB);
    ASSERT_TRUE(sim.SynchronizeStream(0, stream).ok());
    // Across the bound, back to the device, after zeroing it.
    std::vector<char> zeros(dev, 0);
    ASSERT_TRUE(sim.CopyToDeviceAsync(0, va, zeros.data(), dev, stream).ok());
    ASSERT_TRUE(p.CopyOut(va + kPiece - kMiB, kPiece - kMiB, 3 * kMiB, stream).ok());
    ASSERT_TRUE(p.Unpin().ok());
    EXPECT_EQ(p.pinned_bytes(), 0u);
    EXPECT_EQ(p.resident_bytes(), kPiece + 6 * kMiB) << "unpinned, kept";
    EXPECT_EQ(WrongBytes(static_cast<std::uint64_t>(va + kPiece - kMiB), 3 * kMiB, static_cast<std::uint8_t>(9 + (kPiece - kMiB) * 7 % 256)),
              0u);
    ASSERT_TRUE(p.HandBack(/*lazily=*/false).ok());
    EXPECT_EQ(p.resident_bytes(), 0u);
    EXPECT_FALSE(p.CopyOut(va, kPiece, 4096, stream).ok());
    // A size whose rounding overflows is refused (InvalidArgument), not wrapped to a small
    // mapping, and the arena stays as it was.
    const std::size_t before = p.capacity_bytes();
    absl::Status huge = p.Reserve(std::numeric_limits<std::size_t>::max());
    EXPECT_EQ(huge.code(), absl::StatusCode::kInvalidArgument) << huge;
    EXPECT_EQ(p.capacity_bytes(), before);
    EXPECT_TRUE(p.Release().ok());
  }
  ASSERT_TRUE(sim.SynchronizeStream(0, stream).ok());
  ASSERT_TRUE(sim.DestroyStream(0, stream).ok());
  ASSERT_TRUE(sim.Unmap(0, va, dev).ok());
  ASSERT_TRUE(sim.ReleaseChunk(chunk).ok());
  ASSERT_TRUE(sim.FreeAddress(0, va, dev).ok());
  EXPECT_TRUE(sim.CheckNoLeaks().ok()) << sim.CheckNoLeaks();
}

}  // namespace
}  // namespace vmstash
