// CachingAllocator: pause and resume of tags. See Note [Pause/Resume Protocol] in
// caching_allocator.h.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <optional>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "allocator/caching_allocator.h"
#include "base/bytes.h"
#include "base/log.h"
#include "base/status_macros.h"

namespace vmstash {
namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// The (allocator, tag) pairs whose hooks the calling thread is running: a hook that
// pauses or resumes its own tag would wait for itself on the tag's control lock.
struct HookFrame {
  const void* allocator;
  TagId tag;
};
thread_local std::vector<HookFrame> hook_frames;

bool InOwnHook(const void* allocator, TagId tag) {
  for (const HookFrame& f : hook_frames) {
    if (f.allocator == allocator && f.tag == tag) return true;
  }
  return false;
}

// Marks `tag` (and, for a switch, every other tag of it) as this thread's hooks' own.
class HookScope {
 public:
  HookScope(const void* allocator, TagId tag, const std::vector<TagId>& also) : count_(1 + also.size()) {
    hook_frames.push_back({allocator, tag});
    for (TagId t : also) hook_frames.push_back({allocator, t});
  }
  ~HookScope() { hook_frames.resize(hook_frames.size() - count_); }
  HookScope(const HookScope&) = delete;
  HookScope& operator=(const HookScope&) = delete;

 private:
  std::size_t count_;
};

}  // namespace

absl::Status CachingAllocator::AddHooks(TagId tag, TransitionHook before_pause, TransitionHook after_resume) {
  MutexLock lock(&mu_);
  VMSTASH_ASSIGN_OR_RETURN(TagPool * pool, PoolLocked(tag, Policy::kDiscard));
  pool->AddHooks(std::move(before_pause), std::move(after_resume));
  return absl::OkStatus();
}

absl::Status CachingAllocator::Prepare(TagId tag, std::size_t bytes) { return PrepareImpl(tag, bytes, false); }

absl::Status CachingAllocator::PrepareInBackground(TagId tag, std::size_t bytes) {
  return PrepareImpl(tag, bytes, true);
}

absl::Status CachingAllocator::PrepareImpl(TagId tag, std::size_t bytes, bool background) {
  TagPool* pool;
  {
    MutexLock lock(&mu_);
    VMSTASH_ASSIGN_OR_RETURN(pool, FindPoolLocked(tag, "prepare"));
  }
  // The state is checked under the transition lock, and the arena is touched only while
  // it is held: no pause can start in between (see Note [Pause/Resume Protocol]).
  MutexLock t(pool->transition_mu());
  std::size_t want = bytes;
  {
    MutexLock lock(&mu_);
    if (background) {
      // Paused, broken, or released since the request (which reset the target).
      if (pool->state() != TagState::kActive || pool->auto_prepare().requested_bytes == 0) return absl::OkStatus();
    } else if (pool->policy() != Policy::kBackup) {
      return absl::FailedPreconditionError(
          absl::StrCat("tag '", pool->name(), "' has policy discard: it has no backup arena to prepare"));
    } else if (pool->state() != TagState::kActive) {
      return absl::FailedPreconditionError(
          absl::StrCat("prepare of tag '", pool->name(), "' on device ", device_, ": the tag is ",
                       TagStateName(pool->state()), " and its backup arena holds its bytes; prepare before "
                       "pausing or after resuming"));
    }
    if (want == 0) want = static_cast<std::size_t>(pool->stats().requested_bytes.current);
  }
  // Every live block rounds up to a page in the arena; leave room for that.
  VMSTASH_RETURN_IF_ERROR(pool->EnsureArena()->Reserve(want + want / 64 + kBackupAlignBytes));
  MutexLock lock(&mu_);
  pool->stats().backup_arena_bytes = static_cast<std::int64_t>(pool->arena()->capacity_bytes());
  return absl::OkStatus();
}

