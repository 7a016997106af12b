// The handover of chunks between two processes' parts of one switch (Note [Node Switch
// Handover] in node/node_switch.h; allocator/switch_exchange.h), on the simulated driver:
// two allocators, each on its own SimDriver (two "processes" on one device: the chunks
// cross as memfd descriptors, as they would as CUDA's), each part run on its own thread,
// the exchange and the vote played by an in-memory board in the daemon's place. A commit
// maps the pausing side's chunks into the resuming side's covers (nothing created: discard
// covers zeroed, backup covers restored after the giver's interprocess events), and back;
// a veto (the giver restores the bytes a taker wrote from its backup), a failed map of a
// foreign chunk, a failed import or event, or takers that cannot be shown done leave both
// sides as they were, fall back to fresh memory, or break the giver's tag — never wrong
// bytes — and no handle leaks.
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/switch_exchange.h"
#include "allocator/switch_scenario.h"
#include "allocator/testing.h"
#include "base/byte_pattern.h"
#include "gtest/gtest.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

using ::vmstash::testing::FillBlocks;
using ::vmstash::testing::PatternBlock;
using ::vmstash::testing::TagStatsOf;
using ::vmstash::testing::WrongBlocks;

// An offered chunk and its giver (a side's index).
struct Held {
  int giver = 0;
  SharedChunk chunk;
};

// What the daemon grants a taker (node/daemon.cc GrantOnce): the held chunks of the others
// that FitChunks places in `gaps`, moved out of `held`; a chunk placed where no restore
// copy writes goes out as such. `strict_givers` gets the givers whose chunks went into
// strict gaps (SwitchLedger::Took).
std::vector<SharedChunk> GrantAsTheDaemon(int taker, std::vector<Held>& held, const std::vector<FitGap>& gaps,
                                          std::vector<int>* strict_givers) {
  std::vector<std::size_t> candidates;
  std::vector<FitChunk> sizes;
  for (std::size_t i = 0; i < held.size(); ++i) {
    if (held[i].giver == taker) continue;
    candidates.push_back(i);
    sizes.push_back({held[i].chunk.size_bytes, held[i].chunk.anywhere});
  }
  const ChunkFit fit = FitChunks(sizes, gaps);
  std::vector<int> placed_in(held.size(), -1);
  for (std::size_t g = 0; g < fit.placed.size(); ++g) {
    for (int c : fit.placed[g]) placed_in[candidates[c]] = static_cast<int>(g);
  }
  std::vector<SharedChunk> out;
  std::vector<Held> kept;
  for (std::size_t i = 0; i < held.size(); ++i) {
    if (placed_in[i] < 0) {
      kept.push_back(held[i]);
      continue;
    }
    out.push_back(held[i].chunk);
    if (gaps[placed_in[i]].strict) {
      strict_givers->push_back(held[i].giver);
    } else {
      out.back().anywhere = false;
      out.back().wait_event.clear();
    }
  }
  held.swap(kept);
  return out;
}

// The daemon's part, in memory: offers by side, votes, and the decision.
struct Board {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<SharedChunk> offered[2];
  bool offered_all[2] = {false, false};
  bool voted[2] = {false, false};
  absl::Status local[2];
  bool veto = false;  // a third party's "no"
  bool unsettled = false;  // AwaitTakers cannot tell (the daemon lost)
  bool took_strict[2] = {false, false};  // side took the other's chunks into restore gaps
  int settle_asks[2] = {0, 0};
  std::string device[2];
  ~Board() {
    for (auto& v : offered) {
      for (const SharedChunk& c : v) ::close(c.fd);
    }
  }
};

