// BackupArena: host memory (or a disk file) holding a paused `backup` tag's live bytes
// (docs/architecture.md §2, §5). Each tag chooses its BackupStore; AllocatorOptions::backup
// gives the default.
//
// Pinned (default): PinnedPieces (vmm/pinned_pieces.h, Note [Pinned Pieces]): host memory
// registered with the driver piece by piece, so copies run at link speed. Pin() pins the
// whole arena ahead of a pause (Prepare, the background preparation); a pause into an
// arena not yet (or not all) pinned warms (many threads) and pins each piece just before
// its copies, pipelined with them. After a resume the memory stays pinned for the next pause, or, when
// the owner asks (DropContents(give_back=true) or GiveBackSome in steps:
// torch_memory_saver's default mode), is unpinned and handed back to the OS lazily, to be
// pinned again by the next pause. Pageable: an anonymous mmap for users short of
// host RAM; after a resume its pages are given back to the OS (MADV_DONTNEED) so the
// RSS drops, and the next pause faults them in again.
//
// Copies between the device and an arena go through CopyIn / CopyOut. A pinned arena pins
// what the copy needs and splits it at the pieces' bounds (a copy may not span two
// registrations). The pageable and disk stores copy through the arena's staging ring
// (vmm/staging_ring.h, Note [Staging Ring]: a few pinned slots, host threads moving the
// bytes while the link fills the next slots), made by the first pause (ReserveLayout) and
// kept until the arena is released; a pause's bytes reach the arena at Seal(). Where the
// host budget or the host refuses the ring's pinned memory, they copy through the driver
// directly (its own staging: slower, never a failed pause).
//
// Note [Disk Backup]
//   Disk: a file in BackupStore::directory, created with mkstemp and unlinked at once (no
//   file is left behind by a crash; the space is freed when the arena is released), its
//   blocks allocated up front with posix_fallocate, so a full disk is an error of
//   Reserve() — before the pause touches the device — never a SIGBUS while copying. The
//   file is mapped shared; the pause copies into the mapping, then Seal() writes it back
//   (msync) and drops the pages from the process and the page cache, so the paused bytes
//   occupy disk, not host memory. The file stays open while the arena exists, so removing
//   the directory during a pause loses nothing. A missing directory is NotFound; no room
//   (ENOSPC, EDQUOT, EFBIG) is ResourceExhausted; both name the directory and the size.
//
//   The file size limit (RLIMIT_FSIZE, `ulimit -f`, set by batch schedulers): growing a
//   file past it makes the kernel send SIGXFSZ — whose default action kills the process —
//   and fail the call with EFBIG. The signal is sent to the calling thread only, so
//   Reserve() blocks SIGXFSZ on its own thread (pthread_sigmask) around the one call that
//   grows the file; on EFBIG it consumes the signal the kernel left pending (sigtimedwait,
//   zero timeout; a standard signal is pending at most once) before restoring the mask,
//   and returns ResourceExhausted naming the file and the limit. Nothing process-wide
//   changes: a SIGXFSZ handler or disposition the application set stays in force for its
//   own writes, and a thread that blocked SIGXFSZ already keeps its pending signal.
//   (Checking getrlimit first instead would race with setrlimit and still leave the
//   signal for any other reason the call grows the file: glibc's fallback writes.) The
//   mapped writes of the pause and Seal's msync never change the file size.
//
//   Resume reads through the mapping, where a failed read of the file (an I/O error, or a
//   file shortened while paused — it is reachable as /proc/<pid>/fd/<n>) would be a
//   SIGBUS inside the restore copies. So before reading, a resume (and a switch, for each
//   tag it restores, and its rollback; ReadBackup for the bytes it reads) calls Load() on
//   the bytes it will read (the backed-up part, not the arena's whole capacity): it
//   checks the file still has the arena's size (else DataLoss, nothing read), then faults
//   those pages in with MADV_POPULATE_READ, which reports a failed read as an error
//   instead of a signal (EFAULT; on kernels before 5.14, EINVAL, it reads them once with
//   pread instead, which fails with EIO). On an error the pages read so far are dropped
//   and the resume fails with the tag paused and its file kept: a later resume tries
//   again. Covered: a persistent read error and a truncated file. Not covered: a page
//   read successfully by Load(), evicted under memory pressure before its copy and then
//   failing to read again (a disk failing inside that window), or a file truncated
//   after Load() by a writer other than vmstash.
//
// Note [Disk Backup Files]
//   DiskFiles ("disk_files", torch_memory_saver's layout, used by its drop-in): while a
//   tag is paused, each live block with backed-up bytes has its own visible file in the
//   directory, named vmstash-tms-<pid>-<start>-XXXXXX (<start>: the process's start time
//   in clock ticks, /proc/<pid>/stat, so that a reused pid is told apart). ReserveLayout()
//   makes them at each pause, one per piece of the pause's layout (transition_plan.h,
//   BackupPieceBytes), and maps them side by side into one reserved address range, so
//   data() is one contiguous arena as for the other stores; the writes, Seal(), Load()
//   and the errors are those of Note [Disk Backup] (a full disk or a missing directory
//   fails the pause before the device is touched; the files stay open, so removing them
//   loses nothing). The files are removed when the tag resumes (DropContents), when the
//   pause fails (the pause executors call TagPool::ArenaAfterFailedPause on their failure
//   path, which drops or releases the arena: a failed pause leaves nothing behind), when
//   the arena is released, and — for a process that ends normally with a tag paused — as
//   it ends (a handler registered with std::atexit unlinks the files this process made; a
//   forked child ending leaves its parent's alone).
//   A process that dies without running it leaves its files; each ReserveLayout() first
//   sweeps the directory: a file of this pattern whose pid is not alive, or alive with
//   another start time, is removed. Files of live processes (this one's included) stay.
//   Prepare() does nothing for this store (the files are per pause); costs one open file
//   descriptor per file while paused.
//
// Note [Host Budget]
//   The host pages an arena holds are charged to the process's HostBudget (allocator/
//   host_budget.h; VMSTASH_CONF host_max) before they are pinned or written: a pinned arena
//   charges the bytes a pause (ReserveLayout) or a preparation (Pin) is about to make
//   resident, and refunds what it gives back (DropContents, GiveBackSome) or releases; a
//   pageable arena charges what a pause is about to write and refunds it when its pages go
//   back after the resume. Disk stores charge nothing. A refusal is the budget's
//   ResourceExhausted, before the pause touches a page or the device: the pause fails with
//   the tag as it was (an arena too small for it may have been replaced, unpinned), or its
//   tag moves to the disk store in spill_dir (TagPool::ReserveBackup). Arenas kept pinned
//   between cycles (vmstash's default retention) and prepared ahead of a pause are charged
//   as long as they hold their memory. The staging ring of a pageable or disk arena (its
//   pinned slots, StagingRing::kSlots x kSlotBytes) is charged as a staging ring
//   (HostUse::kStagingRing) when the ring is made (a pause's ReserveLayout, a resume's first
//   CopyOut) and refunded when it is freed: at the end of the transition that made it (the
//   pause's Seal, the resume's FreeRingAfterResume) or when the arena is released. So a tag
//   holds a ring only during its own transitions, paused or active (a process's memory
//   tracks its backups, as torch_memory_saver's pageable backups do); a refusal only means
//   no ring (the copies go through the driver directly), never a failed pause.
//   Refunds follow what really went back: a release or hand-back the driver or the kernel
//   refuses (an unregistering, the ring's free, an munmap or madvise) keeps the charge of
//   what it left held, and an arena destroyed after a failed release leaves its charge in
//   the account for good (HostCharge::Abandon: the memory is still held, nobody tracks it).
//   A pause that fails gives back what it charged (AfterFailedPause: TagPool::
//   ArenaAfterFailedPause, for each tag of a failed switch whose arena it reserved), so a
//   failed transition leaves the account as it found it, less what it had to replace.
//   Over the cap, before refusing or spilling, a pause takes back the arenas that other
//   active tags of its device hold prepared and unused (TagPool::ReserveBackup, through
//   TransitionHost::ReclaimPreparedArenas), then charges once more. The rule: only active
//   tags outside the transition, never a paused tag's arena (its backup) nor one holding
//   bytes a resume retained for reading (Note [Retained Backups]); each tag's transition
//   lock is only tried, holding the device's mu (which keeps the pool alive), never
//   waited for — the pausing thread holds its own tags' transition locks, and another
//   tag's holder may be waiting for one of those (a switch takes them in tag order) —
//   so a tag busy preparing, reading or in its own transition is skipped. Taken back
//   means released as ReleaseBackup does (the tag is not prepared again in the
//   background until it grows); it stays so if the pause fails after all. Tags of other
//   devices are not taken back (each device's allocator reclaims among its own tags).
//
// Pool-backed (a pinned store whose owner gave it a HostLeaseSource: the node pool): a
// pause leases its backup from the source, copies into the lease, and gives it back when
// the bytes are no longer needed; the own pinned memory above is the fallback when the
// source refuses (allocator/host_lease.h, Note [Pool-Backed Backups]).
//
// Reserve(n) keeps the memory when it is already large enough, else replaces it (the old
// contents are not kept: callers reserve before copying). Release() gives it back, and
// the staging ring with it.
//
// Thread-safety: none; the owning tag's transition lock guards it.
#ifndef VMSTASH_ALLOCATOR_BACKUP_ARENA_H_
#define VMSTASH_ALLOCATOR_BACKUP_ARENA_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "vmm/driver.h"
#include "allocator/host_budget.h"
#include "allocator/host_lease.h"
#include "vmm/pinned_pieces.h"
#include "vmm/staging_ring.h"

