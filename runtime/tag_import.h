// MappedTag: the importing process's side of a mapped tag (Note [Mapped Tags] in
// tag_share.h): another process's tag mapped read-write at addresses of this process,
// following that tag's pauses and resumes for as long as this object lives.
//
// Addresses: each of the exporter's reservations gets one reservation here of the same
// size; an exporter address A inside its reservation R is Local(A) = ours(R) + (A - R),
// the same across every pause and resume. The exporter's chunks are mapped there while
// granted; between a revoke and the next grant nothing is.
//
// Uses: Acquire() returns a Use while the memory is mapped, or, asked for, while the paused
// tag's backup is granted (FailedPrecondition naming the state otherwise); a revoke waits until
// every Use is destroyed, so the work a Use's holder queued on the memory must be
// complete when it lets go (it synchronizes its stream first). A watch thread serves the
// exporter's events.
//
// Backups: while the exporter's tag is paused with its backup in the node pool, the state
// is kBackup and WriteBackup copies device bytes of this process into the backup (through
// this process's mapping of the pool, `pool`'s Borrow: registered once per connection),
// so the exporter's resume restores them. Nothing is mapped on the device meanwhile.
//
// Thread-safety: every method may be called from any thread.
#ifndef VMSTASH_RUNTIME_TAG_IMPORT_H_
#define VMSTASH_RUNTIME_TAG_IMPORT_H_

#include <sys/types.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/host_lease.h"
#include "runtime/node_leases.h"
#include "runtime/tag_share.h"
#include "vmm/chunk.h"
#include "vmm/driver.h"
#include "vmm/mapping.h"
#include "vmm/reservation.h"

namespace vmstash::share {

struct MapOptions {
  std::string dir;         // empty: control::DefaultRuntimeDir()
  int timeout_ms = 10000;  // the exporter's first answer (a transition in progress delays it)
};

class MappedTag {
 public:
  // kBackup: paused, its backup granted (WriteBackup). The values are the C ABI's.
  enum class State { kMapped, kPaused, kGone, kBackup };

  // Maps tag `tag` of process `pid` on this process's `device` (the same GPU as the
  // exporter's). NotFound: no such process serving mapped tags, or it does not share the
  // tag; PermissionDenied under the trust rules; the exporter's refusal; the driver's
  // errors (nothing stays mapped or reserved). `driver` and `pool` (this process's side
  // of the node pool, for backup grants; may be null: none is taken) must outlive the
  // object.
  static absl::StatusOr<std::unique_ptr<MappedTag>> Map(Driver* driver, int device, pid_t pid, const std::string& tag,
                                                       MapOptions options = {}, NodeLeases* pool = nullptr);
  // Closes the connection (the exporter drops this importer), waits for the Uses, unmaps,
  // releases and frees everything.
  ~MappedTag();
  MappedTag(const MappedTag&) = delete;
  MappedTag& operator=(const MappedTag&) = delete;

  class Use {
   public:
    Use(Use&& other) noexcept : owner_(other.owner_) { other.owner_ = nullptr; }
    Use& operator=(Use&&) = delete;
    ~Use();

   private:
    friend class MappedTag;
    explicit Use(MappedTag* owner) : owner_(owner) {}
    MappedTag* owner_;
  };
  // What a Use holds, as it was acquired (a Use keeps it so: no grant or revoke meanwhile).
  struct UseInfo {
    State state = State::kMapped;   // kMapped, or kBackup
    std::uint64_t generation = 0;   // generation()
    std::uint64_t grants = 0;       // grants(): a caller that checked addresses under this
                                    // count need not check them again while it stays
  };
  // A Use while the memory is mapped — or, with `backup`, while the paused tag's backup is
  // granted (*info, when not null, says which) — FailedPrecondition saying whether the
  // exporter's tag is paused or the exporter is gone (or stopped sharing it), and why.
  absl::StatusOr<Use> Acquire(bool backup = false, UseInfo* info = nullptr);

  // Our address of the exporter's [remote, remote + size_bytes): InvalidArgument when it
  // lies in none of the exporter's reservations; FailedPrecondition when the tag is not
  // mapped now, or the range is not inside the chunks mapped now (the exporter freed or
  // re-created that memory, or grew since the grant: map again).
  absl::StatusOr<DevicePtr> Local(DevicePtr remote, std::size_t size_bytes) const;

