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
//   Locking] in tag_pool.h, which also says what clang checks of these rules). The
//   executors take mu_ as TransitionHost::mu(). Driver calls on the slow paths (chunk
//   create/map, events, synchronize) are made holding mu_; nothing else is called out (no
//   callbacks, no Python, logs only at debug level on slow paths). Hooks run holding only
//   the tag's control lock.
//   Lock order: control lock, transition lock, mu_, then the driver's own locks.
//
// Note [Pending Frees and Synchronization]
//   A free of a block used on other streams (RecordStream) is pending until the events
//   recorded on those streams completed. A device synchronization completes only the work
//   queued before it, so a synchronize made without mu_ (Pause) first notes the sequence
//   number of the next pending free; afterwards only pending frees older than that are
//   taken as complete, newer ones still wait for their events.
//
// Pause, resume and switch are run by executors over the pools: PauseExecutor and
// ResumeExecutor (pause_resume.h, Note [Pause/Resume Protocol]) and SwitchExecutor with
// its SwitchTransaction (switch.h, Note [Switch Protocol]); they see the allocator only
// through TransitionHost (transition_host.h), which it implements.
//
// bypass (AllocatorOptions::bypass): every allocation gets its own reservation and chunk
// straight from the driver, and every free synchronizes the device and releases them:
// slow, but every byte is the user's, for compute-sanitizer and use-after-free hunts
// (BypassAllocations, bypass.h).
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
#include "allocator/bypass.h"
#include "allocator/heap.h"
#include "allocator/hooks.h"
#include "allocator/snapshot.h"
#include "allocator/stats.h"
#include "allocator/tag.h"
#include "allocator/switch.h"
#include "allocator/tag_pool.h"
#include "allocator/transition_host.h"
#include "allocator/transition_plan.h"
#include "vmm/chunk.h"
#include "vmm/driver.h"
#include "vmm/mapping.h"
#include "base/mutex.h"
#include "vmm/reservation.h"

namespace vmstash {

class CachingAllocator : private TransitionHost {
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
  // True when `tag` holds memory here: bytes reserved, or not active (paused, or in a
  // transition); false for a tag that does not exist here.
  bool TagHoldsMemory(TagId tag) const;
  // Undoes CreateTag (a caller's rollback): removes the tag's pool if it holds nothing —
  // no mapped memory, no live block, no hooks, no backup arena. True when removed. The
  // pool object stays alive (retired) until the allocator is destroyed: a call that found
  // it before the removal may still be using it.
  bool DropEmptyTag(TagId tag);

  // Synchronizes the device and unmaps/releases every chunk lying entirely in free
  // blocks, of all tags or of one.
  absl::Status EmptyCache();
  absl::Status EmptyCache(TagId tag);

