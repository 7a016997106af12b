// NodeDaemon: see daemon.h (Note [Node Daemon Lifecycle]).
#include "node/daemon.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/chunk_fit.h"
#include "base/json_writer.h"
#include "base/log.h"
#include "control/runtime_dir.h"
#include "node/decision_record.h"

namespace vmstash::node {
namespace {

// The lock that makes a daemon the directory's one (held while it lives; the kernel lets
// go of it when the process ends, however it ends): its fd, or AlreadyExists.
absl::StatusOr<int> TakeDaemonLock(const std::string& dir, const std::string& socket_path) {
  const std::string path = absl::StrCat(dir, "/vmstashd.lock");
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return control::Errno(absl::StrCat("vmstashd: open ", path), errno);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK) return absl::AlreadyExistsError(absl::StrCat("vmstashd: a daemon already serves ", socket_path));
    return control::Errno(absl::StrCat("vmstashd: flock ", path), err);
  }
  return fd;
}

constexpr std::uint64_t kMaxSwitchTimeoutMs = std::uint64_t{24} * 3600 * 1000;
// A forgotten switch's record stays this long (a reader that asks late still finds it).
constexpr std::int64_t kRecordLingerMs = 60000;
// Without pidfds, watched participants are checked this often.
constexpr int kExitCheckMs = 200;

std::int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool Alive(pid_t pid) { return ::kill(pid, 0) == 0 || errno == EPERM; }

// A pidfd for `pid` (readable once it exits), -1 where the kernel has none (then Alive is
// polled), or -2 when the process is gone already.
int OpenPidfd(pid_t pid) {
#ifdef SYS_pidfd_open
  const long fd = ::syscall(SYS_pidfd_open, pid, 0);
  if (fd >= 0) {
    ::fcntl(static_cast<int>(fd), F_SETFD, FD_CLOEXEC);
    return static_cast<int>(fd);
  }
  if (errno == ESRCH) return -2;
#endif
  return Alive(pid) ? -1 : -2;
}

std::string OkReply(const std::function<void(JsonWriter&)>& fields) {
  JsonWriter w;
  w.BeginObject();
  w.Field("v", kWireVersion);
  w.Field("ok", true);
  fields(w);
  w.EndObject();
  return w.str();
}

}  // namespace

absl::StatusOr<std::unique_ptr<NodeDaemon>> NodeDaemon::Start(DaemonOptions options) {
  if (options.dir.empty()) options.dir = control::DefaultRuntimeDir();
  if (options.capacity_bytes < HostPoolLedger::kUnitBytes) {
    return absl::InvalidArgumentError(absl::StrCat("vmstashd: a pool of ", options.capacity_bytes,
                                                   " bytes holds no lease (the unit is ",
                                                   HostPoolLedger::kUnitBytes, " bytes)"));
  }
  if (options.max_clients < 1) return absl::InvalidArgumentError("vmstashd: max_clients < 1");
  if (!options.peer_allowed) {
    const uid_t me = ::getuid();
    options.peer_allowed = [me](uid_t uid) { return uid == me; };
  }
  if (absl::Status s = control::EnsurePrivateDir(options.dir); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("vmstashd: refusing the runtime directory: ", s.message()));
  }
  const std::string path = SocketPath(options.dir);
  if (path.size() >= sizeof(sockaddr_un{}.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("vmstashd: socket path too long: ", path));
  }
  absl::StatusOr<int> lock = TakeDaemonLock(options.dir, path);
  if (!lock.ok()) return lock.status();
  ::unlink(path.c_str());  // a dead daemon's socket
  absl::StatusOr<std::unique_ptr<SharedHostMemory>> memory = SharedHostMemory::Create(
      options.capacity_bytes / HostPoolLedger::kUnitBytes * HostPoolLedger::kUnitBytes);
  const int fd = memory.ok() ? ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0) : -1;
  absl::Status failed = memory.status();
  int wake[2] = {-1, -1};
  if (failed.ok() && fd < 0) failed = control::Errno("vmstashd: socket", errno);
  if (failed.ok()) {
    sockaddr_un addr = control::UnixAddress(path);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::chmod(path.c_str(), 0600) != 0 ||
        ::listen(fd, 64) != 0) {
      failed = control::Errno(absl::StrCat("vmstashd: listen on ", path), errno);
    } else if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) {
      failed = control::Errno("vmstashd: pipe", errno);
    }
  }
  // A descriptor kept spare: when accept fails for want of descriptors, it is let go to
  // take the pending connection and close it (Accept), rather than spin on it.
  const int spare = failed.ok() ? ::open("/dev/null", O_RDONLY | O_CLOEXEC) : -1;
  if (failed.ok() && spare < 0) failed = control::Errno("vmstashd: open /dev/null", errno);
  if (!failed.ok()) {
    if (fd >= 0) ::close(fd);
    ::unlink(path.c_str());
    ::close(*lock);
    return failed;
  }
  const int swept = SweepDecisions(options.dir);
  if (swept > 0) VMSTASH_LOG(kInfo, "vmstashd: removed {} switch records of processes all gone", swept);
  std::unique_ptr<NodeDaemon> d(
      new NodeDaemon(std::move(options), std::move(*memory), fd, wake, path, *lock, spare));
  d->thread_ = std::thread([raw = d.get()] { raw->Loop(); });
  return d;
}

