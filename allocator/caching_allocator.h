// CachingAllocator: the per-device caching allocator with tags (docs/architecture.md §5).
//
// Layout: a directory of TagPools (tag_pool.h), one per tag in use on this device, each
// with its one state machine; each pool has a small heap (requests up to kSmallMaxBytes,
// rounded to 512 B, carved from 2 MiB chunks) and a large heap (geometric chunk growth,
// see heap.h), each with its own VA reservations, so blocks of different tags never share
// a chunk. Live blocks are found by address in one hash map.
// Sizes are rounded up to kAlignmentBytes (512 B), which is also the minimum alignment of
// every returned address.
//
// Note [Stream-Ordered Reuse]
//   A block is allocated on a stream S. When it is freed, the memory is reusable at once by
//   later allocations on S (S orders them after the user's last use), so it goes into
//   heap index "S". Another stream T may only take it once an event recorded on S after
//   the free has completed. Recording an event on every free would cost a driver call per
//   free, so fences are lazy: when an allocation on T misses, the allocator records one
//   fence event on each other stream that owns free blocks (an event recorded later than
//   the free is later in S's order, so it is a correct, conservative fence), and the
//   blocks freed before a completed fence move to the heap's shared index, which every
//   stream may use. RecordStream(ptr, U) adds streams that use a block besides its
//   allocation stream; freeing such a block records one pooled event per added stream,
//   and the block is cached (in index "S") only when all of them have completed.
//   Synchronizing the device (OOM ladder, EmptyCache) completes everything at once.
//
// Note [OOM Ladder] (PyTorch's is the model)
//   1. a cached free block usable on the stream (own index, shared index);
//   2. fences on other streams (Note [Stream-Ordered Reuse]) that have completed;
//   3. map a new chunk (growth size; on ResourceExhausted, only what the request needs);
//   4. synchronize the device: every free and pending block becomes usable; retry 1;
//   5. release the free chunks of every tag of this device (EmptyCache); retry 3;
//   6. ResourceExhausted whose message gives the request, the tag, device free/total,
//      reserved and paused bytes, and per-tag usage. Never aborts.
//
// Note [Allocator Locking]
//   One Mutex per device allocator (mu_) guards the block map, the pending frees, the
//   fences and every pool's state and stats; a pool in transition (pausing/resuming) is
//   changed by its pauser/resumer under the tag's transition lock alone (Note [Heap
//   Locking] in tag_pool.h, which also says what clang checks of these rules). Driver calls on the slow paths (chunk create/map, events, synchronize)
//   are made holding mu_; nothing else is called out (no callbacks, no Python, logs only
//   at debug level on slow paths). Hooks run holding only the tag's control lock.
//   Lock order: control lock, transition lock, mu_, then the driver's own locks.
//
// Note [Pending Frees and Synchronization]
//   A free of a block used on other streams (RecordStream) is pending until the events
//   recorded on those streams completed. A device synchronization completes only the work
//   queued before it, so a synchronize made without mu_ (Pause) first notes the sequence
//   number of the next pending free; afterwards only pending frees older than that are
//   taken as complete, newer ones still wait for their events.
//
// Note [Pause/Resume Protocol] (docs/architecture.md §5; planned in transition_plan.h,
//   executed in pause_resume.cc and heap_pause.cc)
//   Pause(tag): the tag's transition lock is taken (pause/resume of one tag are serial;
//   other tags and devices proceed), the state becomes "pausing" (allocations into the tag
//   fail with FailedPrecondition, frees of its blocks wait), before-pause hooks run, then
//   (1) the device is synchronized: simple and certain, and a pause is rare; (2) for a
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
//   pools whose state is pausing/resuming, so nobody else touches them.
//   Hooks: pause and resume of one tag are serialized by the tag's control lock, which
//   is held around the hooks and the transition; the transition lock is taken only after
//   the before-pause hooks returned and released before the after-resume hooks run, so a
//   hook may allocate and free blocks of any tag (its own included) while the tag is
//   active. A hook that pauses or resumes its own tag gets FailedPrecondition at once; one
//   that pauses, resumes or switches another tag only tries that tag's control lock and
//   gets FailedPrecondition when the tag is in another transition (waiting could deadlock:
//   see ControlLocks).
//   Prepare and ReleaseBackup on a paused tag are FailedPrecondition: the arena holds the
//   paused bytes (a background preparation that finds the tag paused does nothing).
//   A rollback that cannot map the tag's memory back leaves the tag "broken": it refuses
//   allocation, pause and resume with a message naming the tag and the cause; its blocks
//   can still be freed.
//   Lock order: a tag's control lock, then its transition lock, then mu_.
//
// Note [Switch Protocol] (planned in handoff_plan.h, executed in switch.cc)
//   Switch(pause P, resume R) is one transaction: every tag of P paused and every tag of R
//   resumed, or, on any failure, every tag as it was. It exists because a phase switch run
//   as pauses then resumes costs D2H + H2D although the link carries both directions at
//   once, and releases physical memory only to create as much again right after.
//   (1) Control locks, then transition locks, of all its tags in ascending tag id order
//   (the one order every multi-tag caller uses); tags already in the requested state are
//   left out (kAlreadyInState when all are). P's before-pause hooks run first; a veto
//   runs the after-resume hooks of the P tags whose before-pause hooks already ran.
//   (2) The device is synchronized once. The outgoing chunks become donors and the
//   incoming covers recipients (PlanHandoff): a donor fitting a recipient's gap is mapped
//   there as a second mapping of the same chunk (no create, no release), the rest of the
//   recipient is created fresh, donors that fit nowhere are released at the commit. A
//   discard tag's chunk only goes where no restore copy writes (a discard recipient).
//   (3) Every piece of R is created (fresh) or mapped (donor) first: a cuMemMap or
//   cuMemSetAccess made while copies stream costs ~1 ms on the H200 (~35 us when idle).
//   Then the D2H copies of P's live bytes are queued at once on one outgoing tag's copy
//   stream, cut per donor chunk and into switch_group_bytes (64 MiB) pieces, an event
//   after each group; then the H2D restore copies on one incoming tag's copy stream:
//   into fresh pieces first, then into donors in the order their D2H copies complete,
//   each after a wait for the event of the last D2H copy reading the bytes it overwrites.
//   Both directions run concurrently; the host waits only at the end.
//   (4) Both streams are synchronized (a disk backup is written back), then P's own
//   mappings are unmapped (handles kept; re-mapped on failure).
//   (5) Commit, which cannot fail: P's heaps pause handing their donors over, leftover
//   donors are released (a refused release is retried later, as in a pause), R's heaps
//   commit their transactions with the donors moved into their pieces. Then (switch_zero,
//   default on) the bytes of handed-over chunks that no restore copy wrote (a discard
//   tag's whole pieces; a backup tag's bytes outside its restored live ranges: cached
//   blocks, free space) are zeroed and waited for, so a tag reads what a resume's freshly
//   created memory reads, not another tag's old bytes (a static KV cache read under a
//   mask would turn them into NaN); a failure there is logged only: those bytes are
//   undefined by contract. Only then are the new states published: until the zeroing
//   has completed, R's tags are "resuming" (no allocation in them, their frees wait, no
//   cache release), so no memset can land on a block allocated meanwhile or on memory
//   released and reused by another tag.
//   A failure in (2)-(4) waits for both streams, unmaps and releases what R's pieces
//   made, re-maps P's chunks, restores from the new backup the live bytes of every P
//   donor that restore copies may have written, and runs P's after-resume hooks; P stays
//   active with its bytes, R paused with its backup. If that rollback itself fails, the
//   P tag concerned is broken (as after a failed pause). R's after-resume hooks run after
//   the commit, without locks.
//   A hook run by a switch may not pause, resume or switch any tag of that switch. A hook
//   may transition other tags, but never waits for their control locks (ControlLocks): a
//   tag in another transition is refused at once, since that transition may wait for the
//   locks the hook's own transition holds.
//
// bypass (AllocatorOptions::bypass): every allocation gets its own reservation and chunk straight
// from the driver, and every free synchronizes the device and releases them: slow, but
// every byte is the user's, for compute-sanitizer and use-after-free hunts.
//
// Validate() walks every invariant (block.h, heap.h, stats); tests turn on
// validate_each_op so it runs after every public operation.
//
// Thread-safety: all public methods are thread-safe.
#ifndef VMSTASH_ALLOCATOR_CACHING_ALLOCATOR_H_
#define VMSTASH_ALLOCATOR_CACHING_ALLOCATOR_H_

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/allocator_options.h"
#include "allocator/auto_preparer.h"
#include "allocator/backup_arena.h"
#include "allocator/block.h"
#include "allocator/heap.h"
#include "allocator/snapshot.h"
#include "allocator/stats.h"
#include "allocator/tag.h"
#include "allocator/tag_pool.h"
#include "allocator/transition_plan.h"
#include "vmm/chunk.h"
#include "vmm/driver.h"
#include "vmm/mapping.h"
#include "base/mutex.h"
#include "vmm/reservation.h"