namespace vmstash {

// Where a `backup` tag's paused bytes go.
struct BackupStore {
  enum class Kind { kPinned, kPageable, kDisk, kDiskFiles };
  Kind kind = Kind::kPinned;
  std::string directory;  // kDisk and kDiskFiles only: a directory (CheckBackupStore)

  bool on_disk() const { return kind == Kind::kDisk || kind == Kind::kDiskFiles; }

  bool operator==(const BackupStore& o) const { return kind == o.kind && directory == o.directory; }
  bool operator!=(const BackupStore& o) const { return !(*this == o); }
};
// "pinned" | "pageable" | "disk" | "disk_files"; InvalidArgument otherwise.
absl::StatusOr<BackupStore::Kind> ParseBackupStoreKind(absl::string_view text);
absl::string_view BackupStoreKindName(BackupStore::Kind kind);
// A store as a user would write it: "pinned", "pageable", "disk:<directory>" or
// "disk_files:<directory>".
std::string DescribeBackupStore(const BackupStore& store);
// OK, or InvalidArgument (a directory given for a host store, or none for disk) / NotFound
// (the directory does not exist or is not a directory; only with `directory_must_exist`:
// a store set ahead of its pauses, whose directory the pause that writes there checks).
absl::Status CheckBackupStore(const BackupStore& store, bool directory_must_exist = true);

class BackupArena {
 public:
  // `owner` names the arena in a refusal of the host budget ("the backup of tag 'kv' on
  // device 0"); `budget`: the account its host pages are charged to (Note [Host Budget]);
  // `leases`: where a pinned store leases its backups first (null: nowhere; Note
  // [Pool-Backed Backups]).
  BackupArena(Driver* driver, int device, BackupStore store, std::string owner = "a backup arena",
              HostBudget* budget = &HostBudget::Process(), std::shared_ptr<HostLeaseSource> leases = nullptr)
      : driver_(driver),
        device_(device),
        store_(std::move(store)),
        owner_(std::move(owner)),
        pinned_(driver, device),
        charge_(budget),
        ring_charge_(budget, HostUse::kStagingRing),
        leases_(store_.kind == BackupStore::Kind::kPinned ? std::move(leases) : nullptr) {}
  ~BackupArena();
  BackupArena(const BackupArena&) = delete;
  BackupArena& operator=(const BackupArena&) = delete;