NodeDaemon::NodeDaemon(DaemonOptions options, std::unique_ptr<SharedHostMemory> memory, int listen_fd, int wake[2],
                       std::string path, int lock_fd, int spare_fd)
    : options_(std::move(options)),
      memory_(std::move(memory)),
      listen_fd_(listen_fd),
      wake_read_(wake[0]),
      wake_write_(wake[1]),
      path_(std::move(path)),
      lock_fd_(lock_fd),
      spare_fd_(spare_fd),
      owner_pid_(::getpid()),
      ledger_(memory_->bytes()) {}

NodeDaemon::~NodeDaemon() {
  Stop();
  if (::getpid() != owner_pid_ && thread_.joinable()) thread_.detach();  // a forked child's copy
  ::close(wake_read_);
  ::close(wake_write_);
  ::close(listen_fd_);
  if (spare_fd_ >= 0) ::close(spare_fd_);
  ::close(lock_fd_);  // after the socket is gone: the next daemon may start
}

void NodeDaemon::Stop() {
  if (stopping_.exchange(true)) return;
  if (::getpid() != owner_pid_) return;  // a forked child's copy: the thread, the socket and the lock are the parent's
  const char b = 1;
  (void)!::write(wake_write_, &b, 1);
  if (thread_.joinable()) thread_.join();
  MutexLock lock(&mu_);
  for (auto& [fd, client] : clients_) {
    ledger_.GiveAll(client.id);
    ::close(fd);
  }
  clients_.clear();
  for (auto& [pid, fd] : pidfds_) {
    if (fd >= 0) ::close(fd);
  }
  pidfds_.clear();
  while (!held_.empty()) DropOffers(held_.begin()->first);
  while (!granted_.empty()) DropOffers(granted_.begin()->first);
  ::unlink(path_.c_str());
}

PoolStats NodeDaemon::stats() const {
  MutexLock lock(&mu_);
  return ledger_.stats();
}

std::size_t NodeDaemon::connected() const {
  MutexLock lock(&mu_);
  return clients_.size();
}