namespace vmstash {

class CachingAllocator {
 public:
  static constexpr std::size_t kAlignmentBytes = 512;
  static constexpr std::size_t kSmallMaxBytes = std::size_t{1} << 20;
  static constexpr std::size_t kMaxRequestBytes = std::size_t{1} << 48;

  // `driver` must outlive the allocator.
  static absl::StatusOr<std::unique_ptr<CachingAllocator>> Create(Driver* driver, int device,
                                                                  AllocatorOptions options);
  // Synchronizes the device and gives everything back to the driver. Live blocks are
  // reported in the log (their memory is unmapped too).
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // Allocates size_bytes for use on `stream` in the calling thread's current tag (or
  // `tag`). Size 0 returns 0 (a null pointer). InvalidArgument for a size over 2^48 or an
  // unknown tag id, ResourceExhausted after the OOM ladder.
  absl::StatusOr<DevicePtr> Allocate(std::size_t size_bytes, Stream stream) {
    return Allocate(size_bytes, stream, CurrentTag());
  }
  absl::StatusOr<DevicePtr> Allocate(std::size_t size_bytes, Stream stream, TagId tag);
  // Frees a block (0 is a no-op). InvalidArgument for an address this allocator did not
  // return (or already freed).
  absl::Status Free(DevicePtr ptr);
  // Marks the block at `ptr` as used by `stream` too (see Note [Stream-Ordered Reuse]).
  absl::Status RecordStream(DevicePtr ptr, Stream stream);
  // True when `ptr` is the start of a live allocation of this allocator.
  bool Owns(DevicePtr ptr) const;

