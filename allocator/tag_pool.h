// TagPool: one tag's memory on one device, and the tag's one state machine
// (docs/architecture.md §5).
//
// What: a pool owns its tag's identity (id, name, policy: read here, never from its
// stats), its two heaps (small: requests up to kSmallMaxBytes; large: geometric growth,
// heap.h) and their block records, its backup (tag_backup.h: store, retention, arena and
// the arena's own state machine, told the tag's state by the pool), the copy stream and
// events of its transitions, its hooks and its statistics, and the two locks of its
// transitions. The CachingAllocator keeps one pool per tag in use on its device (its
// directory, indexed by TagId); the transition executors (pause_resume.h, switch.h,
// switch_transaction.h) move pools from state to state.
//
// State machine (Note [Pause/Resume Protocol], Note [Switch Protocol]):
//
//            Pause / Switch out                  commit
//   active ----------------------> pausing ------------------> paused
//     ^  <------- rollback -------   |                           |
//     |                              | rollback failed           | Resume / Switch in
//     |                              v                           v
//     |                            broken (final)             resuming
//     +------------------------- commit ------------------------+  (rollback: paused)
//
// Every change of state goes through MoveTo(), which refuses any (from, to) pair that is
// not in its table (kAllowedTransitions in tag_pool.cc); Validate() checks that the last
// change was in the table and that the pool's parts agree with its state (a paused pool's
// heaps are paused and it reserves nothing; an active one holds no backup extents; a
// broken one says why).
//
// Locking (Note [Allocator Locking] in caching_allocator.h has the lock order):
//   control_mu     held around a transition and its hooks (ControlLocks);
//   transition_mu  held for the transition itself, and for Prepare, ReleaseBackup,
//                  SetBackupStore and backup reads; it guards the arena, the copy stream
//                  and the copy events (annotated: clang checks every use);
//   owner_mu       the owner's mu: the CachingAllocator's per-device mutex, given to the
//                  pool at construction; it guards the state, the stats, the hooks, the
//                  broken reason and the backup's marks (annotated: clang checks every use
//                  inside the pool and the backup). The owner and the executors hold it
//                  under their own names for it (CachingAllocator::mu_,
//                  TransitionHost::mu()), which clang cannot equate with the pool's, so
//                  the public functions that need it check it themselves
//                  (AssertOwnerHeld: checked at run time in builds without NDEBUG, the
//                  tests', and trusted by the analysis).
//   The heaps and the backup extents: Note [Heap Locking] (by state; not annotated).
//
// Note [Heap Locking]
//   Which lock guards a pool's heaps (and its backup extents) depends on its state, which
//   clang cannot check: while the pool is active, paused or broken,
//   the owner's mu; while it is pausing or resuming (busy()), its transition lock alone,
//   held by the one thread running the transition — every other code path skips busy
//   pools (frozen()), so nobody else touches them. This is the one place that says so.
//
// Ownership: the CachingAllocator owns its pools (by unique_ptr: a pool never moves);
// a pool owns its heaps, arena, stream and events and gives them back when destroyed.
#ifndef VMSTASH_ALLOCATOR_TAG_POOL_H_
#define VMSTASH_ALLOCATOR_TAG_POOL_H_

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "allocator/backup_arena.h"
#include "allocator/block.h"
#include "allocator/heap.h"
#include "allocator/snapshot.h"
#include "allocator/stats.h"
#include "allocator/tag.h"
#include "allocator/tag_backup.h"
#include "allocator/tag_state.h"
#include "allocator/transition_plan.h"
#include "base/mutex.h"
#include "vmm/driver.h"