absl::Status CachingAllocator::WithBackup(DevicePtr ptr, std::size_t size_bytes,
                                          const std::function<void(const char*)>& use) {
  if (size_bytes > ~DevicePtr{0} - ptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("backup read: ", size_bytes, " bytes at ", Hex(ptr), " run past the end of the address space"));
  }
  std::vector<TagPool*> paused;
  {
    MutexLock lock(&mu_);
    for (auto& pool : pools_) {
      if (pool != nullptr && pool->state() == TagState::kPaused && pool->policy() == Policy::kBackup) {
        paused.push_back(pool.get());
      }
    }
  }
  for (TagPool* pool : paused) {
    MutexLock t(pool->transition_mu());  // no resume meanwhile: the arena stays
    std::optional<std::size_t> offset;
    {
      MutexLock lock(&mu_);
      if (pool->state() != TagState::kPaused) continue;
      for (const auto& [block, extents] : pool->backup_extents()) {
        if (ptr < block->address || ptr + size_bytes > block->address + block->requested_bytes) continue;
        for (const BackupExtent& e : extents) {
          if (ptr >= e.address && ptr + size_bytes <= e.address + e.size_bytes) offset = e.arena_offset + (ptr - e.address);
        }
        if (!offset.has_value()) {
          return absl::NotFoundError(absl::StrCat("bytes ", Hex(ptr), "+", size_bytes, " of tag '", pool->name(),
                                                  "' were not backed up (outside the live ranges of the pause)"));
        }
        break;
      }
    }
    if (!offset.has_value()) continue;
    // Without mu_ (a disk read may take long; nobody else waits for it): Note [Disk
    // Backup], a read error rather than a SIGBUS, and only these bytes are read.
    VMSTASH_RETURN_IF_ERROR(pool->arena()->Load(*offset, size_bytes));
    use(pool->arena()->data() + *offset);
    return absl::OkStatus();
  }
  return absl::NotFoundError(absl::StrCat("no paused backup holds ", size_bytes, " bytes at ", Hex(ptr)));
}

absl::Status CachingAllocator::ReadBackup(DevicePtr ptr, std::size_t size_bytes, void* dst) {
  if (dst == nullptr && size_bytes != 0) return absl::InvalidArgumentError("ReadBackup: null destination");
  return WithBackup(ptr, size_bytes, [&](const char* src) { std::memcpy(dst, src, size_bytes); });
}

absl::StatusOr<const void*> CachingAllocator::BackupAddress(DevicePtr ptr, std::size_t size_bytes) {
  const void* found = nullptr;
  VMSTASH_RETURN_IF_ERROR(WithBackup(ptr, size_bytes, [&](const char* src) { found = src; }));
  return found;
}

absl::Status CachingAllocator::ReleaseBackup(TagId tag) {
  TagPool* pool;
  {
    MutexLock lock(&mu_);
    VMSTASH_ASSIGN_OR_RETURN(pool, FindPoolLocked(tag, "release_backup"));
  }
  MutexLock t(pool->transition_mu());
  {
    MutexLock lock(&mu_);
    if (pool->state() == TagState::kPaused) {
      return absl::FailedPreconditionError(absl::StrCat("release of the backup of tag '", pool->name(),
                                                        "' on device ", device_, ": the tag is paused and its "
                                                        "backup arena holds its bytes; resume it first"));
    }
  }
  if (pool->arena() != nullptr) VMSTASH_RETURN_IF_ERROR(pool->arena()->Release());
  MutexLock lock(&mu_);
  pool->stats().backup_arena_bytes = 0;
  pool->auto_prepare().requested_bytes = 0;  // a queued background request finds this and does nothing
  pool->auto_prepare().floor_bytes = static_cast<std::size_t>(pool->stats().reserved_bytes.current);
  return absl::OkStatus();
}

