// Switch (Note [Switch Protocol]) on the simulated driver: bytes survive at the same
// addresses in both directions, chunks change hands without create/release where sizes
// allow, more and less incoming memory, no-ops, bad input, hooks, out of memory, and a
// stress run of concurrent switches, pauses, resumes and allocations. Round 3 of review
// (issue 28): zeroing before the incoming tags are published, an overhang that touched
// the next cover, a backup tag's handed-over bytes outside its restored ranges. A discard
// tag's handed-over memory, zeroed or (switch_zero off) the very same physical memory, and
// backed-up bytes both ways are the allocator conformance suite's too, held on a GPU as
// well (allocator_conformance.h).
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/testing.h"
#include "base/byte_pattern.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

using ::testing::HasSubstr;
using Transition = CachingAllocator::Transition;

struct Live {
  DevicePtr address = 0;
  std::size_t size = 0;
  std::uint8_t seed = 0;
};

class SwitchTest : public testing::SimAllocatorTest {
 protected:
  void SetUp() override { Make(768 * kMiB); }
  void Make(std::size_t capacity) {
    AllocatorOptions options = testing::TestOptions();
    options.auto_prepare = false;
    options.pause_stage_bytes = 8 * kMiB;
    options.switch_group_bytes = 4 * kMiB;  // several copy groups
    options.resume_first_piece_bytes = 4 * kMiB;
    if (min_chunk_ != 0) options.min_chunk_bytes = min_chunk_;
    MakeAllocator(SimDriverOptions{1, capacity, 2 * kMiB, {}}, options);
  }
  TagId Tag(const char* name, Policy policy) {
    TagId t = *InternTag(name);
    EXPECT_TRUE(alloc_->CreateTag(t, policy).ok());
    return t;
  }
  // Allocates `sizes` in `tag`, each filled with its own pattern.
  std::vector<Live> Fill(TagId tag, const std::vector<std::size_t>& sizes, std::uint8_t seed) {
    std::vector<Live> out;
    for (std::size_t n : sizes) {
      absl::StatusOr<DevicePtr> p = alloc_->Allocate(n, nullptr, tag);
      EXPECT_TRUE(p.ok()) << p.status();
      FillPattern(*p, n, seed);
      out.push_back({*p, n, seed++});
    }
    return out;
  }
  static std::size_t Wrong(const std::vector<Live>& blocks) {
    std::size_t wrong = 0;
    for (const Live& b : blocks) wrong += WrongBytes(b.address, b.size, b.seed);
    return wrong;
  }
  std::string State(TagId tag) {
    for (const TagStats& t : alloc_->Stats().tags) {
      if (t.name == TagName(tag)) return t.state;
    }
    return "";
  }
  std::uint64_t Calls(DriverOp op) const { return sim_->Counters().Calls(op); }
  void FreeAll(const std::vector<Live>& blocks) {
    for (const Live& b : blocks) ASSERT_TRUE(alloc_->Free(b.address).ok());
  }

  std::size_t min_chunk_ = 0;  // 0: the default
};

TEST_F(SwitchTest, IncomingNeedsMoreTheRestIsCreated) {
  TagId big = Tag("sw_big", Policy::kBackup);
  TagId small = Tag("sw_small", Policy::kBackup);
  std::vector<Live> b = Fill(big, {64 * kMiB, 64 * kMiB, 64 * kMiB, 100 * kMiB}, 20);
  ASSERT_EQ(*alloc_->Pause(big), Transition::kDone);
  std::vector<Live> s = Fill(small, {64 * kMiB, 3 * kMiB, 4096}, 70);
  const std::size_t used_small = sim_->UsedBytes(0);
  ASSERT_EQ(*alloc_->Switch({small}, {big}), Transition::kDone);
  EXPECT_EQ(Wrong(b), 0u);
  EXPECT_GE(sim_->UsedBytes(0), 292 * kMiB);
  EXPECT_GE(alloc_->Stats().handed_over_bytes, 64 * kMiB);  // the 64 MiB chunk at least
  ASSERT_EQ(*alloc_->Switch({big}, {small}), Transition::kDone);  // and back: fewer bytes in
  EXPECT_EQ(Wrong(s), 0u);
  EXPECT_LE(sim_->UsedBytes(0), used_small + 4 * kMiB) << "the rest of the outgoing memory is released";
  ASSERT_TRUE(alloc_->Validate().ok());
  ASSERT_EQ(*alloc_->Resume(big), Transition::kDone);
  EXPECT_EQ(Wrong(b), 0u);
  FreeAll(b);
  FreeAll(s);
}