namespace vmstash {

// Note [Retained Backups]
//   What happens to a `backup` tag's arena after a resume (BackupRetention in
//   tag_backup.h, set by TagPool::SetRetention; the
//   default keeps vmstash's own choice: the arena stays prepared for the next pause, its
//   contents dropped, nothing readable). torch_memory_saver's drop-in sets both flags as
//   its retain_cpu_backup asks (torch_plugin/c_abi/tms_c.cc):
//   keep_after_resume    the arena keeps what the pause saved, readable after the resume
//                        (ReadBackup / BackupAddress, through the retained extents) until
//                        the next pause overwrites it in place (same offsets for the same
//                        blocks; a pause or switch failing before it reserves the arena
//                        keeps it, one failing after has dropped it: ArenaForPause), the
//                        backup is released, a foreground Prepare or a new
//                        store replaces the arena, or the block is freed. A background
//                        preparation leaves an arena holding retained bytes alone. Not for
//                        disk-files arenas, whose files are removed at every resume.
//   release_with_blocks  when a free drops the last backed-up bytes of the arena (those of
//                        a paused tag, or the retained ones of an active tag), the arena
//                        is released too: a backup lives no longer than its blocks. It
//                        stays released: no arena made later (another tag's background
//                        preparation due a moment after, the tag's next pause) takes its
//                        host addresses, so a pointer a reader kept into it is not
//                        page-locked again (vmm/retired_ranges.h, Note [Retired Ranges]).
//   give_back            without keep_after_resume: a pinned arena's host memory goes
//                        back to the OS after each resume (on the background thread, in
//                        steps, from 50 ms after the resume: GiveBack; by the resume itself
//                        without that thread; handed back lazily: Note [Pinned Pieces]) and
//                        after a failed pause, and is pinned again by the next pause; its
//                        address range stays. A background preparation pins only an arena
//                        it makes or grows; a foreground one, a new store or a release
//                        cancels a pending hand-back. torch_memory_saver's default mode
//                        (retain_cpu_backup off).
// A tag's memory as another process maps it (CachingAllocator::ExportTag; Note [Mapped
// Tags] in runtime/tag_share.h): its reservations, and its mapped chunks each exported as
// a descriptor the holder of this object owns (closed by CloseAll or the destructor).
struct ExportedMemory {
  struct Range {
    DevicePtr address = 0;
    std::size_t size_bytes = 0;
  };
  struct Piece {
    DevicePtr address = 0;
    std::size_t size_bytes = 0;
    int fd = -1;
  };
  std::vector<Range> reservations;  // address order
  std::vector<Piece> chunks;        // address order, each inside one reservation
  ExportedMemory() = default;
  ExportedMemory(ExportedMemory&& other) noexcept;
  ExportedMemory& operator=(ExportedMemory&& other) noexcept;
  ExportedMemory(const ExportedMemory&) = delete;
  ExportedMemory& operator=(const ExportedMemory&) = delete;
  ~ExportedMemory() { CloseAll(); }
  void CloseAll();
};

// A paused tag's backup as another process writes it (CachingAllocator::ExportTagBackup;
// Note [Mapped Tags]): its backed-up extents, in the node pool's memory the arena leased.
// The host addresses are valid while the tag stays paused.
struct ExportedBackup {
  std::vector<BackupExtent> extents;  // address order; arena_offset: from `data`
  const char* data = nullptr;         // the arena (a node pool lease)
  std::size_t bytes = 0;              // the arena bytes the extents use
};

// Callbacks for one tag, run without allocator locks (CachingAllocator::AddHooks).
using TransitionHook = std::function<absl::Status(TagId tag, int device)>;
using TransitionHooks = std::vector<std::pair<TransitionHook, TransitionHook>>;  // (before pause, after resume)

class TagPool {
 public:
  // `small` and `large` configure the heaps (their owner_id is `id`).
  // `owner_mu`: the owner's device lock (above), which outlives the pool.
  TagPool(TagId id, Policy policy, BackupStore store, Driver* driver, int device, HeapConfig small,
          HeapConfig large, Mutex* owner_mu, std::shared_ptr<HostLeaseSource> leases = nullptr);
  // Destroys the copy events and stream (errors logged), then the heaps give back their
  // chunks and reservations.
  ~TagPool();
  TagPool(const TagPool&) = delete;
  TagPool& operator=(const TagPool&) = delete;

  // --- Identity ---------------------------------------------------------------------
  TagId id() const { return id_; }
  const std::string& name() const { return name_; }
  Policy policy() const { return policy_; }
  bool backup() const { return policy_ == Policy::kBackup; }
  // Where a `backup` tag's pauses put their bytes (the owner's mu).
  const BackupStore& store() const {
    AssertOwnerHeld();
    return backup_.store();
  }