void NodeDaemon::Loop() {
  std::vector<pollfd> fds;
  std::size_t first_pidfd = 0;
  std::vector<pid_t> polled;    // the pids of the pidfds polled, in their order in fds
  std::vector<pid_t> readable;  // those the last poll found readable (the process exited)
  while (!stopping_.load()) {
    fds.clear();
    fds.push_back({wake_read_, POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    int timeout_ms = -1;
    {
      MutexLock lock(&mu_);
      Tend(readable);
      for (const auto& [fd, client] : clients_) fds.push_back({fd, POLLIN, 0});
      first_pidfd = fds.size();
      polled.clear();
      for (const auto& [pid, fd] : pidfds_) {
        if (fd < 0) continue;
        fds.push_back({fd, POLLIN, 0});
        polled.push_back(pid);
      }
      timeout_ms = PollTimeoutMs();
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      VMSTASH_LOG(kError, "vmstashd: poll: {}", std::strerror(errno));
      continue;
    }
    if (fds[0].revents != 0) break;
    readable.clear();
    for (std::size_t i = first_pidfd; i < fds.size(); ++i) {
      if (fds[i].revents != 0) readable.push_back(polled[i - first_pidfd]);
    }
    if (fds[1].revents != 0) Accept();
    for (std::size_t i = 2; i < first_pidfd; ++i) {
      if (fds[i].revents == 0) continue;
      const int fd = fds[i].fd;
      absl::StatusOr<Received> got = Receive(fd, 0, kMaxFdsPerPacket);
      if (!got.ok() && !absl::IsDeadlineExceeded(got.status()) && !absl::IsInvalidArgument(got.status())) {
        Drop(fd);  // closed: the client exited or died
        continue;
      }
      if (!got.ok() && absl::IsDeadlineExceeded(got.status())) continue;
      absl::Status bad = got.status();
      std::vector<int> received;
      if (got.ok()) received.swap(got->fds);
      std::optional<Reply> reply;
      bool refused = false;
      {
        MutexLock lock(&mu_);
        auto c = clients_.find(fd);
        if (c == clients_.end()) {
          for (int f : received) ::close(f);
          continue;
        }
        if (!c->second.waiting.empty()) {
          refused = true;  // a request while its vote waits: the replies could no longer be told apart
          bad = absl::FailedPreconditionError("node protocol: a request sent while a vote waits for its decision");
        }
        if (!c->second.refused.ok()) bad = c->second.refused;
        if (bad.ok()) {
          reply = Handle(c->second, got->message, received);
        } else {
          reply = Reply{FormatError(bad), {}, false};
        }
        for (int f : received) ::close(f);  // those no offer kept
        refused = refused || !c->second.refused.ok();
      }
      if (!reply.has_value()) continue;  // a vote: answered when its switch is decided
      // A full send buffer (the client does not read its replies) or a closed peer: dropped.
      absl::Status s = SendFds(fd, reply->text, reply->fds);
      if (reply->owned) {
        for (int f : reply->fds) ::close(f);
      }
      if (!s.ok() || refused) Drop(fd);
    }
  }
}

void NodeDaemon::Accept() {
  for (;;) {
    // Non-blocking: a client that does not read its replies is dropped (Loop), it never
    // holds up the serving thread.
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      const int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR) return;
      if ((err == EMFILE || err == ENFILE) && spare_fd_ >= 0) {  // out of descriptors: refuse the pending one
        ::close(spare_fd_);
        const int pending = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (pending >= 0) ::close(pending);
        spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
      }
      if (!said_accept_error_) {
        said_accept_error_ = true;
        VMSTASH_LOG(kWarning, "vmstashd: accept: {} (a connection refused; said once)", std::strerror(err));
      }
      if (err != EMFILE && err != ENFILE) return;
      continue;
    }
    absl::StatusOr<control::Peer> peer = control::PeerOf(fd);
    const std::size_t now = connected();
    absl::Status refused;
    if (!peer.ok()) {
      refused = peer.status();
    } else if (!options_.peer_allowed(peer->uid)) {
      refused = absl::PermissionDeniedError(absl::StrCat("uid ", peer->uid, " may not use this user's node daemon"));
    } else if (now >= 2 * static_cast<std::size_t>(options_.max_clients)) {
      refused = absl::ResourceExhaustedError(absl::StrCat("vmstashd serves ", options_.max_clients,
                                                          " clients already"));
    }
    if (!refused.ok()) {  // closed at once (another uid, or far over the limit)
      (void)Send(fd, FormatError(refused));
      ::close(fd);
      continue;
    }
    // Over the limit: its first request (hello) is read, then refused with the reason and
    // the connection closed. (Closed before its hello was read, the client would see a
    // reset instead of the reason.)
    MutexLock lock(&mu_);
    Client client{0, false, peer->pid};
    if (now >= static_cast<std::size_t>(options_.max_clients)) {
      client.refused = absl::ResourceExhaustedError(absl::StrCat("vmstashd serves ", options_.max_clients,
                                                                 " clients already"));
    }
    clients_[fd] = std::move(client);
  }
}