TEST_F(SwitchTest, DiscardChunksNeverReceiveRestoreCopies) {
  // The outgoing discard tag's chunk would fit the incoming backup tag exactly, but a
  // failed switch could then not put the discard tag's bytes back: it is released instead.
  TagId kv = Tag("sw_kv2", Policy::kDiscard);
  TagId opt = Tag("sw_opt", Policy::kBackup);
  std::vector<Live> o = Fill(opt, {64 * kMiB}, 5);
  ASSERT_EQ(*alloc_->Pause(opt), Transition::kDone);
  std::vector<Live> k = Fill(kv, {64 * kMiB}, 6);
  const std::uint64_t creates = Calls(DriverOp::kCreateChunk);
  ASSERT_EQ(*alloc_->Switch({kv}, {opt}), Transition::kDone);
  EXPECT_EQ(Wrong(o), 0u);
  EXPECT_GT(Calls(DriverOp::kCreateChunk), creates);
  EXPECT_EQ(alloc_->Stats().handed_over_bytes, 0u);
  ASSERT_EQ(*alloc_->Resume(kv), Transition::kDone);
  FreeAll(o);
  FreeAll(k);
}

TEST_F(SwitchTest, SeveralTagsEachWayAndTagsAlreadyInState) {
  TagId w = Tag("sw_w", Policy::kBackup), kv = Tag("sw_kv3", Policy::kDiscard), g = Tag("sw_g", Policy::kDiscard);
  TagId opt = Tag("sw_o", Policy::kBackup), st = Tag("sw_st", Policy::kDiscard), idle = Tag("sw_idle", Policy::kBackup);
  std::vector<Live> o = Fill(opt, {96 * kMiB, 700 * 1024, 4096}, 30);
  std::vector<Live> s = Fill(st, {40 * kMiB}, 40);
  std::vector<Live> i = Fill(idle, {2 * kMiB}, 45);
  ASSERT_EQ(*alloc_->Pause(opt), Transition::kDone);
  ASSERT_EQ(*alloc_->Pause(st), Transition::kDone);
  ASSERT_EQ(*alloc_->Pause(idle), Transition::kDone);
  std::vector<Live> wl = Fill(w, {64 * kMiB, 32 * kMiB, 5000, 300 * 1024}, 100);
  std::vector<Live> kl = Fill(kv, {60 * kMiB}, 110);
  std::vector<Live> gl = Fill(g, {10 * kMiB}, 120);
  // idle is already paused: left out of the transaction.
  ASSERT_EQ(*alloc_->Switch({w, kv, g, idle}, {opt, st}), Transition::kDone);
  EXPECT_EQ(Wrong(o), 0u);
  EXPECT_EQ(State(w), "paused");
  EXPECT_EQ(State(kv), "paused");
  EXPECT_EQ(State(g), "paused");
  EXPECT_EQ(State(idle), "paused");
  EXPECT_EQ(*alloc_->Switch({w, kv, g}, {opt, st}), Transition::kAlreadyInState);
  ASSERT_EQ(*alloc_->Switch({opt, st}, {w, kv, g, idle}), Transition::kDone);
  EXPECT_EQ(Wrong(wl), 0u);
  EXPECT_EQ(Wrong(i), 0u);
  ASSERT_TRUE(alloc_->Validate().ok());
  ASSERT_EQ(*alloc_->Resume(opt), Transition::kDone);
  ASSERT_EQ(*alloc_->Resume(st), Transition::kDone);
  EXPECT_EQ(Wrong(o), 0u);
  for (const auto* v : {&o, &s, &i, &wl, &kl, &gl}) FreeAll(*v);
}