  // --- The owner's lock -----------------------------------------------------------------
  Mutex* owner_mu() const ABSL_LOCK_RETURNED(owner_mu_) { return owner_mu_; }
  // For a caller holding the owner's mu under the owner's name for it (the allocator's mu_,
  // TransitionHost::mu()): states it to the analysis; checked at run time in builds
  // without NDEBUG (Mutex::AssertHeld).
  void AssertOwnerHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK(owner_mu_, backup_.owner_mu()) {
    owner_mu_->AssertHeld();
  }

  // --- State machine (owner's mu) -------------------------------------------------------
  TagState state() const {
    AssertOwnerHeld();
    return state_;
  }
  // Pausing or resuming: its heaps belong to the thread holding its transition lock.
  bool busy() const {
    AssertOwnerHeld();
    return state_ == TagState::kPausing || state_ == TagState::kResuming;
  }
  // Heaps not in a consistent mapped state: skipped by cache release, fence sharing,
  // snapshots and validation.
  bool frozen() const {
    AssertOwnerHeld();
    return busy() || state_ == TagState::kBroken;
  }
  // The one transition function: Internal (the state unchanged) for a move that is not in
  // the table. `broken_reason`: the message of a move to kBroken (required there).
  absl::Status MoveTo(TagState to, std::string broken_reason = {});
  const std::string& broken_reason() const {
    AssertOwnerHeld();
    return broken_reason_;
  }
  // FailedPrecondition naming the tag and its state ("... is paused on device 0: resume
  // it before allocating"), or the broken reason.
  absl::Status NotActiveError(const char* before) const;
  // A failed pause: back to active, or to broken when the rollback failed too
  // (undo_error), with a message naming the tag and what to do. The status for the caller
  // to return.
  absl::Status FailPause(const absl::Status& cause, const absl::Status& undo_error)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_);

  // --- Heaps (Note [Heap Locking]) -------------------------------------------------------
  Heap* small() const { return small_.get(); }
  Heap* large() const { return large_.get(); }
  std::array<Heap*, 2> heaps() const { return {small_.get(), large_.get()}; }
  std::size_t mapped_bytes() const { return small_->mapped_bytes() + large_->mapped_bytes(); }
  std::size_t chunk_count() const { return small_->chunk_count() + large_->chunk_count(); }
  std::size_t free_bytes() const { return small_->free_bytes() + large_->free_bytes(); }
  std::size_t va_bytes() const { return small_->va_bytes() + large_->va_bytes(); }
  // Block records in use (live, pending and free blocks of both heaps).
  std::size_t block_records() const { return blocks_->live(); }
  // The live blocks of both heaps (small, then large; paused or not): a backup layout's input.
  std::vector<const Block*> LiveBlocks() const;
  // A pause's unmapping of every chunk (handles kept); on failure what was unmapped is
  // mapped back and *undo_error says whether that worked.
  absl::Status UnmapHeaps(absl::Status* undo_error);
  // Maps back what UnmapHeaps or UnmapChunk unmapped (a rollback); errors are logged.
  absl::Status RemapHeaps();
  // While paused: where each live block's backed-up bytes are in the arena.
  BackupExtents& backup_extents() { return backup_extents_; }
  const BackupExtents& backup_extents() const { return backup_extents_; }
  // Note [Retained Backups]: while active, the extents a resume kept readable.
  bool has_retained() const {
    AssertOwnerHeld();
    return !backup_.retained().empty();
  }
  // Whether a free may have backup bytes to drop (DropBackupOf); false on the usual path.
  bool holds_backup_records() const {
    AssertOwnerHeld();
    return !backup_extents_.empty() || !backup_.retained().empty();
  }
  // A free of `block`: drops its backup bytes (paused) or its retained ones (active). True
  // when that dropped the arena's last backed-up bytes and the retention releases the
  // arena with its blocks: the caller then calls ReleaseOrphanedArena once it has released
  // the owner's mu.
  bool DropBackupOf(const Block* block);

