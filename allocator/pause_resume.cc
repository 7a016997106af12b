// PauseExecutor and ResumeExecutor: see pause_resume.h and Note [Pause/Resume Protocol].
#include "allocator/pause_resume.h"

#include <chrono>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "allocator/hooks.h"
#include "base/log.h"
#include "base/status_macros.h"

namespace vmstash {
namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

}  // namespace

absl::StatusOr<TransitionResult> PauseExecutor::Run() {
  ControlLocks control;
  VMSTASH_RETURN_IF_ERROR(control.Acquire({pool_}, host_->device(), "pause"));
  TransitionHooks hooks;
  {
    MutexLock lock(host_->mu());
    if (pool_->state() == TagState::kBroken) return absl::FailedPreconditionError(pool_->broken_reason());
    if (pool_->state() == TagState::kPaused) return TransitionResult::kAlreadyInState;
    VMSTASH_RETURN_IF_ERROR(host_->CheckPausableLocked(pool_));  // again in Transact: a hook may allocate
    hooks = pool_->hooks();
  }
  // Before-pause hooks: the tag is still active and no vmstash lock but the control lock
  // is held, so a hook may free (or allocate) blocks of this very tag.
  VMSTASH_RETURN_IF_ERROR(RunHooks(host_, host_->device(), pool_->id(), hooks, /*before_pause=*/true));
  return Transact();
}

absl::StatusOr<TransitionResult> PauseExecutor::Transact() {
  const Clock::time_point start = Clock::now();
  Driver* const driver = host_->driver();
  const int device = host_->device();
  TagPool::ForegroundLock t(pool_);  // Note [Background Steps Yield]
  std::uint64_t synced_before;
  {
    MutexLock lock(host_->mu());
    VMSTASH_RETURN_IF_ERROR(host_->CheckPausableLocked(pool_));
    VMSTASH_RETURN_IF_ERROR(pool_->MoveTo(TagState::kPausing));
    // Note [Pending Frees and Synchronization]: frees made pending after this point are
    // not completed by the synchronize below.
    synced_before = host_->PendingSeqLocked();
  }
  // Called only below, under `t` (clang does not carry it into the lambda).
  auto fail = [&](const absl::Status& status, const absl::Status& undo = absl::OkStatus())
                  ABSL_NO_THREAD_SAFETY_ANALYSIS {
    MutexLock lock(host_->mu());
    return pool_->FailPause(status, undo);
  };
  // (1) No queued work may touch the tag.
  absl::Status sync = driver->SynchronizeDevice(device);
  if (!sync.ok()) return fail(sync);
  std::vector<const Block*> live;
  {
    MutexLock lock(host_->mu());
    host_->CompletePendingLocked(synced_before, pool_->id());
    live = pool_->LiveBlocks();
  }
  // (2)+(3a) Backup of live bytes only, pipelined with the unmapping (BackupAndUnmap).
  BackupLayout layout;
  if (pool_->backup()) layout = PlanBackupLayout(std::move(live), live_);
  std::size_t backed_up = 0;
  absl::Status undo;
  absl::Status staged = pool_->backup() ? BackupAndUnmap(layout, &backed_up, &undo) : pool_->UnmapHeaps(&undo);
  if (!staged.ok()) return fail(staged, undo);
  // (3b) Every copy succeeded and every chunk is unmapped: release.
  absl::Status release_error;
  std::size_t released = pool_->small()->ReleaseAllAndPause(&release_error);
  released += pool_->large()->ReleaseAllAndPause(&release_error);
  if (!release_error.ok()) {
    VMSTASH_LOG(kWarning, "vmstash: pause of tag '{}': a chunk release was refused ({}); it is retried later",
                pool_->name(), release_error.ToString());
  }
  const double ms = Ms(Clock::now() - start);
  if (pool_->arena() != nullptr && LogEnabled(LogLevel::kDebug)) {
    const PinnedPieces::Timing t = pool_->arena()->TakePinTiming();
    VMSTASH_LOG(kDebug, "vmstash: pause of tag '{}': {:.1f} ms, {} bytes backed up; warming {:.1f} ms, {} pieces registered in {:.1f} ms",
                pool_->name(), ms, backed_up, t.warm_ms, t.registered, t.register_ms);
  }
  MutexLock lock(host_->mu());
  VMSTASH_RETURN_IF_ERROR(pool_->NotePaused(std::move(layout.by_block), released, backed_up, ms));
  return TransitionResult::kDone;
}