  // --- Pause/resume: Note [Pause/Resume Protocol] ----------------------------------
  using Transition = vmstash::TransitionResult;
  // The error of a Resume or Switch that is done (every tag in its requested state) but
  // whose after-resume hooks failed carries a mark (a status payload) saying so; layers
  // above keep it on errors that mean the same. TransitionDone: the mark is there.
  static bool TransitionDone(const absl::Status& status) { return vmstash::TransitionDone(status); }
  static absl::Status MarkTransitionDone(absl::Status status) { return vmstash::MarkTransitionDone(std::move(status)); }
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
  using LiveRangesByTag = vmstash::LiveRangesByTag;
  using SwitchChanges = vmstash::SwitchChanges;
  // `agree` (optional): the switch as one of several that all commit or all roll back
  // (Note [Agreed Switch] in switch.h); called exactly once, whatever happens.
  // `exchange` (optional): chunks traded with the other processes of a switch across
  // processes (switch_exchange.h).
  using SwitchAgree = vmstash::SwitchAgree;
  absl::StatusOr<Transition> Switch(const std::vector<TagId>& pause, const std::vector<TagId>& resume,
                                    const LiveRangesByTag* live = nullptr, SwitchChanges* changed = nullptr,
                                    const SwitchAgree* agree = nullptr, SwitchExchange* exchange = nullptr);
  // Reserves (pins) the tag's backup arena ahead of the first pause: `bytes`, or the
  // tag's allocated bytes when 0. FailedPrecondition for a paused tag (its arena holds
  // the paused bytes and is never touched) or a discard tag.
  absl::Status Prepare(TagId tag, std::size_t bytes = 0);
  // Copies `size_bytes` at `ptr` — inside a live block of a paused `backup` tag, within
  // its backed-up bytes, or of an active one that retained them (Note [Retained Backups])
  // — from the backup arena to host memory `dst`. InvalidArgument when the range wraps
  // the address space; NotFound when no paused (or retained) backup holds it.
  absl::Status ReadBackup(DevicePtr ptr, std::size_t size_bytes, void* dst);
  // Where ReadBackup would read from: the host address of those backed-up bytes, valid
  // until the tag is resumed (a retained backup: paused again), or its backup released;
  // the caller keeps them paused while it reads. Same errors as ReadBackup.
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
  // Whether background preparation (AllocatorOptions::auto_prepare) pins the `backup`
  // tag's arena ahead of its pauses (the default) or leaves it to the pause that first
  // needs it (or an explicit Prepare). Turning it off keeps an arena already made and
  // drops a queued request; turning it on requests the tag's present size, even after a
  // ReleaseBackup. NotFound when the tag has no pool here.
  absl::Status SetPrepareAhead(TagId tag, bool ahead);
  // Where the `backup` tag's later pauses put its bytes (backup_arena.h; default
  // AllocatorOptions::backup_store). A different store drops the tag's present arena.
  // FailedPrecondition for a discard tag or one that is not active (a paused tag's arena
  // holds its bytes); NotFound when the tag has no pool here or (with
  // `directory_must_exist`; else the pause checks) a disk directory is missing;
  // InvalidArgument for a malformed store.
  absl::Status SetBackupStore(TagId tag, const BackupStore& store, bool directory_must_exist = true);
  absl::StatusOr<BackupStore> TagBackupStore(TagId tag) const;
  // What the tag's arena does after a resume (Note [Retained Backups] in tag_pool.h).
  // NotFound when the tag has no pool here.
  absl::Status SetBackupRetention(TagId tag, BackupRetention retention);
  // Callbacks for one tag, run without allocator locks (only the tag's control lock, see
  // Note [Pause/Resume Protocol]): before_pause may veto the pause by returning an error;
  // after_resume errors are returned by Resume and Switch (the tags are resumed: the
  // error is marked TransitionDone). Every after-resume hook runs, even after one fails.
  using TransitionHook = vmstash::TransitionHook;
  absl::Status AddHooks(TagId tag, TransitionHook before_pause, TransitionHook after_resume);

  // The tag's memory for another process to map (Note [Mapped Tags] in
  // runtime/tag_share.h): TagPool::ExportMemory under the lock; NotFound when the tag has
  // no pool here.
  absl::StatusOr<ExportedMemory> ExportTag(TagId tag) const ABSL_LOCKS_EXCLUDED(mu_) {
    MutexLock lock(&mu_);
    absl::StatusOr<TagPool*> pool = FindPoolLocked(tag, "export");
    if (!pool.ok()) return pool.status();
    return (*pool)->ExportMemory();
  }
  // The paused `backup` tag's backup for another process (TagPool::ExportBackup: valid
  // while the tag stays paused; its errors, or NotFound for a tag with no pool here).
  absl::StatusOr<ExportedBackup> ExportTagBackup(TagId tag) ABSL_LOCKS_EXCLUDED(mu_) {
    TagPool* pool = nullptr;
    {
      MutexLock lock(&mu_);
      absl::StatusOr<TagPool*> found = FindPoolLocked(tag, "export the backup of");
      if (!found.ok()) return found.status();
      pool = *found;
    }
    // Outside mu_ (the transition lock comes first): a pool dropped meanwhile is retired,
    // not freed (DropEmptyTag), as for WithBackup.
    return pool->ExportBackup();
  }

  AllocatorStats Stats() const;
  Snapshot TakeSnapshot() const;
  absl::Status Validate() const;
  // Resets the peaks of every Stat to the current values.
  void ResetPeaks();

  using TransitionHost::device;
  using TransitionHost::driver;
  using TransitionHost::granularity_bytes;

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

  CachingAllocator(Driver* driver, int device, AllocatorOptions options, std::size_t granularity_bytes,
                   std::size_t device_total_bytes);