TEST_F(SwitchTest, LiveRangesLimitWhatIsBackedUp) {
  TagId a = Tag("sw_hint", Policy::kBackup), b = Tag("sw_hint_in", Policy::kDiscard);
  std::vector<Live> bl = Fill(b, {8 * kMiB}, 1);
  ASSERT_EQ(*alloc_->Pause(b), Transition::kDone);
  std::vector<Live> al = Fill(a, {16 * kMiB}, 2);
  CachingAllocator::LiveRangesByTag live;
  live[a] = {{al[0].address, 4 * kMiB}};
  const std::uint64_t before = Calls(DriverOp::kCopyToHost);
  ASSERT_EQ(*alloc_->Switch({a}, {b}, &live), Transition::kDone);
  EXPECT_EQ(Calls(DriverOp::kCopyToHost) - before, 1u);
  for (const TagStats& s : alloc_->Stats().tags) {
    if (s.name == "sw_hint") { EXPECT_EQ(s.backed_up_bytes, static_cast<std::int64_t>(4 * kMiB)); }
  }
  ASSERT_EQ(*alloc_->Switch({b}, {a}), Transition::kDone);
  EXPECT_EQ(WrongBytes(al[0].address, 4 * kMiB, al[0].seed), 0u);
  FreeAll(al);
  FreeAll(bl);
}