absl::Status PauseExecutor::BackupAndUnmap(const BackupLayout& layout, std::size_t* backed_up,
                                           absl::Status* undo_error) {
  if (layout.arena_bytes == 0) return pool_->UnmapHeaps(undo_error);
  Driver* const driver = host_->driver();
  const int device = host_->device();
  std::vector<std::pair<Heap*, DevicePtr>> owners;  // parallel to `chunks`
  std::vector<ChunkSpan> chunks;
  for (Heap* heap : pool_->heaps()) {
    for (const ChunkView& c : heap->Chunks()) {
      owners.emplace_back(heap, c.address);
      chunks.push_back({c.address, c.size_bytes});
    }
  }
  const std::vector<PauseStage> stages = PlanPauseStages(layout, chunks, host_->options().pause_stage_bytes);

  // Everything that can fail before the first copy: arena, stream, events. A failure
  // leaves nothing behind (a disk-files arena's files are removed: DropContents).
  if (pool_->arena() != nullptr) (void)pool_->arena()->TakePinTiming();  // from here: this pause's (its log line)
  // Over the cap, other active tags' prepared arenas go first (Note [Host Budget]).
  const TagPool::Reclaim reclaim = [this](std::size_t wanted) {
    return host_->ReclaimPreparedArenas({pool_}, wanted);
  };
  absl::Status reserved = pool_->ReserveBackup(layout.arena_bytes, BackupPieceBytes(layout),
                                               host_->options().spill_dir, reclaim);
  BackupArena* const arena = pool_->arena();
  absl::StatusOr<Stream> made_stream = reserved.ok() ? pool_->CopyStream() : absl::StatusOr<Stream>(reserved);
  absl::StatusOr<std::vector<Event>*> made_events =
      made_stream.ok() ? pool_->CopyEvents(stages.size()) : absl::StatusOr<std::vector<Event>*>(made_stream.status());
  if (!made_events.ok()) {
    pool_->ArenaAfterFailedPause();
    return made_events.status();
  }
  const Stream stream = *made_stream;
  std::vector<Event>* const events = *made_events;

  // All copies are queued at once, an event after each stage; while the copy engine works
  // on stage k, the chunks of the stages before it are unmapped (handles kept).
  absl::Status status;
  for (std::size_t k = 0; k < stages.size() && status.ok(); ++k) {
    for (const CopyStep& c : stages[k].copies) {
      status = arena->CopyIn(c.arena_offset, c.device, c.size_bytes, stream);  // pins as it goes
      if (!status.ok()) break;
    }
    if (status.ok()) status = driver->RecordEvent(device, (*events)[k], stream);
  }
  for (std::size_t k = 0; k < stages.size() && status.ok(); ++k) {
    status = driver->SynchronizeEvent(device, (*events)[k]);
    for (std::size_t chunk : stages[k].chunks) {
      if (!status.ok()) break;
      status = owners[chunk].first->UnmapChunk(owners[chunk].second);
    }
    if (status.ok()) *backed_up += stages[k].bytes;
  }
  if (status.ok()) status = driver->SynchronizeStream(device, stream);
  if (status.ok()) status = arena->Seal();  // a disk arena writes back (Note [Disk Backup])
  if (!status.ok()) {
    // Nothing was released: wait for the queued copies, then map back what was unmapped.
    pool_->DrainCopyStream();
    *undo_error = pool_->RemapHeaps();
    *backed_up = 0;
    pool_->ArenaAfterFailedPause();  // a failed pause leaves nothing behind (Note [Disk Backup Files])
  }
  return status;
}

absl::StatusOr<TransitionResult> ResumeExecutor::Run() {
  ControlLocks control;
  VMSTASH_RETURN_IF_ERROR(control.Acquire({pool_}, host_->device(), "resume"));
  TransitionHooks hooks;
  {
    MutexLock lock(host_->mu());
    if (pool_->state() == TagState::kBroken) return absl::FailedPreconditionError(pool_->broken_reason());
    if (pool_->state() == TagState::kActive) return TransitionResult::kAlreadyInState;
    hooks = pool_->hooks();
  }
  VMSTASH_ASSIGN_OR_RETURN(TransitionResult done, Transact());
  // After-resume hooks: the tag is active and the transition lock released.
  VMSTASH_RETURN_IF_ERROR(RunHooks(host_, host_->device(), pool_->id(), hooks, /*before_pause=*/false));
  return done;
}

