// TagBackup: see tag_backup.h.
#include "allocator/tag_backup.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"

namespace vmstash {
namespace {

struct Move {
  ArenaState from;
  ArenaState to;
};
// The arena's life (tag_backup.h): every allowed (from, to) pair, and only those. A move to
// the state it is in changes nothing and is always allowed.
constexpr Move kArenaMoves[] = {
    {ArenaState::kNone, ArenaState::kReady},           // Prepare
    {ArenaState::kNone, ArenaState::kHolding},         // a pause (and a spill's disk arena)
    {ArenaState::kReady, ArenaState::kHolding},        // a pause
    {ArenaState::kReady, ArenaState::kNone},           // Release, a new store; a lease given back (AfterResume)
    {ArenaState::kGivingBack, ArenaState::kReady},     // GiveBackStep's end, a foreground Prepare
    {ArenaState::kGivingBack, ArenaState::kHolding},   // a pause: what is still pinned is used
    {ArenaState::kGivingBack, ArenaState::kNone},      // Release, a new store
    {ArenaState::kHolding, ArenaState::kReady},        // a failed pause; a resume dropping the contents
    {ArenaState::kHolding, ArenaState::kGivingBack},   // a resume handing the memory back later
    {ArenaState::kHolding, ArenaState::kRetained},     // a resume keeping the bytes readable
    {ArenaState::kHolding, ArenaState::kNone},         // a spill; a failed pause releasing; the last free
    {ArenaState::kRetained, ArenaState::kHolding},     // the next pause writes over it
    {ArenaState::kRetained, ArenaState::kReady},       // a foreground Prepare replacing it
    {ArenaState::kRetained, ArenaState::kNone},        // Release (the last retained block freed), a new store
};

}  // namespace

const char* ArenaStateName(ArenaState state) {
  switch (state) {
    case ArenaState::kNone: return "none";
    case ArenaState::kReady: return "ready";
    case ArenaState::kGivingBack: return "giving_back";
    case ArenaState::kHolding: return "holding";
    case ArenaState::kRetained: return "retained";
  }
  return "none";
}

bool ArenaMoveAllowed(ArenaState from, ArenaState to) {
  if (from == to) return true;
  for (const Move& m : kArenaMoves) {
    if (m.from == from && m.to == to) return true;
  }
  return false;
}

TagBackup::TagBackup(Driver* driver, int device, std::string tag_name, BackupStore store, Mutex* transition_mu,
                     Mutex* owner_mu, std::shared_ptr<HostLeaseSource> leases)
    : driver_(driver),
      device_(device),
      tag_name_(std::move(tag_name)),
      leases_(std::move(leases)),
      transition_mu_(transition_mu),
      owner_mu_(owner_mu),
      store_(std::move(store)) {}

std::string TagBackup::Owner() const { return absl::StrCat("tag '", tag_name_, "' on device ", device_); }

void TagBackup::MoveTo(ArenaState to) {
  if (to == state_) return;
  if (!ArenaMoveAllowed(state_, to)) {
    VMSTASH_LOG(kError, "vmstash: {}: the backup's move from {} to {} is not allowed (kept {})", Owner(),
                ArenaStateName(state_), ArenaStateName(to), ArenaStateName(state_));
    return;
  }
  previous_ = state_;
  state_ = to;
}

BackupArena* TagBackup::EnsureArena() {
  if (arena_ == nullptr) {
    arena_ = std::make_unique<BackupArena>(driver_, device_, store_, absl::StrCat("the backup of ", Owner()),
                                           &HostBudget::Process(), leases_);
  }
  return arena_.get();
}

BackupArena* TagBackup::ForPause() {
  ++epoch_;
  pause_found_ = arena_ != nullptr ? arena_->holding() : BackupArena::Holding{};
  MutexLock lock(owner_mu_);
  BackupArena* arena = EnsureArena();
  retained_.clear();  // the arena is written over from here on (Note [Retained Backups])
  MoveTo(ArenaState::kHolding);  // a pending hand-back is cancelled: what is still pinned is used
  return arena;
}

absl::Status TagBackup::Reserve(std::size_t bytes, const std::vector<std::size_t>& pieces,
                                const std::string& spill_dir, const Reclaim& reclaim) {
  absl::Status s = ForPause()->ReserveLayout(bytes, pieces);
  BackupStore host;
  {
    MutexLock lock(owner_mu_);
    host = store_;
  }
  if (!absl::IsResourceExhausted(s) || host.on_disk()) return s;
  // Note [Host Budget]: other active tags' prepared arenas go first, then one more try.
  if (reclaim && reclaim(bytes) > 0) {
    s = arena_->ReserveLayout(bytes, pieces);
    if (!absl::IsResourceExhausted(s)) return s;
  }
  if (spill_dir.empty()) return s;
  if (absl::Status released = arena_->Release(); !released.ok()) {
    VMSTASH_LOG(kError, "vmstash: {}: releasing its host backup before spilling to disk: {}", Owner(),
                released.ToString());
    return s;
  }
  std::unique_ptr<BackupArena> dropped;
  MoveStore(BackupStore{BackupStore::Kind::kDisk, spill_dir}, &dropped);
  absl::Status on_disk = ForPause()->ReserveLayout(bytes, pieces);
  if (!on_disk.ok()) {
    MoveStore(host, &dropped);  // a failed pause changes nothing
    return absl::Status(on_disk.code(), absl::StrCat(s.message(), "; spilling to spill_dir '", spill_dir,
                                                     "' failed too: ", on_disk.message()));
  }
  spilled_from_ = host;
  return absl::OkStatus();
}

void TagBackup::AfterPause() {
  retained_.clear();
  // A pause that kept no bytes did not take the arena (ForPause): it is kept as it is, but
  // nothing of it stays readable and nothing goes back while the tag is paused (the
  // resume sees to it: AfterResume, outside the owner's lock).
  if (state_ == ArenaState::kRetained || state_ == ArenaState::kGivingBack) MoveTo(ArenaState::kReady);
  if (!spilled_from_.has_value()) return;
  VMSTASH_LOG(kWarning, "vmstash: {}: its backup did not fit under host_max (or the host refused it): it now goes "
              "to {} (spill_dir), for this pause and the later ones", Owner(), DescribeBackupStore(store_));
  spilled_from_.reset();
}

void TagBackup::AfterFailedPause() {
  if (spilled_from_.has_value()) {  // the spill of this pause is undone (Reserve)
    std::unique_ptr<BackupArena> disk;
    MoveStore(*spilled_from_, &disk);
    spilled_from_.reset();
    return;  // the disk arena (its file) goes with `disk`
  }
  if (arena_ == nullptr) return;
  BackupRetention retention;
  {
    MutexLock lock(owner_mu_);
    retention = retention_;
  }
  if (retention.release_with_blocks) {  // nothing retained: the backup goes (Note [Retained Backups])
    absl::Status s = Release(std::nullopt);
    if (s.ok()) return;
    VMSTASH_LOG(kError, "vmstash: {}: releasing the backup of a failed pause: {}", Owner(), s.ToString());
  }
  // What the pause added goes back: the tag holds what it held before (Note [Host Budget]).
  arena_->AfterFailedPause(pause_found_, retention.give_back);
  MutexLock lock(owner_mu_);
  MoveTo(arena_->capacity_bytes() > 0 ? ArenaState::kReady : ArenaState::kNone);
}

void TagBackup::AfterResume(bool later) {
  if (arena_ == nullptr) return;
  ArenaState state;
  BackupRetention retention;
  BackupStore::Kind kind;
  {
    MutexLock lock(owner_mu_);
    state = state_;
    retention = retention_;
    kind = store_.kind;
  }
  if (state == ArenaState::kNone) return;  // released while the tag was paused (its last backed-up block freed)
  arena_->FreeRingAfterResume();  // a ring lives for one transition (backup_arena.h, Note [Host Budget])
  if (state != ArenaState::kHolding) {
    // The pause kept no bytes and did not take the arena (AfterPause left it ready):
    // nothing of it is needed. A lease (what a resume retained before) goes back to the
    // pool, and a give_back tag's memory to the OS, at once (no background step: the
    // table has no move from ready to giving_back); other memory stays ready.
    if (arena_->leased() || (retention.give_back && kind == BackupStore::Kind::kPinned)) {
      arena_->DropContents(retention.give_back);
    }
    MutexLock lock(owner_mu_);
    MoveTo(arena_->capacity_bytes() > 0 ? ArenaState::kReady : ArenaState::kNone);
    return;
  }
  ArenaState next = ArenaState::kReady;
  if (retention.keep_after_resume && kind != BackupStore::Kind::kDiskFiles) {
    next = ArenaState::kRetained;  // kept readable
  } else if (later && retention.give_back && kind == BackupStore::Kind::kPinned && !arena_->leased()) {
    next = ArenaState::kGivingBack;  // the owner asks its background thread
  } else {
    arena_->DropContents(retention.give_back);
    if (arena_->capacity_bytes() == 0) next = ArenaState::kNone;  // a disk-files arena: released
  }
  MutexLock lock(owner_mu_);
  MoveTo(next);
}

void TagBackup::AfterFailedResume() {
  if (arena_ != nullptr) arena_->FreeRingAfterResume();
}

void TagBackup::KeepReadable(BackupExtents* extents) {
  retained_.clear();
  if (state_ == ArenaState::kRetained && HasBackedUpBytes(*extents)) retained_ = std::move(*extents);
}

absl::Status TagBackup::ReserveForPrepare(std::size_t want, bool background, std::size_t* pin_to) {
  // Every live block rounds up to a page in the arena; leave room for that.
  const std::size_t need = want + want / 64 + kBackupAlignBytes;
  const bool grows = arena_ == nullptr || need > arena_->capacity_bytes();
  bool give_back = false;
  BackupArena* arena = nullptr;
  {
    MutexLock lock(owner_mu_);
    if (background && !retained_.empty()) return absl::OkStatus();  // Note [Retained Backups]
    if (leases_ != nullptr && leases_->Enabled() && store_.kind == BackupStore::Kind::kPinned) {
      leases_->PrepareAhead(device_);  // Note [Pool-Backed Backups]: no lease ahead; the source may pin
      return absl::OkStatus();
    }
    // A foreground request wants it pinned: a pending hand-back is cancelled. A background
    // one leaves it pending.
    if (!background && state_ == ArenaState::kGivingBack) MoveTo(ArenaState::kReady);
    if (grows) {
      retained_.clear();  // the arena is replaced: what it retained is gone
      if (state_ == ArenaState::kRetained) MoveTo(ArenaState::kReady);
    }
    if (state_ == ArenaState::kNone) MoveTo(ArenaState::kReady);
    give_back = retention_.give_back;
    arena = EnsureArena();
  }
  if (grows) ++epoch_;
  VMSTASH_RETURN_IF_ERROR(arena->Reserve(need));
  // Note [Retained Backups], give_back: a background preparation does not pin again what a
  // resume gave back.
  if (!background || grows || !give_back) *pin_to = arena_->capacity_bytes();
  return absl::OkStatus();
}

absl::Status TagBackup::PinStep(std::uint64_t epoch, std::size_t pin_to, std::size_t step,
                                const std::function<bool()>& announced, bool* warmed, bool* done, bool* yield) {
  *done = true;
  *yield = false;
  // Paused meanwhile (its pause pinned what it needed; a resume may have given it back),
  // released, or replaced.
  if (arena_ == nullptr || epoch_ != epoch) return absl::OkStatus();
  const std::size_t from = arena_->PinnedPrefixBytes();
  if (from >= pin_to) return absl::OkStatus();
  if (!*warmed) {  // all of it faulted in first, then registered step by step (BackupArena::Warm)
    *warmed = true;
    absl::Status w = arena_->Warm(pin_to, announced);
    // Over the host cap (Note [Host Budget]: all of it is charged at once), or short of
    // memory: the steps below pin what fits, step by step, as they did alone.
    if (!w.ok() && !absl::IsResourceExhausted(w)) return w;
    if (announced()) {  // a pause waits: it goes first (a later step pins what is still cold)
      *done = false;
      *yield = true;
      return absl::OkStatus();
    }
  }
  absl::Status pinned = arena_->Pin(std::min(pin_to, from + step));
  *done = !pinned.ok() || arena_->PinnedPrefixBytes() >= pin_to;
  return pinned;
}

absl::Status TagBackup::GiveBackStep(std::size_t step) {
  bool more = false;
  absl::Status s = arena_->GiveBackSome(step, &more);
  if (!s.ok() || !more) {
    MutexLock lock(owner_mu_);
    MoveTo(ArenaState::kReady);
  }
  return s;
}

void TagBackup::CancelGiveBack() {
  MutexLock lock(owner_mu_);
  if (state_ == ArenaState::kGivingBack) MoveTo(arena_ != nullptr ? ArenaState::kReady : ArenaState::kNone);
}

absl::Status TagBackup::Release(std::optional<std::size_t> floor_bytes) {
  ++epoch_;  // a background preparation's next step finds the arena moved
  absl::Status s = arena_ != nullptr ? arena_->Release() : absl::OkStatus();
  MutexLock lock(owner_mu_);
  if (!s.ok()) return s;  // what it could not give back stays held and charged
  retained_.clear();
  auto_prepare_.requested_bytes = 0;  // a queued background request finds this and does nothing
  if (floor_bytes.has_value()) auto_prepare_.floor_bytes = *floor_bytes;
  MoveTo(ArenaState::kNone);
  return absl::OkStatus();
}

void TagBackup::MoveStore(const BackupStore& store, std::unique_ptr<BackupArena>* dropped) {
  *dropped = std::move(arena_);
  ++epoch_;
  MutexLock lock(owner_mu_);
  store_ = store;
  retained_.clear();
  auto_prepare_.requested_bytes = 0;  // a queued background request finds this and does nothing
  MoveTo(ArenaState::kNone);
}

void TagBackup::SetRetention(const BackupRetention& retention) {
  MutexLock lock(owner_mu_);
  retention_ = retention;
}

absl::Status TagBackup::Read(std::size_t offset, std::size_t size_bytes,
                             const std::function<void(const char*)>& use) {
  // Note [Disk Backup]: a read error rather than a SIGBUS, and only these bytes are read.
  VMSTASH_RETURN_IF_ERROR(arena_->Load(offset, size_bytes));
  use(arena_->data() + offset);
  return absl::OkStatus();
}

absl::Status TagBackup::Violation(TagState tag, const std::string& what) const {
  return absl::InternalError(absl::StrCat("the backup of ", Owner(), " (", ArenaStateName(state_), ", the tag ",
                                          TagStateName(tag), "): ", what));
}

absl::Status TagBackup::Validate(TagState tag) const {
  if (!ArenaMoveAllowed(previous_, state_)) {
    return Violation(tag, absl::StrCat("its last move, from ", ArenaStateName(previous_), ", is not in the table"));
  }
  const bool moving = tag == TagState::kPausing || tag == TagState::kResuming;
  if (state_ == ArenaState::kHolding && !moving && tag != TagState::kPaused) {
    return Violation(tag, "it holds a pause's bytes, and the tag is not pausing, paused or resuming");
  }
  if ((state_ == ArenaState::kGivingBack || state_ == ArenaState::kRetained) && tag != TagState::kActive) {
    return Violation(tag, "only an active tag's backup gives its memory back or keeps its bytes readable");
  }
  if (!retained_.empty() && state_ != ArenaState::kRetained) return Violation(tag, "retained extents, and nothing retained");
  return absl::OkStatus();
}

absl::Status TagBackup::ValidateWithArena(TagState tag, std::int64_t arena_bytes_stat) const {
  VMSTASH_RETURN_IF_ERROR(Validate(tag));
  if (spilled_from_.has_value() && tag != TagState::kPausing) return Violation(tag, "a spill outside a pause");
  if (state_ == ArenaState::kNone && held_bytes() != 0) {
    return Violation(tag, absl::StrCat("it holds ", held_bytes(), " bytes of host memory"));
  }
  if (state_ != ArenaState::kNone && arena_ == nullptr) return Violation(tag, "no arena");
  if (arena_bytes_stat != static_cast<std::int64_t>(held_bytes())) {
    return Violation(tag, absl::StrCat("arena-bytes stat ", arena_bytes_stat, " but the arena holds ", held_bytes()));
  }
  return absl::OkStatus();
}

}  // namespace vmstash
