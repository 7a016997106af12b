// 1000 random pause/resume cycles of two tags (one backup, one discard) while worker
// threads allocate, fill, check and free blocks in those tags and in an untouched tag.
// The test's own per-tag reader/writer lock keeps workers from touching a tag's memory
// while it is paused (on a GPU that would be a fault too); frees of a paused tag's blocks
// and allocations refused with FailedPrecondition are part of the mix. Backup-tag cookies
// must survive every cycle; discard-tag cookies are only checked within one cycle.
#include <atomic>
#include <chrono>
#include <functional>
#include <random>
#include <shared_mutex>
#include <thread>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/testing.h"
#include "gtest/gtest.h"
#include "base/mutex.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

using Transition = CachingAllocator::Transition;

struct TagCtl {
  TagId id = 0;
  Policy policy = Policy::kDiscard;
  std::shared_mutex touch;           // shared: workers using memory; exclusive: pause/resume
  std::atomic<bool> paused{false};
  std::atomic<std::uint64_t> epoch{0};  // pause count (discard contents die with each)
};

struct Live {
  DevicePtr ptr = 0;
  std::size_t size = 0;
  std::uint64_t cookie = 0;
  TagCtl* tag = nullptr;
  std::uint64_t epoch = 0;
};

void Fill(const Live& b) {
  auto* w = reinterpret_cast<std::uint64_t*>(b.ptr);
  w[0] = b.cookie;
  w[b.size / 8 - 1] = ~b.cookie;
}
bool Check(const Live& b) {
  auto* w = reinterpret_cast<const std::uint64_t*>(b.ptr);
  return w[0] == b.cookie && w[b.size / 8 - 1] == ~b.cookie;
}

TEST(PauseResumeStressTest, RandomCyclesWithConcurrentAllocAndFree) {
  constexpr int kWorkers = 3;
  constexpr int kCycles = 1000;
  SimDriver sim(SimDriverOptions{1, std::size_t{2} << 30, 2 * kMiB, {}});
  AllocatorOptions options;
  options.validate_each_op = false;  // Validate runs from the pauser thread instead
  auto alloc = *CachingAllocator::Create(&sim, 0, options);
  TagCtl tags[3];
  tags[0].id = *InternTag("stress_weights");
  tags[0].policy = Policy::kBackup;
  tags[1].id = *InternTag("stress_kv");
  tags[2].id = *InternTag("stress_default");
  for (TagCtl& t : tags) ASSERT_TRUE(alloc->CreateTag(t.id, t.policy).ok());
  ASSERT_TRUE(alloc->Prepare(tags[0].id, 64 * kMiB).ok());

  std::atomic<bool> stop{false};
  std::atomic<int> corrupt{0}, errors{0}, refused{0}, paused_frees{0};
  auto worker = [&](int id) {
    std::mt19937_64 rng(99 + id);
    std::vector<Live> mine;
    auto release = [&](const Live& b) {
      std::shared_lock<std::shared_mutex> lock(b.tag->touch);
      if (!b.tag->paused.load()) {
        bool alive = b.tag->policy == Policy::kBackup || b.epoch == b.tag->epoch.load();
        if (alive && !Check(b)) corrupt.fetch_add(1);
      } else {
        paused_frees.fetch_add(1);
      }
      if (!alloc->Free(b.ptr).ok()) errors.fetch_add(1);
    };
    while (!stop.load()) {
      if (mine.size() < 24 && rng() % 2 == 0) {
        TagCtl* t = &tags[rng() % 3];
        std::size_t size = (std::size_t{512} << (rng() % 12)) + 8 * (rng() % 64);
        std::shared_lock<std::shared_mutex> lock(t->touch);
        absl::StatusOr<DevicePtr> p = alloc->Allocate(size, nullptr, t->id);
        if (!p.ok()) {
          if (absl::IsFailedPrecondition(p.status()) && t->paused.load()) refused.fetch_add(1);
          else errors.fetch_add(1);
          continue;
        }
        Live b{*p, size / 8 * 8, rng(), t, t->epoch.load()};
        Fill(b);
        mine.push_back(b);
      } else if (!mine.empty()) {
        std::size_t i = rng() % mine.size();
        release(mine[i]);
        mine[i] = mine.back();
        mine.pop_back();
      }
    }
    for (const Live& b : mine) release(b);
  };
  std::vector<std::thread> threads;
  for (int w = 0; w < kWorkers; ++w) threads.emplace_back(worker, w);

  // Two pausers, one per tag, run at the same time: transitions of different tags proceed
  // in parallel (each holds only its tag's transition lock during copies).
  std::atomic<int> total_cycles{0};
  auto pauser = [&](TagCtl& t, int cycles_to_run) {
    for (int cycle = 0; cycle < cycles_to_run; ++cycle) {
      {
        std::unique_lock<std::shared_mutex> lock(t.touch);
        absl::StatusOr<Transition> p = alloc->Pause(t.id);
        if (!p.ok() || *p != Transition::kDone) errors.fetch_add(1);
        t.paused = true;
        t.epoch.fetch_add(1);
      }
      std::this_thread::yield();  // workers free paused blocks and get refused meanwhile
      {
        std::unique_lock<std::shared_mutex> lock(t.touch);
        absl::StatusOr<Transition> r = alloc->Resume(t.id);
        if (!r.ok() || *r != Transition::kDone) errors.fetch_add(1);
        t.paused = false;
      }
      if (cycle % 50 == 0 && !alloc->Validate().ok()) errors.fetch_add(1);
      total_cycles.fetch_add(1);
    }
  };
  std::thread p0(pauser, std::ref(tags[0]), kCycles / 2), p1(pauser, std::ref(tags[1]), kCycles / 2);
  p0.join();
  p1.join();
  const int cycles = total_cycles.load();
  stop = true;
  for (auto& th : threads) th.join();
  EXPECT_EQ(cycles, kCycles);
  EXPECT_EQ(corrupt.load(), 0);
  EXPECT_EQ(errors.load(), 0);
  absl::Status valid = alloc->Validate();
  EXPECT_TRUE(valid.ok()) << valid;
  AllocatorStats s = alloc->Stats();
  EXPECT_EQ(s.total.allocated_bytes.current, 0);
  std::printf("cycles %d, refused allocations %d, frees while paused %d\n", cycles, refused.load(),
              paused_frees.load());
  ASSERT_TRUE(alloc->EmptyCache().ok());
  EXPECT_EQ(sim.UsedBytes(0), 0u);
  alloc.reset();
  EXPECT_TRUE(sim.CheckNoLeaks().ok());
}