std::optional<NodeDaemon::Reply> NodeDaemon::Handle(Client& client, const std::string& message,
                                                    std::vector<int>& received) {
  auto text = [](std::string t) { return Reply{std::move(t), {}, false}; };
  absl::StatusOr<WireRequest> r = ParseRequest(message);
  if (!r.ok()) {
    if (absl::IsFailedPrecondition(r.status())) AbortForOtherVersion(client, message);
    return text(FormatError(r.status()));
  }
  if (!received.empty() && r->op != WireOp::kOffer) {
    return text(FormatError(absl::InvalidArgumentError("node protocol: only an offer passes descriptors")));
  }
  switch (r->op) {  // a node switch's requests need no hello
    case WireOp::kBegin: return text(Begin(client, *r));
    case WireOp::kVote: {
      std::optional<std::string> t = Vote(client, *r);
      if (!t.has_value()) return std::nullopt;
      return text(std::move(*t));
    }
    case WireOp::kOutcome: return text(Outcome(client, *r));
    case WireOp::kOffer: return text(Offer(client, *r, received));
    case WireOp::kTake: return Take(client, *r);
    case WireOp::kSettled: return text(Settled(client, *r));
    default: break;
  }
  if ((r->op == WireOp::kHello) == client.said_hello) {
    return text(FormatError(absl::FailedPreconditionError(client.said_hello ? "hello was said already"
                                                                            : "say hello first")));
  }
  switch (r->op) {
    case WireOp::kHello: {
      client.said_hello = true;
      client.id = next_client_++;
      return Reply{OkReply([&](JsonWriter& w) {
                     w.Field("client", static_cast<std::uint64_t>(client.id));
                     w.Field("capacity", static_cast<std::uint64_t>(memory_->bytes()));
                   }),
                   {memory_->fd()},
                   false};
    }
    case WireOp::kLease: {
      absl::StatusOr<PoolLease> lease = ledger_.Take(client.id, r->bytes, r->tag);
      if (!lease.ok()) return text(FormatError(lease.status()));
      return text(OkReply([&](JsonWriter& w) {
        w.Field("offset", static_cast<std::uint64_t>(lease->offset));
        w.Field("bytes", static_cast<std::uint64_t>(lease->bytes));
      }));
    }
    case WireOp::kGive: {
      absl::Status s = ledger_.Give(client.id, r->offset);
      return text(s.ok() ? OkReply([](JsonWriter&) {}) : FormatError(s));
    }
    case WireOp::kStats: {
      const PoolStats s = ledger_.stats();
      const std::size_t connected = clients_.size();
      return text(OkReply([&](JsonWriter& w) {
        w.Field("capacity", static_cast<std::uint64_t>(s.capacity_bytes));
        w.Field("leased", static_cast<std::uint64_t>(s.leased_bytes));
        w.Field("peak", static_cast<std::uint64_t>(s.peak_bytes));
        w.Field("largest_free", static_cast<std::uint64_t>(s.largest_free_bytes));
        w.Field("leases", static_cast<std::uint64_t>(s.leases));
        w.Field("clients", static_cast<std::uint64_t>(s.clients));
        w.Field("refused", static_cast<std::uint64_t>(s.refused));
        w.Field("connected", static_cast<std::uint64_t>(connected));
      }));
    }
    case WireOp::kBegin:
    case WireOp::kVote:
    case WireOp::kOutcome:
    case WireOp::kOffer:
    case WireOp::kTake:
    case WireOp::kSettled:
      break;
  }
  return text(FormatError(absl::InternalError("unhandled op")));
}

namespace {

std::string DecisionReply(const SwitchDecision& d) {
  return OkReply([&](JsonWriter& w) {
    w.Field("decision", d.commit ? "commit" : "abort");
    w.Field("reason", d.reason);
  });
}

}  // namespace