  // Creates `tag` with `policy` on this device. OK if it exists with the same policy;
  // FailedPrecondition if it exists with another one. Tags used before being created are
  // created with policy discard.
  absl::Status CreateTag(TagId tag, Policy policy);
  absl::StatusOr<Policy> TagPolicy(TagId tag) const;
  // Undoes CreateTag (a caller's rollback): removes the tag's pool if it holds nothing —
  // no mapped memory, no live block, no hooks, no backup arena. True when removed.
  bool DropEmptyTag(TagId tag);

  // Synchronizes the device and unmaps/releases every chunk lying entirely in free
  // blocks, of all tags or of one.
  absl::Status EmptyCache();
  absl::Status EmptyCache(TagId tag);

  // --- Pause/resume: Note [Pause/Resume Protocol] ----------------------------------
  enum class Transition { kDone, kAlreadyInState };
  // The error of a Resume or Switch that is done (every tag in its requested state) but
  // whose after-resume hooks failed carries a mark (a status payload) saying so; layers
  // above keep it on errors that mean the same. TransitionDone: the mark is there.
  static bool TransitionDone(const absl::Status& status);
  static absl::Status MarkTransitionDone(absl::Status status);
  // `live` (optional): the byte ranges of the tag that hold data, from a layer that
  // caches inside our blocks (PyTorch's MemPool: its active blocks inside our segments).
  // A `backup` pause then copies only the parts of live blocks inside these ranges; the
  // other bytes of those blocks are not preserved. Ranges may be unsorted or overlap.
  using LiveRanges = ByteRanges;
  absl::StatusOr<Transition> Pause(TagId tag, const LiveRanges* live = nullptr);
  absl::StatusOr<Transition> Resume(TagId tag);
  // Pauses `pause` and resumes `resume` in one transaction (Note [Switch Protocol]).
  // InvalidArgument for a tag listed twice or in both lists; NotFound / FailedPrecondition
  // as Pause and Resume; ResourceExhausted when the incoming tags need more memory than
  // the device has once the outgoing tags' memory is handed over. kAlreadyInState when
  // every tag already is in its requested state. `live` (optional): per outgoing tag, the
  // byte ranges known to hold data, as for Pause.
  // `changed` (optional): the tags this call paused and resumed (a caller's rollback
  // switches exactly those back).
  using LiveRangesByTag = absl::flat_hash_map<TagId, LiveRanges>;
  struct SwitchChanges {
    std::vector<TagId> paused;
    std::vector<TagId> resumed;
  };
  absl::StatusOr<Transition> Switch(const std::vector<TagId>& pause, const std::vector<TagId>& resume,
                                    const LiveRangesByTag* live = nullptr, SwitchChanges* changed = nullptr);
  // Reserves (pins) the tag's backup arena ahead of the first pause: `bytes`, or the
  // tag's allocated bytes when 0. FailedPrecondition for a paused tag (its arena holds
  // the paused bytes and is never touched) or a discard tag.
  absl::Status Prepare(TagId tag, std::size_t bytes = 0);
  // Copies `size_bytes` at `ptr` — inside a live block of a paused `backup` tag, within
  // its backed-up bytes — from the backup arena to host memory `dst`. InvalidArgument
  // when the range wraps the address space; NotFound when no paused backup holds it.
  absl::Status ReadBackup(DevicePtr ptr, std::size_t size_bytes, void* dst);
  // Where ReadBackup would read from: the host address of those backed-up bytes, valid
  // until the tag is resumed (or its backup released); the caller keeps them paused
  // while it reads. Same errors as ReadBackup.
  absl::StatusOr<const void*> BackupAddress(DevicePtr ptr, std::size_t size_bytes);
  // Refuse to map new memory when the device's free memory would drop below `bytes`
  // (0: no margin; the allocation then fails like an OOM, after the OOM ladder).
  void SetMemoryMargin(std::size_t bytes);
  // Stops background preparations for good (process exit); see AutoPreparer::Stop.
  void StopBackgroundWork();
  // Waits until background preparations (AllocatorOptions::auto_prepare) are done.
  void WaitForBackgroundPrepare();
  // Gives the tag's backup arena host memory back (and stops preparing it automatically
  // until it grows again). FailedPrecondition while paused (the arena holds its bytes).
  absl::Status ReleaseBackup(TagId tag);
  // Where the `backup` tag's later pauses put its bytes (backup_arena.h; default
  // AllocatorOptions::backup_store). A different store drops the tag's present arena.
  // FailedPrecondition for a discard tag or one that is not active (a paused tag's arena
  // holds its bytes); NotFound when the tag has no pool here or a disk directory is
  // missing; InvalidArgument for a malformed store.
  absl::Status SetBackupStore(TagId tag, const BackupStore& store);
  absl::StatusOr<BackupStore> TagBackupStore(TagId tag) const;
  // Callbacks for one tag, run without allocator locks (only the tag's control lock, see
  // Note [Pause/Resume Protocol]): before_pause may veto the pause by returning an error;
  // after_resume errors are returned by Resume and Switch (the tags are resumed: the
  // error is marked TransitionDone). Every after-resume hook runs, even after one fails.
  using TransitionHook = vmstash::TransitionHook;
  absl::Status AddHooks(TagId tag, TransitionHook before_pause, TransitionHook after_resume);

