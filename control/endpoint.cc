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
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"

namespace vmstash::control {
namespace {

absl::Status Errno(absl::string_view what, int err) {
  std::string message = absl::StrCat(what, ": ", std::strerror(err));
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(message);
  if (err == ENOENT || err == ECONNREFUSED) return absl::UnavailableError(message);
  return absl::InternalError(message);
}

// The directory must be ours and closed to others: someone else could plant sockets.
absl::Status CheckPrivateDir(const std::string& dir) {
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0) return Errno(absl::StrCat("stat ", dir), errno);
  if (!S_ISDIR(st.st_mode)) return absl::FailedPreconditionError(absl::StrCat(dir, " is not a directory"));
  if (st.st_uid != ::getuid()) {
    return absl::PermissionDeniedError(absl::StrCat(dir, " belongs to uid ", st.st_uid, ", not to us (", ::getuid(), ")"));
  }
  if ((st.st_mode & 077) != 0) {
    return absl::PermissionDeniedError(absl::StrCat(dir, " is accessible to other users (mode ",
                                                    absl::Hex(st.st_mode & 0777), "); it must be 0700"));
  }
  return absl::OkStatus();
}

// mkdir honours the umask, which can only make the mode stricter than 0700; the process
// umask itself is never changed (other threads may be creating files meanwhile).
absl::Status EnsurePrivateDir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return Errno(absl::StrCat("mkdir ", dir), errno);
  return CheckPrivateDir(dir);
}

bool ProcessAlive(int pid) { return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM); }

using Clock = std::chrono::steady_clock;

// Waits until `fd` is ready for `events` or the request's total deadline passes: a peer
// sending a byte now and then cannot hold the endpoint past the deadline.
absl::Status WaitReady(int fd, short events, Clock::time_point deadline, const char* what) {
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return absl::DeadlineExceededError(absl::StrCat("control: ", what, " timed out"));
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, static_cast<int>(left));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Errno(absl::StrCat("control: poll for ", what), errno);
    if (n > 0) return absl::OkStatus();
  }
}

absl::Status WriteAll(int fd, absl::string_view data, Clock::time_point deadline) {
  while (!data.empty()) {
    if (absl::Status s = WaitReady(fd, POLLOUT, deadline, "write"); !s.ok()) return s;
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
// before `deadline`.
absl::StatusOr<std::string> ReadLine(int fd, std::size_t limit, Clock::time_point deadline) {
  std::string out;
  char buf[4096];
  for (;;) {
    if (absl::Status s = WaitReady(fd, POLLIN, deadline, "read"); !s.ok()) return s;
    ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return Errno("control: read", errno);
    }
    if (n == 0) return absl::UnavailableError("control: connection closed before a full line");
    const char* nl = static_cast<const char*>(std::memchr(buf, '\n', static_cast<std::size_t>(n)));
    std::size_t take = nl != nullptr ? static_cast<std::size_t>(nl - buf) : static_cast<std::size_t>(n);
    if (out.size() + take > limit) {
      return absl::InvalidArgumentError(absl::StrCat("control: message longer than ", limit, " bytes"));
    }
    out.append(buf, take);
    if (nl != nullptr) return out;
  }
}

sockaddr_un Address(const std::string& path) {
  sockaddr_un addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), std::min(path.size(), sizeof(addr.sun_path) - 1));
  return addr;
}

}  // namespace

std::string DefaultRuntimeDir() {
  if (const char* dir = std::getenv("VMSTASH_RUNTIME_DIR"); dir != nullptr && *dir != '\0') return dir;
  if (const char* xdg = std::getenv("XDG_RUNTIME_DIR"); xdg != nullptr && *xdg != '\0') {
    return absl::StrCat(xdg, "/vmstash");
  }
  return absl::StrCat("/tmp/vmstash-", ::getuid());
}

absl::StatusOr<std::unique_ptr<ControlServer>> ControlServer::Start(ServerOptions options, Handler handler) {
  if (options.dir.empty()) options.dir = DefaultRuntimeDir();
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
  sockaddr_un addr = Address(path);
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
      owner_pid_(::getpid()) {}

ControlServer::~ControlServer() {
  if (::getpid() != owner_pid_) {
    // A forked child: the thread, the socket and the wake pipe belong to the parent. Only
    // this process's copies of the descriptors go; the parent keeps serving.
    thread_.detach();
    ::close(listen_fd_);
    ::close(wake_read_);
    ::close(wake_write_);
    return;
  }
  char c = 1;
  (void)!::write(wake_write_, &c, 1);
  if (thread_.joinable()) thread_.join();
  ::close(listen_fd_);
  ::close(wake_read_);
  ::close(wake_write_);
  ::unlink(path_.c_str());
}

void ControlServer::Loop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_read_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    Serve(fd);
    ::close(fd);
  }
}

void ControlServer::Serve(int fd) {
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(options_.timeout_ms);
  ucred cred;
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || !options_.peer_allowed(cred.uid)) {
    ++refused_;
    (void)WriteAll(fd,
                   ErrorReply(absl::PermissionDeniedError(
                       absl::StrCat("uid ", cred.uid, " may not control process ", ::getpid()))),
                   deadline);
    return;
  }
  std::string reply;
  absl::StatusOr<std::string> line = ReadLine(fd, kMaxMessageBytes, deadline);
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
  (void)WriteAll(fd, reply, Clock::now() + std::chrono::milliseconds(options_.timeout_ms));
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

absl::StatusOr<std::string> Call(const std::string& socket_path, const Request& request, int timeout_ms) {
  const std::size_t slash = socket_path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : socket_path.substr(0, slash);
  if (absl::Status s = CheckPrivateDir(dir); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("refusing the runtime directory: ", s.message()));
  }
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("control: socket", errno);
  sockaddr_un addr = Address(socket_path);
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
  absl::Status sent = WriteAll(fd, FormatRequest(request), deadline);
  absl::StatusOr<std::string> line = ReadLine(fd, kMaxReplyBytes, deadline);
  ::close(fd);
  if (!line.ok()) return sent.ok() ? line.status() : sent;
  return ParseReply(*line);
}

}  // namespace vmstash::control