std::string NodeDaemon::Begin(const Client& client, const WireRequest& r) {
  if (r.timeout_ms == 0 || r.timeout_ms > kMaxSwitchTimeoutMs) {
    return FormatError(absl::InvalidArgumentError(
        absl::StrCat("node switch: timeout_ms ", r.timeout_ms, " (1 to ", kMaxSwitchTimeoutMs, ")")));
  }
  std::vector<pid_t> pids, donors;
  for (absl::string_view p : absl::StrSplit(r.pids, ',')) {
    int pid = 0;
    if (!absl::SimpleAtoi(p, &pid) || pid <= 0) {
      return FormatError(absl::InvalidArgumentError(absl::StrCat("node switch: \"", p, "\" is not a pid")));
    }
    if (!Alive(pid)) return FormatError(absl::NotFoundError(absl::StrCat("node switch: no process ", pid)));
    pids.push_back(pid);
  }
  for (absl::string_view p : absl::StrSplit(r.donors, ',', absl::SkipEmpty())) {
    int pid = 0;
    if (!absl::SimpleAtoi(p, &pid) || std::find(pids.begin(), pids.end(), pid) == pids.end()) {
      return FormatError(absl::InvalidArgumentError(
          absl::StrCat("node switch: donor \"", p, "\" is not one of the participants ", r.pids)));
    }
    donors.push_back(pid);
  }
  absl::StatusOr<std::string> id = NewSwitchId();
  absl::Status s = id.ok() ? switches_.Begin(*id, pids, NowMs() + static_cast<std::int64_t>(r.timeout_ms),
                                             client.pid, donors)
                           : id.status();
  if (!s.ok()) return FormatError(s);
  VMSTASH_LOG(kDebug, "vmstashd: node switch {} of processes {} begun", *id, r.pids);
  return OkReply([&](JsonWriter& w) { w.Field("txn", *id); });
}

void NodeDaemon::AbortForOtherVersion(const Client& client, const std::string& message) {
  absl::StatusOr<JsonValue> doc = JsonValue::Parse(message);
  if (!doc.ok() || !doc->is_object() || (*doc)["op"].String() != "vote") return;
  const std::string txn = (*doc)["txn"].String();
  const std::string theirs = (*doc)["v"].type() == JsonValue::Type::kNumber
                                 ? absl::StrCat("version ", (*doc)["v"].Int())
                                 : "without a version";
  // Its own vote only (the connection's pid), and only in a switch it takes part in.
  absl::StatusOr<std::optional<SwitchDecision>> d = switches_.Vote(
      txn, client.pid, false,
      absl::StrCat("it speaks node protocol ", theirs, ", the node daemon version ", kWireVersion,
                   " (another vmstash release)"));
  if (d.ok() && d->has_value()) Decide(txn);
}

std::optional<std::string> NodeDaemon::Vote(Client& client, const WireRequest& r) {
  if (r.pid != client.pid) {
    return FormatError(absl::PermissionDeniedError(
        absl::StrCat("node switch: process ", client.pid, " may vote for itself only, not for ", r.pid)));
  }
  // A vote that comes after the deadline (the serving thread was held up) finds the switch
  // aborted: no commit is recorded past the deadline, which the participants' own
  // deadlines (later by kVoteGraceMs) rely on.
  for (const std::string& id : switches_.Expire(NowMs())) Decide(id);
  absl::StatusOr<std::optional<SwitchDecision>> d =
      switches_.Vote(r.txn, static_cast<pid_t>(r.pid), r.ok, r.reason);
  if (!d.ok()) {
    if (!absl::IsNotFound(d.status())) return FormatError(d.status());
    return Outcome(client, r);  // begun by a daemon that is gone: its record, or abort
  }
  if (!d->has_value()) {  // undecided: the reply waits
    client.waiting = r.txn;
    return std::nullopt;
  }
  // Decided now (this was the last vote, or a failure) or before (a late vote).
  const SwitchDecision decided = Decide(r.txn);
  switches_.Told(r.txn, static_cast<pid_t>(r.pid));
  return DecisionReply(decided);
}

std::string NodeDaemon::Outcome(const Client& client, const WireRequest& r) {
  if (!IsSwitchId(r.txn)) {
    return FormatError(absl::InvalidArgumentError(absl::StrCat("node switch: \"", r.txn, "\" is not a switch id")));
  }
  absl::StatusOr<std::optional<SwitchDecision>> known = switches_.Decision(r.txn);
  if (known.ok()) {
    if (!known->has_value()) return OkReply([](JsonWriter& w) { w.Field("decision", "pending"); });
    const SwitchDecision d = **known;
    switches_.Told(r.txn, client.pid, /*observer=*/true) || switches_.Told(r.txn, client.pid);
    return DecisionReply(d);
  }
  // Not ours: begun by a daemon that died. Its record stands; with none, it never decided
  // (a decision is recorded before anyone is told), and no one can decide it now but us.
  absl::StatusOr<SwitchDecision> recorded = RecordDecision(
      options_.dir, r.txn, {},
      SwitchDecision{false, absl::StrCat("the node daemon that began switch ", r.txn, " is gone and had not decided")});
  if (!recorded.ok()) return FormatError(recorded.status());
  return DecisionReply(*recorded);
}