absl::Status ResumeExecutor::MapBack(Heap* heap, Heap::ResumeTxn* txn, bool restore, std::size_t first_piece_bytes,
                                     std::size_t* restored) {
  VMSTASH_ASSIGN_OR_RETURN(std::vector<CoverSpan> covers, heap->PlanResume());
  const std::vector<Block*> live = heap->LiveBlocks();
  RestorePlanner planner(std::vector<const Block*>(live.begin(), live.end()), covers, &pool_->backup_extents());
  BackupArena* const arena = pool_->arena();
  const Stream stream = pool_->copy_stream();
  return heap->PrepareResume(
      txn, covers,
      [&](DevicePtr va, std::size_t size) -> absl::Status {
        if (!restore) return absl::OkStatus();
        VMSTASH_ASSIGN_OR_RETURN(std::vector<CopyStep> copies, planner.CopiesInto(va, size));
        for (const CopyStep& c : copies) {
          VMSTASH_RETURN_IF_ERROR(arena->CopyOut(c.device, c.arena_offset, c.size_bytes, stream));
          *restored += c.size_bytes;
        }
        return absl::OkStatus();
      },
      first_piece_bytes);
}

absl::StatusOr<TransitionResult> ResumeExecutor::Transact() {
  const Clock::time_point start = Clock::now();
  TagPool::ForegroundLock t(pool_);  // Note [Background Steps Yield]
  {
    MutexLock lock(host_->mu());
    VMSTASH_RETURN_IF_ERROR(pool_->MoveTo(TagState::kResuming));
  }
  auto fail = [&](const absl::Status& status) {
    pool_->AssertTransitionHeld();
    pool_->ArenaAfterFailedResume();  // its ring goes (backup_arena.h, Note [Host Budget])
    MutexLock lock(host_->mu());
    VMSTASH_RETURN_IF_ERROR(pool_->MoveTo(TagState::kPaused));
    return status;
  };
  const bool restore = pool_->backup() && HasBackedUpBytes(pool_->backup_extents());
  if (restore && pool_->arena() == nullptr) {
    return fail(absl::InternalError(absl::StrCat("resume of tag '", pool_->name(), "': its backup arena is gone")));
  }
  if (restore) {
    // Note [Disk Backup]: a read error, not a SIGBUS; only the backed-up bytes are read.
    absl::Status ready = pool_->arena()->Load(0, BackedUpArenaEnd(pool_->backup_extents()));
    if (ready.ok()) ready = pool_->CopyStream().status();
    if (!ready.ok()) return fail(ready);
  }
  // The large heap comes back in pieces when there is something to copy, so that creating
  // and mapping piece k+1 overlaps the copies of piece k; with nothing to copy, one chunk
  // per cover is fastest.
  std::size_t restored = 0;
  auto small = std::make_unique<Heap::ResumeTxn>();
  auto large = std::make_unique<Heap::ResumeTxn>();
  absl::Status made = MapBack(pool_->small(), small.get(), restore, 0, &restored);
  if (made.ok()) {
    const std::size_t first_piece = restore ? host_->options().resume_first_piece_bytes : 0;
    made = MapBack(pool_->large(), large.get(), restore, first_piece, &restored);
  }
  const double queued_ms = Ms(Clock::now() - start);
  if (made.ok() && restore) made = host_->driver()->SynchronizeStream(host_->device(), pool_->copy_stream());
  if (!made.ok()) {
    // Wait for the copies queued into pieces already mapped, then the transactions'
    // destructors unmap and release those pieces; the tag stays paused, its backup intact.
    if (restore) pool_->DrainCopyStream();
    small.reset();
    large.reset();
    return fail(made);
  }
  std::size_t pieces = 0;  // for the debug line only
  if (LogEnabled(LogLevel::kDebug)) {
    for (const Heap::ResumeTxn* txn : {small.get(), large.get()}) {
      for (const Heap::ResumeTxn::Cover& c : txn->covers) pieces += c.pieces.size();
    }
  }
  const double copied_ms = Ms(Clock::now() - start);
  pool_->small()->CommitResume(std::move(small));
  pool_->large()->CommitResume(std::move(large));
  // Pages given back, unless retained (Note [Retained Backups]).
  pool_->ArenaAfterResume(host_->GivesBackInBackground());
  const double ms = Ms(Clock::now() - start);
  VMSTASH_LOG(kDebug, "vmstash: resume of tag '{}': {:.1f} ms, {} bytes restored; {} pieces mapped and copies queued at "
              "{:.1f} ms, copies done at {:.1f} ms", pool_->name(), ms, restored, pieces, queued_ms, copied_ms);
  MutexLock lock(host_->mu());
  VMSTASH_RETURN_IF_ERROR(pool_->NoteResumed(restored, ms));
  host_->NoteReservedLocked(pool_);  // may ask for a background preparation, now that the tag is active
  return TransitionResult::kDone;
}

}  // namespace vmstash
