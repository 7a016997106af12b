// TransitionHost: what the transition executors (pause_resume.h, switch.h) need of the
// per-device allocator that owns the pools they move, and nothing more.
//
// What: the device's driver, options and granularity; the device lock (mu), which guards
// every pool's state and stats (Note [Allocator Locking] in caching_allocator.h); and
// three services of the directory: the pending frees a synchronization completes (Note
// [Pending Frees and Synchronization]), the reserved-bytes accounting of a pool that comes
// back (which may start a background preparation), the switch counters, the arenas
// other tags hold prepared, taken back for a pause over the host cap, and whether a pool
// holds what no pause can move (bypass allocations).
//
// Layering: the CachingAllocator derives from this class (privately) and hands `this` to
// the executors it runs; the executors see this interface and the TagPools, never the
// allocator itself, so the arrows point one way: caching_allocator -> executors ->
// transition_host, tag_pool.
//
// Thread-safety: mu() is the device lock; the *Locked methods require it (annotated on the
// lock itself, so clang checks the executors' calls). The rest is immutable.
#ifndef VMSTASH_ALLOCATOR_TRANSITION_HOST_H_
#define VMSTASH_ALLOCATOR_TRANSITION_HOST_H_

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "allocator/allocator_options.h"
#include "allocator/tag.h"
#include "allocator/tag_pool.h"
#include "base/mutex.h"
#include "vmm/driver.h"

namespace vmstash {

// What Pause, Resume and Switch report when they succeed.
enum class TransitionResult { kDone, kAlreadyInState };

class TransitionHost {
 public:
  TransitionHost(const TransitionHost&) = delete;
  TransitionHost& operator=(const TransitionHost&) = delete;

  Driver* driver() const { return driver_; }
  int device() const { return device_; }
  const AllocatorOptions& options() const { return options_; }
  std::size_t granularity_bytes() const { return granularity_bytes_; }
  Mutex* mu() const ABSL_LOCK_RETURNED(mu_) { return &mu_; }

  // Note [Pending Frees and Synchronization]: the sequence number of the next pending
  // free, noted before a synchronize made without mu.
  virtual std::uint64_t PendingSeqLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) = 0;
  // Completes the pending frees older than `synced_before` (and those whose events
  // completed), including those of `in_transition`, a busy pool of the caller's.
  virtual void CompletePendingLocked(std::uint64_t synced_before, TagId in_transition)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) = 0;
  // A pool's reserved bytes changed (it came back active): its stats, a background
  // preparation when a `backup` tag outgrew its arena, and the background hand-back of a
  // resumed arena whose retention gives its memory back.
  virtual void NoteReservedLocked(TagPool* pool) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) = 0;
  // Whether a background thread hands resumed arenas' memory back (TagPool::ArenaAfterResume
  // leaves it to NoteReservedLocked's request) or the resume does it itself.
  virtual bool GivesBackInBackground() const = 0;
  // A switch committed, handing `handed_bytes` of chunks over.
  virtual void NoteSwitchLocked(std::size_t handed_bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) = 0;
  // Note [Host Budget] (backup_arena.h): a pause over host_max takes back the arenas this
  // device's other active tags hold prepared (TagPool::ReclaimPrepared), tag by tag until
  // `wanted` bytes were refunded, leaving out the pools of `transition` (whose transition
  // locks the caller holds). Each tag's transition lock is tried, never waited for: a tag
  // busy elsewhere is skipped. The caller holds no mu. The bytes refunded.
  virtual std::size_t ReclaimPreparedArenas(const std::vector<const TagPool*>& transition, std::size_t wanted)
      ABSL_LOCKS_EXCLUDED(mu_) = 0;
  // Whether `pool` may start pausing: FailedPrecondition (naming the option) while it holds
  // allocations of AllocatorOptions::bypass, which live outside its heaps (bypass.h) and
  // which no pause copies or releases. Checked under mu_ with the move to kPausing, so no
  // allocation slips in between (a pool that is not active allocates nothing).
  virtual absl::Status CheckPausableLocked(const TagPool* pool) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) = 0;

 protected:
  TransitionHost(Driver* driver, int device, AllocatorOptions options, std::size_t granularity_bytes)
      : driver_(driver), device_(device), options_(std::move(options)), granularity_bytes_(granularity_bytes) {}
  ~TransitionHost() = default;

  Driver* const driver_;
  const int device_;
  const AllocatorOptions options_;
  const std::size_t granularity_bytes_;
  mutable Mutex mu_;  // the device lock (Note [Allocator Locking])
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_TRANSITION_HOST_H_