TEST_F(SwitchTest, BadInputIsRefusedAndChangesNothing) {
  TagId a = Tag("sw_a", Policy::kBackup), b = Tag("sw_b", Policy::kBackup);
  std::vector<Live> al = Fill(a, {4 * kMiB}, 1);
  std::vector<Live> bl = Fill(b, {4 * kMiB}, 2);
  ASSERT_EQ(*alloc_->Pause(b), Transition::kDone);
  EXPECT_EQ(alloc_->Switch({}, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc_->Switch({a, a}, {b}).status().code(), absl::StatusCode::kInvalidArgument);
  absl::Status both = alloc_->Switch({a}, {a}).status();
  EXPECT_EQ(both.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(both.message(), HasSubstr("both paused and resumed"));
  TagId never = *InternTag("sw_never_used");
  EXPECT_EQ(alloc_->Switch({a}, {never}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(State(a), "active");
  EXPECT_EQ(State(b), "paused");
  ASSERT_EQ(*alloc_->Switch({a}, {b}), Transition::kDone);
  EXPECT_EQ(Wrong(bl), 0u);
  ASSERT_EQ(*alloc_->Resume(a), Transition::kDone);
  EXPECT_EQ(Wrong(al), 0u);
  FreeAll(al);
  FreeAll(bl);
}

TEST_F(SwitchTest, HooksRunAndAVetoUndoesTheOnesThatRan) {
  TagId a = Tag("sw_ha", Policy::kBackup), b = Tag("sw_hb", Policy::kBackup), c = Tag("sw_hc", Policy::kDiscard);
  std::vector<Live> al = Fill(a, {4 * kMiB}, 1);
  std::vector<Live> bl = Fill(b, {4 * kMiB}, 2);
  std::vector<Live> cl = Fill(c, {4 * kMiB}, 3);
  ASSERT_EQ(*alloc_->Pause(c), Transition::kDone);
  std::vector<std::string> log;
  bool veto = true;
  absl::Status inner;
  auto hooks = [&](const char* name) {
    return std::make_pair(
        [&, name](TagId, int) {
          log.push_back(std::string("before ") + name);
          if (std::string(name) == "b" && veto) return absl::UnavailableError("NCCL deregistration failed");
          inner = alloc_->Switch({c}, {a}).status();  // a tag of this very switch
          return absl::OkStatus();
        },
        [&, name](TagId, int) {
          log.push_back(std::string("after ") + name);
          return absl::OkStatus();
        });
  };
  for (auto [tag, name] : {std::pair{a, "a"}, std::pair{b, "b"}, std::pair{c, "c"}}) {
    auto [before, after] = hooks(name);
    ASSERT_TRUE(alloc_->AddHooks(tag, before, after).ok());
  }
  absl::Status vetoed = alloc_->Switch({a, b}, {c}).status();
  EXPECT_EQ(vetoed.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(log, (std::vector<std::string>{"before a", "before b", "after a"}));
  EXPECT_EQ(inner.code(), absl::StatusCode::kFailedPrecondition) << inner;
  EXPECT_EQ(State(a), "active");
  EXPECT_EQ(State(b), "active");
  EXPECT_EQ(State(c), "paused");
  veto = false;
  log.clear();
  ASSERT_EQ(*alloc_->Switch({a, b}, {c}), Transition::kDone);
  EXPECT_EQ(log, (std::vector<std::string>{"before a", "before b", "after c"}));
  ASSERT_EQ(*alloc_->Switch({c}, {a, b}), Transition::kDone);
  EXPECT_EQ(Wrong(al), 0u);
  EXPECT_EQ(Wrong(bl), 0u);
  ASSERT_EQ(*alloc_->Resume(c), Transition::kDone);
  FreeAll(al);
  FreeAll(bl);
  FreeAll(cl);
}

TEST_F(SwitchTest, OutOfMemoryLeavesEveryTagAsItWasAndALaterSwitchSucceeds) {
  Make(256 * kMiB);
  TagId big = Tag("sw_oom_big", Policy::kBackup), small = Tag("sw_oom_small", Policy::kBackup);
  TagId other = Tag("sw_oom_other", Policy::kDiscard);
  std::vector<Live> b = Fill(big, {200 * kMiB}, 10);
  ASSERT_EQ(*alloc_->Pause(big), Transition::kDone);
  std::vector<Live> s = Fill(small, {32 * kMiB}, 20);
  std::vector<Live> o = Fill(other, {64 * kMiB}, 30);  // leaves too little for big
  absl::StatusOr<Transition> r = alloc_->Switch({small}, {big});
  ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("every tag is as it was"));
  EXPECT_EQ(State(small), "active");
  EXPECT_EQ(State(big), "paused");
  EXPECT_EQ(Wrong(s), 0u);
  FreeAll(o);
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  ASSERT_EQ(*alloc_->Switch({small}, {big}), Transition::kDone);
  EXPECT_EQ(Wrong(b), 0u);
  ASSERT_EQ(*alloc_->Switch({big}, {small}), Transition::kDone);
  EXPECT_EQ(Wrong(s), 0u);
  ASSERT_EQ(*alloc_->Resume(big), Transition::kDone);
  FreeAll(b);
  FreeAll(s);
}

// Concurrent switches of overlapping tag sets, pauses, resumes and allocations in other
// tags: no deadlock (tags are locked in id order), no lost byte, nothing leaked. Run
// under ASAN and TSAN by scripts/run_tests.sh.
TEST_F(SwitchTest, StressConcurrentSwitchesPausesAndAllocations) {
  Make(1024 * kMiB);
  const char* names[] = {"sws_0", "sws_1", "sws_2", "sws_3"};
  std::vector<TagId> tags;
  std::vector<std::vector<Live>> blocks;
  for (int k = 0; k < 4; ++k) {
    tags.push_back(Tag(names[k], k % 2 == 0 ? Policy::kBackup : Policy::kDiscard));
    blocks.push_back(Fill(tags[k], {8 * kMiB, 300 * 1024, 24 * kMiB}, static_cast<std::uint8_t>(40 * k)));
  }
  TagId busy = Tag("sws_busy", Policy::kDiscard);
  std::atomic<bool> stop{false};
  std::atomic<int> switches{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < 3; ++w) {
    threads.emplace_back([&, w] {
      std::uint64_t x = 77 + w;
      for (int it = 0; it < 60; ++it) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        const int p = (x >> 33) % 4, q = (x >> 40) % 4;
        absl::StatusOr<Transition> r;
        if (p == q) {
          r = (x >> 50) % 2 ? alloc_->Pause(tags[p]) : alloc_->Resume(tags[p]);
        } else {
          r = alloc_->Switch({tags[p]}, {tags[q]});
        }
        ASSERT_TRUE(r.ok()) << r.status();
        if (p != q && *r == Transition::kDone) switches.fetch_add(1);
      }
    });
  }
  threads.emplace_back([&] {
    while (!stop.load()) {
      absl::StatusOr<DevicePtr> p = alloc_->Allocate(3 * kMiB, nullptr, busy);
      ASSERT_TRUE(p.ok()) << p.status();
      FillPattern(*p, 3 * kMiB, 9);
      ASSERT_EQ(WrongBytes(*p, 3 * kMiB, 9), 0u);
      ASSERT_TRUE(alloc_->Free(*p).ok());
    }
  });
  for (int w = 0; w < 3; ++w) threads[w].join();
  stop.store(true);
  threads.back().join();
  EXPECT_GT(switches.load(), 0);
  for (int k = 0; k < 4; ++k) {
    ASSERT_TRUE(alloc_->Resume(tags[k]).ok());
    if (k % 2 == 0) { EXPECT_EQ(Wrong(blocks[k]), 0u) << names[k]; }
    FreeAll(blocks[k]);
  }
  ASSERT_TRUE(alloc_->Validate().ok());
}

// Issue 28 item 2: the handed-over memory was zeroed after the incoming tag had been
// published active, so a block allocated in it meanwhile (here: right before the zeroing
// memset, from the switch's own thread) was zeroed. Now the tag is active only once the
// zeroing has completed; until then an allocation in it is refused.
TEST_F(SwitchTest, NothingAllocatedInAResumedTagIsZeroedByItsSwitch) {
  TagId kv = Tag("sw_zw_kv", Policy::kDiscard), out = Tag("sw_zw_out", Policy::kDiscard);
  // One 18.5 MiB block in a 20 MiB chunk: its cover (20 MiB) keeps 1.5 MiB free after it.
  std::vector<Live> k = Fill(kv, {18 * kMiB + 512 * 1024}, 1);
  ASSERT_EQ(*alloc_->Pause(kv), Transition::kDone);
  std::vector<Live> o = Fill(out, {4 * kMiB}, 7);  // a 20 MiB chunk: the donor
  constexpr std::size_t kLate = 1536 * 1024;
  DevicePtr late = 0;
  absl::Status late_status = absl::UnknownError("not run");
  bool armed = true;
  sim_->SetBeforeCall([&](DriverOp op) {
    if (op != DriverOp::kMemset || !armed) return;
    armed = false;
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(kLate, nullptr, kv);
    late_status = p.status();
    if (p.ok()) {
      late = *p;
      FillPattern(late, kLate, 33);
    }
  });
  ASSERT_EQ(*alloc_->Switch({out}, {kv}), Transition::kDone);
  sim_->SetBeforeCall(nullptr);
  EXPECT_FALSE(armed) << "the switch zeroed nothing: the test did not open its window";
  EXPECT_EQ(alloc_->Stats().handed_over_bytes, 20 * kMiB);
  if (late != 0) {
    EXPECT_EQ(WrongBytes(late, kLate, 33), 0u) << "a block allocated in the resumed tag was zeroed by the switch";
    ASSERT_TRUE(alloc_->Free(late).ok());
  } else {
    EXPECT_EQ(late_status.code(), absl::StatusCode::kFailedPrecondition) << late_status;
  }
  DevicePtr now = *alloc_->Allocate(kLate, nullptr, kv);  // active once the switch returned
  FillPattern(now, kLate, 34);
  EXPECT_EQ(WrongBytes(now, kLate, 34), 0u);
  ASSERT_TRUE(alloc_->Free(now).ok());
  ASSERT_EQ(*alloc_->Resume(out), Transition::kDone);
  FreeAll(k);
  FreeAll(o);
}

// Issue 28 item 2, under load: threads allocate, write, check, free and empty the cache
// of tags while repeated switches bring those tags in (the users of a tag being switched
// out step aside first, as a program must), and of a tag no switch touches. No byte
// written by a user may change, no memset may land on released or reused memory. Run
// under ASAN and TSAN by scripts/run_tests.sh.
TEST_F(SwitchTest, StressUsersOfIncomingTagsNeverSeeTheSwitchZeroTheirBytes) {
  Make(1024 * kMiB);
  TagId t[2] = {Tag("swz_x", Policy::kDiscard), Tag("swz_y", Policy::kDiscard)};
  TagId keep = Tag("swz_keep", Policy::kBackup);
  std::vector<Live> base[2] = {Fill(t[0], {18 * kMiB + 512 * 1024, 8 * kMiB}, 1),
                               Fill(t[1], {18 * kMiB + 512 * 1024, 8 * kMiB}, 2)};
  ASSERT_EQ(*alloc_->Pause(t[1]), Transition::kDone);
  // A tag's users count themselves in; the switch taking it out raises `leaving` and waits
  // until none is left (a reader-writer lock would starve the switch of its turn).
  std::atomic<int> users[2] = {0, 0};
  std::atomic<bool> leaving[2] = {false, false};
  std::atomic<bool> stop{false};
  std::atomic<int> wrong{0}, used{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      std::uint64_t x = 1234 + w;
      while (!stop.load()) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        const int k = (x >> 33) % 2;
        const std::size_t n = (x >> 40) % 2 ? kMiB + 512 * 1024 : 3 * kMiB;
        const auto seed = static_cast<std::uint8_t>(x >> 50);
        users[k].fetch_add(1);
        if (leaving[k].load()) {
          users[k].fetch_sub(1);
          std::this_thread::yield();
          continue;
        }
        absl::StatusOr<DevicePtr> p = alloc_->Allocate(n, nullptr, t[k]);
        if (!p.ok()) {
          users[k].fetch_sub(1);
          EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition) << p.status();
          continue;  // paused, or still being switched in
        }
        FillPattern(*p, n, seed);
        std::this_thread::yield();
        if (WrongBytes(*p, n, seed) != 0) wrong.fetch_add(1);
        used.fetch_add(1);
        EXPECT_TRUE(alloc_->Free(*p).ok());
        if ((x >> 45) % 4 == 0) {
          EXPECT_TRUE(alloc_->EmptyCache(t[k]).ok());
        }
        users[k].fetch_sub(1);
      }
    });
  }
  threads.emplace_back([&] {
    std::uint8_t seed = 0;
    while (!stop.load()) {
      absl::StatusOr<DevicePtr> p = alloc_->Allocate(4 * kMiB, nullptr, keep);
      ASSERT_TRUE(p.ok()) << p.status();
      FillPattern(*p, 4 * kMiB, ++seed);
      std::this_thread::yield();
      if (WrongBytes(*p, 4 * kMiB, seed) != 0) wrong.fetch_add(1);
      ASSERT_TRUE(alloc_->Free(*p).ok());
      ASSERT_TRUE(alloc_->EmptyCache(keep).ok());
    }
  });
  for (int it = 0; it < 60; ++it) {  // sized for TSAN (about 50 s there)
    const int out = it % 2;
    leaving[out].store(true);
    while (users[out].load() != 0) std::this_thread::yield();
    absl::StatusOr<Transition> r = alloc_->Switch({t[out]}, {t[1 - out]});
    leaving[out].store(false);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) break;
    // The tag just switched in is the next one to leave: let its users in first, or on a
    // busy machine the loop can run through without any of them touching it.
    const int before = used.load();
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (used.load() < before + 2 && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::yield();
    }
    if (used.load() < before + 2) {
      ADD_FAILURE() << "no user allocated in a switched-in tag for 60 s";
      break;
    }
  }
  stop.store(true);
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0) << "bytes a user wrote were changed by a switch";
  EXPECT_GT(used.load(), 0);
  ASSERT_EQ(*alloc_->Resume(t[1]), Transition::kDone);
  ASSERT_TRUE(alloc_->Validate().ok());
  for (auto& b : base) FreeAll(b);
  absl::Status ordering = sim_->CheckOrdering();
  EXPECT_TRUE(ordering.ok()) << ordering;
}

