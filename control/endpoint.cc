// The control endpoint: see endpoint.h.
#include "control/endpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <system_error>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "base/log.h"

namespace vmstash::control {
namespace {

bool ProcessAlive(int pid) { return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM); }

// A client waits at most this long before checking that the server process still exists.
constexpr int kPeerCheckMs = 1000;
// The accept thread's pause after accept failed for want of descriptors or memory.
constexpr int kAcceptBackoffMs = 100;
// ReadLine's error when the peer closed the connection.
constexpr absl::string_view kClosedBeforeLine = "control: connection closed before a full line";

using Clock = std::chrono::steady_clock;
constexpr Clock::time_point kNever = Clock::time_point::max();  // no deadline

Clock::time_point DeadlineAfter(int timeout_ms) {
  return timeout_ms <= 0 ? kNever : Clock::now() + std::chrono::milliseconds(timeout_ms);
}

// Waits until `fd` is ready for `events` or the request's total deadline passes: a peer
// sending a byte now and then cannot hold the endpoint past the deadline. A readable
// `stop_fd` (the server's wake pipe; -1 for none) ends the wait: the server is stopping.
// With a `peer` pid (a client's server; 0 for none) the wait ends when that process is gone
// (Note [Client Deadlines]).
absl::Status WaitReady(int fd, short events, Clock::time_point deadline, const char* what, int stop_fd,
                       pid_t peer) {
  for (;;) {
    int timeout = -1;
    if (deadline != kNever) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return absl::DeadlineExceededError(absl::StrCat("control: ", what, " timed out"));
      timeout = static_cast<int>(std::min<std::int64_t>(left, std::numeric_limits<int>::max()));
    }
    if (peer > 0 && (timeout < 0 || timeout > kPeerCheckMs)) timeout = kPeerCheckMs;
    pollfd p[2] = {{fd, events, 0}, {stop_fd, POLLIN, 0}};
    const int n = ::poll(p, stop_fd >= 0 ? 2 : 1, timeout);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Errno(absl::StrCat("control: poll for ", what), errno);
    if (n > 0 && p[0].revents != 0) return absl::OkStatus();
    if (n > 0) return absl::UnavailableError("control: the endpoint is stopping");
    if (peer > 0 && ProcessGone(peer)) {
      return absl::UnavailableError(
          absl::StrCat("control: the server process ", peer, " is gone; the outcome of the request is unknown"));
    }
  }
}

absl::Status WriteAll(int fd, absl::string_view data, Clock::time_point deadline, int stop_fd = -1,
                      pid_t peer = 0) {
  while (!data.empty()) {
    if (absl::Status s = WaitReady(fd, POLLOUT, deadline, "write", stop_fd, peer); !s.ok()) return s;
    ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return Errno("control: write", errno);
    }
    data.remove_prefix(static_cast<std::size_t>(n));
  }
  return absl::OkStatus();
}

// Reads one '\n'-terminated line of at most `limit` bytes (without the '\n'), all of it
// before `deadline` (for `stop_fd` and `peer`, see WaitReady).
absl::StatusOr<std::string> ReadLine(int fd, std::size_t limit, Clock::time_point deadline, int stop_fd = -1,
                                     pid_t peer = 0) {
  std::string out;
  char buf[4096];
  for (;;) {
    if (absl::Status s = WaitReady(fd, POLLIN, deadline, "read", stop_fd, peer); !s.ok()) return s;
    ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return Errno("control: read", errno);
    }
    if (n == 0) return absl::UnavailableError(kClosedBeforeLine);
    const char* nl = static_cast<const char*>(std::memchr(buf, '\n', static_cast<std::size_t>(n)));
    std::size_t take = nl != nullptr ? static_cast<std::size_t>(nl - buf) : static_cast<std::size_t>(n);
    if (out.size() + take > limit) {
      return absl::InvalidArgumentError(absl::StrCat("control: message longer than ", limit, " bytes"));
    }
    out.append(buf, take);
    if (nl != nullptr) return out;
  }
}