  // --- Transition resources (transition lock) -----------------------------------------------
  Mutex* control_mu() const ABSL_LOCK_RETURNED(control_mu_) { return &control_mu_; }
  Mutex* transition_mu() const ABSL_LOCK_RETURNED(transition_mu_) { return &transition_mu_; }
  // For a caller that holds the lock through a lock set clang cannot follow (a switch's
  // OrderedLocks): states it, for the analysis only.
  void AssertTransitionHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK(transition_mu_) {}
  BackupArena* arena() ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_) {
    backup_.AssertTransitionHeld();
    return backup_.arena();
  }
  using Reclaim = TagBackup::Reclaim;
  // A pause's (or switch's) backup reservation (TagBackup::Reserve: the arena from here on
  // holds the pause's bytes; a store refused by the host cap or the host takes back other
  // tags' prepared arenas through `reclaim`, then spills to `spill_dir`); the arena-bytes
  // statistic follows.
  absl::Status ReserveBackup(std::size_t bytes, const std::vector<std::size_t>& pieces, const std::string& spill_dir,
                             const Reclaim& reclaim = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_) ABSL_LOCKS_EXCLUDED(owner_mu_);
  // A pause (or switch) failed after ReserveBackup (TagBackup::AfterFailedPause).
  void ArenaAfterFailedPause() ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_) ABSL_LOCKS_EXCLUDED(owner_mu_);
  // Note [Host Budget] (backup_arena.h): another tag's pause over the cap takes back this
  // tag's arena if the tag is active and the arena is held only in readiness (no bytes
  // retained for reading): released as ReleaseBackup does, not prepared again in the
  // background until the tag grows. The caller took the transition lock with TryLock,
  // holding the owner's mu (so that the pool stays alive), and released the owner's mu;
  // the transition lock is released here. The bytes refunded.
  std::size_t ReclaimPrepared() ABSL_UNLOCK_FUNCTION(transition_mu_) ABSL_LOCKS_EXCLUDED(owner_mu_);
  // The backup arena's requests (CachingAllocator::Prepare, ReleaseBackup, SetBackupStore,
  // ReadBackup): each takes the transition lock, then the owner's mu (the lock order), so
  // that no transition starts in between (Note [Pause/Resume Protocol]).
  // Prepare: reserves `bytes` (0: the requested bytes) of arena; `background`: the
  // AutoPreparer's request, a quiet no-op unless the tag is active and still wants it.
  // A background preparation pins in steps of kPrepareStepBytes, taking the transition
  // lock for each, so that a pause arriving meanwhile waits for one step at most and pins
  // the rest itself, pipelined with its copies (Note [Pinned Pieces]).
  //
  // Note [Background Steps Yield]
  //   A lock released is handed to no one in particular: a background loop that takes the
  //   transition lock again right after each step (Prepare's PinStep, GiveBack) wins it
  //   over a waiting pause step after step, and the pause waits for the whole loop (on an
  //   H200 machine: a first pause meeting a 12 GiB preparation a quarter done took 1.8 s,
  //   against 0.9 s for one meeting nothing prepared). So every foreground caller of the
  //   lock (pause, resume, switch; a foreground Prepare, ReleaseBackup, SetStore,
  //   SetRetention, the last free's ReleaseOrphanedArena, a backup read) announces itself
  //   before it waits for it (AnnounceTransition, WithdrawTransition once it holds it; in
  //   ForegroundLock), and the loops take no next step while one is
  //   announced (YieldToTransitions); after it they find the arena moved on (the backup's
  //   epoch and state) and stop, or go on. A preparation faults in all of the arena
  //   before its first registration (many threads: BackupArena::Warm), the threads
  //   checking for an announced transition before each unit of PinnedPieces::kWarmUnitBytes.
  static constexpr std::size_t kPrepareStepBytes = std::size_t{512} << 20;
  void AnnounceTransition() { transitions_waiting_.fetch_add(1, std::memory_order_acq_rel); }
  void WithdrawTransition() { transitions_waiting_.fetch_sub(1, std::memory_order_acq_rel); }
  // A foreground caller's hold of one tag's transition lock, announced while it waits
  // (a caller of several tags' locks announces each, then takes them in order).
  class ABSL_SCOPED_LOCKABLE ForegroundLock {
   public:
    explicit ForegroundLock(TagPool* pool)
        ABSL_EXCLUSIVE_LOCK_FUNCTION(pool->transition_mu_, pool->backup_.transition_mu())
        : pool_(pool) {
      pool->AnnounceTransition();
      pool->transition_mu_.Lock();
      pool->WithdrawTransition();
    }
    ~ForegroundLock() ABSL_UNLOCK_FUNCTION() { pool_->transition_mu_.Unlock(); }
    ForegroundLock(const ForegroundLock&) = delete;
    ForegroundLock& operator=(const ForegroundLock&) = delete;

   private:
    TagPool* const pool_;
  };
  absl::Status Prepare(std::size_t bytes, bool background) ABSL_LOCKS_EXCLUDED(transition_mu_, owner_mu_);
  absl::Status ReleaseBackup() ABSL_LOCKS_EXCLUDED(transition_mu_, owner_mu_);
 private:
  // A background step's hold of the transition lock (not announced: Note [Background Steps
  // Yield]), under both names clang knows it by (the pool's, the backup's).
  class ABSL_SCOPED_LOCKABLE BackgroundLock {
   public:
    explicit BackgroundLock(TagPool* pool)
        ABSL_EXCLUSIVE_LOCK_FUNCTION(pool->transition_mu_, pool->backup_.transition_mu())
        : mu_(&pool->transition_mu_) {
      mu_->Lock();
    }
    ~BackgroundLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
    BackgroundLock(const BackgroundLock&) = delete;
    BackgroundLock& operator=(const BackgroundLock&) = delete;

   private:
    Mutex* const mu_;
  };
  // The pool's own hold of the owner's mu, under both names clang knows it by.
  class ABSL_SCOPED_LOCKABLE OwnerLock {
   public:
    explicit OwnerLock(const TagPool* pool) ABSL_EXCLUSIVE_LOCK_FUNCTION(pool->owner_mu_, pool->backup_.owner_mu())
        : mu_(pool->owner_mu_) {
      mu_->Lock();
    }
    ~OwnerLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
    OwnerLock(const OwnerLock&) = delete;
    OwnerLock& operator=(const OwnerLock&) = delete;

   private:
    Mutex* const mu_;
  };
  // The reserved-bytes statistic, read under the owner's mu (a release's floor for
  // background preparation).
  std::size_t ReservedBytes() const ABSL_LOCKS_EXCLUDED(owner_mu_);
  // The one sync of the arena-bytes statistic with what the arena holds.
  void SyncArenaBytesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_, owner_mu_);
  // Note [Background Steps Yield]: returns once no foreground transition is announced.
  void YieldToTransitions() const ABSL_LOCKS_EXCLUDED(transition_mu_);
  // Prepare's first step: sizes the arena; *pin_to: how far it is to be pinned (0: no pinning).
  absl::Status ReserveForPrepare(std::size_t bytes, bool background, std::size_t* pin_to)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_) ABSL_LOCKS_EXCLUDED(owner_mu_);
  // A background preparation's later steps: pins up to kPrepareStepBytes more of
  // [0, pin_to) unless the tag stopped wanting it or the arena changed since step one (a
  // pause, a new store, a release: the backup's epoch moved); *done when nothing is left.
  // The first of them (*warmed false) faults in all of [0, pin_to) first
  // (BackupArena::Warm), ending early when a foreground transition announces itself.
  absl::Status PinStep(std::uint64_t epoch, std::size_t pin_to, bool* warmed, bool* done)
      ABSL_LOCKS_EXCLUDED(transition_mu_, owner_mu_);
 public:
  // After DropBackupOf returned true: releases the arena if it still holds no backed-up
  // bytes, once a transition (or a backup read) of the tag holding the transition lock is
  // done; the caller holds no allocator lock, as Free's wait for a busy tag. Errors are
  // logged.
  void ReleaseOrphanedArena() ABSL_LOCKS_EXCLUDED(transition_mu_, owner_mu_);
  // Note [Retained Backups].
  void SetRetention(BackupRetention retention) ABSL_LOCKS_EXCLUDED(transition_mu_, owner_mu_);
  const BackupRetention& retention() const {
    AssertOwnerHeld();
    return backup_.retention();
  }
  // A resume's (or switch-in's) end, its restore copies complete (TagBackup::AfterResume:
  // the arena's contents dropped, kept readable, or its memory left to GiveBack on a
  // background thread with `later`, so that the resume returns when the device has its
  // bytes).
  void ArenaAfterResume(bool later) ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_) ABSL_LOCKS_EXCLUDED(owner_mu_);
  // A resume (or switch-in) failed, its copies waited for: the tag stays paused, its arena
  // holding its bytes; the staging ring the copies made goes (TagBackup::AfterFailedResume).
  void ArenaAfterFailedResume() ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_) {
    backup_.AssertTransitionHeld();
    backup_.AfterFailedResume();
  }
  // A resumed arena's memory is still to be given back.
  bool give_back_pending() const {
    AssertOwnerHeld();
    return backup_.give_back_pending();
  }
  // The background hand-back: steps of kPrepareStepBytes, each under the transition lock,
  // while the tag is active and the hand-back still pending (a pause cancels it and keeps
  // what is still pinned). Errors end it (logged by the caller), the rest stays pinned.
  absl::Status GiveBack() ABSL_LOCKS_EXCLUDED(transition_mu_, owner_mu_);
  // A new store; the old arena is released first (a release the driver refuses is the
  // error, the store and the arena unchanged) and goes to *dropped.
  absl::Status SetStore(const BackupStore& store, std::unique_ptr<BackupArena>* dropped)
      ABSL_LOCKS_EXCLUDED(transition_mu_, owner_mu_);
  // When this paused pool backed up [ptr, ptr + size_bytes): calls `use` with their host
  // address, holding the transition lock (no resume meanwhile), and returns true; false
  // when those bytes are not its; NotFound when they lie in one of its live blocks but
  // outside what was backed up.
  absl::StatusOr<bool> WithBackup(DevicePtr ptr, std::size_t size_bytes, const std::function<void(const char*)>& use)
      ABSL_LOCKS_EXCLUDED(transition_mu_, owner_mu_);
  // The paused tag's backup for another process (ExportedBackup); from then on until its
  // resume the arena is kept (backup_lent_). Unavailable when the tag is not paused;
  // FailedPrecondition when its bytes are not in a node pool lease (a discard tag, a disk
  // or pageable store, the pool refused the pause), saying which.
  absl::StatusOr<ExportedBackup> ExportBackup() ABSL_LOCKS_EXCLUDED(transition_mu_, owner_mu_);
  // The copy stream, created on first use.
  absl::StatusOr<Stream> CopyStream() ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_);
  Stream copy_stream() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_) { return copy_stream_; }
  // At least `count` copy events (one per pipelined stage or switch group).
  absl::StatusOr<std::vector<Event>*> CopyEvents(std::size_t count) ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_);
  // Waits for the copy stream (the device, if that wait fails) before a rollback unmaps
  // memory the copies may still touch.
  void DrainCopyStream() ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_);
  // No mapped memory, no live block (bypass allocations included), no hooks, no arena, no
  // stream (DropEmptyTag). Tries the control and transition locks (the caller holds the
  // owner's mu, which comes after them): a pool named in a transition or switch is not empty.
  bool Empty();

  // --- Hooks and auto-prepare marks (owner's mu) --------------------------------------------
  const TransitionHooks& hooks() const {
    AssertOwnerHeld();
    return hooks_;
  }
  void AddHooks(TransitionHook before_pause, TransitionHook after_resume) {
    AssertOwnerHeld();
    hooks_.emplace_back(std::move(before_pause), std::move(after_resume));
  }
  using AutoPrepare = TagBackup::AutoPrepare;
  AutoPrepare& auto_prepare() {
    AssertOwnerHeld();
    return backup_.auto_prepare();
  }

  // --- Statistics (owner's mu) -------------------------------------------------------------
  // The counters; their identity fields (name, policy, store, state) are filled by FillStats.
  TagStats& stats() {
    AssertOwnerHeld();
    return stats_;
  }
  const TagStats& stats() const {
    AssertOwnerHeld();
    return stats_;
  }
  // The reserved bytes and chunk count from the heaps (not while busy).
  void NoteReserved();
  // A block (or bypass allocation) of size_bytes, of which requested_bytes were asked
  // for, was allocated / freed.
  void NoteAllocated(std::size_t size_bytes, std::size_t requested_bytes) {
    AssertOwnerHeld();
    stats_.allocated_bytes.Add(static_cast<std::int64_t>(size_bytes));
    stats_.requested_bytes.Add(static_cast<std::int64_t>(requested_bytes));
    stats_.active_blocks.Add(1);
    ++stats_.allocations;
  }
  void NoteFreed(std::size_t size_bytes, std::size_t requested_bytes) {
    AssertOwnerHeld();
    stats_.allocated_bytes.Add(-static_cast<std::int64_t>(size_bytes));
    stats_.requested_bytes.Add(-static_cast<std::int64_t>(requested_bytes));
    stats_.active_blocks.Add(-1);
    ++stats_.frees;
  }
  // The pool's report: counters, identity, state and cached bytes.
  void FillStats(TagStats* out) const;
  // The pool's part of a snapshot: its tag, and its segments unless frozen.
  void AppendSnapshot(Snapshot* snap) const;
  // Its memory as another process maps it (ExportedMemory), for an active pool:
  // FailedPrecondition naming the state otherwise, or when a chunk cannot be exported
  // (created without AllocatorOptions::share_chunks); the driver's error. Nothing stays
  // open on failure.
  absl::StatusOr<ExportedMemory> ExportMemory() const;
  // A pause or switch-out committed: the state becomes paused, with its backup extents
  // and stats. `ms`: how long it took. The transition lock is held.
  absl::Status NotePaused(BackupExtents extents, std::size_t released, std::size_t backed_up, double ms)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_);
  // A resume or switch-in committed: the state becomes active, the reserved bytes are the
  // heaps' again (NoteReserved) and the extents are gone (kept as the retained extents
  // when the retention says so: Note [Retained Backups]).
  absl::Status NoteResumed(std::size_t restored, double ms) ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_);

  // Invariant walker, in the style of Heap::Validate: Internal naming the first violation.
  // The state machine's (last move in the table; parts agreeing with the state), the
  // backup's (TagBackup::Validate; its arena too when the transition lock is free), then,
  // for a pool that is not frozen, the heaps' and the stats'. `bypass_bytes`: bytes of this
  // tag's bypass allocations (counted in its stats, not in its heaps). *allocated_bytes
  // and *pending_blocks accumulate as in Heap::Validate.
  absl::Status Validate(std::size_t bypass_bytes, std::size_t* allocated_bytes, std::size_t* pending_blocks) const
     ;
  // The backup's invariants with its arena (TagBackup::ValidateWithArena): waits for the
  // transition lock, then takes the owner's mu. Not from inside a transition of the tag.
  absl::Status ValidateBackup() ABSL_LOCKS_EXCLUDED(transition_mu_, owner_mu_);

 private:
  const TagId id_;
  const std::string name_;
  const Policy policy_;
  Driver* const driver_;
  const int device_;
  // Block records of this tag's heaps: per tag, so a transition (without the owner's mu)
  // never shares a free list with other tags' allocations.
  const std::unique_ptr<BlockPool> blocks_ = std::make_unique<BlockPool>();
  const std::unique_ptr<Heap> small_;
  const std::unique_ptr<Heap> large_;

  Mutex* const owner_mu_;
  mutable Mutex control_mu_;
  mutable Mutex transition_mu_;

  TagState state_ ABSL_GUARDED_BY(owner_mu_) = TagState::kActive;
  TagState previous_ ABSL_GUARDED_BY(owner_mu_) = TagState::kActive;  // before the last move (Validate)
  std::string broken_reason_ ABSL_GUARDED_BY(owner_mu_);
  // Note [Heap Locking]: the owner's mu or the transition lock, by state (not annotated).
  BackupExtents backup_extents_;
  // ExportBackup gave another process the paused arena's place (Note [Mapped Tags]): the
  // last free keeps it (ReleaseOrphanedArena) until the resume, which the exporter
  // revokes that process's access before.
  bool backup_lent_ ABSL_GUARDED_BY(owner_mu_) = false;
  TransitionHooks hooks_ ABSL_GUARDED_BY(owner_mu_);
  TagStats stats_ ABSL_GUARDED_BY(owner_mu_);

  std::atomic<int> transitions_waiting_{0};  // Note [Background Steps Yield]
  // The backup's life (tag_backup.h): given both locks, its fields annotated with them.
  TagBackup backup_;
  Stream copy_stream_ ABSL_GUARDED_BY(transition_mu_) = nullptr;
  std::vector<Event> copy_events_ ABSL_GUARDED_BY(transition_mu_);
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_TAG_POOL_H_
