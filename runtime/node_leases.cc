// This process's side of the node pool: see node_leases.h, Note [Node Leases].
#include "runtime/node_leases.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/bytes.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "control/runtime_dir.h"
#include "node/launch.h"
#include "node/wire.h"

namespace vmstash {

NodeLeases::NodeLeases(Driver* driver, node::NodeOptions options) : driver_(driver), options_(std::move(options)) {}

NodeLeases::~NodeLeases() {
  MutexLock lock(&mu_);
  if (!held_.empty()) {
    VMSTASH_LOG(kError, "vmstash: the node pool's source torn down with {} lease(s) held; they go back with the "
                "connection", held_.size());
  }
  held_.clear();
  while (!connections_.empty()) RetireLocked(connections_.front().get());
}

std::string NodeLeases::SocketPathOf() const {
  return node::SocketPath(options_.dir.empty() ? control::DefaultRuntimeDir() : options_.dir);
}

std::string NodeLeases::Describe() const { return absl::StrCat("the node pool (", SocketPathOf(), ")"); }

absl::Status NodeLeases::Connect(bool start) {
  MutexLock lock(&mu_);
  if (!connections_.empty() && !connections_.back()->broken) {
    enabled_.store(true, std::memory_order_release);
    return absl::OkStatus();
  }
  const std::string dir = options_.dir.empty() ? control::DefaultRuntimeDir() : options_.dir;
  if (start) {
    const std::size_t capacity =
        options_.capacity_bytes > 0 ? options_.capacity_bytes : node::DefaultCapacityBytes();
    VMSTASH_ASSIGN_OR_RETURN(node::Started started, node::StartDaemon(dir, capacity));
    if (!started.already) {
      VMSTASH_LOG(kInfo, "vmstash: started the node daemon (pid {}) with a pool of {} on {}", started.pid,
                  HumanBytes(capacity), node::SocketPath(dir));
    }
  }
  VMSTASH_ASSIGN_OR_RETURN(std::unique_ptr<node::NodeClient> client, node::NodeClient::Connect({dir}));
  auto c = std::make_unique<Connection>();
  c->registered.assign((client->pool_bytes() + kSegmentBytes - 1) / kSegmentBytes, -1);
  c->client = std::move(client);
  VMSTASH_LOG(kInfo, "vmstash: backups go to the node pool ({} on {})", HumanBytes(c->client->pool_bytes()),
              node::SocketPath(dir));
  connections_.push_back(std::move(c));
  last_error_.clear();
  enabled_.store(true, std::memory_order_release);
  return absl::OkStatus();
}

absl::StatusOr<NodeLeases::Connection*> NodeLeases::UsableLocked() {
  if (!connections_.empty() && !connections_.back()->broken) return connections_.back().get();
  for (std::size_t i = connections_.size(); i-- > 0;) {  // broken ones nobody holds a lease of
    if (connections_[i]->broken && connections_[i]->outstanding == 0) RetireLocked(connections_[i].get());
  }
  const auto now = std::chrono::steady_clock::now();
  if (now < retry_at_) {
    return absl::UnavailableError(absl::StrCat("no node daemon on ", SocketPathOf(), " (", last_error_,
                                               "); trying again within ", kRetrySeconds, " s"));
  }
  const std::string dir = options_.dir.empty() ? control::DefaultRuntimeDir() : options_.dir;
  absl::StatusOr<std::unique_ptr<node::NodeClient>> client = node::NodeClient::Connect({dir});
  if (!client.ok()) {
    retry_at_ = now + std::chrono::seconds(kRetrySeconds);
    last_error_ = std::string(client.status().message());
    return absl::UnavailableError(absl::StrCat("no node daemon on ", SocketPathOf(), ": ", last_error_));
  }
  auto c = std::make_unique<Connection>();
  c->registered.assign(((*client)->pool_bytes() + kSegmentBytes - 1) / kSegmentBytes, -1);
  c->client = *std::move(client);
  VMSTASH_LOG(kWarning, "vmstash: connected to the node daemon again on {} (a pool of {})", SocketPathOf(),
              HumanBytes(c->client->pool_bytes()));
  connections_.push_back(std::move(c));
  return connections_.back().get();
}

absl::Status NodeLeases::RegisterLocked(Connection* c, int device, std::size_t offset, std::size_t bytes) {
  const std::size_t pool = c->client->pool_bytes();
  for (std::size_t k = offset / kSegmentBytes; k * kSegmentBytes < offset + bytes; ++k) {
    if (c->registered[k] >= 0) continue;
    const std::size_t begin = k * kSegmentBytes;
    const std::size_t size = std::min(kSegmentBytes, pool - begin);
    VMSTASH_RETURN_IF_ERROR(driver_->HostRegister(device, c->client->pool_data() + begin, size));
    c->registered[k] = device;
  }
  return absl::OkStatus();
}

absl::StatusOr<HostLease> NodeLeases::Take(int device, std::size_t bytes, const std::string& owner) {
  MutexLock lock(&mu_);
  absl::StatusOr<Connection*> usable = UsableLocked();
  if (!usable.ok()) {
    ++fallbacks_;
    return usable.status();
  }
  Connection* c = *usable;
  absl::StatusOr<node::HostLease> got = c->client->Lease(bytes, owner);
  if (!got.ok()) {
    ++fallbacks_;
    if (absl::IsUnavailable(got.status())) {  // gone or not answering: replaced at a later Take
      c->broken = true;
      retry_at_ = std::chrono::steady_clock::now() + std::chrono::seconds(kRetrySeconds);
      last_error_ = std::string(got.status().message());
      if (c->outstanding == 0) RetireLocked(c);
    }
    return got.status();
  }
  if (absl::Status registered = RegisterLocked(c, device, got->offset, got->bytes); !registered.ok()) {
    ++fallbacks_;
    if (absl::Status back = c->client->Give(*got); !back.ok()) {
      VMSTASH_LOG(kWarning, "vmstash: giving back a node pool lease it could not register: {}", back.ToString());
    }
    return absl::Status(registered.code(), absl::StrCat("registering the node pool's memory: ", registered.message()));
  }
  const std::uint64_t id = next_id_++;
  held_[id] = Held{c, *got};
  ++c->outstanding;
  return HostLease{id, got->data, got->bytes, c->client->pool_data(), kSegmentBytes};
}

void NodeLeases::Give(const HostLease& lease) {
  MutexLock lock(&mu_);
  auto it = held_.find(lease.id);
  if (it == held_.end()) {
    VMSTASH_LOG(kError, "vmstash: a node pool lease ({} bytes) given back twice or never taken", lease.bytes);
    return;
  }
  Connection* c = it->second.connection;
  const node::HostLease held = it->second.lease;
  held_.erase(it);
  --c->outstanding;
  if (!c->broken) {
    absl::Status s = c->client->Give(held);
    if (absl::IsUnavailable(s)) {
      c->broken = true;  // the daemon took it back with the connection, or is gone
    } else if (!s.ok()) {
      VMSTASH_LOG(kWarning, "vmstash: giving a node pool lease back: {}", s.ToString());
    }
  }
  if (c->broken && c->outstanding == 0) RetireLocked(c);
}

void NodeLeases::RetireLocked(Connection* c) {
  for (std::size_t k = 0; k < c->registered.size(); ++k) {
    if (c->registered[k] < 0) continue;
    if (absl::Status s = driver_->HostUnregister(c->registered[k], c->client->pool_data() + k * kSegmentBytes);
        !s.ok()) {
      VMSTASH_LOG(kError, "vmstash: unregistering the node pool's memory: {}", s.ToString());
    }
    c->registered[k] = -1;
  }
  connections_.erase(std::remove_if(connections_.begin(), connections_.end(),
                                    [c](const std::unique_ptr<Connection>& p) { return p.get() == c; }),
                     connections_.end());
}

absl::StatusOr<NodeLeases::Report> NodeLeases::Stats() {
  MutexLock lock(&mu_);
  Report report;
  report.socket = SocketPathOf();
  report.fallbacks = fallbacks_;
  for (const auto& [id, held] : held_) {
    ++report.leases;
    report.leased_bytes += held.lease.bytes;
  }
  if (connections_.empty() || connections_.back()->broken) {
    return absl::UnavailableError(absl::StrCat("not connected to a node daemon on ", report.socket,
                                               last_error_.empty() ? "" : absl::StrCat(" (", last_error_, ")")));
  }
  Connection* c = connections_.back().get();
  for (std::size_t k = 0; k < c->registered.size(); ++k) {
    if (c->registered[k] >= 0) report.registered_bytes += std::min(kSegmentBytes, c->client->pool_bytes() - k * kSegmentBytes);
  }
  absl::StatusOr<node::PoolStats> pool = c->client->Stats();
  if (!pool.ok()) {
    if (absl::IsUnavailable(pool.status())) c->broken = true;
    return pool.status();
  }
  report.pool = *pool;
  return report;
}

}  // namespace vmstash
