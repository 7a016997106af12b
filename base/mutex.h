// Mutex: the project's lock, a std::mutex with Abseil's thread-safety annotations.
//
// Why not absl::Mutex: the project links the distribution's prebuilt abseil, which is not
// built with ThreadSanitizer instrumentation, so TSAN cannot see absl::Mutex's
// happens-before edges and reports false races (the stress test runs under TSAN in CI).
// std::mutex is intercepted by every sanitizer, costs the same uncontended, and the
// annotations keep ABSL_GUARDED_BY checking with clang.
//
// Thread-safety: it is the thread-safety primitive.
#ifndef VMSTASH_BASE_MUTEX_H_
#define VMSTASH_BASE_MUTEX_H_

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "absl/base/thread_annotations.h"

namespace vmstash {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() {
    mu_.lock();
    holder_.store(std::this_thread::get_id(), std::memory_order_relaxed);
  }
  void Unlock() ABSL_UNLOCK_FUNCTION() {
    holder_.store(std::thread::id(), std::memory_order_relaxed);
    mu_.unlock();
  }
  bool TryLock() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true) {
    if (!mu_.try_lock()) return false;
    holder_.store(std::this_thread::get_id(), std::memory_order_relaxed);
    return true;
  }
  // Whether the calling thread holds it (only the holder writes its own id, so the answer
  // is exact for the caller).
  bool HeldByMe() const { return holder_.load(std::memory_order_relaxed) == std::this_thread::get_id(); }
  // For a caller that holds this lock under another name clang cannot follow (a pool's
  // owner_mu_ is its allocator's mu_): states it to the analysis, and in builds without
  // NDEBUG (the tests) checks it, aborting on a caller that does not hold it (a bug in the
  // library, not a recoverable failure).
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() {
#ifndef NDEBUG
    if (!HeldByMe()) {
      std::fputs("vmstash: internal error: a lock asserted held is not held by this thread\n", stderr);
      std::abort();
    }
#endif
  }

 private:
  std::mutex mu_;
  std::atomic<std::thread::id> holder_{};
};

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

}  // namespace vmstash

#endif  // VMSTASH_BASE_MUTEX_H_
