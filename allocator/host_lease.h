// HostLeaseSource: pinned host memory that a backup arena borrows from outside this
// process's own arenas — the node pool (node/, docs/node.md), which the runtime connects
// to (runtime/node_leases.h) — instead of pinning its own (docs/architecture.md §5).
//
// Note [Pool-Backed Backups]
//   Why: a process's own pinned arenas are either kept (the node's pinned memory is then
//   the sum of every process's backups) or handed back after each resume (the next pause
//   faults them in again: at ~45% of the link once another process took the host's free
//   memory). A node pool is pinned once and shared by the node's processes in turn, so a
//   pause runs at link speed and the node holds the largest phase's backups, not the sum.
//
//   A lease is `bytes` of host memory at `data`, already registered with the driver for
//   every device of the process (page-locked), in registrations that never span a
//   multiple of `segment_bytes` counted from `segment_base`: a copy (one driver call) must
//   not cross two registrations, so the arena cuts copies there.
//
//   The arena's rules (backup_arena.h, for the pinned store when its owner gave it a
//   source):
//     - A pause leases what its layout needs (ReserveLayout); a lease big enough from an
//       earlier pause is used again. When the source refuses (the pool is full, the daemon
//       is gone, a registration failed) the pause falls back to the arena's own pinned
//       memory and logs one line saying why: a pause never fails for want of the pool.
//     - The lease goes back to the source as soon as the tag's bytes are no longer needed:
//       after its resume (unless the tag keeps them readable: Note [Retained Backups]),
//       after a failed pause, and when the arena is released. So the pool holds paused
//       tags' backups only.
//     - No lease is taken ahead (TagBackup::ReserveForPrepare): a lease held by an active
//       tag would be the sum again. A preparation tells the source instead
//       (PrepareAhead), which may pin its memory ahead without leasing it.
//     - Leased bytes are the pool's, not this process's: they are not charged to the host
//       budget (Note [Host Budget]); the pool's own cap bounds them. They count in the
//       arena-bytes statistic while held.
//
// Thread-safety: a source's Take and Give may be called from any thread at once.
#ifndef VMSTASH_ALLOCATOR_HOST_LEASE_H_
#define VMSTASH_ALLOCATOR_HOST_LEASE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace vmstash {

struct HostLease {
  std::uint64_t id = 0;         // the source's name for it (Give)
  char* data = nullptr;
  std::size_t bytes = 0;        // at least what was asked
  char* segment_base = nullptr; // copies are cut at segment_base + k * segment_bytes
  std::size_t segment_bytes = 0;
};

class HostLeaseSource {
 public:
  virtual ~HostLeaseSource() = default;
  // Whether the process asked for this source (the runtime's `node` option, or a connect):
  // when not, arenas behave as if they had none — nothing tried, nothing logged, prepared
  // as usual. When it is, a Take may still fail (the daemon is gone): the fallback above.
  virtual bool Enabled() const = 0;
  // At least `bytes` of registered host memory for a backup on `device`; `owner` names it
  // ("tag 'kv' on device 0", shown in the pool's reports). Any error means no lease: the
  // caller uses its own memory.
  virtual absl::StatusOr<HostLease> Take(int device, std::size_t bytes, const std::string& owner) = 0;
  // Returns a lease; the caller has finished every copy that uses it. Never fails for the
  // caller (the source logs what it could not do).
  virtual void Give(const HostLease& lease) = 0;
  // "the node pool (<socket>)": names the source in the arena's log lines.
  virtual std::string Describe() const = 0;
  // A pool-backed tag of `device` grows (its background preparation, which takes no
  // lease): the source may ready itself ahead of the pauses (the node pool: node_pin, its
  // pages registered in the background). Never blocks; the default does nothing.
  virtual void PrepareAhead(int device) { (void)device; }
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_HOST_LEASE_H_
