// mimalloc-style stress test: several threads allocate and free random sizes in random
// tags on random streams, fill blocks with cookies and check them on free (also when the
// free happens on another thread), with RecordStream, EmptyCache and Validate mixed in.
// Seeded (VMSTASH_STRESS_SEED-free: the seed is fixed per thread) so failures reproduce.
// Runs under --config=asan and --config=tsan in CI (scripts/run_tests.sh).
#include <atomic>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "allocator/caching_allocator.h"
#include "allocator/testing.h"
#include "gtest/gtest.h"
#include "base/mutex.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

struct Live {
  DevicePtr ptr = 0;
  std::size_t size = 0;
  std::uint64_t cookie = 0;
};

std::uint64_t CookieFor(DevicePtr p, std::size_t size, std::uint64_t salt) {
  return (p * 0x9e3779b97f4a7c15ull) ^ (size << 7) ^ salt;
}

// Writes the cookie over the block's first and last 64 bytes (the whole block if small).
void Fill(const Live& b) {
  auto* bytes = reinterpret_cast<std::uint64_t*>(b.ptr);
  std::size_t words = b.size / 8;
  std::size_t head = std::min<std::size_t>(words, 8);
  for (std::size_t i = 0; i < head; ++i) bytes[i] = b.cookie + i;
  for (std::size_t i = words > 8 ? words - 8 : head; i < words; ++i) bytes[i] = b.cookie + i;
}

bool Check(const Live& b) {
  auto* bytes = reinterpret_cast<const std::uint64_t*>(b.ptr);
  std::size_t words = b.size / 8;
  std::size_t head = std::min<std::size_t>(words, 8);
  for (std::size_t i = 0; i < head; ++i) {
    if (bytes[i] != b.cookie + i) return false;
  }
  for (std::size_t i = words > 8 ? words - 8 : head; i < words; ++i) {
    if (bytes[i] != b.cookie + i) return false;
  }
  return true;
}

TEST(CachingAllocatorStressTest, ThreadsWithCookiesAndCrossThreadFrees) {
  constexpr int kThreads = 4;
  constexpr int kOpsPerThread = 10000;
  SimDriver sim(SimDriverOptions{1, std::size_t{3} << 30, 2 * kMiB, {}});
  std::vector<Stream> streams = {nullptr, *sim.CreateStream(0), *sim.CreateStream(0)};
  AllocatorOptions options;
  auto alloc = *CachingAllocator::Create(&sim, 0, options);
  std::vector<TagId> tags = {kDefaultTag, *InternTag("kv_cache"), *InternTag("weights")};
  ASSERT_TRUE(alloc->CreateTag(tags[2], Policy::kBackup).ok());

  Mutex exchange_mu;
  std::vector<Live> exchange;  // blocks handed to other threads to free
  std::atomic<int> corrupt{0}, errors{0}, ooms{0};

  auto worker = [&](int id) {
    std::mt19937_64 rng(1234 + id);
    std::vector<Live> mine;
    auto free_one = [&](const Live& b) {
      if (!Check(b)) corrupt.fetch_add(1);
      absl::Status st = alloc->Free(b.ptr);
      if (!st.ok()) {
        errors.fetch_add(1);
        ADD_FAILURE() << st;
      }
    };
    for (int op = 0; op < kOpsPerThread; ++op) {
      int dice = static_cast<int>(rng() % 100);
      if (dice < 50 || mine.empty()) {
        // log-uniform sizes 512 B .. 8 MiB, rarely 40 MiB
        std::size_t size = std::size_t{512} << (rng() % 15);
        size += rng() % size;
        if (rng() % 200 == 0) size = 40 * kMiB;
        ScopedTag tag(tags[rng() % tags.size()]);
        Stream stream = streams[rng() % streams.size()];
        absl::StatusOr<DevicePtr> p = alloc->Allocate(size, stream);
        if (!p.ok()) {
          if (absl::IsResourceExhausted(p.status())) ooms.fetch_add(1);
          else ADD_FAILURE() << p.status(), errors.fetch_add(1);
          continue;
        }
        Live b{*p, size, CookieFor(*p, size, rng())};
        Fill(b);
        if (rng() % 10 == 0 && !alloc->RecordStream(b.ptr, streams[rng() % streams.size()]).ok()) {
          errors.fetch_add(1);
        }
        mine.push_back(b);
      } else if (dice < 80) {
        std::size_t i = rng() % mine.size();
        free_one(mine[i]);
        mine[i] = mine.back();
        mine.pop_back();
      } else if (dice < 95) {
        // Hand a block to whoever comes next; take one handed over by someone else.
        std::size_t i = rng() % mine.size();
        Live given = mine[i];
        mine[i] = mine.back();
        mine.pop_back();
        Live taken;
        {
          MutexLock lock(&exchange_mu);
          exchange.push_back(given);
          std::size_t j = rng() % exchange.size();
          taken = exchange[j];
          exchange[j] = exchange.back();
          exchange.pop_back();
        }
        free_one(taken);
      } else if (dice < 96) {
        absl::Status st = alloc->Validate();
        if (!st.ok()) ADD_FAILURE() << st, errors.fetch_add(1);
      } else {
        absl::Status st = alloc->EmptyCache();
        if (!st.ok()) ADD_FAILURE() << st, errors.fetch_add(1);
      }
    }
    for (const Live& b : mine) free_one(b);
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  for (const Live& b : exchange) {
    EXPECT_TRUE(Check(b));
    EXPECT_TRUE(alloc->Free(b.ptr).ok());
  }
  EXPECT_EQ(corrupt.load(), 0);
  EXPECT_EQ(errors.load(), 0);
  absl::Status valid = alloc->Validate();
  EXPECT_TRUE(valid.ok()) << valid;
  AllocatorStats s = alloc->Stats();
  EXPECT_EQ(s.total.allocated_bytes.current, 0);
  EXPECT_EQ(s.total.active_blocks.current, 0);
  EXPECT_GT(s.cache_hits, 1000u);
  ASSERT_TRUE(alloc->EmptyCache().ok());
  EXPECT_EQ(sim.UsedBytes(0), 0u);
  alloc.reset();
  ASSERT_TRUE(sim.DestroyStream(0, streams[1]).ok());
  ASSERT_TRUE(sim.DestroyStream(0, streams[2]).ok());
  EXPECT_TRUE(sim.CheckNoLeaks().ok());
}

}  // namespace
}  // namespace vmstash