  // Local for every range at once (one lock): out[i] for ranges[i]; the first failure.
  absl::Status LocalAll(const std::vector<ShareRange>& ranges, std::vector<DevicePtr>* out) const;
  // OK when every range (exporter addresses) lies inside the chunks mapped now
  // (FailedPrecondition as Local's for the first that does not, or when not mapped) and,
  // with `locals`, is at locals[i] here (what an earlier Local gave: FailedPrecondition
  // when the exporter's reservation there changed since, so our address did).
  absl::Status Covers(const std::vector<ShareRange>& ranges, const std::vector<DevicePtr>* locals = nullptr) const;

  // One copy into the backup: `size_bytes` of this process's device memory at `src` to the
  // exporter's bytes at `remote`.
  struct BackupWrite {
    DevicePtr remote = 0;
    DevicePtr src = 0;
    std::size_t size_bytes = 0;
  };
  // Queues `writes` on `stream` (device to host copies into the backup); the caller holds
  // a Use (Acquire(true)) until they are complete. Every write is checked before any is
  // queued: FailedPrecondition when the state is not kBackup (saying why), a revoke is
  // waiting, or a write lies outside what the pause backed up (not in one extent: freed,
  // or not live at the pause); the pool's Borrow error (no node pool here, another one)
  // at the first write of a grant (the span is registered then, outside mu_). A driver
  // error part-way leaves the copies queued before it: the backup then holds some of the
  // new bytes (write it again before the exporter resumes).
  absl::Status WriteBackup(const std::vector<BackupWrite>& writes, Stream stream);
  // Bytes of the backup granted now (0 when not kBackup).
  std::size_t backup_bytes() const;

  State state() const;
  // The generation of the exporter's last grant or "paused" (TagExporter::Share).
  std::uint64_t generation() const;
  // The exporter's chunks mapped now, by the exporter's addresses.
  std::vector<ShareRange> Mapped() const;
  // Uses in progress (Acquire's, not destroyed yet).
  int users() const;
  // fork() (Note [Fork] in process.h): the child closes its copy of the connection, so
  // that the exporter sees it close when this process ends; the child's copy of the
  // object is never used or destroyed.
  void CloseInForkedChild() { ::close(fd_); }
  std::uint64_t grants() const;
  std::uint64_t revokes() const;
  // The index file the exporter published for the tag (ShareIndexPath), as read when it
  // was mapped ("" when there was none).
  const std::string& index() const { return index_; }
  pid_t pid() const { return pid_; }
  const std::string& tag() const { return tag_; }
  int device() const { return device_; }

 private:
  struct Region {  // one of the exporter's reservations, and ours for it
    ShareRange remote;
    Reservation local;
  };
  struct Piece {
    ShareRange remote;
    Chunk chunk;
    Mapping mapping;  // destroyed first
  };
  struct Backup {  // a backup grant: where its bytes are in the pool, and which they are
    std::string pool;
    std::size_t span_offset = 0, span_bytes = 0;
    std::vector<BackupRange> extents;  // by address, not overlapping, inside the span
  };
  MappedTag(Driver* driver, int device, pid_t pid, std::string tag, int fd, NodeLeases* pool);
  void Watch();
  // A backup grant whose first packet is `head`: its extents read and checked.
  absl::Status TakeBackup(const ShareMessage& head);
  // A grant whose first packet is `grant`: its chunks read, imported and mapped; the
  // acknowledgement to send.
  absl::Status TakeGrant(const ShareMessage& grant);
  // Waits for the Uses and unmaps and releases every piece (state `next`, reason `why`).
  void Unmap(State next, const std::string& why);
  void Ack(const std::string& what, const absl::Status& status);
  // Local's check under mu_.
  absl::StatusOr<DevicePtr> LocalLocked(DevicePtr remote, std::size_t size_bytes) const;
  std::string Describe(State s) const;

  Driver* const driver_;
  NodeLeases* const pool_;
  const int device_;
  const pid_t pid_;
  const std::string tag_;
  const int fd_;
  std::string index_;  // set by Map, then read-only
  mutable std::mutex mu_;
  std::condition_variable idle_;  // users_ went to 0
  State state_ = State::kPaused;
  bool revoking_ = false;        // a revoke waits for the Uses: no new one
  int users_ = 0;
  std::string why_;              // why not mapped (for messages)
  std::uint64_t generation_ = 0;
  std::uint64_t grants_ = 0, revokes_ = 0;
  std::vector<Region> regions_;  // by remote address
  std::vector<Piece> pieces_;    // by remote address
  Backup backup_;                // kBackup's
  std::optional<HostLease> borrowed_;  // the backup's span, borrowed at its first write
  std::mutex borrow_mu_;               // one Borrow at a time (taken before mu_, never under it)
  std::thread thread_;
};

}  // namespace vmstash::share

#endif  // VMSTASH_RUNTIME_TAG_IMPORT_H_