// Issue 28 item 5: a donor one granule larger than the first cover overhung into the
// freed chunk between two live blocks and filled it, so the two covers touched: two run
// heads over one run of chunks, Validate failed and every later operation with it.
TEST_F(SwitchTest, AnOverhangingDonorNeverTouchesTheNextCover) {
  min_chunk_ = 2 * kMiB;
  Make(768 * kMiB);
  TagId in = Tag("sw_ovh_in", Policy::kDiscard), out = Tag("sw_ovh_out", Policy::kDiscard);
  DevicePtr a = *alloc_->Allocate(64 * kMiB, nullptr, in);  // its own 64 MiB chunk
  DevicePtr x = *alloc_->Allocate(4 * kMiB, nullptr, in);   // a 4 MiB chunk (64 / 16)
  DevicePtr c = *alloc_->Allocate(4 * kMiB, nullptr, in);
  ASSERT_EQ(x, a + 64 * kMiB);
  ASSERT_EQ(c, x + 4 * kMiB);
  ASSERT_TRUE(alloc_->Free(x).ok());
  ASSERT_TRUE(alloc_->EmptyCache(in).ok());  // a one-chunk hole between the two covers
  ASSERT_EQ(*alloc_->Pause(in), Transition::kDone);
  DevicePtr o = *alloc_->Allocate(68 * kMiB, nullptr, out);  // one chunk 4 MiB over the first cover
  ASSERT_EQ(*alloc_->Switch({out}, {in}), Transition::kDone);
  absl::Status valid = alloc_->Validate();
  EXPECT_TRUE(valid.ok()) << valid;
  DevicePtr more = *alloc_->Allocate(4 * kMiB, nullptr, in);  // the allocator still works
  for (DevicePtr p : {a, c, more}) ASSERT_TRUE(alloc_->Free(p).ok());
  ASSERT_EQ(*alloc_->Resume(out), Transition::kDone);
  ASSERT_TRUE(alloc_->Free(o).ok());
  ASSERT_TRUE(alloc_->Validate().ok());
}