namespace vmstash {
namespace {

// A tag's pool dropped (a CreateTag rollback) while other threads are between looking it
// up and using it (Prepare, ReleaseBackup, a pause): the pool is retired, never freed
// under them (use-after-free under ASAN before), and a new CreateTag makes a fresh one.
TEST(CachingAllocatorStressTest, DroppingAnEmptyTagWhileOthersUseItIsSafe) {
  SimDriver sim(SimDriverOptions{1, std::size_t{1} << 30, 2 * kMiB, {}});
  AllocatorOptions options;
  options.auto_prepare = false;
  auto alloc = *CachingAllocator::Create(&sim, 0, options);
  // Several tags in turn: a pool a Prepare has given an arena is never empty again, so one
  // tag would leave the drops to the first iteration's race (a drop is then never tried).
  constexpr int kTags = 64;
  std::vector<TagId> tags;
  for (int i = 0; i < kTags; ++i) tags.push_back(*InternTag(absl::StrCat("stress_dropped_", i)));
  std::atomic<int> current{0};
  std::atomic<bool> stop{false};
  std::atomic<int> used{0};
  std::vector<std::thread> users;
  for (int t = 0; t < 3; ++t) {
    users.emplace_back([&, t] {
      while (!stop.load()) {
        const TagId tag = tags[current.load()];
        absl::Status s = t == 0 ? alloc->Prepare(tag, 0)
                         : t == 1 ? alloc->ReleaseBackup(tag)
                                  : alloc->Pause(tag).status();
        if (s.ok()) used.fetch_add(1);
      }
    });
  }
  int dropped = 0;
  for (int i = 0; i < 3000; ++i) {
    const TagId tag = tags[i % kTags];
    ASSERT_TRUE(alloc->CreateTag(tag, Policy::kBackup).ok());
    current.store(i % kTags);
    if (alloc->DropEmptyTag(tag)) ++dropped;
    (void)alloc->Resume(tag);
  }
  stop.store(true);
  for (std::thread& u : users) u.join();
  EXPECT_GT(dropped, 0);
  EXPECT_TRUE(alloc->Validate().ok());
}

}  // namespace
}  // namespace vmstash
