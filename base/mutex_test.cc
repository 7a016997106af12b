// Mutex (mutex.h): who holds it, as AssertHeld checks for a lock held under another name.
#include "base/mutex.h"

#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace vmstash {
namespace {

TEST(MutexTest, HeldByMeFollowsLockTryLockAndUnlock) {
  Mutex mu;
  EXPECT_FALSE(mu.HeldByMe());
  mu.Lock();
  EXPECT_TRUE(mu.HeldByMe());
  mu.AssertHeld();
  mu.Unlock();
  EXPECT_FALSE(mu.HeldByMe());
  ASSERT_TRUE(mu.TryLock());
  EXPECT_TRUE(mu.HeldByMe());
  mu.Unlock();
  {
    MutexLock lock(&mu);
    EXPECT_TRUE(mu.HeldByMe());
  }
  EXPECT_FALSE(mu.HeldByMe());
}

TEST(MutexTest, AnotherThreadsHoldIsNotMine) {
  Mutex mu;
  std::atomic<int> step{0};
  std::thread holder([&] {
    MutexLock lock(&mu);
    step.store(1);
    while (step.load() != 2) std::this_thread::yield();
  });
  while (step.load() != 1) std::this_thread::yield();
  EXPECT_FALSE(mu.HeldByMe());
  EXPECT_FALSE(mu.TryLock());
  step.store(2);
  holder.join();
  EXPECT_FALSE(mu.HeldByMe());
}

// Many threads taking turns: each sees the lock as its own exactly while it holds it (run
// under TSAN and ASAN by scripts/run_tests.sh).
TEST(MutexTest, EveryHolderSeesItselfAndNoOneElse) {
  Mutex mu;
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) {
        if (mu.HeldByMe()) wrong.fetch_add(1);
        MutexLock lock(&mu);
        if (!mu.HeldByMe()) wrong.fetch_add(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
}

#if !defined(NDEBUG) && !defined(__SANITIZE_THREAD__)  // a death test forks: not under TSAN
TEST(MutexDeathTest, AssertHeldWithoutTheLockAbortsInTestBuilds) {
  Mutex mu;
  EXPECT_DEATH(mu.AssertHeld(), "a lock asserted held is not held by this thread");
}
#endif

}  // namespace
}  // namespace vmstash
