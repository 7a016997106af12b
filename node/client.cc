// NodeClient: see client.h.
#include "node/client.h"

#include <pthread.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/json_reader.h"
#include "control/runtime_dir.h"
#include "node/wire.h"

namespace vmstash::node {
namespace {

constexpr const char* kGone =
    "the node daemon is gone (it exited or was killed): what this process leased stays mapped and usable here; new "
    "leases need a daemon started again (vmstash daemon start) and a new connection";

// The sockets of this process's connections. A forked child's copy of one would keep the
// connection open in the daemon after the parent closed it (its leases would stay leased
// while the child lives), so the child closes them at once. The fork handler takes no lock
// (the process runtime's own handlers take its lock, which a thread connecting here may
// hold: a lock here would make a cycle with them), and is registered while the library
// loads, never from a call: a table of atomic slots, a socket noted as soon as it is
// connected and forgotten just before it is closed (a fork between the two leaves that
// one socket to the child, which then keeps the connection until it exits or execs).
constexpr int kSocketSlots = 256;
std::atomic<int> socket_slots[kSocketSlots];

void CloseSocketsInChild() {
  for (std::atomic<int>& slot : socket_slots) {
    const int fd = slot.exchange(-1, std::memory_order_relaxed);
    if (fd >= 0) ::close(fd);
  }
}

[[maybe_unused]] const bool fork_handler_registered = [] {
  for (std::atomic<int>& slot : socket_slots) slot.store(-1, std::memory_order_relaxed);
  return ::pthread_atfork(nullptr, nullptr, &CloseSocketsInChild) == 0;
}();

void NoteSocket(int fd, bool live) {
  int want = live ? -1 : fd;
  for (std::atomic<int>& slot : socket_slots) {
    int expected = want;
    if (slot.compare_exchange_strong(expected, live ? fd : -1, std::memory_order_acq_rel)) return;
  }
  // More connections than slots (not what a process makes): the extra ones are not closed
  // in a forked child.
}

}  // namespace

absl::StatusOr<std::unique_ptr<NodeClient>> NodeClient::Connect(const ClientOptions& options) {
  absl::StatusOr<int> connected = ConnectTrusted(options.dir);
  if (!connected.ok()) {
    if (!absl::IsUnavailable(connected.status())) return connected.status();
    return absl::Status(connected.status().code(),
                        absl::StrCat(connected.status().message(), "; start one with `vmstash daemon start`"));
  }
  const int fd = *connected;
  NoteSocket(fd, true);
  const auto close_socket = [fd] {
    NoteSocket(fd, false);
    ::close(fd);
  };
  const std::string path = SocketPath(options.dir.empty() ? control::DefaultRuntimeDir() : options.dir);
  WireRequest hello;
  hello.op = WireOp::kHello;
  hello.pid = ::getpid();
  absl::Status sent = Send(fd, FormatRequest(hello));
  // A refusal (too many clients) may be waiting even when the send failed: read it.
  absl::StatusOr<Received> got = Receive(fd, sent.ok() ? options.timeout_ms : 0);
  if (!got.ok()) {
    close_socket();
    return absl::Status(got.status().code(), absl::StrCat("node: hello to ", path, ": ", got.status().message()));
  }
  absl::StatusOr<JsonValue> reply = ParseReply(got->message);
  if (!reply.ok() || got->fd < 0) {
    if (got->fd >= 0) ::close(got->fd);
    close_socket();
    return reply.ok() ? absl::InternalError("node: the daemon's hello carried no pool") : reply.status();
  }
  const std::size_t capacity = static_cast<std::size_t>((*reply)["capacity"].Int());
  absl::StatusOr<std::unique_ptr<SharedHostMemory>> memory = SharedHostMemory::Map(got->fd, capacity);
  if (!memory.ok()) {
    close_socket();
    return memory.status();
  }
  return std::unique_ptr<NodeClient>(new NodeClient(fd, static_cast<ClientId>((*reply)["client"].Int()),
                                                    std::move(*memory), options.timeout_ms));
}

NodeClient::~NodeClient() {
  if (::getpid() != owner_pid_) return;  // a forked child's copy: its socket was closed at the fork
  NoteSocket(fd_, false);
  ::close(fd_);
}

absl::StatusOr<JsonValue> NodeClient::Call(const std::string& request) {
  if (::getpid() != owner_pid_) {
    return absl::FailedPreconditionError("node: a forked child cannot use its parent's connection to the node daemon "
                                         "(the replies would go to either process); connect anew in the child");
  }
  MutexLock lock(&mu_);
  if (!broken_.ok()) return broken_;
  absl::Status sent = Send(fd_, request);
  absl::StatusOr<Received> got = sent.ok() ? Receive(fd_, timeout_ms_) : absl::StatusOr<Received>(sent);
  if (!got.ok()) {
    // No reply read: a later one could answer the wrong request, so this connection takes
    // no more. It stays open: the daemon keeps what this process leased.
    broken_ = absl::IsUnavailable(got.status())
                  ? absl::UnavailableError(kGone)
                  : absl::UnavailableError(absl::StrCat("node: this connection to the node daemon takes no more "
                                                        "requests (", got.status().message(), "); what this process "
                                                        "leased stays leased until it exits"));
    return broken_;
  }
  if (got->fd >= 0) ::close(got->fd);
  return ParseReply(got->message);
}

absl::StatusOr<HostLease> NodeClient::Lease(std::size_t bytes, const std::string& tag) {
  WireRequest r;
  r.op = WireOp::kLease;
  r.bytes = bytes;
  r.tag = tag;
  absl::StatusOr<JsonValue> reply = Call(FormatRequest(r));
  if (!reply.ok()) return reply.status();
  HostLease lease;
  lease.offset = static_cast<std::size_t>((*reply)["offset"].Int());
  lease.bytes = static_cast<std::size_t>((*reply)["bytes"].Int());
  if (lease.offset + lease.bytes > memory_->bytes() || lease.bytes < bytes) {
    return absl::InternalError(absl::StrCat("node: the daemon leased ", lease.bytes, " bytes at ", lease.offset,
                                            ", outside the pool of ", memory_->bytes()));
  }
  lease.data = memory_->data() + lease.offset;
  return lease;
}

absl::Status NodeClient::Give(const HostLease& lease) {
  WireRequest r;
  r.op = WireOp::kGive;
  r.offset = lease.offset;
  return Call(FormatRequest(r)).status();
}

absl::StatusOr<PoolStats> NodeClient::Stats() {
  WireRequest r;
  r.op = WireOp::kStats;
  absl::StatusOr<JsonValue> reply = Call(FormatRequest(r));
  if (!reply.ok()) return reply.status();
  PoolStats s;
  s.capacity_bytes = static_cast<std::size_t>((*reply)["capacity"].Int());
  s.leased_bytes = static_cast<std::size_t>((*reply)["leased"].Int());
  s.peak_bytes = static_cast<std::size_t>((*reply)["peak"].Int());
  s.largest_free_bytes = static_cast<std::size_t>((*reply)["largest_free"].Int());
  s.leases = static_cast<std::size_t>((*reply)["leases"].Int());
  s.clients = static_cast<std::size_t>((*reply)["clients"].Int());
  s.refused = static_cast<std::uint64_t>((*reply)["refused"].Int());
  return s;
}

}  // namespace vmstash::node