std::size_t NodeDaemon::HeldCap() {
  // Room is left for connections (votes, clients) and the daemon's own files.
  constexpr std::size_t kReserve = 512;
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) != 0 || files.rlim_cur == RLIM_INFINITY) return kMaxHeldChunks;
  const std::size_t limit = static_cast<std::size_t>(files.rlim_cur);
  return std::min(kMaxHeldChunks, limit > 2 * kReserve ? limit - kReserve : limit / 4);
}

std::string NodeDaemon::Offer(const Client& client, const WireRequest& r, std::vector<int>& fds) {
  if (r.pid != client.pid) {
    return FormatError(absl::PermissionDeniedError(
        absl::StrCat("node switch: process ", client.pid, " may offer its own chunks only, not those of ", r.pid)));
  }
  absl::StatusOr<std::vector<std::size_t>> sizes = ParseSizes(r.sizes);
  if (!sizes.ok()) return FormatError(sizes.status());
  if (sizes->size() != fds.size()) {
    return FormatError(absl::InvalidArgumentError(
        absl::StrCat("node switch: an offer of ", sizes->size(), " sizes came with ", fds.size(), " descriptors")));
  }
  absl::StatusOr<std::vector<ChunkUse>> uses = ParseUses(r.uses, sizes->size());
  if (!uses.ok()) return FormatError(uses.status());
  const bool writable = std::any_of(uses->begin(), uses->end(), [](const ChunkUse& u) { return u.anywhere; });
  if (absl::Status s = switches_.Offered(r.txn, static_cast<pid_t>(r.pid), r.last, writable); !s.ok()) {
    return FormatError(s);
  }
  std::size_t kept = 0;
  for (std::size_t i = 0; i < fds.size() && held_count_ < HeldCap(); ++i, ++kept, ++held_count_) {
    held_[r.txn].push_back(HeldChunk{static_cast<pid_t>(r.pid), r.device, (*sizes)[i], fds[i], (*uses)[i]});
    fds[i] = -1;
  }
  fds.erase(std::remove(fds.begin(), fds.end(), -1), fds.end());  // the rest: closed by the caller
  return OkReply([&](JsonWriter& w) { w.Field("kept", static_cast<std::uint64_t>(kept)); });
}

NodeDaemon::Reply NodeDaemon::Take(const Client& client, const WireRequest& r) {
  if (r.pid != client.pid) {
    return Reply{FormatError(absl::PermissionDeniedError(absl::StrCat(
                     "node switch: process ", client.pid, " may take chunks for itself only, not for ", r.pid))),
                 {}, false};
  }
  // A part offers before it takes, if at all: nothing more comes from this one (so two
  // parts named donors that offer nothing never wait for each other).
  (void)switches_.Offered(r.txn, static_cast<pid_t>(r.pid), true);
  absl::StatusOr<bool> in = switches_.OffersIn(r.txn, static_cast<pid_t>(r.pid));
  if (!in.ok()) return Reply{FormatError(in.status()), {}, false};
  if (!*in) return Reply{OkReply([](JsonWriter& w) { w.Field("ready", false); }), {}, false};
  // The fit is made once per taker (first come, first served): the held chunks of the
  // device from other processes that fit its gaps become its own; the rest stay for the
  // others. Later takes of the same part collect what one packet could not carry.
  std::vector<HeldChunk>* mine = GrantOnce(r);
  Reply reply;
  reply.owned = true;
  std::vector<std::string> sizes;
  std::vector<ChunkUse> uses;
  bool more = false;
  if (mine != nullptr) {
    const std::size_t n = std::min(mine->size(), kMaxFdsPerPacket);
    for (std::size_t i = 0; i < n; ++i) {
      reply.fds.push_back((*mine)[i].fd);
      sizes.push_back(absl::StrCat((*mine)[i].size_bytes));
      uses.push_back((*mine)[i].use);
    }
    mine->erase(mine->begin(), mine->begin() + static_cast<std::ptrdiff_t>(n));
    held_count_ -= n;
    more = !mine->empty();
  }
  reply.text = OkReply([&](JsonWriter& w) {
    w.Field("ready", true);
    w.Field("sizes", absl::StrJoin(sizes, ","));
    w.Field("uses", FormatUses(uses));
    w.Field("more", more);
  });
  return reply;
}