// Issue 28 (suspected, shown): chunks handed to a backup tag kept the outgoing tag's old
// bytes outside its restored live ranges (its cached blocks and free space), the hazard
// switch_zero exists for. They now read zeros, as a resume's fresh memory does.
TEST_F(SwitchTest, ABackupTagReadsZerosOutsideItsRestoredRangesInHandedChunks) {
  TagId w = Tag("sw_bz_w", Policy::kBackup), out = Tag("sw_bz_out", Policy::kBackup);
  std::vector<Live> wb = Fill(w, {20 * kMiB}, 5);  // one 20 MiB chunk, one 20 MiB cover
  const CachingAllocator::LiveRanges part = {{wb[0].address, 4 * kMiB}};
  ASSERT_EQ(*alloc_->Pause(w, &part), Transition::kDone);
  std::vector<Live> ob = Fill(out, {20 * kMiB}, 60);  // the donor, full of its own bytes
  ASSERT_EQ(*alloc_->Switch({out}, {w}), Transition::kDone);
  EXPECT_EQ(alloc_->Stats().handed_over_bytes, 20 * kMiB);
  EXPECT_EQ(WrongBytes(wb[0].address, 4 * kMiB, 5), 0u) << "the live range is restored";
  const auto* rest = reinterpret_cast<const std::uint8_t*>(wb[0].address + 4 * kMiB);
  std::size_t nonzero = 0;
  for (std::size_t i = 0; i < 16 * kMiB; i += 512) nonzero += rest[i] != 0;
  EXPECT_EQ(nonzero, 0u) << "bytes outside the restored range show the outgoing tag's data";
  ASSERT_EQ(*alloc_->Resume(out), Transition::kDone);
  EXPECT_EQ(Wrong(ob), 0u);
  FreeAll(wb);
  FreeAll(ob);
}