// OK when the peer of `fd` may talk to us, else the PermissionDenied to reply.
absl::Status CheckPeer(int fd, const std::function<bool(uid_t)>& allowed) {
  ucred cred;
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return absl::PermissionDeniedError(absl::StrCat("the peer's credentials are unknown; it may not control process ",
                                                    ::getpid()));
  }
  if (!allowed(cred.uid)) {
    return absl::PermissionDeniedError(absl::StrCat("uid ", cred.uid, " may not control process ", ::getpid()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ControlServer>> ControlServer::Start(ServerOptions options, Handler handler) {
  if (options.dir.empty()) options.dir = DefaultRuntimeDir();
  if (options.max_connections < 1) {
    return absl::InvalidArgumentError(absl::StrCat("control: max_connections ", options.max_connections, " < 1"));
  }
  if (!options.peer_allowed) {
    const uid_t me = ::getuid();
    options.peer_allowed = [me](uid_t uid) { return uid == me; };
  }
  if (absl::Status s = EnsurePrivateDir(options.dir); !s.ok()) return s;
  (void)ListEndpoints(options.dir);  // clean stale sockets of dead processes
  std::string path = absl::StrCat(options.dir, "/", ::getpid(), ".sock");
  if (path.size() >= sizeof(sockaddr_un::sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("control socket path too long: ", path));
  }
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("control: socket", errno);
  ::unlink(path.c_str());  // a stale one of an earlier process with our pid
  sockaddr_un addr = UnixAddress(path);
  // The socket inode's mode (fchmod before bind) is what bind gives the file, less the
  // umask: never more than 0600, and the process umask is left alone. chmod afterwards
  // makes it exactly 0600; the directory (0700, ours) closes the gap in between.
  int bound = ::fchmod(fd, 0600) == 0 ? ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) : -1;
  int bind_errno = errno;
  if (bound != 0 || ::chmod(path.c_str(), 0600) != 0 || ::listen(fd, 16) != 0) {
    absl::Status s = Errno(absl::StrCat("control: bind/listen ", path), bound != 0 ? bind_errno : errno);
    ::close(fd);
    ::unlink(path.c_str());
    return s;
  }
  int wake[2];
  if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    absl::Status s = Errno("control: pipe", errno);
    ::close(fd);
    ::unlink(path.c_str());
    return s;
  }
  auto server = std::unique_ptr<ControlServer>(new ControlServer(std::move(options), std::move(handler), fd, wake,
                                                                 std::move(path)));
  server->thread_ = std::thread([s = server.get()] { s->Loop(); });
  return server;
}

ControlServer::ControlServer(ServerOptions options, Handler handler, int listen_fd, int wake_fd[2], std::string path)
    : options_(std::move(options)),
      handler_(std::move(handler)),
      listen_fd_(listen_fd),
      wake_read_(wake_fd[0]),
      wake_write_(wake_fd[1]),
      path_(std::move(path)),
      owner_pid_(::getpid()),
      workers_(std::make_unique<std::list<std::unique_ptr<Worker>>>()) {}

ControlServer::~ControlServer() {
  if (::getpid() != owner_pid_) {
    // A forked child: the thread, the socket and the wake pipe belong to the parent. Only
    // this process's copies of the descriptors go; the parent keeps serving. The serving
    // threads do not exist here: their handles are leaked, neither joined nor detached.
    thread_.detach();
    (void)workers_.release();
    ::close(listen_fd_);
    ::close(wake_read_);
    ::close(wake_write_);
    return;
  }
  char c = 1;
  (void)!::write(wake_write_, &c, 1);  // never read: it stays readable for every waiter
  if (thread_.joinable()) thread_.join();
  for (const std::unique_ptr<Worker>& w : *workers_) w->thread.join();
  ::close(listen_fd_);
  ::close(wake_read_);
  ::close(wake_write_);
  ::unlink(path_.c_str());
}

// Note [Serving Model].
void ControlServer::Loop() {
  bool warned = false;
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_read_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) {
      Dispatch(fd);
      continue;
    }
    const int err = errno;
    if (err != EMFILE && err != ENFILE && err != ENOBUFS && err != ENOMEM) continue;  // EINTR, ECONNABORTED...
    // The connection stays pending, so poll would report it again at once: back off,
    // still waking for a stop.
    if (!warned) {
      VMSTASH_LOG(kWarning, "vmstash: control endpoint {}: accept failed ({}); retrying every {} ms", path_,
                  std::strerror(err), kAcceptBackoffMs);
      warned = true;
    }
    pollfd wake = {wake_read_, POLLIN, 0};
    if (::poll(&wake, 1, kAcceptBackoffMs) > 0) return;
  }
}

