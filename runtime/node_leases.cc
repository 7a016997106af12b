// This process's side of the node pool: see node_leases.h, Note [Node Leases].
#include "runtime/node_leases.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/bytes.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "control/runtime_dir.h"
#include "node/launch.h"
#include "node/wire.h"

namespace vmstash {
namespace {

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older headers lack it
#endif

// Faults in `count` ranges (range(i) -> {address, bytes}) writable, 8 MiB at a time, with up
// to 16 threads; contents kept. Best effort: a kernel without MADV_POPULATE_WRITE, or a
// refusal, leaves the pages to the registration (which faults them in itself, or fails).
template <typename Range>
void PopulateInParallel(std::size_t count, const Range& range) {
  constexpr std::size_t kUnit = std::size_t{8} << 20;
  std::vector<std::pair<char*, std::size_t>> units;
  for (std::size_t i = 0; i < count; ++i) {
    const auto [at, size] = range(i);
    madvise(at, size, MADV_HUGEPAGE);  // shmem THP, where the host allows it ("advise")
    for (std::size_t off = 0; off < size; off += kUnit) units.emplace_back(at + off, std::min(kUnit, size - off));
  }
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const std::size_t threads = std::min<std::size_t>({16, hw, units.size()});
  std::atomic<std::size_t> next{0};
  std::atomic<bool> refused{false};
  auto work = [&] {
    for (std::size_t u; !refused.load(std::memory_order_relaxed) && (u = next.fetch_add(1)) < units.size();) {
      if (madvise(units[u].first, units[u].second, MADV_POPULATE_WRITE) != 0) refused.store(true);
    }
  };
  std::vector<std::thread> pool;
  for (std::size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
}

}  // namespace

NodeLeases::NodeLeases(Driver* driver, node::NodeOptions options) : driver_(driver), options_(std::move(options)) {}

NodeLeases::~NodeLeases() {
  StopPinning();
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
  SweepLocked();
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
  VMSTASH_ASSIGN_OR_RETURN(std::unique_ptr<node::NodeClient> client,
                           node::NodeClient::Connect({dir, kRequestTimeoutMs}));
  Connection* c = AddLocked(std::move(client));
  VMSTASH_LOG(kInfo, "vmstash: backups go to the node pool ({} on {})", HumanBytes(c->client->pool_bytes()),
              node::SocketPath(dir));
  last_error_.clear();
  retry_delay_ = std::chrono::seconds(0);
  enabled_.store(true, std::memory_order_release);
  return absl::OkStatus();
}

absl::StatusOr<NodeLeases::Connection*> NodeLeases::UsableLocked() {
  SweepLocked();
  if (!connections_.empty() && !connections_.back()->broken) return connections_.back().get();
  const auto now = std::chrono::steady_clock::now();
  if (now < retry_at_) {
    return absl::UnavailableError(absl::StrCat(
        "no node daemon on ", SocketPathOf(), " (", last_error_, "); trying again in ",
        std::chrono::duration_cast<std::chrono::seconds>(retry_at_ - now).count() + 1, " s"));
  }
  const std::string dir = options_.dir.empty() ? control::DefaultRuntimeDir() : options_.dir;
  absl::StatusOr<std::unique_ptr<node::NodeClient>> client = node::NodeClient::Connect({dir, kRequestTimeoutMs});
  if (!client.ok()) {
    FailedLocked(client.status());
    return absl::UnavailableError(absl::StrCat("no node daemon on ", SocketPathOf(), ": ", last_error_));
  }
  retry_delay_ = std::chrono::seconds(0);
  Connection* c = AddLocked(*std::move(client));
  if (c->generation > 1) {
    VMSTASH_LOG(kWarning, "vmstash: connected to the node daemon again on {} (a pool of {})", SocketPathOf(),
                HumanBytes(c->client->pool_bytes()));
  } else {  // a first connection made for a Borrow (another process's backup)
    VMSTASH_LOG(kInfo, "vmstash: connected to the node daemon on {} (a pool of {})", SocketPathOf(),
                HumanBytes(c->client->pool_bytes()));
  }
  return c;
}

void NodeLeases::FailedLocked(const absl::Status& why) {
  last_error_ = std::string(why.message());
  retry_delay_ = std::min<std::chrono::seconds>(std::max<std::chrono::seconds>(2 * retry_delay_, kFirstRetry),
                                                 kLastRetry);
  retry_at_ = std::chrono::steady_clock::now() + retry_delay_;
}

absl::Status NodeLeases::RegisterLocked(Connection* c, int device, std::size_t offset, std::size_t bytes) {
  const std::size_t pool = c->client->pool_bytes();
  std::vector<std::size_t> fresh;  // segments this connection has not registered yet
  for (std::size_t k = offset / kSegmentBytes; k * kSegmentBytes < offset + bytes; ++k) {
    if (c->registered[k] < 0) fresh.push_back(k);
  }
  if (fresh.empty()) return absl::OkStatus();
  // Faulted in by many threads first (registering faults pages in one by one on one thread:
  // 1.6 GB/s for a fresh 8 GiB on an H200 machine), then registered; contents untouched
  // (another process's lease may share a segment).
  const auto segment = [&](std::size_t i) {
    const std::size_t begin = fresh[i] * kSegmentBytes;
    return std::make_pair(c->client->pool_data() + begin, std::min(kSegmentBytes, pool - begin));
  };
  PopulateInParallel(fresh.size(), segment);
  for (std::size_t i = 0; i < fresh.size(); ++i) {
    const auto [at, size] = segment(i);
    VMSTASH_RETURN_IF_ERROR(driver_->HostRegister(device, at, size));
    c->registered[fresh[i]] = device;
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
      FailedLocked(got.status());
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
  const bool borrowed = it->second.borrowed;
  held_.erase(it);
  --c->outstanding;
  if (!c->broken && !borrowed) {
    absl::Status s = c->client->Give(held);
    if (absl::IsUnavailable(s)) {
      c->broken = true;  // the daemon took it back with the connection, or is gone
      FailedLocked(s);
    } else if (!s.ok()) {
      VMSTASH_LOG(kWarning, "vmstash: giving a node pool lease back: {}", s.ToString());
    }
  }
  if (c->broken && c->outstanding == 0) RetireLocked(c);
}

absl::StatusOr<NodeLeases::PoolPlace> NodeLeases::Locate(const char* data, std::size_t bytes) const {
  MutexLock lock(&mu_);
  for (const std::unique_ptr<Connection>& c : connections_) {
    const char* base = c->client->pool_data();
    if (data >= base && bytes <= c->client->pool_bytes() &&
        static_cast<std::size_t>(data - base) <= c->client->pool_bytes() - bytes) {
      return PoolPlace{c->client->pool_identity(), static_cast<std::size_t>(data - base)};
    }
  }
  return absl::NotFoundError("those bytes are not in the node pool (the process's own backup memory)");
}

absl::StatusOr<HostLease> NodeLeases::Borrow(const std::string& pool, std::size_t offset, std::size_t bytes,
                                             int device) {
  MutexLock lock(&mu_);
  Connection* c = nullptr;
  for (const std::unique_ptr<Connection>& k : connections_) {
    if (k->client->pool_identity() == pool) c = k.get();
  }
  if (c == nullptr) {
    absl::StatusOr<Connection*> usable = UsableLocked();
    if (usable.ok() && (*usable)->client->pool_identity() != pool) {
      // Another pool: ours may be a dead daemon's that nothing has asked anything of yet
      // (the other process's, a daemon started again). Asked now, and replaced when dead.
      absl::StatusOr<node::PoolStats> alive = (*usable)->client->Stats();
      if (absl::IsUnavailable(alive.status())) {
        (*usable)->broken = true;
        usable = UsableLocked();
      }
    }
    if (!usable.ok()) {
      return absl::Status(usable.status().code(),
                          absl::StrCat("this process reaches no node pool: ", usable.status().message()));
    }
    if ((*usable)->client->pool_identity() != pool) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the other process's backup is in another node pool than the one this process maps (", pool, " vs ",
          (*usable)->client->pool_identity(), "): the node daemon was started again in between"));
    }
    c = *usable;
  }
  if (bytes == 0 || bytes > c->client->pool_bytes() || offset > c->client->pool_bytes() - bytes) {
    return absl::InvalidArgumentError(absl::StrCat("bytes [", offset, ", +", bytes, ") are outside the node pool of ",
                                                   c->client->pool_bytes(), " bytes"));
  }
  if (absl::Status s = RegisterLocked(c, device, offset, bytes); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("registering the node pool's memory: ", s.message()));
  }
  const std::uint64_t id = next_id_++;
  held_[id] = Held{c, node::HostLease{offset, bytes, c->client->pool_data() + offset}, /*borrowed=*/true};
  ++c->outstanding;
  return HostLease{id, c->client->pool_data() + offset, bytes, c->client->pool_data(), kSegmentBytes};
}