std::string NodeDaemon::Settled(const Client& client, const WireRequest& r) {
  if (r.pid != client.pid) {
    return FormatError(absl::PermissionDeniedError(
        absl::StrCat("node switch: process ", client.pid, " may ask for itself only, not for ", r.pid)));
  }
  absl::StatusOr<SwitchLedger::Settlement> s = switches_.Unsettled(r.txn, static_cast<pid_t>(r.pid));
  if (absl::IsNotFound(s.status())) {
    Linger();
    if (std::any_of(lingering_.begin(), lingering_.end(), [&](const auto& l) { return l.second == r.txn; })) {
      s = SwitchLedger::Settlement{{}, true};
    }
  }
  if (!s.ok()) return FormatError(s.status());
  return OkReply([&](JsonWriter& w) {
    w.Field("settled", s->settled);
    w.Field("waiting", absl::StrJoin(s->waiting, ","));
  });
}

std::vector<NodeDaemon::HeldChunk>* NodeDaemon::GrantOnce(const WireRequest& r) {
  const pid_t pid = static_cast<pid_t>(r.pid);
  const Taker taker{pid, r.device};
  if (auto g = granted_.find(r.txn); g != granted_.end()) {
    if (auto mine = g->second.find(taker); mine != g->second.end()) return &mine->second;
  }
  // Nothing held (none offered, all given, or the switch decided) or no gap: nothing to
  // grant, and no entry is made (none that no decision would remove, none that would keep
  // a later take with gaps from its grant).
  auto held = held_.find(r.txn);
  if (held == held_.end() || r.gaps.empty()) return nullptr;
  std::vector<HeldChunk>& chunks = held->second;
  std::vector<std::size_t> candidates;  // indexes into `chunks`
  std::vector<FitChunk> sizes;
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    if (chunks[i].pid == pid || chunks[i].device != r.device) continue;
    candidates.push_back(i);
    sizes.push_back({chunks[i].size_bytes, chunks[i].use.anywhere});
  }
  const ChunkFit fit = FitChunks(sizes, r.gaps);
  std::vector<bool> taken(chunks.size(), false);
  for (std::size_t g = 0; g < fit.placed.size(); ++g) {
    for (int c : fit.placed[g]) {
      HeldChunk& chunk = chunks[candidates[c]];
      if (r.gaps[g].strict) {
        // Restore copies may write it: its giver's rollback waits for this taker, which is
        // noted on disk first (a giver whose daemon dies reads it there); unnoted, it is
        // not given.
        if (absl::Status s = RecordTaker(options_.dir, r.txn, chunk.pid, pid); !s.ok()) {
          VMSTASH_LOG(kWarning, "vmstashd: node switch {}: a chunk is kept from a restore gap ({})", r.txn,
                      s.message());
          continue;
        }
        (void)switches_.Took(r.txn, pid, chunk.pid);
      } else {
        // Placed where no restore copy writes, it goes out as such: the taker fits what it
        // gets again (an import or an event may fail there), and must never move into a
        // restore gap a chunk whose giver is not noted as waiting for it.
        chunk.use = ChunkUse{};
      }
      taken[candidates[c]] = true;
    }
  }
  std::vector<HeldChunk>& granted = granted_[r.txn][taker];
  std::vector<HeldChunk> kept;
  for (std::size_t i = 0; i < chunks.size(); ++i) (taken[i] ? granted : kept).push_back(chunks[i]);
  chunks.swap(kept);
  if (chunks.empty()) held_.erase(held);
  return &granted;
}

void NodeDaemon::DropOffers(const std::string& id) {
  if (auto held = held_.find(id); held != held_.end()) {
    for (const HeldChunk& c : held->second) ::close(c.fd);
    held_count_ -= held->second.size();
    held_.erase(held);
  }
  if (auto granted = granted_.find(id); granted != granted_.end()) {
    for (const auto& [taker, chunks] : granted->second) {
      for (const HeldChunk& c : chunks) ::close(c.fd);
      held_count_ -= chunks.size();
    }
    granted_.erase(granted);
  }
}