class BoardExchange final : public SwitchExchange {
 public:
  BoardExchange(Board* board, int me) : b_(board), me_(me) {}
  absl::Status Offer(const std::string& device, std::vector<SharedChunk> chunks) override {
    std::lock_guard<std::mutex> lock(b_->mu);
    b_->device[me_] = device;
    for (const SharedChunk& c : chunks) b_->offered[me_].push_back(c);
    b_->offered_all[me_] = true;
    b_->cv.notify_all();
    return absl::OkStatus();
  }
  // As the daemon does: the offered chunks that FitChunks places in `gaps`; the rest stay.
  absl::StatusOr<std::vector<SharedChunk>> Take(const std::string& device, const std::vector<FitGap>& gaps) override {
    std::unique_lock<std::mutex> lock(b_->mu);
    const int other = 1 - me_;
    b_->cv.wait(lock, [&] { return b_->offered_all[other] || b_->voted[other]; });
    ++takes;
    asked = gaps;
    if (b_->device[other] != device) return std::vector<SharedChunk>();
    std::vector<Held> held;
    for (const SharedChunk& c : b_->offered[other]) held.push_back({other, c});
    std::vector<int> strict_givers;
    std::vector<SharedChunk> out = GrantAsTheDaemon(me_, held, gaps, &strict_givers);
    b_->took_strict[me_] = b_->took_strict[me_] || !strict_givers.empty();
    b_->offered[other].clear();
    for (const Held& h : held) b_->offered[other].push_back(h.chunk);
    return out;
  }
  // As the daemon does: once the taker voted (Vote below sets it after its copies).
  absl::Status AwaitTakers() override {
    std::unique_lock<std::mutex> lock(b_->mu);
    ++b_->settle_asks[me_];
    if (b_->unsettled) return absl::UnavailableError("the board is gone");
    const int other = 1 - me_;
    b_->cv.wait(lock, [&] { return !b_->took_strict[other] || b_->voted[other]; });
    return absl::OkStatus();
  }
  std::size_t MaxGaps() const override { return 64; }
  std::vector<FitGap> asked;
  int takes = 0;

 private:
  Board* const b_;
  const int me_;
};

// Both sides' votes: commit when both are OK and nobody vetoed.
CachingAllocator::SwitchAgree Vote(Board* b, int me) {
  return [b, me](const absl::Status& local) -> absl::Status {
    std::unique_lock<std::mutex> lock(b->mu);
    b->local[me] = local;
    b->voted[me] = true;
    b->cv.notify_all();
    b->cv.wait(lock, [&] { return b->voted[1 - me]; });
    if (b->local[0].ok() && b->local[1].ok() && !b->veto) return absl::OkStatus();
    return absl::AbortedError("the other side said no");
  };
}

struct Side {
  std::unique_ptr<SimDriver> sim;
  std::unique_ptr<CachingAllocator> alloc;
  TagId w = 0, kv = 0;  // backup, discard
  std::vector<PatternBlock> w_blocks, kv_blocks;

  std::uint64_t Calls(DriverOp op) const { return sim->Counters().Calls(op); }
  std::string State(TagId t) const { return TagStatsOf(*alloc, t).state; }
};

class SwitchHandoverTest : public ::testing::Test {
 protected:
  // Side `name`: `w` (backup, 12 MiB + 3 MiB) and `kv` (discard, 24 MiB in 8 MiB blocks),
  // active, every byte patterned.
  // `capacity`: the device's; B's leaves less free memory than its covers and an eighth,
  // so its restoring covers take A's chunks (RestoresTakeForeignChunks).
  static Side MakeSide(const std::string& name, bool share, std::uint8_t seed, std::size_t capacity = 256 * kMiB) {
    Side s;
    s.sim = std::make_unique<SimDriver>(SimDriverOptions{1, capacity, 2 * kMiB, {}});
    AllocatorOptions options = testing::TestOptions();
    options.auto_prepare = false;
    options.switch_group_bytes = 4 * kMiB;
    options.resume_first_piece_bytes = 4 * kMiB;
    options.min_chunk_bytes = 8 * kMiB;
    options.max_chunk_bytes = 8 * kMiB;
    options.share_chunks = share;
    s.alloc = *CachingAllocator::Create(s.sim.get(), 0, options);
    s.w = *InternTag(name + "_w");
    s.kv = *InternTag(name + "_kv");
    EXPECT_TRUE(s.alloc->CreateTag(s.w, Policy::kBackup).ok());
    EXPECT_TRUE(s.alloc->CreateTag(s.kv, Policy::kDiscard).ok());
    s.w_blocks = FillBlocks(*s.alloc, s.w, {12 * kMiB, 3 * kMiB}, seed);
    s.kv_blocks = FillBlocks(*s.alloc, s.kv, {8 * kMiB, 8 * kMiB, 8 * kMiB}, static_cast<std::uint8_t>(seed + 100));
    return s;
  }