absl::Status CachingAllocator::SetBackupStore(TagId tag, const BackupStore& store) {
  VMSTASH_RETURN_IF_ERROR(CheckBackupStore(store));
  TagPool* pool;
  {
    MutexLock lock(&mu_);
    VMSTASH_ASSIGN_OR_RETURN(pool, FindPoolLocked(tag, "set_backup_store"));
  }
  std::unique_ptr<BackupArena> dropped;  // freed after the locks are released
  MutexLock t(pool->transition_mu());
  MutexLock lock(&mu_);
  if (pool->policy() != Policy::kBackup) {
    return absl::FailedPreconditionError(absl::StrCat("tag '", pool->name(), "' has policy discard: its pauses "
                                                      "keep no bytes, so it has no backup store"));
  }
  if (pool->store() == store) return absl::OkStatus();
  if (pool->state() != TagState::kActive) {
    return absl::FailedPreconditionError(absl::StrCat("backup store of tag '", pool->name(), "' on device ",
                                                      device_, ": the tag is ", TagStateName(pool->state()), " and its ",
                                                      DescribeBackupStore(pool->store()), " backup holds its bytes; change "
                                                      "the store while the tag is active"));
  }
  // The arena is touched only under the transition lock, which is held: no pause can be
  // using it.
  dropped = pool->ChangeStore(store);
  pool->stats().backup_arena_bytes = 0;
  pool->auto_prepare().requested_bytes = 0;
  return absl::OkStatus();
}

absl::StatusOr<BackupStore> CachingAllocator::TagBackupStore(TagId tag) const {
  MutexLock lock(&mu_);
  VMSTASH_ASSIGN_OR_RETURN(const TagPool* pool, FindPoolLocked(tag, "backup store"));
  return pool->store();
}

absl::Status CachingAllocator::FailTransition(TagPool* pool, TagState state, const absl::Status& status,
                                              const absl::Status& undo_error) {
  MutexLock lock(&mu_);
  if (undo_error.ok()) {
    VMSTASH_RETURN_IF_ERROR(pool->MoveTo(state));
    return status;
  }
  VMSTASH_RETURN_IF_ERROR(pool->MoveTo(
      TagState::kBroken,
      absl::StrCat("tag '", pool->name(), "' on device ", device_, " is broken: a failed pause (", status.message(),
                   ") could not map its memory back (", undo_error.message(), "); its contents are lost. Allocation, "
                   "pause and resume of it are refused; free its blocks (they can be freed) and use another tag, or "
                   "restart the process")));
  VMSTASH_LOG(kError, "vmstash: {}", pool->broken_reason());
  return absl::Status(status.code(), pool->broken_reason());
}

absl::Status CachingAllocator::ControlLocks::Acquire(const std::vector<TagPool*>& pools, int device,
                                                    const char* what) {
  const bool in_hook = !hook_frames.empty();
  for (TagPool* pool : pools) {
    Mutex* mu = pool->control_mu();
    if (!in_hook) {
      mu->Lock();
    } else if (!mu->TryLock()) {
      for (auto it = held_.rbegin(); it != held_.rend(); ++it) (*it)->Unlock();
      held_.clear();
      return absl::FailedPreconditionError(absl::StrCat(
          what, " of tag '", TagName(pool->id()), "' on device ", device, " from a hook: the tag is in another "
          "transition, and a hook may not wait for one (that transition may be waiting for the hook's own); "
          "retry after the hook returns"));
    }
    held_.push_back(mu);
  }
  return absl::OkStatus();
}

absl::StatusOr<TagPool*> CachingAllocator::TransitionPool(TagId tag, const char* what) {
  if (InOwnHook(this, tag)) {
    return absl::FailedPreconditionError(absl::StrCat(what, " of tag '", TagName(tag), "' on device ", device_,
                                                      " from a hook of that tag (or of a switch moving it): a hook "
                                                      "may allocate and free, but not pause, resume or switch the "
                                                      "tags it runs for"));
  }
  MutexLock lock(&mu_);
  return FindPoolLocked(tag, what);
}