// Issue 16 item 2: workers free blocks used on their own held stream (RecordStream) while
// a pauser thread pauses and resumes other tags (each pause synchronizes the device
// without the allocator lock). A block must never be handed out again while a stream
// recorded on it still runs: the held stream is checked right after every allocation
// that returned a block overlapping it (a hold only ends by a wait or a release, so a
// hold still on proves the reuse decision was made during it).
TEST(PauseResumeStressTest, RecordedStreamsAreHonouredAcrossConcurrentPauses) {
  constexpr int kWorkers = 4;
  constexpr int kRounds = 400;
  SimDriver sim(SimDriverOptions{1, std::size_t{2} << 30, 2 * kMiB, {}});
  AllocatorOptions options;
  options.validate_each_op = false;
  options.auto_prepare = false;
  auto alloc = *CachingAllocator::Create(&sim, 0, options);
  const TagId shared = *InternTag("stress_recorded");
  const TagId paused_tags[2] = {*InternTag("stress_cycled_backup"), *InternTag("stress_cycled_discard")};
  ASSERT_TRUE(alloc->CreateTag(shared, Policy::kDiscard).ok());
  ASSERT_TRUE(alloc->CreateTag(paused_tags[0], Policy::kBackup).ok());
  ASSERT_TRUE(alloc->CreateTag(paused_tags[1], Policy::kDiscard).ok());
  std::vector<DevicePtr> cycled;
  for (TagId t : paused_tags) cycled.push_back(*alloc->Allocate(3 * kMiB, nullptr, t));
  // A synchronize returns a little after the device went idle (as a real one does), so
  // other threads' frees land in the window between it and the caller's next step.
  sim.SetAfterSynchronizeDevice([](int) { std::this_thread::sleep_for(std::chrono::microseconds(200)); });
  std::atomic<bool> stop{false};
  std::atomic<int> violations{0}, checked_while_held{0}, failures{0};
  std::thread pauser([&] {
    std::mt19937 rng(7);
    while (!stop.load()) {
      const TagId t = paused_tags[rng() % 2];
      if (!alloc->Pause(t).ok() || !alloc->Resume(t).ok()) failures.fetch_add(1);
    }
  });
  std::vector<std::thread> workers;
  for (int w = 0; w < kWorkers; ++w) {
    workers.emplace_back([&, w] {
      std::mt19937 rng(100 + w);
      Stream own = *sim.CreateStream(0);
      Stream user = *sim.CreateStream(0);
      for (int i = 0; i < kRounds; ++i) {
        const std::size_t size = (rng() % 2 == 0 ? 512 : 64 * 1024) * (1 + rng() % 4);
        absl::StatusOr<DevicePtr> p = alloc->Allocate(size, own, shared);
        if (!p.ok()) {
          failures.fetch_add(1);
          continue;
        }
        sim.HoldStream(0, user);  // `user` runs long work on p
        if (!alloc->RecordStream(*p, user).ok() || !alloc->Free(*p).ok()) failures.fetch_add(1);
        for (int k = 0; k < 3; ++k) {
          absl::StatusOr<DevicePtr> q = alloc->Allocate(size, own, shared);
          if (!q.ok()) {
            failures.fetch_add(1);
            continue;
          }
          const bool overlaps = *q < *p + size && *p < *q + size;
          if (sim.StreamHeld(0, user)) {
            checked_while_held.fetch_add(1);
            if (overlaps) violations.fetch_add(1);
          }
          if (!alloc->Free(*q).ok()) failures.fetch_add(1);
        }
        sim.ReleaseStream(0, user);
      }
      (void)sim.DestroyStream(0, own);
      (void)sim.DestroyStream(0, user);
    });
  }
  for (auto& t : workers) t.join();
  stop.store(true);
  pauser.join();
  EXPECT_EQ(violations.load(), 0);
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(checked_while_held.load(), kWorkers * kRounds);  // the check was exercised
  sim.SetAfterSynchronizeDevice(nullptr);
  for (DevicePtr p : cycled) ASSERT_TRUE(alloc->Free(p).ok());
  ASSERT_TRUE(alloc->Validate().ok());
  alloc.reset();
  absl::Status leaks = sim.CheckNoLeaks();
  EXPECT_TRUE(leaks.ok()) << leaks;
}

}  // namespace
}  // namespace vmstash