  // The one lookup of a tag's pool: null when the tag has none on this device.
  TagPool* PoolOrNullLocked(TagId tag) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return tag >= 0 && static_cast<std::size_t>(tag) < pools_.size() ? pools_[tag].get() : nullptr;
  }
  // The pool `what` (a request's name, for the message) needs: InvalidArgument for a tag
  // id never interned, NotFound for a tag without a pool on this device (one message).
  absl::StatusOr<TagPool*> FindPoolLocked(TagId tag, const char* what) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // FindPoolLocked under mu_, for calls that then work on the pool without it (pools are
  // retired, never freed, while the allocator lives).
  absl::StatusOr<TagPool*> FindPool(TagId tag, const char* what) const ABSL_LOCKS_EXCLUDED(mu_);
  // The tag's pool, created with `policy` when it has none here (`what` as for FindPoolLocked).
  absl::StatusOr<TagPool*> PoolLocked(TagId tag, Policy policy, const char* what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Block*> AllocateSlowLocked(TagPool* pool, Heap* heap, std::size_t size_bytes, Stream stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The bypass option's allocation (BypassAllocations), out of the cached path's way.
  absl::StatusOr<DevicePtr> AllocateBypassLocked(TagPool* pool, std::size_t size_bytes, std::size_t rounded)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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
  // (TransitionHost; in_transition -1: none.)
  void CompletePendingLocked(std::uint64_t synced_before, TagId in_transition) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::uint64_t PendingSeqLocked() const override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pending_seq_; }
  // The pool a Pause, Resume or Switch moves: FindPoolLocked, or FailedPrecondition when
  // the calling thread runs that tag's hooks (hooks.h).
  absl::StatusOr<TagPool*> TransitionPool(TagId tag, const char* what);
  // Prepare (or the background preparer's request, `background`) of the tag's pool.
  absl::Status PrepareTag(TagId tag, std::size_t bytes, bool background);
  // The background thread's hand-back of a resumed arena (TagPool::GiveBack).
  absl::Status GiveBackTag(TagId tag);
  // Finds the backed-up bytes [ptr, ptr + size_bytes) of a paused tag and calls `use`
  // with their host address, holding that tag's transition lock (no resume meanwhile).
  absl::Status WithBackup(DevicePtr ptr, std::size_t size_bytes, const std::function<void(const char*)>& use);
  TagPool* PoolOf(const Block* block) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return pools_[block->heap->config().owner_id].get();
  }
  absl::Status SynchronizeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Releases free chunks of one tag (or all when tag < 0); first error returned.
  absl::Status ReleaseCachedLocked(TagId tag) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // (TransitionHost.) The pool's reserved bytes, and a background preparation when a
  // `backup` tag outgrew its arena.
  void NoteReservedLocked(TagPool* pool) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool GivesBackInBackground() const override { return preparer_ != nullptr && !preparer_->stopped(); }
  void NoteSwitchLocked(std::size_t handed_bytes) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    counters_.switches += 1;
    counters_.handed_over_bytes += handed_bytes;
  }
  // (TransitionHost.) Note [Host Budget]: other active tags' prepared arenas, taken back.
  std::size_t ReclaimPreparedArenas(const std::vector<const TagPool*>& transition, std::size_t wanted) override
      ABSL_LOCKS_EXCLUDED(mu_);
  // (TransitionHost.) Refused while the pool holds bypass allocations.
  absl::Status CheckPausableLocked(const TagPool* pool) const override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return bypass_.CheckNoneOf(pool->id(), pool->name());
  }
  absl::StatusOr<Event> TakeEventLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ValidateLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AfterOpLocked(absl::Status status) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string OomMessageLocked(const TagPool* pool, std::size_t size_bytes, const absl::Status& cause)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // driver_, device_, options_, granularity_bytes_ and the device lock mu_ are the
  // TransitionHost's.
  const std::size_t device_total_bytes_;

  std::vector<std::unique_ptr<TagPool>> pools_ ABSL_GUARDED_BY(mu_);  // by TagId
  // Pools DropEmptyTag took out of pools_: kept (empty) until the allocator goes, as calls
  // that looked them up before may still be using them.
  std::vector<std::unique_ptr<TagPool>> retired_pools_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<DevicePtr, Block*> live_ ABSL_GUARDED_BY(mu_);
  BypassAllocations bypass_ ABSL_GUARDED_BY(mu_);  // options_.bypass: every allocation is here
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