absl::Status CachingAllocator::BackupAndUnmap(TagPool* pool, const BackupLayout& layout, std::size_t* backed_up,
                                              absl::Status* undo_error) {
  if (layout.arena_bytes == 0) return pool->UnmapHeaps(undo_error);
  std::vector<std::pair<Heap*, DevicePtr>> owners;  // parallel to `chunks`
  std::vector<ChunkSpan> chunks;
  for (Heap* heap : pool->heaps()) {
    for (const ChunkView& c : heap->Chunks()) {
      owners.emplace_back(heap, c.address);
      chunks.push_back({c.address, c.size_bytes});
    }
  }
  const std::vector<PauseStage> stages = PlanPauseStages(layout, chunks, options_.pause_stage_bytes);

  // Everything that can fail before the first copy: arena, stream, events.
  VMSTASH_RETURN_IF_ERROR(pool->EnsureArena()->Reserve(layout.arena_bytes));
  VMSTASH_ASSIGN_OR_RETURN(Stream stream, pool->CopyStream());
  VMSTASH_ASSIGN_OR_RETURN(std::vector<Event> * events, pool->CopyEvents(stages.size()));

  // All copies are queued at once, an event after each stage; while the copy engine works
  // on stage k, the chunks of the stages before it are unmapped (handles kept).
  absl::Status status;
  for (std::size_t k = 0; k < stages.size() && status.ok(); ++k) {
    for (const CopyStep& c : stages[k].copies) {
      status = driver_->CopyToHostAsync(device_, pool->arena()->data() + c.arena_offset, c.device, c.size_bytes,
                                        stream);
      if (!status.ok()) break;
    }
    if (status.ok()) status = driver_->RecordEvent(device_, (*events)[k], stream);
  }
  for (std::size_t k = 0; k < stages.size() && status.ok(); ++k) {
    status = driver_->SynchronizeEvent(device_, (*events)[k]);
    for (std::size_t chunk : stages[k].chunks) {
      if (!status.ok()) break;
      status = owners[chunk].first->UnmapChunk(owners[chunk].second);
    }
    if (status.ok()) *backed_up += stages[k].bytes;
  }
  if (status.ok()) status = driver_->SynchronizeStream(device_, stream);
  if (status.ok()) status = pool->arena()->Seal();  // a disk arena writes back (Note [Disk Backup])
  if (!status.ok()) {
    // Nothing was released: wait for the queued copies, then map back what was unmapped.
    pool->DrainCopyStream();
    *undo_error = pool->RemapHeaps();
    *backed_up = 0;
  }
  return status;
}

absl::StatusOr<CachingAllocator::Transition> CachingAllocator::Pause(TagId tag, const LiveRanges* live_ranges) {
  VMSTASH_ASSIGN_OR_RETURN(TagPool * pool, TransitionPool(tag, "pause"));
  ControlLocks control;
  VMSTASH_RETURN_IF_ERROR(control.Acquire({pool}, device_, "pause"));
  TransitionHooks hooks;
  {
    MutexLock lock(&mu_);
    if (pool->state() == TagState::kBroken) return absl::FailedPreconditionError(pool->broken_reason());
    if (pool->state() == TagState::kPaused) return Transition::kAlreadyInState;
    hooks = pool->hooks();
  }
  // Before-pause hooks: the tag is still active and no vmstash lock but the control lock
  // is held, so a hook may free (or allocate) blocks of this very tag.
  VMSTASH_RETURN_IF_ERROR(RunHooks(tag, hooks, /*before_pause=*/true));
  return PauseTransition(pool, live_ranges);
}