  void SetUp() override {
    a_ = MakeSide("ho_a", true, 1);
    b_ = MakeSide("ho_b", true, 50, 44 * kMiB);  // its 40 MiB fit, not 45
    ASSERT_TRUE(b_.alloc->Switch({b_.w, b_.kv}, {}).ok());  // B's phase is paused
  }

  void TearDown() override {
    for (Side* s : {&a_, &b_}) {
      s->alloc.reset();
      absl::Status leaks = s->sim->CheckNoLeaks();
      EXPECT_TRUE(leaks.ok()) << leaks;
    }
  }

  // One switch over both sides: `from` pauses `out`, `to` resumes `in`, each part on its
  // own thread with the board between them. Returns both parts' results.
  std::pair<absl::Status, absl::Status> Cross(Side& from, std::vector<TagId> out, Side& to, std::vector<TagId> in,
                                              Board* board) {
    BoardExchange ex_from(board, 0), ex_to(board, 1);
    const CachingAllocator::SwitchAgree agree_from = Vote(board, 0), agree_to = Vote(board, 1);
    absl::Status r_from, r_to;
    std::thread t([&] { r_from = from.alloc->Switch(out, {}, nullptr, nullptr, &agree_from, &ex_from).status(); });
    r_to = to.alloc->Switch({}, in, nullptr, nullptr, &agree_to, &ex_to).status();
    t.join();
    takes_ = ex_to.takes;
    asked_ = ex_to.asked;
    return {r_from, r_to};
  }

  static bool Zero(const PatternBlock& b) {
    const auto* p = reinterpret_cast<const unsigned char*>(b.address);
    for (std::size_t i = 0; i < b.size; ++i) {
      if (p[i] != 0) return false;
    }
    return true;
  }

  Side a_, b_;
  int takes_ = 0;
  std::vector<FitGap> asked_;  // the gaps the resuming side took for
};

TEST_F(SwitchHandoverTest, ReleasedChunksReachTheOtherSidesDiscardTagAndComeBack) {
  const std::uint64_t b_creates = b_.Calls(DriverOp::kCreateChunk);
  const std::size_t a_used = a_.sim->UsedBytes(0), b_used = b_.sim->UsedBytes(0);
  Board board;
  auto [ra, rb] = Cross(a_, {a_.kv}, b_, {b_.kv}, &board);
  ASSERT_TRUE(ra.ok()) << ra;
  ASSERT_TRUE(rb.ok()) << rb;
  EXPECT_EQ(takes_, 1);
  std::size_t asked_bytes = 0;
  for (const FitGap& g : asked_) asked_bytes += g.size_bytes;
  EXPECT_EQ(asked_bytes, 24 * kMiB) << "B asked for its discard tag's covers, nothing more";
  EXPECT_EQ(a_.State(a_.kv), "paused");
  EXPECT_EQ(b_.State(b_.kv), "active");
  EXPECT_EQ(b_.Calls(DriverOp::kCreateChunk), b_creates) << "B's discard tag got A's chunks, not new ones";
  EXPECT_GE(b_.Calls(DriverOp::kImportChunkFd), 3u);
  for (const PatternBlock& blk : b_.kv_blocks) EXPECT_TRUE(Zero(blk)) << "handed-over memory reads zeros";
  EXPECT_EQ(a_used - a_.sim->UsedBytes(0), 24 * kMiB) << "A's handles went at its commit";
  EXPECT_EQ(b_.sim->UsedBytes(0), b_used) << "B made none: it maps A's memory, which lives on";
  // B uses the memory, then hands it back.
  for (const PatternBlock& blk : b_.kv_blocks) FillPattern(blk.address, blk.size, 9);
  const std::uint64_t a_creates = a_.Calls(DriverOp::kCreateChunk);
  Board back;
  auto [rb2, ra2] = Cross(b_, {b_.kv}, a_, {a_.kv}, &back);
  ASSERT_TRUE(rb2.ok()) << rb2;
  ASSERT_TRUE(ra2.ok()) << ra2;
  EXPECT_EQ(a_.Calls(DriverOp::kCreateChunk), a_creates);
  for (const PatternBlock& blk : a_.kv_blocks) EXPECT_TRUE(Zero(blk));
  EXPECT_EQ(WrongBlocks(a_.w_blocks), 0u);
  EXPECT_TRUE(a_.alloc->Validate().ok());
  EXPECT_TRUE(b_.alloc->Validate().ok());
}

