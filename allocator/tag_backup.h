// TagBackup: the life of one `backup` tag's backup on one device — its store, its
// retention (Note [Retained Backups] in tag_pool.h), its arena (backup_arena.h) and where
// that arena is in its life (docs/architecture.md §5).
//
// Arena states (ArenaState). Every change goes through MoveTo(), which refuses a move that
// is not in its table (kArenaMoves in tag_backup.cc); Validate() checks the last move and
// that the parts agree with the state:
//
//   none ------ Prepare ------> ready <------- GiveBack's end ------- giving_back
//    ^  \                      |  ^  \                                    ^
//    |   \                     |  |   `-- a resume, contents dropped      |
//    |    `-- a pause --------\|  |       (AfterResume) <-----------.     |
//    |                         v  | a failed pause                   |    | a resume whose
//    |                       holding ---- a resume, bytes kept ----> retained  memory goes back
//    |                         |     `-------------------------------------'  in the background
//    +-- Release (ReleaseBackup, the last free, the host cap's reclaim, a new store):
//        from any state but holding with bytes a paused tag needs
//
//   none         no arena memory: never made, released, or dropped for a new store
//   ready        memory kept for the next pause; nothing of the tag's in it
//   giving_back  ready, its pinned memory to be handed back on a background thread
//                (GiveBackStep; a pause or a foreground Prepare cancels it)
//   holding      a pause writes, or has written, the tag's bytes into it: the tag is
//                pausing, paused or resuming (from ForPause to AfterResume or
//                AfterFailedPause)
//   retained     after a resume, it keeps what the pause saved, readable through the
//                retained extents (which frees empty) until the next pause or a release
//
// Direction: tag_pool -> tag_backup -> backup_arena. A TagBackup is told the tag's state by
// its caller (TagPool) and never reads TagPool; it has no lock of its own but is given
// the pool's two (annotated on every field and function; clang checks them):
//   transition_mu  the tag's transition lock: the arena, its epoch and the pause's marks;
//   owner_mu       the owner's mu (the CachingAllocator's device lock): the arena state,
//                  the store, the retention, the retained extents, the auto-prepare marks.
//                  The state, the store and the retention are written holding both (their
//                  writers require the transition lock and take the owner's mu), so the
//                  functions that hold the transition lock read them under the owner's mu
//                  too, briefly.
#ifndef VMSTASH_ALLOCATOR_TAG_BACKUP_H_
#define VMSTASH_ALLOCATOR_TAG_BACKUP_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/backup_arena.h"
#include "allocator/host_lease.h"
#include "allocator/tag_state.h"
#include "allocator/transition_plan.h"
#include "base/mutex.h"
#include "vmm/driver.h"

namespace vmstash {

enum class ArenaState { kNone, kReady, kGivingBack, kHolding, kRetained };
const char* ArenaStateName(ArenaState state);
// True when MoveTo(to) is allowed from `from` (the table in tag_backup.cc).
bool ArenaMoveAllowed(ArenaState from, ArenaState to);

// Note [Retained Backups] (tag_pool.h) says what each flag does.
struct BackupRetention {
  bool keep_after_resume = false;
  bool release_with_blocks = false;
  bool give_back = false;
};

class TagBackup {
 public:
  // The marks of background preparation (CachingAllocator's requests; owner's mu).
  struct AutoPrepare {
    std::size_t requested_bytes = 0;  // the last background request
    // A release's reserved bytes: background preparation waits until the tag grows past
    // them, so a released arena is not pinned again at the next resume.
    std::size_t floor_bytes = 0;
    // Whether background preparation serves this tag at all (CachingAllocator::SetPrepareAhead).
    bool ahead = true;
  };
  // Takes back other tags' prepared arenas for a pause over the cap: called with the
  // bytes wanted, returns the bytes refunded (TransitionHost::ReclaimPreparedArenas).
  using Reclaim = std::function<std::size_t(std::size_t wanted)>;

  // `tag_name` and `device` name the tag in messages.
  // `transition_mu` and `owner_mu`: the pool's locks (above), which outlive it.
  // `leases`: where a pinned store's arena leases its backups (null: nowhere; Note
  // [Pool-Backed Backups] in host_lease.h).
  TagBackup(Driver* driver, int device, std::string tag_name, BackupStore store, Mutex* transition_mu,
            Mutex* owner_mu, std::shared_ptr<HostLeaseSource> leases = nullptr);
  TagBackup(const TagBackup&) = delete;
  TagBackup& operator=(const TagBackup&) = delete;

  // --- The locks ----------------------------------------------------------------------
  // The pool takes them as both its names for them and these (TagPool's OwnerLock,
  // ForegroundLock, BackgroundLock): clang cannot equate a pool's transition_mu_ with its
  // backup's. A pool function entered holding one states it here; checked at run time in
  // builds without NDEBUG (Mutex::AssertHeld).
  Mutex* transition_mu() const ABSL_LOCK_RETURNED(transition_mu_) { return transition_mu_; }
  Mutex* owner_mu() const ABSL_LOCK_RETURNED(owner_mu_) { return owner_mu_; }
  void AssertTransitionHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK(transition_mu_) { transition_mu_->AssertHeld(); }
  void AssertOwnerHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK(owner_mu_) { owner_mu_->AssertHeld(); }