  // Capacity >= size_bytes (rounded up to 2 MiB; a pinned arena's new memory is not
  // pinned yet: Pin). ResourceExhausted when the host (or the disk) refuses; NotFound for
  // a disk store whose directory is missing. A no-op for kDiskFiles (its files are made
  // per pause, by ReserveLayout).
  absl::Status Reserve(std::size_t size_bytes);
  // A pause's reservation: `piece_bytes` (BackupPieceBytes of its layout, page multiples
  // adding up to size_bytes) are the backed-up bytes of each block in arena order. For
  // kDiskFiles, one file per piece (Note [Disk Backup Files]), replacing any files the
  // arena had; for the other stores Reserve(size_bytes), and a pinned arena is charged for
  // those bytes and warms them (many threads), or, when part of it is pinned already,
  // leaves that to the pause's first CopyIn past the pinned part (WarmAheadWithin); the
  // CopyIns pin them, pipelined with the copies.
  absl::Status ReserveLayout(std::size_t size_bytes, const std::vector<std::size_t>& piece_bytes);
  absl::Status Release();
  // Pins [0, end) of a pinned arena now (a no-op for the other stores): what Prepare does
  // ahead of a pause. A background preparation pins in steps (PinnedPrefixBytes tells how
  // far it got), so that a pause waits for one step at most.
  absl::Status Pin(std::size_t end);
  // Faults in [0, end) of a pinned arena (a no-op for the other stores) without pinning it,
  // many threads at once, ending early once `stop` returns true: a background
  // preparation's first step, its Pin steps then only register (faulting in piece by piece
  // between the registrations runs at a third of the speed: Note [Pinned Pieces]).
  absl::Status Warm(std::size_t end, const std::function<bool()>& stop);
  std::size_t PinnedPrefixBytes() const;
  // Queue a copy from device `src` into [offset, offset + size_bytes) of the arena /
  // from there to device `dst` on `stream` (Note [Pinned Pieces]: pinned pieces, split
  // at their bounds; one driver copy for the other stores).
  absl::Status CopyIn(std::size_t offset, DevicePtr src, std::size_t size_bytes, Stream stream);
  absl::Status CopyOut(DevicePtr dst, std::size_t offset, std::size_t size_bytes, Stream stream);
  // A pinned arena's memory given back as DropContents(give_back=true) does, at most
  // `max_pinned_bytes` of pinned memory at a time (each unregistering waits for the
  // device's queued work: Note [Pinned Pieces]); *more: some is left. *more = false and
  // no-op for the other stores.
  absl::Status GiveBackSome(std::size_t max_pinned_bytes, bool* more);
  // After the pause's copies completed: the bytes still in a pageable or disk arena's
  // staging ring are moved into it (Note [Staging Ring]), then a disk arena is written
  // back and its pages dropped (Note [Disk Backup]); an error leaves the bytes in the
  // mapping. Then the ring is freed (Note [Host Budget]: a paused tag holds none; the
  // resume makes one again). No-op for a pinned arena.
  absl::Status Seal();
  // Before reading bytes [offset, offset + size_bytes) out of data() (a resume's copies, a
  // backup read): a disk arena reads those pages of its file in, so that a read error is
  // this error (DataLoss, naming the file) rather than a SIGBUS during the reads (Note
  // [Disk Backup]); on an error its contents stay in the file, none in memory. Only the
  // range is read (a prepared arena may be far larger than what a pause used).
  // InvalidArgument for a range outside the arena. No-op for the host stores.
  absl::Status Load(std::size_t offset, std::size_t size_bytes);
  // After a resume (and after a failed pause, once its copies were waited for): pageable
  // and disk arenas forget what their staging ring still held and give their pages back to
  // the OS (a pageable arena's contents are lost; a disk arena's stay in the file); a
  // disk-files arena is released, its files removed. A pinned arena keeps its
  // memory pinned, or with `give_back` unpins it and hands it back lazily (Note [Pinned
  // Pieces]; contents lost). Errors are logged.
  void DropContents(bool give_back = false);
  // After a resume's copies, whatever the retention: the staging ring of a pageable or
  // disk arena is freed and refunded (Note [Host Budget]: a ring lives for one transition
  // only). A free the driver refuses keeps it, charged (logged). No-op without a ring.
  void FreeRingAfterResume();
  // What the arena holds, as a pause found it (TagPool::ArenaForPause), so that a failed
  // pause gives back what it added (AfterFailedPause).
  struct Holding {
    std::size_t capacity_bytes = 0;
    std::size_t resident_bytes = 0;       // held_bytes()
    std::size_t pinned_prefix_bytes = 0;  // PinnedPrefixBytes()
    bool ring = false;                    // a staging ring
  };
  Holding holding() const;
  // After a failed pause (its copies waited for): DropContents(give_back), then what the
  // pause added to what the arena held `before` goes back, refunded (Note [Host Budget]):
  // a staging ring it made is freed; a pinned arena it warmed beyond what it held gives
  // all its memory back, and the pinned prefix it had is pinned again (not when the pause
  // replaced the arena: that one held nothing of it). Errors are logged (what could not
  // be given back stays charged).
  void AfterFailedPause(const Holding& before, bool give_back);
  // A pinned arena's warming and registering time since the last call (zeros otherwise).
  PinnedPieces::Timing TakePinTiming() { return pinned_.TakeTiming(); }
  // The files of a kDiskFiles arena (their paths), for tests and messages.
  std::vector<std::string> FilePaths() const;