TEST_F(SwitchHandoverTest, ChunksThatFitNoGapOfTheTakerAreNotTakenAndItsCoverIsMadeFresh) {
  // B resumes a discard tag of one 2 MiB block: A's 8 MiB chunks fit no gap of it.
  const TagId small = *InternTag("ho_b_small");
  ASSERT_TRUE(b_.alloc->CreateTag(small, Policy::kDiscard).ok());
  ASSERT_EQ(FillBlocks(*b_.alloc, small, {2 * kMiB}, 7).size(), 1u);
  ASSERT_TRUE(b_.alloc->Switch({small}, {}).ok());
  const std::uint64_t b_imports = b_.Calls(DriverOp::kImportChunkFd);
  const std::uint64_t b_creates = b_.Calls(DriverOp::kCreateChunk);
  Board board;
  auto [ra, rb] = Cross(a_, {a_.kv}, b_, {small}, &board);
  ASSERT_TRUE(ra.ok()) << ra;
  ASSERT_TRUE(rb.ok()) << rb;
  ASSERT_EQ(asked_.size(), 1u);
  EXPECT_EQ(asked_[0].size_bytes, 2 * kMiB);
  EXPECT_EQ(b_.Calls(DriverOp::kImportChunkFd), b_imports) << "nothing that fits no gap is taken";
  EXPECT_GT(b_.Calls(DriverOp::kCreateChunk), b_creates);
  EXPECT_EQ(board.offered[0].size(), 3u) << "A's chunks stay for another taker";
  EXPECT_EQ(b_.State(small), "active");
  EXPECT_EQ(a_.State(a_.kv), "paused");
  EXPECT_TRUE(b_.alloc->Validate().ok());
}

TEST_F(SwitchHandoverTest, BackupTagsRestoreIntoTheOtherSidesChunksAfterItsBackupCopies) {
  const std::uint64_t b_creates = b_.Calls(DriverOp::kCreateChunk);
  const std::size_t b_used = b_.sim->UsedBytes(0);
  Board board;
  auto [ra, rb] = Cross(a_, {a_.w, a_.kv}, b_, {b_.w, b_.kv}, &board);
  ASSERT_TRUE(ra.ok()) << ra;
  ASSERT_TRUE(rb.ok()) << rb;
  EXPECT_EQ(WrongBlocks(b_.w_blocks), 0u) << "B's backup restored whole";
  for (const PatternBlock& blk : b_.kv_blocks) EXPECT_TRUE(Zero(blk));
  // B's backup covers (12 MiB and 4 MiB) take what fits them of A's 8 MiB chunks: one.
  EXPECT_LE(b_.Calls(DriverOp::kCreateChunk) - b_creates, 1u) << "B restored into A's chunks";
  EXPECT_LE(b_.sim->UsedBytes(0) - b_used, 4 * kMiB) << "of its 16 MiB of backup covers, 12 are A's memory";
  EXPECT_TRUE(board.took_strict[1]) << "B's backup covers asked for and got A's backed-up chunks";
  EXPECT_EQ(a_.Calls(DriverOp::kCreateIpcEvent), 2u) << "an event after each group that last reads a chunk";
  EXPECT_EQ(b_.Calls(DriverOp::kOpenIpcEvent), 1u) << "the event of the one chunk B took";
  EXPECT_GE(b_.Calls(DriverOp::kStreamWaitEvent), 1u) << "B's restores into A's chunks waited for A's event";
  EXPECT_EQ(board.settle_asks[0], 0) << "a commit waits for no taker";
  Board back;
  auto [rb2, ra2] = Cross(b_, {b_.w, b_.kv}, a_, {a_.w, a_.kv}, &back);
  ASSERT_TRUE(rb2.ok() && ra2.ok()) << rb2 << " / " << ra2;
  EXPECT_EQ(WrongBlocks(a_.w_blocks), 0u) << "A's backup, made while B mapped A's chunks, is whole";
  EXPECT_TRUE(a_.alloc->Validate().ok());
  EXPECT_TRUE(b_.alloc->Validate().ok());
}

