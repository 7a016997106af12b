// NodeClient: a process's connection to the node daemon (daemon.h; docs/node.md): the
// node pool mapped into this process, and leases of it.
//
// Connect: to `<runtime dir>/vmstashd.sock` (control/runtime_dir.h's trust rules: the
// directory ours and closed to others, the daemon running as our uid), hello, then the
// pool's memfd mapped here MAP_SHARED: every client sees the same pages. Lease returns
// where the leased bytes are in this process (data() + offset), Give returns them.
// A daemon that died (Note [Node Daemon Lifecycle]): Lease, Give and Stats fail
// Unavailable saying so; the mapping stays, and what was leased stays usable here; a new
// NodeClient connects to a daemon started again. A request whose reply cannot be read (a
// timeout, a transport error) leaves the connection taking no more requests (Unavailable),
// open, so that the daemon keeps what was leased. Destroying the client closes the
// connection: the daemon takes back every lease, so the caller stops using them first. A
// forked child cannot use its parent's client (FailedPrecondition); it connects anew. The
// child's copy of the socket is closed at the fork (pthread_atfork), so the parent's
// connection ends when the parent closes it, and the pool's mapping is not inherited
// (MADV_DONTFORK).
//
// Thread-safety: every method may be called from any thread (one request at a time).
#ifndef VMSTASH_NODE_CLIENT_H_
#define VMSTASH_NODE_CLIENT_H_

#include <sys/types.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/json_reader.h"
#include "base/mutex.h"
#include "node/host_pool.h"
#include "node/shared_memory.h"

namespace vmstash::node {

struct ClientOptions {
  std::string dir;            // empty: control::DefaultRuntimeDir()
  int timeout_ms = 5000;      // per request (the daemon answers at once)
};

struct HostLease {
  std::size_t offset = 0;     // in the pool
  std::size_t bytes = 0;      // rounded up to the ledger's unit
  char* data = nullptr;       // where they are in this process
};

class NodeClient {
 public:
  // Unavailable when no daemon serves the directory; PermissionDenied under the trust rules.
  static absl::StatusOr<std::unique_ptr<NodeClient>> Connect(const ClientOptions& options = ClientOptions());
  ~NodeClient();  // closes the connection: the daemon takes back what is still leased
  NodeClient(const NodeClient&) = delete;
  NodeClient& operator=(const NodeClient&) = delete;

  absl::StatusOr<HostLease> Lease(std::size_t bytes, const std::string& tag) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Give(const HostLease& lease) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<PoolStats> Stats() ABSL_LOCKS_EXCLUDED(mu_);

  ClientId id() const { return id_; }
  char* pool_data() const { return memory_->data(); }
  std::size_t pool_bytes() const { return memory_->bytes(); }
  const std::string& pool_identity() const { return memory_->identity(); }

 private:
  NodeClient(int fd, ClientId id, std::unique_ptr<SharedHostMemory> memory, int timeout_ms)
      : fd_(fd), id_(id), memory_(std::move(memory)), timeout_ms_(timeout_ms), owner_pid_(::getpid()) {}
  // One request and its reply document (the daemon's error as a status).
  absl::StatusOr<JsonValue> Call(const std::string& request) ABSL_LOCKS_EXCLUDED(mu_);

  const int fd_;
  const ClientId id_;
  const std::unique_ptr<SharedHostMemory> memory_;
  const int timeout_ms_;
  const pid_t owner_pid_;
  Mutex mu_;  // one request at a time on the connection
  absl::Status broken_ ABSL_GUARDED_BY(mu_);  // why it takes no more requests (OK: it does)
};

}  // namespace vmstash::node

#endif  // VMSTASH_NODE_CLIENT_H_