  char* data() const {
    if (lease_.has_value()) return lease_->data;
    return store_.kind == BackupStore::Kind::kPinned ? pinned_.data() : static_cast<char*>(mapped_);
  }
  // A pinned store with a lease source (Note [Pool-Backed Backups]); leased(): it holds a
  // lease now (its memory is the lease's, not its own).
  bool pool_backed() const { return leases_ != nullptr && leases_->Enabled(); }
  bool leased() const { return lease_.has_value(); }
  std::size_t capacity_bytes() const { return capacity_bytes_; }
  // What the arena holds (its statistic): the capacity, less what a pinned arena gave
  // back or has not faulted in yet (Note [Pinned Pieces]); 0 for a pageable arena whose
  // pages went back after a resume.
  // Not counted: a pageable or disk arena's staging ring (staging_bytes()).
  std::size_t held_bytes() const {
    if (lease_.has_value()) return lease_->bytes;
    if (store_.kind == BackupStore::Kind::kPinned) return pinned_.resident_bytes();
    return store_.kind == BackupStore::Kind::kPageable && dropped_ ? 0 : capacity_bytes_;
  }
  // The pinned bytes of the arena's staging ring (0: none, e.g. refused by the budget).
  std::size_t staging_bytes() const { return ring_ == nullptr ? 0 : ring_->held_bytes(); }
  // What the arena and its ring hold charged to the host budget (Note [Host Budget]).
  std::size_t charged_bytes() const { return charge_.bytes() + ring_charge_.bytes(); }
  const BackupStore& store() const { return store_; }

