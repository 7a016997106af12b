// HostPoolLedger: which parts of the node's one pinned host pool each client process
// leases (the daemon's accounting; docs/node.md).
//
// What: a pure table over `capacity` bytes of the daemon's shared host memory, in units of
// kUnitBytes (2 MiB, the huge-page size: two leases never share a unit, so a lease given
// back frees whole units). Take(client, bytes, tag) leases the lowest free run that fits
// (first fit over the free runs ordered by offset); Give(client, offset) returns one, and
// only its holder may; GiveAll(client) returns everything a client held (its connection
// closed: it exited, or died). Free runs are merged with their neighbours at once, so the
// table never holds two adjacent free runs. The ledger holds no memory and does no I/O:
// what a lease's bytes are is the caller's (the daemon's memfd, mapped by each client).
//
// Invariants (Validate): the free runs and the leases tile [0, capacity) exactly, in
// units; no two free runs touch; leased_bytes equals the sum of the leases and never
// passed peak_bytes; every lease is listed under its client.
//
// Thread-safety: none; the daemon's loop is its one writer.
#ifndef VMSTASH_NODE_HOST_POOL_H_
#define VMSTASH_NODE_HOST_POOL_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace vmstash::node {

using ClientId = std::uint64_t;

struct PoolLease {
  ClientId client = 0;
  std::size_t offset = 0;  // into the pool, a multiple of kUnitBytes
  std::size_t bytes = 0;   // what was asked, rounded up to units
  std::string tag;         // the client's name for what it holds (reports only)
};

struct PoolStats {
  std::size_t capacity_bytes = 0;
  std::size_t leased_bytes = 0;
  std::size_t peak_bytes = 0;         // the most ever leased at once
  std::size_t largest_free_bytes = 0;
  std::size_t leases = 0;
  std::size_t clients = 0;            // clients holding at least one lease
  std::uint64_t refused = 0;          // Take calls the pool could not serve
};

class HostPoolLedger {
 public:
  static constexpr std::size_t kUnitBytes = std::size_t{2} << 20;

  // `capacity_bytes` is rounded down to units (0 units: every Take is refused).
  explicit HostPoolLedger(std::size_t capacity_bytes);

  // A lease of `bytes` (rounded up to units) for `client`. InvalidArgument for 0 bytes
  // or more than the capacity; ResourceExhausted when no free run fits (the message says
  // how much is free and the largest run), the table unchanged.
  absl::StatusOr<PoolLease> Take(ClientId client, std::size_t bytes, std::string tag);
  // Returns the lease at `offset`: NotFound when there is none, PermissionDenied when it
  // is another client's (the table unchanged either way).
  absl::Status Give(ClientId client, std::size_t offset);
  // Returns every lease of `client`; the bytes returned.
  std::size_t GiveAll(ClientId client);

  std::vector<PoolLease> LeasesOf(ClientId client) const;
  PoolStats stats() const;
  std::size_t capacity_bytes() const { return capacity_; }
  // Internal naming the first broken invariant (above).
  absl::Status Validate() const;

 private:
  void Free(std::size_t offset, std::size_t bytes);  // merges with its neighbours

  const std::size_t capacity_;
  std::map<std::size_t, std::size_t> free_;        // offset -> bytes
  std::map<std::size_t, PoolLease> leases_;        // offset -> lease
  std::map<ClientId, std::set<std::size_t>> by_client_;
  std::size_t leased_ = 0;
  std::size_t peak_ = 0;
  std::uint64_t refused_ = 0;
};

}  // namespace vmstash::node

#endif  // VMSTASH_NODE_HOST_POOL_H_