  // --- State (owner's mu) --------------------------------------------------------------
  ArenaState state() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(owner_mu_) { return state_; }
  const BackupStore& store() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(owner_mu_) { return store_; }
  const BackupRetention& retention() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(owner_mu_) { return retention_; }
  bool give_back_pending() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(owner_mu_) {
    return state_ == ArenaState::kGivingBack;
  }
  // What a resume kept readable (Note [Retained Backups]).
  BackupExtents& retained() ABSL_EXCLUSIVE_LOCKS_REQUIRED(owner_mu_) { return retained_; }
  const BackupExtents& retained() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(owner_mu_) { return retained_; }
  AutoPrepare& auto_prepare() ABSL_EXCLUSIVE_LOCKS_REQUIRED(owner_mu_) { return auto_prepare_; }

  // --- The arena (transition lock) -----------------------------------------------------
  BackupArena* arena() ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_) { return arena_.get(); }
  // Moves whenever the arena is written by a pause, replaced or released (PinStep).
  std::uint64_t epoch() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_) { return epoch_; }
  // What the arena holds in host memory (0 without one): the arena-bytes statistic.
  std::size_t held_bytes() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_) {
    return arena_ == nullptr ? 0 : arena_->held_bytes();
  }

  // --- A pause (transition lock) --------------------------------------------------------
  // The arena a pause writes (made on first use), from here on holding: what a resume
  // retained is dropped (the arena is written over), a pending hand-back cancelled (what
  // is still pinned is used). Records what the arena held, for AfterFailedPause.
  BackupArena* ForPause() ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_) ABSL_LOCKS_EXCLUDED(owner_mu_);
  // The pause's reservation: ForPause, then ReserveLayout of `bytes` in `pieces`. When the
  // host refuses a host store (the host budget or the host: ResourceExhausted), `reclaim`
  // (if set) takes back other tags' prepared arenas and, if it gave something back, the
  // reservation is tried once more; still refused and with `spill_dir` set, the store
  // becomes the disk store there for this pause and the later ones (undone by
  // AfterFailedPause, logged by AfterPause); the disk refusing too leaves the store as it
  // was and returns both errors.
  absl::Status Reserve(std::size_t bytes, const std::vector<std::size_t>& pieces, const std::string& spill_dir,
                       const Reclaim& reclaim)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_) ABSL_LOCKS_EXCLUDED(owner_mu_);
  // The pause committed (the owner's mu and the transition lock held): nothing retained
  // any more; an arena the pause did not take (it kept no bytes) is ready; a spill is
  // logged.
  void AfterPause() ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_, owner_mu_);
  // The pause failed after ForPause (its copies waited for): a spill is undone (the disk
  // arena dropped), or, with release_with_blocks, the arena released (its bytes are of no
  // block), else what the pause added goes back (BackupArena::AfterFailedPause): ready.
  void AfterFailedPause() ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_) ABSL_LOCKS_EXCLUDED(owner_mu_);

  // --- A resume (transition lock) -------------------------------------------------------
  // Its restore copies complete: the staging ring goes, then the arena keeps its bytes
  // readable (keep_after_resume, not for disk files: retained), or, a pinned arena whose
  // memory goes back with `later`, is left to GiveBackStep (giving_back), or drops its
  // contents (ready; none for a disk-files arena, released).
  void AfterResume(bool later) ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_) ABSL_LOCKS_EXCLUDED(owner_mu_);
  // A resume failed (the tag stays paused, the arena holding its bytes): the staging ring
  // its copies made goes (a ring lives for one transition).
  void AfterFailedResume() ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_);
  // Owner's mu, at the resume's commit: `extents` (the pause's, with bytes) become the
  // retained ones when the arena kept them.
  void KeepReadable(BackupExtents* extents) ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_, owner_mu_);

  // --- Preparation and hand-back (transition lock) ------------------------------------
  // Sizes the arena for `want` bytes of blocks (the caller checked the tag is active and
  // wants it); *pin_to: how far it is to be pinned (0: not at all; a background request
  // does not pin again what a resume gave back). A foreground request cancels a pending
  // hand-back. Skipped (OK, *pin_to 0) by a background request while bytes are retained,
  // and by any request for a pool-backed store (Note [Pool-Backed Backups]: the pool is
  // pinned already; an active tag holds none of it).
  absl::Status ReserveForPrepare(std::size_t want, bool background, std::size_t* pin_to)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_) ABSL_LOCKS_EXCLUDED(owner_mu_);
  // One step of a background preparation begun at `epoch`: pins up to `step` more bytes of
  // [0, pin_to) (faulting all of it in first, once, ending early when `announced`);
  // *done when nothing is left or the arena moved on; *yield when a foreground transition
  // announced itself during the warming.
  absl::Status PinStep(std::uint64_t epoch, std::size_t pin_to, std::size_t step,
                       const std::function<bool()>& announced, bool* warmed, bool* done, bool* yield)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_);
  // Pins [0, end) now (a foreground Prepare).
  absl::Status Pin(std::size_t end) ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_) { return arena_->Pin(end); }
  // One step of the background hand-back: at most `step` pinned bytes go back; leaves
  // giving_back (for ready) when done or on an error (the rest stays pinned).
  absl::Status GiveBackStep(std::size_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_) ABSL_LOCKS_EXCLUDED(owner_mu_);
  // The hand-back is not for this tag any more (not active, no arena): ready or none.
  void CancelGiveBack() ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_) ABSL_LOCKS_EXCLUDED(owner_mu_);

  // --- Release (transition lock): the one way memory leaves without a new arena ----------
  // Releases the arena's memory: none. A release the driver refuses is the error, with
  // what it could not give back still held and charged (Note [Host Budget]); the state
  // stays. Either way the epoch moves (a background step finds the arena moved on).
  // `floor_bytes`: when set, background preparation waits until the tag grows past it.
  absl::Status Release(std::optional<std::size_t> floor_bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_) ABSL_LOCKS_EXCLUDED(owner_mu_);
  // A new store: the arena goes to *dropped (released by the caller's Release first, for
  // a store change; dropped whole for a spill's undo), none.
  void MoveStore(const BackupStore& store, std::unique_ptr<BackupArena>* dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_) ABSL_LOCKS_EXCLUDED(owner_mu_);
  // Note [Retained Backups]: set holding the transition lock and the owner's mu.
  void SetRetention(const BackupRetention& retention)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_) ABSL_LOCKS_EXCLUDED(owner_mu_);

  // --- Reads (transition lock) ----------------------------------------------------------
  // Calls `use` with the host address of the arena's bytes at `offset`, after loading
  // them (a disk arena: a read error, not a SIGBUS).
  absl::Status Read(std::size_t offset, std::size_t size_bytes, const std::function<void(const char*)>& use)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_);
  bool has_arena() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_) { return arena_ != nullptr; }

  // Invariant walker: Internal naming the first violation. The last move in the table; the
  // state agreeing with the tag's `tag` (holding only while the tag is pausing, paused or
  // resuming; giving_back and retained only while active; retained extents only when
  // retained). What the transition lock guards (the arena, a spill) is ValidateWithArena's.
  absl::Status Validate(TagState tag) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(owner_mu_);
  // Validate's checks, then the arena's (both locks held): the state agreeing with the
  // arena (none holds nothing, the others have one), a spill only while pausing, and
  // `arena_bytes_stat` equal to what the arena holds.
  absl::Status ValidateWithArena(TagState tag, std::int64_t arena_bytes_stat) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_, owner_mu_);

 private:
  // The one writer of the state (owner's mu and transition lock held): Internal, the
  // state unchanged, for a move not in the table (logged: a caller bug).
  void MoveTo(ArenaState to) ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_, owner_mu_);
  BackupArena* EnsureArena() ABSL_EXCLUSIVE_LOCKS_REQUIRED(transition_mu_, owner_mu_);
  std::string Owner() const;
  // Validate's Internal error naming the backup, its state and the tag's.
  absl::Status Violation(TagState tag, const std::string& what) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(owner_mu_);

  Driver* const driver_;
  const int device_;
  const std::string tag_name_;
  const std::shared_ptr<HostLeaseSource> leases_;
  Mutex* const transition_mu_;
  Mutex* const owner_mu_;
  // Written holding both locks (above).
  ArenaState state_ ABSL_GUARDED_BY(owner_mu_) = ArenaState::kNone;
  ArenaState previous_ ABSL_GUARDED_BY(owner_mu_) = ArenaState::kNone;  // before the last move (Validate)
  BackupStore store_ ABSL_GUARDED_BY(owner_mu_);
  BackupRetention retention_ ABSL_GUARDED_BY(owner_mu_);
  BackupExtents retained_ ABSL_GUARDED_BY(owner_mu_);
  AutoPrepare auto_prepare_ ABSL_GUARDED_BY(owner_mu_);
  std::unique_ptr<BackupArena> arena_ ABSL_GUARDED_BY(transition_mu_);
  std::uint64_t epoch_ ABSL_GUARDED_BY(transition_mu_) = 0;
  // What the arena held when the pause in progress found it (ForPause).
  BackupArena::Holding pause_found_ ABSL_GUARDED_BY(transition_mu_);
  // The host store a pause in progress moved the tag from (Reserve's spill).
  std::optional<BackupStore> spilled_from_ ABSL_GUARDED_BY(transition_mu_);
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_TAG_BACKUP_H_
