// TagPool: see tag_pool.h.
#include "allocator/tag_pool.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/bytes.h"
#include "base/log.h"
#include "base/status_macros.h"

namespace vmstash {
TagPool::TagPool(TagId id, Policy policy, BackupStore store, Driver* driver, int device, HeapConfig small,
                 HeapConfig large, Mutex* owner_mu, std::shared_ptr<HostLeaseSource> leases)
    : id_(id),
      name_(TagName(id)),
      policy_(policy),
      driver_(driver),
      device_(device),
      small_(std::make_unique<Heap>(std::move(small), blocks_.get())),
      large_(std::make_unique<Heap>(std::move(large), blocks_.get())),
      owner_mu_(owner_mu),
      backup_(driver, device, name_, std::move(store), &transition_mu_, owner_mu, std::move(leases)) {}

TagPool::~TagPool() {
  for (Event e : copy_events_) {
    absl::Status s = driver_->DestroyEvent(device_, e);
    if (!s.ok()) VMSTASH_LOG(kError, "vmstash: destroying a copy event of tag '{}': {}", name_, s.ToString());
  }
  if (copy_stream_ != nullptr) {
    absl::Status s = driver_->DestroyStream(device_, copy_stream_);
    if (!s.ok()) VMSTASH_LOG(kError, "vmstash: destroying a tag's copy stream: {}", s.ToString());
  }
}

absl::Status TagPool::MoveTo(TagState to, std::string broken_reason) {
  AssertOwnerHeld();
  if (!TagTransitionAllowed(state_, to)) {
    return absl::InternalError(absl::StrCat("tag '", name_, "' on device ", device_, ": the move from ",
                                            TagStateName(state_), " to ", TagStateName(to), " is not allowed"));
  }
  if ((to == TagState::kBroken) == broken_reason.empty()) {
    return absl::InternalError(absl::StrCat("tag '", name_, "': a move to ", TagStateName(to),
                                            to == TagState::kBroken ? " needs" : " takes no", " reason"));
  }
  previous_ = state_;
  state_ = to;
  broken_reason_ = std::move(broken_reason);
  return absl::OkStatus();
}

absl::Status TagPool::NotActiveError(const char* before) const {
  AssertOwnerHeld();
  if (state_ == TagState::kBroken) return absl::FailedPreconditionError(broken_reason_);
  return absl::FailedPreconditionError(
      absl::StrCat("tag '", name_, "' is ", TagStateName(state_), " on device ", device_, ": ", before));
}

std::vector<const Block*> TagPool::LiveBlocks() const {
  std::vector<const Block*> live;
  for (const Heap* heap : heaps()) {
    for (const Block* b : heap->LiveBlocks()) live.push_back(b);
  }
  return live;
}

absl::Status TagPool::RemapHeaps() {
  absl::Status first = small_->RemapAll();
  absl::Status large = large_->RemapAll();
  if (first.ok()) first = large;
  if (!first.ok()) VMSTASH_LOG(kError, "vmstash: pause rollback of tag '{}': {}", name_, first.ToString());
  return first;
}

absl::Status TagPool::UnmapHeaps(absl::Status* undo_error) {
  absl::Status unmapped = small_->UnmapAll();
  if (unmapped.ok()) unmapped = large_->UnmapAll();
  if (!unmapped.ok()) *undo_error = RemapHeaps();
  return unmapped;
}

void TagPool::SyncArenaBytesLocked() {
  backup_.AssertTransitionHeld();
  stats_.backup_arena_bytes = static_cast<std::int64_t>(backup_.held_bytes());
}

absl::Status TagPool::ReserveBackup(std::size_t bytes, const std::vector<std::size_t>& pieces,
                                    const std::string& spill_dir, const Reclaim& reclaim) {
  backup_.AssertTransitionHeld();
  return backup_.Reserve(bytes, pieces, spill_dir, reclaim);
}

void TagPool::ArenaAfterFailedPause() {
  backup_.AssertTransitionHeld();
  backup_.AfterFailedPause();  // the statistic follows at FailPause
}

absl::Status TagPool::FailPause(const absl::Status& cause, const absl::Status& undo_error) {
  AssertOwnerHeld();
  SyncArenaBytesLocked();
  if (undo_error.ok()) {
    VMSTASH_RETURN_IF_ERROR(MoveTo(TagState::kActive));
    return cause;
  }
  VMSTASH_RETURN_IF_ERROR(MoveTo(
      TagState::kBroken,
      absl::StrCat("tag '", name_, "' on device ", device_, " is broken: a failed pause (", cause.message(),
                   ") could not map its memory back (", undo_error.message(), "); its contents are lost. Allocation, "
                   "pause and resume of it are refused; free its blocks (they can be freed) and use another tag, or "
                   "restart the process")));
  VMSTASH_LOG(kError, "vmstash: {}", broken_reason_);
  return absl::Status(cause.code(), broken_reason_);
}

absl::Status TagPool::Prepare(std::size_t bytes, bool background) {
  std::size_t pin_to = 0;
  std::uint64_t epoch = 0;
  {
    // The state is checked under the transition lock, and the arena is touched only while
    // it is held: no pause can start in between (see Note [Pause/Resume Protocol]).
    if (!background) AnnounceTransition();  // Note [Background Steps Yield]
    BackgroundLock t(this);
    if (!background) WithdrawTransition();
    VMSTASH_RETURN_IF_ERROR(ReserveForPrepare(bytes, background, &pin_to));
    if (pin_to == 0) return absl::OkStatus();
    if (!background) {  // the caller waits for all of it
      absl::Status pinned = backup_.Pin(pin_to);
      OwnerLock lock(this);
      SyncArenaBytesLocked();
      return pinned;
    }
    epoch = backup_.epoch();
  }
  const auto start = std::chrono::steady_clock::now();
  bool warmed = false;
  for (bool done = false; !done;) VMSTASH_RETURN_IF_ERROR(PinStep(epoch, pin_to, &warmed, &done));
  VMSTASH_LOG(kDebug, "vmstash: tag '{}': background preparation of {} bytes ended after {:.1f} ms", name_, pin_to,
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  return absl::OkStatus();
}

void TagPool::YieldToTransitions() const {
  while (transitions_waiting_.load(std::memory_order_acquire) > 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

absl::Status TagPool::PinStep(std::uint64_t epoch, std::size_t pin_to, bool* warmed, bool* done) {
  YieldToTransitions();
  BackgroundLock t(this);
  *done = true;
  {
    OwnerLock lock(this);
    if (state_ != TagState::kActive || backup_.auto_prepare().requested_bytes == 0) return absl::OkStatus();
  }
  auto announced = [this] { return transitions_waiting_.load(std::memory_order_acquire) > 0; };
  bool yield = false;
  absl::Status s = backup_.PinStep(epoch, pin_to, kPrepareStepBytes, announced, warmed, done, &yield);
  OwnerLock lock(this);
  SyncArenaBytesLocked();
  return s;
}

absl::Status TagPool::ReserveForPrepare(std::size_t bytes, bool background, std::size_t* pin_to) {
  std::size_t want = bytes;
  {
    OwnerLock lock(this);
    if (background) {
      // Paused, broken, or released since the request (which reset the target).
      if (state_ != TagState::kActive || backup_.auto_prepare().requested_bytes == 0) return absl::OkStatus();
    } else if (policy_ != Policy::kBackup) {
      return absl::FailedPreconditionError(
          absl::StrCat("tag '", name_, "' has policy discard: it has no backup arena to prepare"));
    } else if (state_ != TagState::kActive) {
      return absl::FailedPreconditionError(
          absl::StrCat("prepare of tag '", name_, "' on device ", device_, ": the tag is ", TagStateName(state_),
                       " and its backup arena holds its bytes; prepare before pausing or after resuming"));
    }
    if (want == 0) want = static_cast<std::size_t>(stats_.requested_bytes.current);
  }
  if (want > std::numeric_limits<std::size_t>::max() / 2) {
    return absl::InvalidArgumentError(absl::StrCat("prepare of tag '", name_, "': ", want, " bytes is not a size"));
  }
  backup_.AssertTransitionHeld();
  VMSTASH_RETURN_IF_ERROR(backup_.ReserveForPrepare(want, background, pin_to));
  OwnerLock lock(this);
  SyncArenaBytesLocked();
  return absl::OkStatus();
}

absl::Status TagPool::ReleaseBackup() {
  ForegroundLock t(this);
  {
    OwnerLock lock(this);
    if (state_ == TagState::kPaused) {
      return absl::FailedPreconditionError(absl::StrCat("release of the backup of tag '", name_, "' on device ",
                                                        device_, ": the tag is paused and its backup arena holds "
                                                        "its bytes; resume it first"));
    }
  }
  VMSTASH_RETURN_IF_ERROR(backup_.Release(ReservedBytes()));
  OwnerLock lock(this);
  SyncArenaBytesLocked();
  return absl::OkStatus();
}

std::size_t TagPool::ReservedBytes() const {
  OwnerLock lock(this);
  return static_cast<std::size_t>(stats_.reserved_bytes.current);
}

bool TagPool::DropBackupOf(const Block* block) {
  AssertOwnerHeld();
  BackupExtents& extents = state_ == TagState::kPaused ? backup_extents_ : backup_.retained();
  auto found = extents.find(block);
  if (found == extents.end()) return false;
  const bool had_bytes = !found->second.empty();
  if (state_ == TagState::kPaused) {
    for (const BackupExtent& e : found->second) stats_.backed_up_bytes -= static_cast<std::int64_t>(e.size_bytes);
  }
  extents.erase(found);
  if (!had_bytes || HasBackedUpBytes(extents)) return false;
  if (state_ != TagState::kPaused) backup_.retained().clear();
  return backup_.retention().release_with_blocks;
}

void TagPool::ReleaseOrphanedArena() {
  // Waits for a transition, preparation or backup read of the tag (which may still use the
  // arena); only trying the lock would leave the arena behind for good, as no later free
  // asks again.
  ForegroundLock t(this);  // Note [Background Steps Yield]
  {
    OwnerLock lock(this);
    // A paused arena lent to another process (ExportBackup) stays until the resume, which
    // gives it back once that process let go.
    const bool orphaned = backup_.retention().release_with_blocks && backup_.has_arena() &&
                          (state_ == TagState::kPaused ? !HasBackedUpBytes(backup_extents_) && !backup_lent_
                                                       : state_ == TagState::kActive && backup_.retained().empty());
    if (!orphaned) return;
  }
  absl::Status s = backup_.Release(ReservedBytes());
  if (!s.ok()) {
    VMSTASH_LOG(kError, "vmstash: tag '{}': releasing the backup of its freed blocks: {}", name_, s.ToString());
    return;
  }
  OwnerLock lock(this);
  SyncArenaBytesLocked();
}

std::size_t TagPool::ReclaimPrepared() {
  backup_.AssertTransitionHeld();  // taken by the caller (TryLock)
  {
    OwnerLock lock(this);
    // Never a paused tag's arena (its backup), nor bytes a resume kept readable.
    if (state_ != TagState::kActive || !backup_.retained().empty() || !backup_.has_arena()) {
      transition_mu_.Unlock();
      return 0;
    }
  }
  const std::size_t charged = backup_.arena()->charged_bytes();
  if (charged == 0) {
    transition_mu_.Unlock();
    return 0;
  }
  const std::size_t floor = ReservedBytes();
  absl::Status s = backup_.Release(floor);
  const std::size_t given = charged - std::min(charged, backup_.arena()->charged_bytes());
  if (s.ok()) {
    VMSTASH_LOG(kInfo, "vmstash: tag '{}' on device {}: its prepared backup arena ({} bytes) was given back for "
                "another tag's pause over host_max", name_, device_, given);
  } else {
    VMSTASH_LOG(kError, "vmstash: tag '{}': giving back its prepared backup arena: {}", name_, s.ToString());
  }
  {
    OwnerLock lock(this);
    SyncArenaBytesLocked();
    backup_.auto_prepare().requested_bytes = 0;  // a queued background request finds this and does nothing
    backup_.auto_prepare().floor_bytes = floor;
  }
  transition_mu_.Unlock();
  return given;
}

void TagPool::SetRetention(BackupRetention retention) {
  ForegroundLock t(this);
  backup_.SetRetention(retention);
}

void TagPool::ArenaAfterResume(bool later) {
  backup_.AssertTransitionHeld();
  backup_.AfterResume(later);
}

absl::Status TagPool::GiveBack() {
  for (;;) {
    YieldToTransitions();
    BackgroundLock t(this);
    bool gone = false;
    {
      OwnerLock lock(this);
      if (!backup_.give_back_pending()) return absl::OkStatus();
      gone = state_ != TagState::kActive || !backup_.has_arena();
    }
    if (gone) {
      backup_.CancelGiveBack();
      return absl::OkStatus();
    }
    absl::Status s = backup_.GiveBackStep(kPrepareStepBytes);
    OwnerLock lock(this);
    SyncArenaBytesLocked();
    if (!s.ok() || !backup_.give_back_pending()) return s;
  }
}

absl::Status TagPool::SetStore(const BackupStore& store, std::unique_ptr<BackupArena>* dropped) {
  ForegroundLock t(this);
  {
    OwnerLock lock(this);
    if (policy_ != Policy::kBackup) {
      return absl::FailedPreconditionError(absl::StrCat("tag '", name_, "' has policy discard: its pauses "
                                                        "keep no bytes, so it has no backup store"));
    }
    if (backup_.store() == store) return absl::OkStatus();
    if (state_ != TagState::kActive) {
      return absl::FailedPreconditionError(absl::StrCat("backup store of tag '", name_, "' on device ", device_,
                                                        ": the tag is ", TagStateName(state_), " and its ",
                                                        DescribeBackupStore(backup_.store()), " backup holds its "
                                                        "bytes; change the store while the tag is active"));
    }
  }
  // The arena is touched only under the transition lock, which is held: no pause can be
  // using it or start (the tag stays active). Released here, without the owner's mu, so
  // that a release the driver refuses changes nothing but what went back (the rest stays
  // charged: Note [Host Budget]) rather than fail unseen in a destructor.
  if (absl::Status released = backup_.Release(std::nullopt); !released.ok()) {
    OwnerLock lock(this);
    SyncArenaBytesLocked();
    return absl::Status(released.code(), absl::StrCat("backup store of tag '", name_, "' on device ", device_,
                                                      " unchanged: releasing its ", DescribeBackupStore(backup_.store()),
                                                      " arena failed: ", released.message()));
  }
  backup_.MoveStore(store, dropped);
  OwnerLock lock(this);
  SyncArenaBytesLocked();
  return absl::OkStatus();
}

absl::StatusOr<bool> TagPool::WithBackup(DevicePtr ptr, std::size_t size_bytes,
                                         const std::function<void(const char*)>& use) {
  ForegroundLock t(this);  // no resume meanwhile: the arena stays
  std::optional<std::size_t> offset;
  {
    OwnerLock lock(this);
    // Paused: what the pause saved; active: what a resume retained (Note [Retained Backups]).
    const BackupExtents* held = state_ == TagState::kPaused   ? &backup_extents_
                                : state_ == TagState::kActive ? &backup_.retained()
                                                              : nullptr;
    if (held == nullptr) return false;
    for (const auto& [block, extents] : *held) {
      if (ptr < block->address || ptr + size_bytes > block->address + block->requested_bytes) continue;
      for (const BackupExtent& e : extents) {
        if (ptr >= e.address && ptr + size_bytes <= e.address + e.size_bytes) offset = e.arena_offset + (ptr - e.address);
      }
      if (!offset.has_value()) {
        return absl::NotFoundError(absl::StrCat("bytes ", Hex(ptr), "+", size_bytes, " of tag '", name_,
                                                "' were not backed up (outside the live ranges of the pause)"));
      }
      break;
    }
  }
  if (!offset.has_value()) return false;
  // Without the owner's mu (a disk read may take long; nobody else waits for it).
  VMSTASH_RETURN_IF_ERROR(backup_.Read(*offset, size_bytes, use));
  return true;
}

absl::StatusOr<ExportedBackup> TagPool::ExportBackup() {
  ForegroundLock t(this);  // no resume meanwhile: the arena stays
  OwnerLock lock(this);
  const auto refused = [&](absl::string_view why) {
    return absl::FailedPreconditionError(absl::StrCat("tag '", name_, "' on device ", device_, ": ", why));
  };
  if (state_ != TagState::kPaused) {
    return absl::UnavailableError(absl::StrCat("tag '", name_, "' on device ", device_, " is not paused"));
  }
  if (!backup()) return refused("a discard tag keeps no bytes while paused");
  const BackupArena* arena = backup_.arena();
  if (arena == nullptr || !arena->leased()) {
    return refused("its backup is not in the node pool (both processes run with VMSTASH_CONF node:1, and the pool "
                   "had room at the pause)");
  }
  ExportedBackup out;
  for (const auto& [block, extents] : backup_extents_) out.extents.insert(out.extents.end(), extents.begin(), extents.end());
  std::sort(out.extents.begin(), out.extents.end(),
            [](const BackupExtent& a, const BackupExtent& b) { return a.address < b.address; });
  out.data = arena->data();
  out.bytes = BackedUpArenaEnd(backup_extents_);
  backup_lent_ = true;
  return out;
}

absl::StatusOr<Stream> TagPool::CopyStream() {
  if (copy_stream_ == nullptr) {
    VMSTASH_ASSIGN_OR_RETURN(copy_stream_, driver_->CreateStream(device_));
  }
  return copy_stream_;
}

absl::StatusOr<std::vector<Event>*> TagPool::CopyEvents(std::size_t count) {
  while (copy_events_.size() < count) {
    VMSTASH_ASSIGN_OR_RETURN(Event e, driver_->CreateEvent(device_, false));
    copy_events_.push_back(e);
  }
  return &copy_events_;
}

void TagPool::DrainCopyStream() {
  absl::Status s = driver_->SynchronizeStream(device_, copy_stream_);
  if (s.ok()) return;
  s = driver_->SynchronizeDevice(device_);  // the stream sync itself failed: wait for everything
  if (!s.ok()) VMSTASH_LOG(kError, "vmstash: tag '{}': cannot wait for its copies: {}", name_, s.ToString());
}

bool TagPool::Empty() {
  AssertOwnerHeld();
  if (state_ != TagState::kActive || chunk_count() != 0 || va_bytes() != 0 || !hooks_.empty()) return false;
  if (stats_.active_blocks.current != 0) return false;  // bypass allocations live outside the heaps
  // A pool named in a transition or a switch (moving or not) holds its control lock
  // throughout: not empty. Both are tried, never waited for (the caller holds mu_).
  if (!control_mu_.TryLock()) return false;
  bool empty = false;
  if (transition_mu_.TryLock()) {
    backup_.AssertTransitionHeld();
    empty = !backup_.has_arena() && copy_stream_ == nullptr;
    transition_mu_.Unlock();
  }
  control_mu_.Unlock();
  return empty;
}

void TagPool::NoteReserved() {
  AssertOwnerHeld();
  stats_.reserved_bytes.Add(static_cast<std::int64_t>(mapped_bytes()) - stats_.reserved_bytes.current);
  stats_.chunks = static_cast<std::int64_t>(chunk_count());
}

void TagPool::FillStats(TagStats* out) const {
  AssertOwnerHeld();
  *out = stats_;
  out->name = name_;
  out->policy = policy_;
  out->backup_store = DescribeBackupStore(backup_.store());
  out->state = TagStateName(state_);
  // A pool in transition is being changed by its pauser/resumer without the owner's mu: not read.
  out->cached_bytes = frozen() ? 0 : static_cast<std::int64_t>(free_bytes());
}

ExportedMemory::ExportedMemory(ExportedMemory&& other) noexcept
    : reservations(std::move(other.reservations)), chunks(std::move(other.chunks)) {
  other.chunks.clear();
}

ExportedMemory& ExportedMemory::operator=(ExportedMemory&& other) noexcept {
  if (this != &other) {
    CloseAll();
    reservations = std::move(other.reservations);
    chunks = std::move(other.chunks);
    other.chunks.clear();
  }
  return *this;
}

void ExportedMemory::CloseAll() {
  for (Piece& p : chunks) {
    if (p.fd >= 0) ::close(p.fd);
    p.fd = -1;
  }
}

absl::StatusOr<ExportedMemory> TagPool::ExportMemory() const {
  AssertOwnerHeld();
  if (state() != TagState::kActive) return NotActiveError("resume it before another process maps it");
  ExportedMemory out;
  for (const Heap* heap : heaps()) {
    for (const Heap::SegmentView& view : heap->Segments()) {
      out.reservations.push_back({view.address, view.va_bytes});
      for (const ChunkView& c : view.chunks) {
        absl::StatusOr<int> fd = c.chunk->ExportFd();
        if (!fd.ok()) {
          return absl::Status(fd.status().code(),
                              absl::StrCat("tag '", name_, "' on device ", device_, " cannot be mapped by another "
                                           "process: exporting its chunk at 0x", absl::Hex(c.address), " failed (",
                                           fd.status().message(), "); its chunks are exportable only when the "
                                           "process runs with VMSTASH_CONF share_chunks:1 (or node:1)"));
        }
        out.chunks.push_back({c.address, c.size_bytes, *fd});
      }
    }
  }
  auto by_address = [](const auto& a, const auto& b) { return a.address < b.address; };
  std::sort(out.reservations.begin(), out.reservations.end(), by_address);
  std::sort(out.chunks.begin(), out.chunks.end(), by_address);
  return out;
}

void TagPool::AppendSnapshot(Snapshot* snap) const {
  AssertOwnerHeld();
  snap->tags.push_back(TagSnapshot{name(), policy(), TagStateName(state())});
  if (frozen()) return;  // the heaps belong to their transition (Note [Heap Locking])
  for (const Heap* heap : heaps()) {
    for (const Heap::SegmentView& view : heap->Segments()) {
      SegmentSnapshot seg;
      seg.tag = name();
      seg.heap = heap->config().small ? "small" : "large";
      seg.address = view.address;
      seg.va_bytes = view.va_bytes;
      DevicePtr cursor = view.address;
      for (const ChunkView& c : view.chunks) {
        if (c.address > cursor) seg.chunks.push_back({cursor, c.address - cursor, false});
        seg.chunks.push_back({c.address, c.size_bytes, true});
        seg.mapped_bytes += c.size_bytes;
        cursor = c.address + c.size_bytes;
      }
      for (const Block* b : view.blocks) {
        seg.blocks.push_back(BlockSnapshot{b->address, b->size_bytes, b->requested_bytes, b->allocated,
                                           reinterpret_cast<std::uint64_t>(b->stream)});
      }
      if (heap->paused()) {  // live blocks keep their addresses without chunks
        for (const Block* b : heap->LiveBlocks()) {
          if (b->address < seg.address || b->address >= seg.address + seg.va_bytes) continue;
          seg.blocks.push_back(BlockSnapshot{b->address, b->size_bytes, b->requested_bytes, b->allocated,
                                             reinterpret_cast<std::uint64_t>(b->stream)});
        }
      }
      snap->segments.push_back(std::move(seg));
    }
  }
}

absl::Status TagPool::NotePaused(BackupExtents extents, std::size_t released, std::size_t backed_up, double ms) {
  backup_.AssertTransitionHeld();
  AssertOwnerHeld();
  VMSTASH_RETURN_IF_ERROR(MoveTo(TagState::kPaused));
  backup_.AfterPause();  // the arena now holds this pause's bytes
  backup_extents_ = std::move(extents);
  TagStats& s = stats_;
  s.reserved_bytes.Add(-s.reserved_bytes.current);
  s.chunks = 0;
  s.paused_bytes = static_cast<std::int64_t>(released);
  s.backed_up_bytes = static_cast<std::int64_t>(backed_up);
  SyncArenaBytesLocked();
  ++s.pauses;
  s.last_pause_ms = ms;
  s.last_pause_gib_per_s = ms > 0 ? backed_up / (ms / 1000.0) / (1 << 30) : 0;
  return absl::OkStatus();
}

absl::Status TagPool::NoteResumed(std::size_t restored, double ms) {
  backup_.AssertTransitionHeld();
  AssertOwnerHeld();
  VMSTASH_RETURN_IF_ERROR(MoveTo(TagState::kActive));
  backup_lent_ = false;
  // Note [Retained Backups]: what ArenaAfterResume kept stays readable.
  backup_.KeepReadable(&backup_extents_);
  backup_extents_.clear();
  NoteReserved();
  TagStats& s = stats_;
  SyncArenaBytesLocked();  // a disk-files arena is gone
  s.paused_bytes = 0;
  s.backed_up_bytes = 0;
  ++s.resumes;
  s.last_resume_ms = ms;
  s.last_resume_gib_per_s = ms > 0 ? restored / (ms / 1000.0) / (1 << 30) : 0;
  return absl::OkStatus();
}

absl::Status TagPool::ValidateBackup() {
  ForegroundLock t(this);
  OwnerLock lock(this);
  return backup_.ValidateWithArena(state_, stats_.backup_arena_bytes);
}

absl::Status TagPool::Validate(std::size_t bypass_bytes, std::size_t* allocated_bytes,
                               std::size_t* pending_blocks) const {
  AssertOwnerHeld();
  const char* const state = TagStateName(state_);
  auto fail = [&](const std::string& what) {
    return absl::InternalError(absl::StrCat("tag ", name_, " (", state, "): ", what));
  };
  // The state machine.
  const bool initial = previous_ == TagState::kActive && state_ == TagState::kActive;
  if (!initial && !TagTransitionAllowed(previous_, state_)) {
    return fail(absl::StrCat("its last move, from ", TagStateName(previous_), ", is not in the table"));
  }
  if ((state_ == TagState::kBroken) == broken_reason_.empty()) return fail("broken exactly when it has a reason");
  if (state_ == TagState::kPaused) {
    if (!small_->paused() || !large_->paused()) return fail("a heap is not paused");
    if (stats_.reserved_bytes.current != 0 || stats_.chunks != 0) return fail("it reserves memory");
    std::int64_t backed_up = 0;
    for (const auto& [block, extents] : backup_extents_) {
      for (const BackupExtent& e : extents) backed_up += static_cast<std::int64_t>(e.size_bytes);
    }
    if (backed_up != stats_.backed_up_bytes) {
      return fail(absl::StrCat("backed-up stat ", stats_.backed_up_bytes, " but its extents hold ", backed_up));
    }
  }
  VMSTASH_RETURN_IF_ERROR(backup_.Validate(state_));
  if (state_ == TagState::kActive) {
    if (small_->paused() || large_->paused()) return fail("a heap is paused");
    if (!backup_extents_.empty()) return fail("it holds backup extents");
    if (stats_.paused_bytes != 0 || stats_.backed_up_bytes != 0) return fail("its stats count paused bytes");
  }
  if (frozen()) return absl::OkStatus();  // the heaps belong to their transition (Note [Heap Locking])
  // The heaps and the stats.
  std::size_t allocated = 0;
  VMSTASH_RETURN_IF_ERROR(small_->Validate(&allocated, pending_blocks));
  VMSTASH_RETURN_IF_ERROR(large_->Validate(&allocated, pending_blocks));
  if (static_cast<std::int64_t>(allocated + bypass_bytes) != stats_.allocated_bytes.current) {
    return fail(absl::StrCat("allocated stat ", stats_.allocated_bytes.current, " but blocks hold ",
                             allocated + bypass_bytes));
  }
  const std::size_t mapped = mapped_bytes() + bypass_bytes;
  if (static_cast<std::int64_t>(mapped) != stats_.reserved_bytes.current) {
    return fail(absl::StrCat("reserved stat ", stats_.reserved_bytes.current, " but ", mapped, " mapped"));
  }
  *allocated_bytes += allocated;
  return absl::OkStatus();
}

}  // namespace vmstash