TEST_F(SwitchHandoverTest, AVetoLeavesBothSidesAsTheyWereAndReleasesTheImports) {
  Board board;
  board.veto = true;
  auto [ra, rb] = Cross(a_, {a_.w, a_.kv}, b_, {b_.w, b_.kv}, &board);
  EXPECT_EQ(ra.code(), absl::StatusCode::kAborted) << ra;
  EXPECT_EQ(rb.code(), absl::StatusCode::kAborted) << rb;
  EXPECT_GE(b_.Calls(DriverOp::kImportChunkFd), 1u);
  EXPECT_TRUE(board.took_strict[1]);
  EXPECT_EQ(board.settle_asks[0], 1) << "A waited for B before writing its chunks again";
  EXPECT_EQ(a_.State(a_.kv), "active");
  EXPECT_EQ(a_.State(a_.w), "active");
  EXPECT_EQ(b_.State(b_.kv), "paused");
  EXPECT_EQ(WrongBlocks(a_.kv_blocks), 0u) << "A's discard bytes survive a rolled-back pause, though B mapped them";
  EXPECT_EQ(WrongBlocks(a_.w_blocks), 0u) << "B's restore copies wrote A's chunks; A restored them from its backup";
  ASSERT_TRUE(b_.alloc->Switch({}, {b_.w}).ok());
  EXPECT_EQ(WrongBlocks(b_.w_blocks), 0u);
  EXPECT_TRUE(a_.alloc->Validate().ok());
  EXPECT_TRUE(b_.alloc->Validate().ok());
}

TEST_F(SwitchHandoverTest, AForeignChunkThatCannotBeMappedRollsBothBack) {
  b_.sim->InjectFault(FaultRule{DriverOp::kMap, 1, 1, absl::StatusCode::kInternal});
  Board board;
  auto [ra, rb] = Cross(a_, {a_.kv}, b_, {b_.kv}, &board);
  EXPECT_FALSE(rb.ok());
  EXPECT_EQ(ra.code(), absl::StatusCode::kAborted) << ra;
  EXPECT_EQ(a_.State(a_.kv), "active");
  EXPECT_EQ(b_.State(b_.kv), "paused");
  EXPECT_EQ(WrongBlocks(a_.kv_blocks), 0u);
  b_.sim->ClearFaults();
  Board again;  // and the same switch then goes through
  auto [ra2, rb2] = Cross(a_, {a_.kv}, b_, {b_.kv}, &again);
  EXPECT_TRUE(ra2.ok() && rb2.ok()) << ra2 << " / " << rb2;
}

TEST_F(SwitchHandoverTest, AnImportThatFailsIsReplacedByFreshMemory) {
  b_.sim->InjectFault(FaultRule{DriverOp::kImportChunkFd, 1, 1, absl::StatusCode::kInternal});
  const std::uint64_t b_creates = b_.Calls(DriverOp::kCreateChunk);
  Board board;
  auto [ra, rb] = Cross(a_, {a_.kv}, b_, {b_.kv}, &board);
  ASSERT_TRUE(ra.ok()) << ra;
  ASSERT_TRUE(rb.ok()) << rb;
  EXPECT_GT(b_.Calls(DriverOp::kCreateChunk), b_creates) << "the chunk not imported was made here";
  for (const PatternBlock& blk : b_.kv_blocks) EXPECT_TRUE(Zero(blk));
}