  AllocatorStats Stats() const;
  Snapshot TakeSnapshot() const;
  absl::Status Validate() const;
  // Resets the peaks of every Stat to the current values.
  void ResetPeaks();

  int device() const { return device_; }
  Driver* driver() const { return driver_; }
  std::size_t granularity_bytes() const { return granularity_bytes_; }

 private:
  struct Fence {
    Stream stream = nullptr;
    Event event = nullptr;
    std::uint64_t epoch = 0;
  };
  struct PendingFree {
    Block* block = nullptr;
    std::uint64_t seq = 0;  // Note [Pending Frees and Synchronization]
    std::vector<Event> events;
    bool needs_device_sync = false;  // an event could not be recorded
  };
  struct BypassAllocation {
    Reservation reservation;
    Chunk chunk;
    Mapping mapping;
    TagId tag = kDefaultTag;
    std::size_t size_bytes = 0;
    std::size_t requested_bytes = 0;
  };

  CachingAllocator(Driver* driver, int device, AllocatorOptions options, std::size_t granularity_bytes,
                   std::size_t device_total_bytes);

  // The one lookup of a tag's pool: null when the tag has none on this device.
  TagPool* PoolOrNullLocked(TagId tag) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return tag >= 0 && static_cast<std::size_t>(tag) < pools_.size() ? pools_[tag].get() : nullptr;
  }
  // The pool `what` (a request's name, for the message) needs: InvalidArgument for a tag
  // id never interned, NotFound for a tag without a pool on this device (one message).
  absl::StatusOr<TagPool*> FindPoolLocked(TagId tag, const char* what) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The tag's pool, created with `policy` when it has none here.
  absl::StatusOr<TagPool*> PoolLocked(TagId tag, Policy policy) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Block*> AllocateSlowLocked(TagPool* pool, Heap* heap, std::size_t size_bytes, Stream stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<DevicePtr> AllocateBypassLocked(TagPool* pool, std::size_t size_bytes, std::size_t rounded)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status FreeBypassLocked(DevicePtr ptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees a live block already taken out of live_; its pool is not in transition.
  absl::Status FreeBlockLocked(TagPool* pool, Block* block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Step 3 of the ladder (Note [OOM Ladder]): heap growth, unless it would cut into the
  // memory margin (ResourceExhausted).
  absl::StatusOr<Block*> GrowLocked(Heap* heap, std::size_t size_bytes, Stream stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Step 2 of the ladder (Note [OOM Ladder]): completed fences on other streams; true
  // when blocks moved to a shared index.
  bool ReuseFencedLocked(Heap* heap, Stream stream) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Returns pending frees whose events completed, and those with seq < synced_before
  // (completed by a device synchronization that started when pending_seq_ was
  // synced_before), skipping blocks of tags in transition except `in_transition`.
  void ProcessPendingLocked(std::uint64_t synced_before, TagId in_transition = -1)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The transition's failure: the pool goes back to `state`, or to kBroken when the
  // rollback failed (undo_error), with a message naming the tag and what to do.
  absl::Status FailTransition(TagPool* pool, TagState state, const absl::Status& status,
                              const absl::Status& undo_error = absl::OkStatus());
  // A state change under mu_ (TagPool::MoveTo); a refused one is logged and returned.
  absl::Status MoveLocked(TagPool* pool, TagState to) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PrepareImpl(TagId tag, std::size_t bytes, bool background);
  // Pause/Resume without the hooks, with the control lock held.
  absl::StatusOr<Transition> PauseTransition(TagPool* pool, const LiveRanges* live);
  absl::StatusOr<Transition> ResumeTransition(TagPool* pool);
  // Runs the tag's before-pause (or after-resume) hooks, marked as this thread's hooks of
  // `tag`; the first error, with the tag named.
  absl::Status RunHooks(TagId tag, const TransitionHooks& hooks,
                        bool before_pause, const std::vector<TagId>& also_mine = {});
  // The pool for a Pause/Resume/hook, with its hooks; NotFound / FailedPrecondition.
  absl::StatusOr<TagPool*> TransitionPool(TagId tag, const char* what);
  // The control locks of a transition's pools (sorted by tag id), taken in that order and
  // released in reverse. Called from a hook (whose thread already holds the control locks
  // of the hook's own transition), a lock is only tried: waiting for it while holding
  // those could deadlock with a transition that holds it and waits for them
  // (Note [Pause/Resume Protocol]); a busy one is FailedPrecondition, nothing held.
  // "From a hook" is known per thread: a hook that hands a transition to another thread
  // and waits for it is not recognised, and may deadlock as before; hooks must not.
  class ControlLocks {
   public:
    ControlLocks() = default;
    ~ControlLocks() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      for (auto it = held_.rbegin(); it != held_.rend(); ++it) (*it)->Unlock();
    }
    ControlLocks(const ControlLocks&) = delete;
    ControlLocks& operator=(const ControlLocks&) = delete;
    absl::Status Acquire(const std::vector<TagPool*>& pools, int device, const char* what)
        ABSL_NO_THREAD_SAFETY_ANALYSIS;

   private:
    std::vector<Mutex*> held_;
  };
  // The background preparer's work: Prepare() for an active tag whose arena is smaller
  // than `bytes` needs; a quiet no-op otherwise (the tag was paused or released meanwhile).
  absl::Status PrepareInBackground(TagId tag, std::size_t bytes);
  // Finds the backed-up bytes [ptr, ptr + size_bytes) of a paused tag and calls `use`
  // with their host address, holding that tag's transition lock (no resume meanwhile).
  absl::Status WithBackup(DevicePtr ptr, std::size_t size_bytes, const std::function<void(const char*)>& use);
  // Executes a backup pause's plan (transition_plan.h): reserves the arena, queues
  // the copies of every stage and unmaps each stage's chunks as its copies complete;
  // on failure waits for the copies and maps everything back (*undo_error: whether
  // that failed). *backed_up: the bytes copied.
  absl::Status BackupAndUnmap(TagPool* pool, const BackupLayout& layout, std::size_t* backed_up,
                              absl::Status* undo_error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool->transition_mu());
  // Executes one heap's resume plan into *txn: maps its covers piece by piece and, when
  // `restore`, queues each piece's restore copies as soon as it is mapped.
  absl::Status MapBack(TagPool* pool, Heap* heap, Heap::ResumeTxn* txn, bool restore, std::size_t first_piece_bytes,
                       std::size_t* restored) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pool->transition_mu());
  TagPool* PoolOf(const Block* block) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return pools_[block->heap->config().owner_id].get();
  }
  // Switch steps (switch.cc). SwitchTransition runs (2)-(5) of Note [Switch Protocol]
  // holding the tags' transition locks; it leaves every tag as it was on failure.
  struct SwitchRun;
  absl::StatusOr<std::vector<TagPool*>> SwitchPools(const std::vector<TagId>& tags, const char* what);
  absl::Status SwitchTransition(SwitchRun& run);
  absl::Status PrepareSwitchBackups(SwitchRun& run);
  absl::Status MapSwitchRecipients(SwitchRun& run);
  absl::Status QueueSwitchBackups(SwitchRun& run);
  absl::Status QueueSwitchRestores(SwitchRun& run);
  // Returns what it could not restore ("tag 'x' is broken: ..."), empty when every tag is
  // as it was.
  std::string RollBackSwitch(SwitchRun& run, const absl::Status& cause);
  void CommitSwitch(SwitchRun& run);
  void ZeroHandedOver(SwitchRun& run);
  // Appends the parts of donor piece [va, va + size_bytes) that the restore copies
  // `written` do not cover (switch_zero zeroes them).
  static void NoteUnwritten(DevicePtr va, std::size_t size_bytes, std::vector<CopyStep> written,
                            std::vector<std::pair<DevicePtr, std::size_t>>* out);
  void LogSwitch(const SwitchRun& run) const;
  std::size_t GroupBytes() const { return std::max(options_.switch_group_bytes, granularity_bytes_); }
  absl::Status SynchronizeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Releases free chunks of one tag (or all when tag < 0); first error returned.
  absl::Status ReleaseCachedLocked(TagId tag) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NoteReservedLocked(TagPool* pool) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A resume has succeeded (Resume and Switch): the pool's commit (TagPool::NoteResumed),
  // then its reserved bytes, which may ask for a background preparation.
  absl::Status NoteResumedLocked(TagPool* pool, std::size_t restored, double ms) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Event> TakeEventLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ValidateLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AfterOpLocked(absl::Status status) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string OomMessageLocked(const TagPool* pool, std::size_t size_bytes, const absl::Status& cause)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Driver* const driver_;
  const int device_;
  const AllocatorOptions options_;
  const std::size_t granularity_bytes_;
  const std::size_t device_total_bytes_;

  mutable Mutex mu_;
  std::vector<std::unique_ptr<TagPool>> pools_ ABSL_GUARDED_BY(mu_);  // by TagId
  absl::flat_hash_map<DevicePtr, Block*> live_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<DevicePtr, std::unique_ptr<BypassAllocation>> bypass_live_ ABSL_GUARDED_BY(mu_);
  std::vector<Event> idle_events_ ABSL_GUARDED_BY(mu_);
  std::vector<Fence> fences_ ABSL_GUARDED_BY(mu_);
  std::vector<PendingFree> pending_ ABSL_GUARDED_BY(mu_);
  std::uint64_t free_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::uint64_t pending_seq_ ABSL_GUARDED_BY(mu_) = 0;  // next PendingFree::seq
  AllocatorStats counters_ ABSL_GUARDED_BY(mu_);  // device-wide counters (tags filled on read)
  std::atomic<std::size_t> memory_margin_bytes_{0};
  // Set at construction when options_.auto_prepare; its thread calls Prepare().
  std::unique_ptr<AutoPreparer> preparer_;
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_CACHING_ALLOCATOR_H_
