// SCRATCH (review): three parties, a daemon-like board. Delete me.
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
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

constexpr int kN = 3;

// The daemon, in memory, as node/daemon.cc + switch_ledger.cc do it.
struct Board {
  std::mutex mu;
  std::condition_variable cv;
  struct Held { int giver; SharedChunk c; };
  std::vector<Held> held;
  bool donor[kN] = {};
  bool offered[kN] = {};
  bool voted[kN] = {};
  std::set<int> takers[kN];  // per giver: Took
  int decided = -1;          // -1 undecided, 0 abort, 1 commit
  int veto_by = -1;          // this side's vote decides abort at once
  int offer_after = -1;      // side that offers only after this one has
  int offer_after_me = -1;
  std::vector<std::string> log;
  bool took = false;
  ~Board() { for (auto& h : held) ::close(h.c.fd); }
};

class BoardExchange final : public SwitchExchange {
 public:
  BoardExchange(Board* b, int me) : b_(b), me_(me) {}
  absl::Status Offer(const std::string&, std::vector<SharedChunk> chunks) override {
    std::unique_lock<std::mutex> lock(b_->mu);
    if (b_->offer_after_me == me_) b_->cv.wait(lock, [&] { return b_->offered[b_->offer_after]; });
    if (b_->decided >= 0) { for (auto& c : chunks) ::close(c.fd); return absl::FailedPreconditionError("decided"); }
    for (auto& c : chunks) b_->held.push_back({me_, c});
    b_->offered[me_] = true;
    b_->cv.notify_all();
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<SharedChunk>> Take(const std::string&, const std::vector<FitGap>& gaps) override {
    std::unique_lock<std::mutex> lock(b_->mu);
    b_->offered[me_] = true;
    b_->cv.wait(lock, [&] {
      if (b_->decided >= 0) return true;
      for (int o = 0; o < kN; ++o) if (o != me_ && b_->donor[o] && !b_->offered[o] && !b_->voted[o]) return false;
      return true;
    });
    if (b_->decided >= 0) return std::vector<SharedChunk>();
    std::vector<int> cand;
    std::vector<FitChunk> sizes;
    for (std::size_t i = 0; i < b_->held.size(); ++i) {
      if (b_->held[i].giver == me_) continue;
      cand.push_back(i);
      sizes.push_back({b_->held[i].c.size_bytes, b_->held[i].c.anywhere});
    }
    const ChunkFit fit = FitChunks(sizes, gaps);
    std::vector<bool> taken(b_->held.size(), false);
    for (std::size_t g = 0; g < fit.placed.size(); ++g) {
      for (int c : fit.placed[g]) {
        taken[cand[c]] = true;
        char buf[200];
        std::snprintf(buf, sizeof buf, "daemon: chunk of giver %d (%zu MiB, anywhere %d) -> gap %zu (%zu MiB strict %d)",
                      b_->held[cand[c]].giver, b_->held[cand[c]].c.size_bytes >> 20, b_->held[cand[c]].c.anywhere, g,
                      gaps[g].size_bytes >> 20, gaps[g].strict);
        b_->log.push_back(buf);
        if (gaps[g].strict) b_->takers[b_->held[cand[c]].giver].insert(me_);
      }
    }
    std::vector<SharedChunk> out;
    std::vector<Board::Held> kept;
    for (std::size_t i = 0; i < b_->held.size(); ++i) {
      if (taken[i]) out.push_back(b_->held[i].c); else kept.push_back(b_->held[i]);
    }
    b_->held.swap(kept);
    b_->took = true;
    b_->cv.notify_all();
    return out;
  }
  absl::Status AwaitTakers() override {
    std::unique_lock<std::mutex> lock(b_->mu);
    ++settle_asks;
    b_->cv.wait(lock, [&] { for (int t : b_->takers[me_]) if (!b_->voted[t]) return false; return true; });
    return absl::OkStatus();
  }
  std::size_t MaxGaps() const override { return 64; }
  int settle_asks = 0;

 private:
  Board* const b_;
  const int me_;
};

CachingAllocator::SwitchAgree Vote(Board* b, int me) {
  return [b, me](const absl::Status& local) -> absl::Status {
    std::unique_lock<std::mutex> lock(b->mu);
    if (b->veto_by == me) b->cv.wait(lock, [&] { return b->took; });
    b->voted[me] = true;
    if (b->decided < 0 && (!local.ok() || b->veto_by == me)) b->decided = 0;
    bool all = true;
    for (int i = 0; i < kN; ++i) all = all && b->voted[i];
    if (b->decided < 0 && all) b->decided = 1;
    b->cv.notify_all();
    b->cv.wait(lock, [&] { return b->decided >= 0; });
    if (b->decided == 1) return absl::OkStatus();
    return absl::AbortedError("abort");
  };
}

struct Side {
  std::unique_ptr<SimDriver> sim;
  std::unique_ptr<CachingAllocator> alloc;
  TagId w = 0, kv = 0;
  std::vector<PatternBlock> w_blocks, kv_blocks;
};

Side MakeSide(const std::string& name, std::uint8_t seed, std::size_t capacity = 256 * kMiB) {
  Side s;
  s.sim = std::make_unique<SimDriver>(SimDriverOptions{1, capacity, 2 * kMiB, {}});
  AllocatorOptions options = testing::TestOptions();
  options.auto_prepare = false;
  options.switch_group_bytes = 4 * kMiB;
  options.resume_first_piece_bytes = 4 * kMiB;
  options.min_chunk_bytes = 8 * kMiB;
  options.max_chunk_bytes = 8 * kMiB;
  options.share_chunks = true;
  s.alloc = *CachingAllocator::Create(s.sim.get(), 0, options);
  s.w = *InternTag(name + "_w");
  s.kv = *InternTag(name + "_kv");
  EXPECT_TRUE(s.alloc->CreateTag(s.w, Policy::kBackup).ok());
  EXPECT_TRUE(s.alloc->CreateTag(s.kv, Policy::kDiscard).ok());
  s.w_blocks = FillBlocks(*s.alloc, s.w, {12 * kMiB, 3 * kMiB}, seed);
  s.kv_blocks = FillBlocks(*s.alloc, s.kv, {8 * kMiB, 8 * kMiB, 8 * kMiB}, static_cast<std::uint8_t>(seed + 100));
  return s;
}

// Two givers (A, B: backup tags) and one taker (T, short of memory). T cannot open A's
// events, so its re-fit moves B's chunk into a restoring cover the daemon gave A's: B is
// not recorded as given to T, so B's rollback does not wait for T, restores its bytes, and
// T's restore copies then overwrite them.
void RunThree(int mode) {
  const bool import_fault = mode == 1;
  Side a = MakeSide("r3_a", 1), b = MakeSide("r3_b", 30), t = MakeSide("r3_t", 60, 44 * kMiB);
  ASSERT_TRUE(t.alloc->Switch({t.w, t.kv}, {}).ok());
  if (mode == 2) {
  } else if (import_fault) {
    t.sim->InjectFault(FaultRule{DriverOp::kImportChunkFd, 1, 2, absl::StatusCode::kInternal});
  } else {
    t.sim->InjectFault(FaultRule{DriverOp::kOpenIpcEvent, 1, 2, absl::StatusCode::kInternal});
  }
  Board board;
  board.donor[0] = board.donor[1] = true;
  board.veto_by = 0;  // A's vote aborts (say A's hooks or a third process failed)
  board.offer_after_me = 1;
  board.offer_after = 0;  // A's chunks first in the daemon's list
  BoardExchange ex0(&board, 0), ex1(&board, 1), ex2(&board, 2);
  auto v0 = Vote(&board, 0), v1 = Vote(&board, 1), v2 = Vote(&board, 2);
  std::mutex latch_mu;
  std::condition_variable latch_cv;
  bool b_done = false;
  bool blocked_once = false;
  // T is slow between its take and its restore copies (maps cost ~1 ms each on a GPU).
  t.sim->SetBeforeCall([&](DriverOp op) {
    if (op != DriverOp::kCopyToDevice || blocked_once) return;
    blocked_once = true;
    std::unique_lock<std::mutex> l(latch_mu);
    latch_cv.wait(l, [&] { return b_done; });
  });
  absl::Status ra, rb, rt;
  std::thread ta([&] { ra = a.alloc->Switch({a.w}, {}, nullptr, nullptr, &v0, &ex0).status(); });
  std::thread tb([&] {
    rb = b.alloc->Switch({b.w}, {}, nullptr, nullptr, &v1, &ex1).status();
    std::lock_guard<std::mutex> l(latch_mu);
    b_done = true;
    latch_cv.notify_all();
  });
  rt = t.alloc->Switch({}, {t.w, t.kv}, nullptr, nullptr, &v2, &ex2).status();
  ta.join();
  tb.join();
  t.sim->SetBeforeCall(nullptr);
  for (const auto& l : board.log) std::printf("%s\n", l.c_str());
  std::printf("takers recorded: A:%zu B:%zu; settle asks A:%d B:%d; T imports %llu opens %llu\n",
              board.takers[0].size(), board.takers[1].size(), ex0.settle_asks, ex1.settle_asks,
              (unsigned long long)t.sim->Counters().Calls(DriverOp::kImportChunkFd),
              (unsigned long long)t.sim->Counters().Calls(DriverOp::kOpenIpcEvent));
  EXPECT_EQ(ra.code(), absl::StatusCode::kAborted) << ra;
  EXPECT_EQ(rb.code(), absl::StatusCode::kAborted) << rb;
  EXPECT_EQ(rt.code(), absl::StatusCode::kAborted) << rt;
  EXPECT_EQ(TagStatsOf(*b.alloc, b.w).state, "active");
  {
    const auto* p = reinterpret_cast<const unsigned char*>(b.w_blocks[0].address);
    std::size_t zeros = 0; for (std::size_t i = 0; i < b.w_blocks[0].size; ++i) zeros += p[i] == 0;
    std::printf("B's 12 MiB block: %zu zero bytes; wrong vs own seed %zu; wrong vs T's w seed %zu / %zu\n", zeros,
                WrongBlocks({b.w_blocks[0]}), WrongBlocks({{b.w_blocks[0].address, b.w_blocks[0].size, t.w_blocks[0].seed}}),
                WrongBlocks({{b.w_blocks[0].address, b.w_blocks[0].size, t.w_blocks[1].seed}}));
  }
  EXPECT_EQ(WrongBlocks(a.w_blocks), 0u) << "A's backup-tag bytes after the abort";
  EXPECT_EQ(WrongBlocks(b.w_blocks), 0u) << "B's backup-tag bytes after the abort (B was never recorded as a giver "
                                            "to T, yet T restored into B's chunk after B's rollback)";
  ASSERT_TRUE(t.alloc->Switch({}, {t.w}).ok());
  EXPECT_EQ(WrongBlocks(t.w_blocks), 0u);
}

TEST(Review3, OpenIpcEventFailureMovesAnotherGiversChunkIntoARestoringCover) { RunThree(0); }
TEST(Review3, ImportFailureMovesAnotherGiversChunkIntoARestoringCover) { RunThree(1); }
TEST(Review3, Control) { RunThree(2); }

}  // namespace
}  // namespace vmstash