// Issue 28 item 3, the allocator's side: an after-resume hook's failure stopped the
// hooks of the switch's other incoming tags, and its error looked like a failed switch.
// Every hook runs now, and the error is marked done (TransitionDone); a failed
// transition's error is not.
TEST_F(SwitchTest, EveryAfterResumeHookRunsAndTheErrorSaysTheSwitchIsDone) {
  TagId a = Tag("sw_hk_a", Policy::kBackup), b = Tag("sw_hk_b", Policy::kBackup);
  TagId c = Tag("sw_hk_c", Policy::kDiscard);
  std::vector<Live> la = Fill(a, {4 * kMiB}, 1), lb = Fill(b, {4 * kMiB}, 2), lc = Fill(c, {4 * kMiB}, 3);
  ASSERT_EQ(*alloc_->Pause(a), Transition::kDone);
  ASSERT_EQ(*alloc_->Pause(b), Transition::kDone);
  int ran_a = 0, ran_b = 0;
  ASSERT_TRUE(alloc_->AddHooks(a, nullptr, [&](TagId, int) { ++ran_a; return absl::InternalError("a's hook"); }).ok());
  ASSERT_TRUE(alloc_->AddHooks(a, nullptr, [&](TagId, int) { ++ran_a; return absl::OkStatus(); }).ok());
  ASSERT_TRUE(alloc_->AddHooks(b, nullptr, [&](TagId, int) { ++ran_b; return absl::UnavailableError("b's hook"); }).ok());
  absl::StatusOr<Transition> r = alloc_->Switch({c}, {a, b});
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(CachingAllocator::TransitionDone(r.status())) << r.status();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("switch done"));
  EXPECT_EQ(ran_a, 2);
  EXPECT_EQ(ran_b, 1) << "the second incoming tag's hooks must run too";
  EXPECT_EQ(State(a), "active");
  EXPECT_EQ(State(b), "active");
  EXPECT_EQ(State(c), "paused");
  EXPECT_EQ(Wrong(la) + Wrong(lb), 0u);
  // Resume: the same mark, every hook run.
  ASSERT_EQ(*alloc_->Pause(a), Transition::kDone);
  absl::StatusOr<Transition> resumed = alloc_->Resume(a);
  EXPECT_TRUE(CachingAllocator::TransitionDone(resumed.status())) << resumed.status();
  EXPECT_EQ(ran_a, 4);
  // A transition that failed is not marked.
  sim_->InjectFault(FaultRule{DriverOp::kUnmap, 1, 1, absl::StatusCode::kInternal});
  absl::StatusOr<Transition> failed = alloc_->Pause(b);
  ASSERT_FALSE(failed.ok());
  EXPECT_FALSE(CachingAllocator::TransitionDone(failed.status()));
  EXPECT_FALSE(CachingAllocator::TransitionDone(absl::OkStatus()));
  sim_->ClearFaults();
  EXPECT_EQ(State(b), "active");
  ASSERT_EQ(*alloc_->Resume(c), Transition::kDone);
  FreeAll(la);
  FreeAll(lb);
  FreeAll(lc);
}

}  // namespace
}  // namespace vmstash