TEST_F(SwitchHandoverTest, ChunksThatCannotBeExportedAreNotOffered) {
  a_.sim->InjectFault(FaultRule{DriverOp::kExportChunkFd, 1, 100, absl::StatusCode::kInternal});
  const std::uint64_t b_creates = b_.Calls(DriverOp::kCreateChunk);
  const std::size_t a_used = a_.sim->UsedBytes(0);
  Board board;
  auto [ra, rb] = Cross(a_, {a_.kv}, b_, {b_.kv}, &board);
  ASSERT_TRUE(ra.ok() && rb.ok()) << ra << " / " << rb;
  EXPECT_EQ(b_.Calls(DriverOp::kImportChunkFd), 0u);
  EXPECT_GT(b_.Calls(DriverOp::kCreateChunk), b_creates);
  EXPECT_EQ(a_used - a_.sim->UsedBytes(0), 24 * kMiB) << "A released what it could not hand over";
}

TEST_F(SwitchHandoverTest, TakersThatCannotBeShownDoneBreakTheGiversWrittenTagNeverItsBytes) {
  Board board;
  board.veto = true;
  board.unsettled = true;  // the daemon lost: no one can say the taker stopped writing
  auto [ra, rb] = Cross(a_, {a_.w, a_.kv}, b_, {b_.w, b_.kv}, &board);
  EXPECT_EQ(ra.code(), absl::StatusCode::kAborted) << ra;
  EXPECT_NE(ra.message().find("another process took its memory"), std::string::npos) << ra;
  EXPECT_EQ(a_.State(a_.w), "broken") << "its chunks may still be written: not restored into, not used";
  EXPECT_EQ(a_.State(a_.kv), "active") << "a discard tag's chunks never go where restore copies write";
  EXPECT_EQ(WrongBlocks(a_.kv_blocks), 0u);
  EXPECT_EQ(b_.State(b_.w), "paused");
  ASSERT_TRUE(b_.alloc->Switch({}, {b_.w}).ok());
  EXPECT_EQ(WrongBlocks(b_.w_blocks), 0u);
}

TEST_F(SwitchHandoverTest, AnEventThatCannotBeOpenedKeepsTheChunkOutOfRestoringCovers) {
  b_.sim->InjectFault(FaultRule{DriverOp::kOpenIpcEvent, 1, 100, absl::StatusCode::kInternal});
  const std::uint64_t b_creates = b_.Calls(DriverOp::kCreateChunk);
  Board board;
  auto [ra, rb] = Cross(a_, {a_.w, a_.kv}, b_, {b_.w, b_.kv}, &board);
  ASSERT_TRUE(ra.ok() && rb.ok()) << ra << " / " << rb;
  EXPECT_GT(b_.Calls(DriverOp::kCreateChunk), b_creates) << "B's backup covers were made fresh";
  EXPECT_EQ(WrongBlocks(b_.w_blocks), 0u);
  for (const PatternBlock& blk : b_.kv_blocks) EXPECT_TRUE(Zero(blk));
  EXPECT_TRUE(b_.alloc->Validate().ok());
}

TEST_F(SwitchHandoverTest, AnEventThatCannotBeMadeOffersTheChunkForDiscardCoversOnly) {
  a_.sim->InjectFault(FaultRule{DriverOp::kCreateIpcEvent, 1, 100, absl::StatusCode::kInternal});
  Board board;
  auto [ra, rb] = Cross(a_, {a_.w, a_.kv}, b_, {b_.w, b_.kv}, &board);
  ASSERT_TRUE(ra.ok() && rb.ok()) << ra << " / " << rb;
  EXPECT_FALSE(board.took_strict[1]);
  EXPECT_EQ(b_.Calls(DriverOp::kOpenIpcEvent), 0u);
  EXPECT_EQ(WrongBlocks(b_.w_blocks), 0u);
  Board back;
  auto [rb2, ra2] = Cross(b_, {b_.w, b_.kv}, a_, {a_.w, a_.kv}, &back);
  ASSERT_TRUE(rb2.ok() && ra2.ok()) << rb2 << " / " << ra2;
  EXPECT_EQ(WrongBlocks(a_.w_blocks), 0u);
}

// Three parts as the daemon sees them: two givers and one taker, the first giver's vote
// deciding "abort" once the taker has taken.
struct Board3 {
  static constexpr int kN = 3;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Held> held;
  bool offered[kN] = {};
  bool voted[kN] = {};
  std::vector<int> takers[kN];  // per giver (SwitchLedger::Took)
  int decided = -1;             // -1 undecided, 0 abort, 1 commit
  bool took = false;
  ~Board3() {
    for (const Held& h : held) ::close(h.chunk.fd);
  }
};

