// PauseExecutor and ResumeExecutor: one Pause(tag) or Resume(tag) of a TagPool, from its
// control lock to its after-resume hooks (Note [Pause/Resume Protocol] below).
//
// What: the CachingAllocator finds the pool (its directory) and runs an executor over it;
// each executor has two phases: Run(), the lock/hook phase (the tag's control lock, the
// state check, the hooks), and Transact(), the transition itself under the tag's
// transition lock, which executes the pure plans of transition_plan.h against the heaps
// and the driver and moves the pool through its state machine (tag_pool.h). An executor
// lives for one call.
//
// Layering: executors see the TagPool and the TransitionHost (transition_host.h), never
// the allocator.
//
// Thread-safety: an executor is used by one thread; the locks it takes are the tag's
// control and transition locks and the host's mu, in that order.
//
// Note [Pause/Resume Protocol] (docs/architecture.md §5; planned in transition_plan.h,
//   executed by PauseExecutor and ResumeExecutor here and by the heaps, heap_pause.cc)
//   Pause(tag): under the tag's control lock the before-pause hooks run (see Hooks below);
//   then the tag's transition lock is taken (pause/resume of one tag are serial; other
//   tags and devices proceed) and the state becomes "pausing" (allocations into the tag
//   fail with FailedPrecondition, frees of its blocks wait), then (1) the device is synchronized: simple and certain, and a pause is rare; (2) for a
//   `backup` tag the requested bytes of each live block — never free cached blocks — are
//   copied into the tag's backup arena with async copies on the tag's own stream, queued
//   all at once in stages of whole chunks with an event after each stage; (3a) as each
//   stage's event completes, its chunks are unmapped (handles kept) while the copy engine
//   works on the next stages; (3b) only when every copy succeeded are the handles
//   released; the reservations stay. A failure in (1)-(3a) waits for the queued copies,
//   re-maps what was unmapped and leaves the tag active and intact: nothing was given back
//   yet, so the rollback cannot run out of memory. (Releasing stage k-1 during the copy of
//   stage k would save the release time, ~11 ms per 16 GiB on an H200, but a failure
//   after it would need memory that another thread may have taken meanwhile.)
//   Resume(tag): the live blocks are covered by granule-aligned runs (re-chunked, so a
//   tag grown in many chunks comes back in few), mapped at the same VA. A `backup` tag's
//   large runs come back in pieces growing from resume_first_piece_bytes to max_chunk;
//   each piece's restore copies are queued as soon as it is mapped, so creating and
//   mapping piece k+1 overlaps the copies of piece k. Any failure (ResourceExhausted
//   included) undoes what this resume made; the tag stays paused with its backup intact
//   and a later retry can succeed. Then after-resume hooks run.
//   Pausing a paused tag or resuming an active one is a no-op reported as
//   kAlreadyInState; pausing or resuming a tag that has no pool on this device is
//   NotFound. Freeing a block of a paused tag drops its backup bytes. The driver calls of
//   a transition are made without mu_ (only the tag's transition lock): other code skips
//   pools whose state is pausing/resuming, so nobody else touches them (Note [Heap
//   Locking] in tag_pool.h).
//   Hooks: pause and resume of one tag are serialized by the tag's control lock, which
//   is held around the hooks and the transition; the transition lock is taken only after
//   the before-pause hooks returned and released before the after-resume hooks run, so a
//   hook may allocate and free blocks of any tag (its own included) while the tag is
//   active. A hook that pauses or resumes its own tag gets FailedPrecondition at once; one
//   that pauses, resumes or switches another tag only tries that tag's control lock and
//   gets FailedPrecondition when the tag is in another transition (waiting could deadlock:
//   see ControlLocks in hooks.h).
//   Prepare and ReleaseBackup on a paused tag are FailedPrecondition: the arena holds the
//   paused bytes (a background preparation that finds the tag paused does nothing;
//   TagPool::Prepare).
//   A rollback that cannot map the tag's memory back leaves the tag "broken": it refuses
//   allocation, pause and resume with a message naming the tag and the cause; its blocks
//   can still be freed.
//   Lock order: a tag's control lock, then its transition lock, then mu_.
#ifndef VMSTASH_ALLOCATOR_PAUSE_RESUME_H_
#define VMSTASH_ALLOCATOR_PAUSE_RESUME_H_

#include <cstddef>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/heap.h"
#include "allocator/tag_pool.h"
#include "allocator/transition_host.h"
#include "allocator/transition_plan.h"

namespace vmstash {

class PauseExecutor {
 public:
  // `live` (optional): the byte ranges of the tag that hold data (CachingAllocator::Pause).
  PauseExecutor(TransitionHost* host, TagPool* pool, const ByteRanges* live) : host_(host), pool_(pool), live_(live) {}
  PauseExecutor(const PauseExecutor&) = delete;
  PauseExecutor& operator=(const PauseExecutor&) = delete;

  // The lock/hook phase: the control lock, the state check (kAlreadyInState for a paused
  // tag, the broken reason for a broken one), the before-pause hooks, then Transact().
  absl::StatusOr<TransitionResult> Run();

 private:
  // The transition under the transition lock: (1) synchronize, (2)+(3a) back up and unmap
  // (BackupAndUnmap), (3b) release; on failure the tag as it was (or broken).
  absl::StatusOr<TransitionResult> Transact();
  // Executes a backup pause's plan (transition_plan.h): reserves the arena, queues the
  // copies of every stage and unmaps each stage's chunks as its copies complete; on
  // failure waits for the copies and maps everything back (*undo_error: whether that
  // failed). *backed_up: the bytes copied.
  absl::Status BackupAndUnmap(const BackupLayout& layout, std::size_t* backed_up, absl::Status* undo_error)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool_->transition_mu());

  TransitionHost* const host_;
  TagPool* const pool_;
  const ByteRanges* const live_;
};

class ResumeExecutor {
 public:
  ResumeExecutor(TransitionHost* host, TagPool* pool) : host_(host), pool_(pool) {}
  ResumeExecutor(const ResumeExecutor&) = delete;
  ResumeExecutor& operator=(const ResumeExecutor&) = delete;

  // The lock/hook phase: the control lock, the state check (kAlreadyInState for an active
  // tag, the broken reason for a broken one), Transact(), then the after-resume hooks
  // (their error marked TransitionDone).
  absl::StatusOr<TransitionResult> Run();

 private:
  // The transition under the transition lock: maps the covers back (re-chunked) and
  // restores a backup tag's bytes; on failure the tag stays paused, its backup intact.
  absl::StatusOr<TransitionResult> Transact();
  // Executes one heap's resume plan into *txn: maps its covers piece by piece and, when
  // `restore`, queues each piece's restore copies as soon as it is mapped.
  absl::Status MapBack(Heap* heap, Heap::ResumeTxn* txn, bool restore, std::size_t first_piece_bytes,
                       std::size_t* restored) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool_->transition_mu());

  TransitionHost* const host_;
  TagPool* const pool_;
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_PAUSE_RESUME_H_