absl::StatusOr<CachingAllocator::Transition> CachingAllocator::PauseTransition(TagPool* pool,
                                                                              const LiveRanges* live_ranges) {
  const Clock::time_point start = Clock::now();
  const TagId tag = pool->id();
  MutexLock t(pool->transition_mu());
  std::uint64_t synced_before;
  {
    MutexLock lock(&mu_);
    VMSTASH_RETURN_IF_ERROR(pool->MoveTo(TagState::kPausing));
    // Note [Pending Frees and Synchronization]: frees made pending after this point are
    // not completed by the synchronize below.
    synced_before = pending_seq_;
  }
  auto fail = [&](const absl::Status& status, const absl::Status& undo = absl::OkStatus()) {
    return FailTransition(pool, TagState::kActive, status, undo);
  };
  // (1) No queued work may touch the tag.
  absl::Status sync = driver_->SynchronizeDevice(device_);
  if (!sync.ok()) return fail(sync);
  std::vector<const Block*> live;
  Policy policy;
  {
    MutexLock lock(&mu_);
    ProcessPendingLocked(synced_before, tag);
    live = pool->LiveBlocks();
    policy = pool->policy();
  }
  // (2)+(3a) Backup of live bytes only, pipelined with the unmapping (BackupAndUnmap).
  BackupLayout layout;
  if (policy == Policy::kBackup) layout = PlanBackupLayout(std::move(live), live_ranges);
  std::size_t backed_up = 0;
  absl::Status undo;
  absl::Status staged = policy == Policy::kBackup ? BackupAndUnmap(pool, layout, &backed_up, &undo)
                                                  : pool->UnmapHeaps(&undo);
  if (!staged.ok()) return fail(staged, undo);
  // (3b) Every copy succeeded and every chunk is unmapped: release.
  absl::Status release_error;
  std::size_t released = pool->small()->ReleaseAllAndPause(&release_error);
  released += pool->large()->ReleaseAllAndPause(&release_error);
  if (!release_error.ok()) {
    VMSTASH_LOG(kWarning, "vmstash: pause of tag '{}': a chunk release was refused ({}); it is retried later",
                TagName(tag), release_error.ToString());
  }
  const double ms = Ms(Clock::now() - start);
  MutexLock lock(&mu_);
  VMSTASH_RETURN_IF_ERROR(pool->NotePaused(std::move(layout.by_block), released, backed_up, ms));
  return Transition::kDone;
}

absl::Status CachingAllocator::NoteResumedLocked(TagPool* pool, std::size_t restored, double ms) {
  VMSTASH_RETURN_IF_ERROR(pool->NoteResumed(restored, ms));
  NoteReservedLocked(pool);  // may ask for a background preparation, now that the tag is active
  return absl::OkStatus();
}

absl::StatusOr<CachingAllocator::Transition> CachingAllocator::Resume(TagId tag) {
  VMSTASH_ASSIGN_OR_RETURN(TagPool * pool, TransitionPool(tag, "resume"));
  ControlLocks control;
  VMSTASH_RETURN_IF_ERROR(control.Acquire({pool}, device_, "resume"));
  TransitionHooks hooks;
  {
    MutexLock lock(&mu_);
    if (pool->state() == TagState::kBroken) return absl::FailedPreconditionError(pool->broken_reason());
    if (pool->state() == TagState::kActive) return Transition::kAlreadyInState;
    hooks = pool->hooks();
  }
  VMSTASH_ASSIGN_OR_RETURN(Transition done, ResumeTransition(pool));
  // After-resume hooks: the tag is active and the transition lock released.
  VMSTASH_RETURN_IF_ERROR(RunHooks(tag, hooks, /*before_pause=*/false));
  return done;
}

namespace {
constexpr absl::string_view kDonePayload = "type.vmstash.dev/transition-done";
}  // namespace

bool CachingAllocator::TransitionDone(const absl::Status& status) {
  return !status.ok() && status.GetPayload(kDonePayload).has_value();
}

absl::Status CachingAllocator::MarkTransitionDone(absl::Status status) {
  if (!status.ok()) status.SetPayload(kDonePayload, absl::Cord("done"));
  return status;
}

absl::Status CachingAllocator::RunHooks(TagId tag, const TransitionHooks& hooks,
                                        bool before_pause, const std::vector<TagId>& also_mine) {
  HookScope scope(this, tag, also_mine);
  absl::Status first;  // after-resume: every hook runs; the first error is returned, marked done
  for (const auto& [before, after] : hooks) {
    const TransitionHook& hook = before_pause ? before : after;
    if (!hook) continue;
    absl::Status s = hook(tag, device_);
    if (s.ok()) continue;
    if (before_pause) {
      return absl::Status(s.code(),
                          absl::StrCat("pause of tag '", TagName(tag), "': before-pause hook: ", s.message()));
    }
    if (first.ok()) {
      first = MarkTransitionDone(absl::Status(
          s.code(), absl::StrCat("tag '", TagName(tag), "' resumed, but an after-resume hook failed: ", s.message())));
    }
  }
  return first;
}