class Board3Exchange final : public SwitchExchange {
 public:
  Board3Exchange(Board3* board, int me) : b_(board), me_(me) {}
  absl::Status Offer(const std::string&, std::vector<SharedChunk> chunks) override {
    std::unique_lock<std::mutex> lock(b_->mu);
    if (me_ == 1) b_->cv.wait(lock, [&] { return b_->offered[0]; });  // the first giver's chunks come first
    for (const SharedChunk& c : chunks) b_->held.push_back({me_, c});
    b_->offered[me_] = true;
    b_->cv.notify_all();
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<SharedChunk>> Take(const std::string&, const std::vector<FitGap>& gaps) override {
    std::unique_lock<std::mutex> lock(b_->mu);
    b_->cv.wait(lock, [&] { return (b_->offered[0] || b_->voted[0]) && (b_->offered[1] || b_->voted[1]); });
    std::vector<int> strict_givers;
    std::vector<SharedChunk> out = GrantAsTheDaemon(me_, b_->held, gaps, &strict_givers);
    for (int g : strict_givers) b_->takers[g].push_back(me_);
    b_->took = true;
    b_->cv.notify_all();
    return out;
  }
  absl::Status AwaitTakers() override {
    std::unique_lock<std::mutex> lock(b_->mu);
    b_->cv.wait(lock, [&] {
      for (int t : b_->takers[me_]) {
        if (!b_->voted[t]) return false;
      }
      return true;
    });
    return absl::OkStatus();
  }
  std::size_t MaxGaps() const override { return 64; }

 private:
  Board3* const b_;
  const int me_;
};

CachingAllocator::SwitchAgree Vote3(Board3* b, int me) {
  return [b, me](const absl::Status& local) -> absl::Status {
    std::unique_lock<std::mutex> lock(b->mu);
    if (me == 0) b->cv.wait(lock, [&] { return b->took; });
    b->voted[me] = true;
    if (b->decided < 0 && (!local.ok() || me == 0)) b->decided = 0;  // the first giver says no
    b->cv.notify_all();
    b->cv.wait(lock, [&] { return b->decided >= 0; });
    return b->decided == 1 ? absl::OkStatus() : absl::AbortedError("the first giver said no");
  };
}

// Two givers (A and C, backup tags) and B, short of memory, taking for its backup covers. A
// failure at B (an event it cannot open, an import) makes B fit again what it could use: it
// must never move C's chunk, which the daemon gave it for a discard cover (C waits for
// nobody), into a restoring cover. Otherwise C's rollback restores its bytes at once and
// B's restore copies, slower, overwrite them. B is held up at its first restore copy until
// C's switch has returned, to make that order certain.
TEST_F(SwitchHandoverTest, ATakerFittingAgainNeverMovesIntoARestoringCoverAChunkGivenForADiscardOne) {
  for (const DriverOp fault : {DriverOp::kOpenIpcEvent, DriverOp::kImportChunkFd, DriverOp::kNumOps}) {
    SCOPED_TRACE(fault == DriverOp::kNumOps ? "no fault" : std::string(DriverOpName(fault)));
    Side c = MakeSide("ho_c", true, 30);
    if (fault != DriverOp::kNumOps) b_.sim->InjectFault(FaultRule{fault, 1, 2, absl::StatusCode::kInternal});
    Board3 board;
    Board3Exchange ex_a(&board, 0), ex_c(&board, 1), ex_b(&board, 2);
    const CachingAllocator::SwitchAgree v_a = Vote3(&board, 0), v_c = Vote3(&board, 1), v_b = Vote3(&board, 2);
    std::mutex latch_mu;
    std::condition_variable latch_cv;
    bool c_done = false, held_once = false;
    b_.sim->SetBeforeCall([&](DriverOp op) {
      if (op != DriverOp::kCopyToDevice || held_once) return;
      held_once = true;
      std::unique_lock<std::mutex> l(latch_mu);
      latch_cv.wait(l, [&] { return c_done; });
    });
    absl::Status ra, rc, rb;
    std::thread ta([&] { ra = a_.alloc->Switch({a_.w}, {}, nullptr, nullptr, &v_a, &ex_a).status(); });
    std::thread tc([&] {
      rc = c.alloc->Switch({c.w}, {}, nullptr, nullptr, &v_c, &ex_c).status();
      std::lock_guard<std::mutex> l(latch_mu);
      c_done = true;
      latch_cv.notify_all();
    });
    rb = b_.alloc->Switch({}, {b_.w, b_.kv}, nullptr, nullptr, &v_b, &ex_b).status();
    ta.join();
    tc.join();
    b_.sim->SetBeforeCall(nullptr);
    b_.sim->ClearFaults();
    EXPECT_EQ(ra.code(), absl::StatusCode::kAborted) << ra;
    EXPECT_EQ(rc.code(), absl::StatusCode::kAborted) << rc;
    EXPECT_EQ(rb.code(), absl::StatusCode::kAborted) << rb;
    EXPECT_EQ(WrongBlocks(a_.w_blocks), 0u);
    EXPECT_EQ(WrongBlocks(c.w_blocks), 0u) << "C's bytes overwritten by B's restore after C's rollback";
    EXPECT_EQ(b_.State(b_.w), "paused");
    c.alloc.reset();
    EXPECT_TRUE(c.sim->CheckNoLeaks().ok());
  }
  ASSERT_TRUE(b_.alloc->Switch({}, {b_.w}).ok());
  EXPECT_EQ(WrongBlocks(b_.w_blocks), 0u);
}

TEST(SwitchHandoverUnshared, AProcessWithoutShareChunksOffersNothingAndTheSwitchStillCommits) {
  // share_chunks off on the pausing side: its chunks cannot be exported.
  Side a = [] {
    Side s;
    s.sim = std::make_unique<SimDriver>(SimDriverOptions{1, 256 * kMiB, 2 * kMiB, {}});
    AllocatorOptions options = testing::TestOptions();
    options.auto_prepare = false;
    s.alloc = *CachingAllocator::Create(s.sim.get(), 0, options);
    s.kv = *InternTag("ho_u_kv");
    EXPECT_TRUE(s.alloc->CreateTag(s.kv, Policy::kDiscard).ok());
    s.kv_blocks = FillBlocks(*s.alloc, s.kv, {8 * kMiB}, 3);
    return s;
  }();
  Side b;
  b.sim = std::make_unique<SimDriver>(SimDriverOptions{1, 256 * kMiB, 2 * kMiB, {}});
  AllocatorOptions options = testing::TestOptions();
  options.auto_prepare = false;
  options.share_chunks = true;
  b.alloc = *CachingAllocator::Create(b.sim.get(), 0, options);
  b.kv = *InternTag("ho_u_kv_b");
  ASSERT_TRUE(b.alloc->CreateTag(b.kv, Policy::kDiscard).ok());
  b.kv_blocks = FillBlocks(*b.alloc, b.kv, {8 * kMiB}, 4);
  ASSERT_TRUE(b.alloc->Pause(b.kv).ok());
  Board board;
  BoardExchange ex_a(&board, 0), ex_b(&board, 1);
  const CachingAllocator::SwitchAgree agree_a = Vote(&board, 0), agree_b = Vote(&board, 1);
  absl::Status ra;
  std::thread t([&] { ra = a.alloc->Switch({a.kv}, {}, nullptr, nullptr, &agree_a, &ex_a).status(); });
  absl::Status rb = b.alloc->Switch({}, {b.kv}, nullptr, nullptr, &agree_b, &ex_b).status();
  t.join();
  EXPECT_TRUE(ra.ok() && rb.ok()) << ra << " / " << rb;
  EXPECT_EQ(b.Calls(DriverOp::kImportChunkFd), 0u);
  EXPECT_EQ(a.sim->UsedBytes(0), 0u);
  for (Side* s : {&a, &b}) {
    s->alloc.reset();
    EXPECT_TRUE(s->sim->CheckNoLeaks().ok());
  }
}

}  // namespace
}  // namespace vmstash
