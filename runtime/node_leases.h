// NodeLeases: this process's side of the node pool (docs/node.md) — the HostLeaseSource
// (allocator/host_lease.h, Note [Pool-Backed Backups]) every backup arena of the process
// leases from once the process asked for the pool: VMSTASH_CONF `node:1` (process.h) or
// a connect from the C ABI / Python (vmstash.node.connect).
//
// Note [Node Leases]
//   Connect(start): a connection to the daemon serving the runtime directory (node/
//   client.h), the daemon started first when none serves and `start` (node/launch.h,
//   with node_capacity or half of the host's memory). From then on the source is
//   enabled, and stays so (a later failure is a fallback, not a disable).
//   Take: a lease from the daemon, then the 64 MiB segments of this process's mapping of
//   the pool that the lease covers are registered with the driver (page-locked, for every
//   device: the driver registers portably), each once per connection and kept until the
//   connection is retired: the first pause into a segment pins it, every later one — of
//   this process's tags, whichever the lease — copies at link speed. Pages come into being
//   where they are first registered, never more than the pool's size.
//   Before registering, the fresh segments are faulted in by many threads (the
//   registration alone faults them in one by one).
//   node_pin: the whole pool is pinned ahead instead, on a background thread started by
//   the first PrepareAhead (a backup tag growing: its background preparation) — not at
//   connect, which would make a CUDA context on a device the process may never use —
//   segment by segment, each registered under mu_ (a Take meanwhile waits for one
//   segment at most, and registers what it needs itself if it comes first). The thread
//   pins the connection it started for (known by its generation, not its address), stops
//   when that one is retired or replaced (a later preparation starts one for the new
//   connection), and is joined at exit (StopPinning) and at teardown. Every process pinning the pool holds it all page-locked (the pages
//   are shared: once in memory), from its first growing backup tag on.
//   Failures are the arena's fallback (its own memory, logged there): no daemon (not
//   started, died), the pool full, a registration refused (the lease goes straight back).
//   A request waits kRequestTimeoutMs at most (the daemon answers at once; one that hangs,
//   e.g. stopped, costs that pause this much). A connection that fails (the daemon died or
//   stopped answering) is replaced at a later Take, tried again after kFirstRetry, doubling
//   up to kLastRetry while it keeps failing (vmstash.node.connect() tries at once); the
//   old one stays open (its mapping, its
//   registrations) until every lease taken through it is given back, then is retired:
//   its segments unregistered, its mapping dropped. Leases from a daemon that died stay
//   usable here (the pages are the mapping's): nothing is lost.
//   Give: the lease goes back to the daemon that gave it (when it is gone, nothing to do).
//   Locate / Borrow (mapped tags' backups: Note [Mapped Tags] in tag_share.h): Locate
//   names where a lease's bytes are in the pool (the pool's identity, an offset), for
//   another process; Borrow, in that process, registers those bytes' segments as Take
//   does and returns them as a lease of its own that the daemon never hears of (Give
//   only drops it): the connection, its mapping and its registrations stay while it is
//   held, whatever happens to the daemon meanwhile.
//   Teardown (the Runtime's, after its allocators, before its driver): every segment
//   unregistered, every connection closed.
//
// Thread-safety: every method may be called from any thread; one lock (mu_) serializes
// them, held across a request to the daemon (which answers at once, or within the
// client's timeout when it hangs) and across a registration.
#ifndef VMSTASH_RUNTIME_NODE_LEASES_H_
#define VMSTASH_RUNTIME_NODE_LEASES_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/host_lease.h"
#include "base/mutex.h"
#include "node/client.h"
#include "node/node_options.h"
#include "vmm/driver.h"

namespace vmstash {

class NodeLeases final : public HostLeaseSource {
 public:
  static constexpr std::size_t kSegmentBytes = std::size_t{64} << 20;
  // A failed connection is tried again at a later Take after kFirstRetry, doubling at each
  // failure up to kLastRetry (a daemon that hangs costs a pause kRequestTimeoutMs at most,
  // that often).
  static constexpr std::chrono::seconds kFirstRetry{5};
  static constexpr std::chrono::seconds kLastRetry{60};
  static constexpr int kRequestTimeoutMs = 2000;

  // `driver` outlives this object (the Runtime's).
  NodeLeases(Driver* driver, node::NodeOptions options);
  // The runtime directory of this process's node daemon (empty: the default).
  const std::string& dir() const { return options_.dir; }
  ~NodeLeases() override;
  NodeLeases(const NodeLeases&) = delete;
  NodeLeases& operator=(const NodeLeases&) = delete;

  // Note [Node Leases]. OK when connected already. The error (no daemon and `start` off,
  // no vmstashd, the trust rules) leaves the source as it was.
  absl::Status Connect(bool start) ABSL_LOCKS_EXCLUDED(mu_);