void NodeLeases::PrepareAhead(int device) {
  if (!options_.pin_ahead || pin_running_.load() || stop_pinning_.load()) return;
  if (!mu_.TryLock()) return;  // busy: a later preparation tries again (the caller holds a device lock)
  if (!connections_.empty() && !connections_.back()->broken &&
      connections_.back()->generation != pinned_generation_ && !stop_pinning_.load()) {
    if (pinner_.joinable()) pinner_.join();  // done (pin_running_ is false): its last step is its log line
    pinned_generation_ = connections_.back()->generation;
    pin_running_.store(true);
    pinner_ = std::thread([this, generation = pinned_generation_, device] { PinAhead(generation, device); });
  }
  mu_.Unlock();
}

void NodeLeases::StopPinning() {
  stop_pinning_.store(true);
  std::thread pinner;
  {
    MutexLock lock(&mu_);
    pinner = std::move(pinner_);
  }
  if (pinner.joinable()) pinner.join();
}

NodeLeases::Connection* NodeLeases::CurrentLocked(std::uint64_t generation) {
  if (connections_.empty()) return nullptr;
  Connection* c = connections_.back().get();
  return c->generation == generation && !c->broken ? c : nullptr;
}

void NodeLeases::PinAhead(std::uint64_t generation, int device) {
  const auto start = std::chrono::steady_clock::now();
  std::size_t pinned = 0;
  absl::Status failed;
  for (std::size_t k = 0; !stop_pinning_.load(); ++k) {
    // One segment at a time under the lock (a Take waits for one at most): faulted in by
    // many threads, then registered. Under the lock, the connection cannot be retired
    // meanwhile, and nothing else of the process is touched.
    MutexLock lock(&mu_);
    Connection* c = CurrentLocked(generation);
    if (c == nullptr || k >= c->registered.size()) break;
    if (c->registered[k] >= 0) continue;
    char* at = c->client->pool_data() + k * kSegmentBytes;
    const std::size_t size = std::min(kSegmentBytes, c->client->pool_bytes() - k * kSegmentBytes);
    PopulateInParallel(1, [&](std::size_t) { return std::make_pair(at, size); });
    if (absl::Status s = driver_->HostRegister(device, at, size); !s.ok()) {
      failed = s;
      break;
    }
    c->registered[k] = device;
    pinned += size;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (failed.ok()) {
    VMSTASH_LOG(kInfo, "vmstash: node_pin: pinned {} of the node pool ahead in {:.1f} s", HumanBytes(pinned), seconds);
  } else {
    VMSTASH_LOG(kWarning, "vmstash: node_pin: pinning the node pool ahead stopped after {}: {}; later pauses pin "
                "what they lease", HumanBytes(pinned), failed.ToString());
  }
  pin_running_.store(false);
}

NodeLeases::Connection* NodeLeases::AddLocked(std::unique_ptr<node::NodeClient> client) {
  auto c = std::make_unique<Connection>();
  c->generation = next_generation_++;
  c->registered.assign((client->pool_bytes() + kSegmentBytes - 1) / kSegmentBytes, -1);
  c->client = std::move(client);
  connections_.push_back(std::move(c));
  return connections_.back().get();
}

void NodeLeases::SweepLocked() {
  for (std::size_t i = connections_.size(); i-- > 0;) {  // broken ones nobody holds a lease of
    if (connections_[i]->broken && connections_[i]->outstanding == 0) RetireLocked(connections_[i].get());
  }
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
  SweepLocked();
  Report report;
  report.socket = SocketPathOf();
  report.fallbacks = fallbacks_;
  report.pinning = pin_running_.load();
  for (const auto& [id, held] : held_) {
    if (held.borrowed) continue;  // another process's lease
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
    if (absl::IsUnavailable(pool.status())) {
      c->broken = true;
      FailedLocked(pool.status());
      SweepLocked();
    }
    return pool.status();
  }
  report.pool = *pool;
  return report;
}

}  // namespace vmstash