absl::Status CachingAllocator::MapBack(TagPool* pool, Heap* heap, Heap::ResumeTxn* txn, bool restore,
                                       std::size_t first_piece_bytes, std::size_t* restored) {
  VMSTASH_ASSIGN_OR_RETURN(std::vector<CoverSpan> covers, heap->PlanResume());
  const std::vector<Block*> live = heap->LiveBlocks();
  RestorePlanner planner(std::vector<const Block*>(live.begin(), live.end()), covers, &pool->backup_extents());
  BackupArena* const arena = pool->arena();
  const Stream stream = pool->copy_stream();
  return heap->PrepareResume(
      txn, covers,
      [&](DevicePtr va, std::size_t size) -> absl::Status {
        if (!restore) return absl::OkStatus();
        VMSTASH_ASSIGN_OR_RETURN(std::vector<CopyStep> copies, planner.CopiesInto(va, size));
        for (const CopyStep& c : copies) {
          VMSTASH_RETURN_IF_ERROR(
              driver_->CopyToDeviceAsync(device_, c.device, arena->data() + c.arena_offset, c.size_bytes, stream));
          *restored += c.size_bytes;
        }
        return absl::OkStatus();
      },
      first_piece_bytes);
}

absl::StatusOr<CachingAllocator::Transition> CachingAllocator::ResumeTransition(TagPool* pool) {
  const Clock::time_point start = Clock::now();
  MutexLock t(pool->transition_mu());
  Policy policy;
  {
    MutexLock lock(&mu_);
    VMSTASH_RETURN_IF_ERROR(pool->MoveTo(TagState::kResuming));
    policy = pool->policy();
  }
  auto fail = [&](const absl::Status& status) {
    MutexLock lock(&mu_);
    VMSTASH_RETURN_IF_ERROR(pool->MoveTo(TagState::kPaused));
    return status;
  };
  const bool restore = policy == Policy::kBackup && HasBackedUpBytes(pool->backup_extents());
  if (restore && pool->arena() == nullptr) {
    return fail(absl::InternalError(absl::StrCat("resume of tag '", pool->name(), "': its backup arena is gone")));
  }
  if (restore) {
    // Note [Disk Backup]: a read error, not a SIGBUS; only the backed-up bytes are read.
    absl::Status ready = pool->arena()->Load(0, BackedUpArenaEnd(pool->backup_extents()));
    if (ready.ok()) ready = pool->CopyStream().status();
    if (!ready.ok()) return fail(ready);
  }
  // The large heap comes back in pieces when there is something to copy, so that creating
  // and mapping piece k+1 overlaps the copies of piece k; with nothing to copy, one chunk
  // per cover is fastest.
  std::size_t restored = 0;
  auto small = std::make_unique<Heap::ResumeTxn>();
  auto large = std::make_unique<Heap::ResumeTxn>();
  absl::Status made = MapBack(pool, pool->small(), small.get(), restore, 0, &restored);
  if (made.ok()) {
    made = MapBack(pool, pool->large(), large.get(), restore, restore ? options_.resume_first_piece_bytes : 0,
                   &restored);
  }
  if (made.ok() && restore) made = driver_->SynchronizeStream(device_, pool->copy_stream());
  if (!made.ok()) {
    // Wait for the copies queued into pieces already mapped, then the transactions'
    // destructors unmap and release those pieces; the tag stays paused, its backup intact.
    if (restore) pool->DrainCopyStream();
    small.reset();
    large.reset();
    return fail(made);
  }
  pool->small()->CommitResume(std::move(small));
  pool->large()->CommitResume(std::move(large));
  if (pool->arena() != nullptr) pool->arena()->DropContents();
  const double ms = Ms(Clock::now() - start);
  MutexLock lock(&mu_);
  VMSTASH_RETURN_IF_ERROR(NoteResumedLocked(pool, restored, ms));
  return Transition::kDone;
}

}  // namespace vmstash