  absl::StatusOr<HostLease> Take(int device, std::size_t bytes, const std::string& owner) override
      ABSL_LOCKS_EXCLUDED(mu_);
  void Give(const HostLease& lease) override ABSL_LOCKS_EXCLUDED(mu_);
  // node_pin: starts pinning the current connection's pool in the background (once per
  // connection). Never blocks: its caller holds a device's lock, so when the source's lock
  // is busy (a Take registering, a request waiting) it does nothing, and a later
  // preparation tries again.
  void PrepareAhead(int device) override ABSL_LOCKS_EXCLUDED(mu_);
  // Stops node_pin's thread and waits for it (at exit: no background work while the
  // driver goes; Runtime::StopBackgroundWork). Later PrepareAhead calls do nothing.
  void StopPinning() ABSL_LOCKS_EXCLUDED(mu_);
  std::string Describe() const override;
  // Where `bytes` at `data` (inside a lease this process holds) are in the node pool.
  struct PoolPlace {
    std::string pool;        // node::NodeClient::pool_identity
    std::size_t offset = 0;  // in the pool
  };
  // NotFound when they are not in a pool this process maps.
  absl::StatusOr<PoolPlace> Locate(const char* data, std::size_t bytes) const ABSL_LOCKS_EXCLUDED(mu_);
  // [offset, offset + bytes) of pool `pool` (another process's Locate), registered for
  // `device`, as a lease to Give back (the daemon never hears of it). Connects first when
  // this process has no connection (without starting a daemon). Unavailable without a
  // daemon; FailedPrecondition when this process maps another pool (the daemon was started
  // again since); InvalidArgument for a range outside it; the registration's error.
  absl::StatusOr<HostLease> Borrow(const std::string& pool, std::size_t offset, std::size_t bytes, int device)
      ABSL_LOCKS_EXCLUDED(mu_);
  bool Enabled() const override { return enabled_.load(std::memory_order_acquire); }

  // What this process sees: the pool's stats from the daemon (Unavailable without one),
  // and its own leases.
  struct Report {
    node::PoolStats pool;
    std::string socket;
    std::size_t leases = 0;         // held by this process
    std::size_t leased_bytes = 0;
    std::size_t registered_bytes = 0;  // of the pool, in this process (current connection)
    bool pinning = false;           // node_pin's thread is running
    std::uint64_t fallbacks = 0;    // Takes refused
  };
  absl::StatusOr<Report> Stats() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Connection {
    std::uint64_t generation = 0;  // unique per connection (never reused, unlike its address)
    std::unique_ptr<node::NodeClient> client;
    std::vector<int> registered;  // per segment: the device it was registered through, or -1
    std::size_t outstanding = 0;  // leases taken through it and not given back
    bool broken = false;
  };
  struct Held {
    Connection* connection = nullptr;
    node::HostLease lease;
    bool borrowed = false;  // Borrow's: the daemon never heard of it
  };

  // A usable connection (the current one, or a new one when it is missing or broken and
  // the retry time has come); Unavailable naming why not.
  absl::StatusOr<Connection*> UsableLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status RegisterLocked(Connection* c, int device, std::size_t offset, std::size_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // node_pin's thread: pins the segments of connection `generation` on `device` in order,
  // while it is the current one (Note [Node Leases]).
  void PinAhead(std::uint64_t generation, int device) ABSL_LOCKS_EXCLUDED(mu_);
  // The current connection when it is `generation` and usable, else null.
  Connection* CurrentLocked(std::uint64_t generation) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new connection's bookkeeping around `client`, made the current one.
  Connection* AddLocked(std::unique_ptr<node::NodeClient> client) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A connection attempt or a request failed: why, and when to try again (backoff).
  void FailedLocked(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Retires every broken connection no lease is held through.
  void SweepLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Unregisters a connection's segments and drops it (no lease of it is held).
  void RetireLocked(Connection* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string SocketPathOf() const;

  Driver* const driver_;
  const node::NodeOptions options_;
  std::atomic<bool> enabled_{false};
  mutable Mutex mu_;
  std::vector<std::unique_ptr<Connection>> connections_ ABSL_GUARDED_BY(mu_);  // back(): the current one
  std::map<std::uint64_t, Held> held_ ABSL_GUARDED_BY(mu_);
  std::uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::uint64_t fallbacks_ ABSL_GUARDED_BY(mu_) = 0;
  std::chrono::steady_clock::time_point retry_at_ ABSL_GUARDED_BY(mu_){};
  std::chrono::seconds retry_delay_ ABSL_GUARDED_BY(mu_){0};
  std::string last_error_ ABSL_GUARDED_BY(mu_);
  std::uint64_t next_generation_ ABSL_GUARDED_BY(mu_) = 1;
  std::uint64_t pinned_generation_ ABSL_GUARDED_BY(mu_) = 0;  // the connection the pinner was started for
  std::atomic<bool> pin_running_{false};
  std::atomic<bool> stop_pinning_{false};
  std::thread pinner_ ABSL_GUARDED_BY(mu_);  // joined by StopPinning, or before the next one starts
};

}  // namespace vmstash

#endif  // VMSTASH_RUNTIME_NODE_LEASES_H_