 private:
  absl::Status ReserveDisk(std::size_t size_bytes);
  // Note [Pool-Backed Backups]: a lease of at least size_bytes held (an earlier one kept
  // when big enough), the own pinned memory released; false when the source refused
  // (logged), the arena as it was but for a lease too small, given back.
  bool TryLease(std::size_t size_bytes);
  void GiveLease();
  // A copy between the device and [offset, offset + size_bytes) of the lease, cut at its
  // segments.
  absl::Status LeasedCopy(bool to_host, std::size_t offset, DevicePtr device_ptr, std::size_t size_bytes,
                          Stream stream);
  // Release() but for the staging ring (Reserve replacing the memory keeps the ring).
  absl::Status ReleaseStore();
  // Frees the staging ring and refunds it; when the driver refuses, the ring stays, charged.
  absl::Status ReleaseRing();
  // Makes and charges the staging ring of a pageable or disk arena if it has none (Note
  // [Host Budget]); when the budget or the host refuses, the arena copies through the
  // driver directly (slower), and only the next pause (ReserveLayout) tries again. Logged.
  void TryRing();
  // Note [Host Budget] for the pinned store: charge what holding [0, end) needs / refund
  // down to what is resident.
  absl::Status ChargePinned(std::size_t end);
  void RefundPinned();
  absl::Status ReserveFiles(std::size_t size_bytes, const std::vector<std::size_t>& piece_bytes);
  // One more file of `size_bytes` at arena `offset`, named `prefix` + XXXXXX, mapped there.
  absl::Status AddFile(const std::string& prefix, std::size_t offset, std::size_t size_bytes);
  absl::Status ReleaseFiles();
  // "disk backup file '<path>' (unlinked)" or "disk backup files in '<directory>'".
  std::string FileWhat() const;
  // Load() without MADV_POPULATE_READ: reads [begin, end) of the arena from its file(s).
  absl::Status ReadFileThrough(std::size_t begin, std::size_t end);
  // Load()'s check that the file(s) holding [begin, end) still have their size.
  absl::Status CheckFileSizes(std::size_t begin, std::size_t end) const;
  // Gives the mapped pages back (pageable: the contents too; disk: they stay in the file);
  // false (errno set) when the kernel did not take them.
  bool DropPages();

  // One file of a kDiskFiles arena: its bytes are [offset, offset + size_bytes) of the arena.
  struct File {
    int fd = -1;
    std::string path;
    std::size_t offset = 0;
    std::size_t size_bytes = 0;
  };

  Driver* const driver_;
  const int device_;
  const BackupStore store_;
  const std::string owner_;
  PinnedPieces pinned_;
  HostCharge charge_;  // Note [Host Budget]
  std::unique_ptr<StagingRing> ring_;  // pageable and disk stores (Note [Staging Ring])
  bool ring_refused_ = false;          // TryRing failed since the last ReserveLayout
  HostCharge ring_charge_;             // what ring_ may pin
  const std::shared_ptr<HostLeaseSource> leases_;  // Note [Pool-Backed Backups]
  std::optional<HostLease> lease_;
  std::string last_refusal_;  // the source's last refusal (logged at warning level once)
  void* mapped_ = nullptr;  // pageable and disk stores
  int fd_ = -1;             // disk store
  std::string path_;        // disk store: the (unlinked) file's name, for messages
  std::vector<File> files_;  // disk-files store, in arena order
  std::size_t capacity_bytes_ = 0;
  bool dropped_ = false;  // pageable: DropContents gave the pages back since the last Reserve
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_BACKUP_ARENA_H_