SwitchDecision NodeDaemon::Decide(const std::string& id) {
  absl::StatusOr<std::optional<SwitchDecision>> d = switches_.Decision(id);
  if (!d.ok() || !d->has_value()) return SwitchDecision{false, "node switch: no decision"};
  SwitchDecision decided = **d;
  absl::StatusOr<SwitchDecision> recorded = RecordDecision(options_.dir, id, switches_.Participants(id), decided);
  if (!recorded.ok()) {
    // Unrecorded, a commit could not be learned by a participant that loses contact: abort
    // (what they presume when no record is found).
    VMSTASH_LOG(kError, "vmstashd: node switch {}: {}; aborting it", id, recorded.status().message());
    decided = SwitchDecision{false, absl::StrCat("the node daemon could not record its decision: ",
                                                 recorded.status().message())};
  } else {
    decided = *recorded;
  }
  switches_.Settle(id, decided);
  DropOffers(id);
  VMSTASH_LOG(kInfo, "vmstashd: node switch {}: {}{}", id, decided.commit ? "commit" : "abort: ", decided.reason);
  for (auto& [fd, client] : clients_) {
    if (client.waiting != id) continue;
    client.waiting.clear();
    if (Send(fd, DecisionReply(decided)).ok()) switches_.Told(id, client.pid);
  }
  return decided;
}

void NodeDaemon::Tend(const std::vector<pid_t>& readable) {
  // Exits of the watched participants.
  std::vector<pid_t> watched = switches_.Watched();
  for (auto it = pidfds_.begin(); it != pidfds_.end();) {
    if (std::find(watched.begin(), watched.end(), it->first) == watched.end()) {
      if (it->second >= 0) ::close(it->second);
      it = pidfds_.erase(it);
    } else {
      ++it;
    }
  }
  std::vector<pid_t> exited;
  for (pid_t pid : watched) {
    auto it = pidfds_.find(pid);
    if (it == pidfds_.end()) {
      const int fd = OpenPidfd(pid);
      if (fd == -2) {
        exited.push_back(pid);
        continue;
      }
      it = pidfds_.emplace(pid, fd).first;
    }
    const bool gone = it->second >= 0 ? std::find(readable.begin(), readable.end(), pid) != readable.end()
                                      : !Alive(pid);
    if (gone) exited.push_back(pid);
  }
  for (pid_t pid : exited) {
    auto it = pidfds_.find(pid);
    if (it != pidfds_.end()) {
      if (it->second >= 0) ::close(it->second);
      pidfds_.erase(it);
    }
    for (const std::string& id : switches_.Exited(pid)) Decide(id);
  }
  for (const std::string& id : switches_.Expire(NowMs())) Decide(id);
  Linger();
  const std::int64_t now = NowMs();
  while (!lingering_.empty() && now - lingering_.front().first >= kRecordLingerMs) {
    RemoveDecision(options_.dir, lingering_.front().second);
    lingering_.pop_front();
  }
}

void NodeDaemon::Linger() {
  const std::int64_t now = NowMs();
  for (std::string& id : switches_.TakeForgotten()) lingering_.emplace_back(now, std::move(id));
}

int NodeDaemon::PollTimeoutMs() {
  std::int64_t timeout = -1;
  std::optional<std::int64_t> next = switches_.NextDeadline();
  if (!lingering_.empty()) {
    const std::int64_t gone = lingering_.front().first + kRecordLingerMs;
    next = next.has_value() ? std::min(*next, gone) : gone;
  }
  if (next.has_value()) timeout = std::max<std::int64_t>(0, *next - NowMs() + 1);
  for (const auto& [pid, fd] : pidfds_) {
    if (fd < 0) timeout = timeout < 0 ? kExitCheckMs : std::min<std::int64_t>(timeout, kExitCheckMs);
  }
  return static_cast<int>(std::min<std::int64_t>(timeout, 60000));
}

void NodeDaemon::Drop(int fd) {
  MutexLock lock(&mu_);
  auto c = clients_.find(fd);
  if (c == clients_.end()) return;
  if (c->second.said_hello) {
    const std::size_t bytes = ledger_.GiveAll(c->second.id);
    if (bytes > 0) {
      VMSTASH_LOG(kInfo, "vmstashd: client {} (pid {}) left holding {} bytes: back in the pool", c->second.id,
                  c->second.pid, bytes);
    }
  }
  ::close(fd);
  clients_.erase(c);
}

}  // namespace vmstash::node
