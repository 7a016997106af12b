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

#include <mutex>

#include "absl/base/thread_annotations.h"

namespace vmstash {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  bool TryLock() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true) { return mu_.try_lock(); }

 private:
  std::mutex mu_;
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