// Note [Serving Model].
void ControlServer::Dispatch(int fd) {
  for (auto it = workers_->begin(); it != workers_->end();) {
    if (!(*it)->done.load(std::memory_order_acquire)) {
      ++it;
      continue;
    }
    (*it)->thread.join();
    it = workers_->erase(it);
  }
  if (workers_->size() < static_cast<std::size_t>(options_.max_connections)) {
    try {
      Worker* w = workers_->emplace_back(std::make_unique<Worker>()).get();
      try {
        w->thread = std::thread([this, w, fd] {
          Serve(fd);
          ::close(fd);
          w->done.store(true, std::memory_order_release);
        });
        return;
      } catch (const std::system_error&) {
        workers_->pop_back();  // no thread to be had: refused below like one over the limit
      }
    } catch (const std::bad_alloc&) {
      // refused below
    }
  }
  // Over the limit: refused on this thread, without waiting (the reply fits the socket
  // buffer of a fresh connection; a peer that does not read it loses it).
  absl::Status s = CheckPeer(fd, options_.peer_allowed);
  if (s.ok()) {
    s = absl::ResourceExhaustedError(absl::StrCat("control: process ", ::getpid(), " is serving ",
                                                  options_.max_connections, " requests already; try again"));
  }
  ++refused_;
  const std::string reply = ErrorReply(s);
  (void)!::send(fd, reply.data(), reply.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  ::close(fd);
}

void ControlServer::Serve(int fd) {
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(options_.timeout_ms);
  if (absl::Status s = CheckPeer(fd, options_.peer_allowed); !s.ok()) {
    ++refused_;
    (void)WriteAll(fd, ErrorReply(s), deadline, wake_read_);
    return;
  }
  std::string reply;
  absl::StatusOr<std::string> line = ReadLine(fd, kMaxMessageBytes, deadline, wake_read_);
  if (!line.ok()) {
    reply = ErrorReply(line.status());
  } else {
    absl::StatusOr<Request> request = ParseRequest(*line);
    if (!request.ok()) {
      reply = ErrorReply(request.status());
    } else {
      absl::StatusOr<std::string> result = handler_(*request);
      reply = result.ok() ? OkReply(*result) : ErrorReply(result.status());
    }
  }
  ++served_;
  // The handler's own time does not count against the peer; the reply gets a timeout of
  // its own.
  (void)WriteAll(fd, reply, Clock::now() + std::chrono::milliseconds(options_.timeout_ms), wake_read_);
}

std::vector<Endpoint> ListEndpoints(const std::string& dir_arg) {
  const std::string dir = dir_arg.empty() ? DefaultRuntimeDir() : dir_arg;
  std::vector<Endpoint> out;
  if (!CheckPrivateDir(dir).ok()) return out;  // not ours, or open to others: trust nothing in it
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = ::readdir(d)) {
    absl::string_view name(e->d_name);
    if (!absl::EndsWith(name, ".sock")) continue;
    int pid = 0;
    if (!absl::SimpleAtoi(name.substr(0, name.size() - 5), &pid)) continue;
    std::string path = absl::StrCat(dir, "/", name);
    if (!ProcessAlive(pid)) {
      ::unlink(path.c_str());  // stale: the process is gone
      continue;
    }
    out.push_back({pid, std::move(path)});
  }
  ::closedir(d);
  std::sort(out.begin(), out.end(), [](const Endpoint& a, const Endpoint& b) { return a.pid < b.pid; });
  return out;
}

absl::StatusOr<std::string> EndpointOf(int pid, const std::string& dir_arg) {
  const std::string dir = dir_arg.empty() ? DefaultRuntimeDir() : dir_arg;
  if (!ProcessAlive(pid)) return absl::NotFoundError(absl::StrCat("no process ", pid));
  if (absl::Status s = CheckPrivateDir(dir); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("refusing the runtime directory: ", s.message()));
  }
  std::string path = absl::StrCat(dir, "/", pid, ".sock");
  if (::access(path.c_str(), F_OK) != 0) {
    return absl::NotFoundError(absl::StrCat("process ", pid, " has no vmstash control endpoint in ", dir,
                                            " (not using vmstash, started with control:0, or another user's)"));
  }
  return path;
}

bool IsTransition(Op op) { return op == Op::kPause || op == Op::kResume || op == Op::kSwitch; }

// Note [Client Deadlines].
absl::StatusOr<std::string> Call(const std::string& socket_path, const Request& request, const CallOptions& options) {
  return Call(socket_path, request, IsTransition(request.op) ? options.transition_timeout_ms : options.read_timeout_ms);
}

absl::StatusOr<std::string> Call(const std::string& socket_path, const Request& request, int timeout_ms) {
  const std::size_t slash = socket_path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : socket_path.substr(0, slash);
  if (absl::Status s = CheckPrivateDir(dir); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("refusing the runtime directory: ", s.message()));
  }
  const Clock::time_point deadline = DeadlineAfter(timeout_ms);
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("control: socket", errno);
  sockaddr_un addr = UnixAddress(socket_path);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    absl::Status s = Errno(absl::StrCat("control: connect ", socket_path), errno);
    ::close(fd);
    return s;
  }
  // The server must run as this user: a socket planted by someone else is not talked to.
  ucred cred;
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.uid != ::getuid()) {
    ::close(fd);
    return absl::PermissionDeniedError(absl::StrCat("control: the server at ", socket_path, " runs as uid ",
                                                    cred.uid, ", not as this user (", ::getuid(), "); refused"));
  }
  // cred.pid: the server process, watched while waiting (Note [Client Deadlines]).
  absl::Status sent = WriteAll(fd, FormatRequest(request), deadline, -1, cred.pid);
  absl::StatusOr<std::string> line = ReadLine(fd, kMaxReplyBytes, deadline, -1, cred.pid);
  ::close(fd);
  if (!line.ok() && sent.ok() && line.status().message() == kClosedBeforeLine) {
    return absl::UnavailableError(absl::StrCat("control: ", socket_path, " closed the connection before replying (",
                                               line.status().message(), "): the process exited or stopped its "
                                               "endpoint; the outcome of the request is unknown"));
  }
  if (!line.ok()) return sent.ok() ? line.status() : sent;
  return ParseReply(*line);
}

}  // namespace vmstash::control
