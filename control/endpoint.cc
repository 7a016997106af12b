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

absl::Status EnsurePrivateDir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return Errno(absl::StrCat("mkdir ", dir), errno);
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

bool ProcessAlive(int pid) { return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM); }

void SetTimeouts(int fd, int timeout_ms) {
  struct timeval tv;
  tv.tv_sec = timeout_ms / 1000;
  tv.tv_usec = (timeout_ms % 1000) * 1000;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

absl::Status WriteAll(int fd, absl::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return absl::DeadlineExceededError("control: write timed out");
      return Errno("control: write", errno);
    }
    data.remove_prefix(static_cast<std::size_t>(n));
  }
  return absl::OkStatus();
}

// Reads one '\n'-terminated line of at most `limit` bytes (without the '\n').
absl::StatusOr<std::string> ReadLine(int fd, std::size_t limit) {
  std::string out;
  char buf[4096];
  for (;;) {
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return absl::DeadlineExceededError("control: read timed out");
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
  // Created 0600 (umask), then chmod to be sure.
  mode_t old_mask = ::umask(0177);
  int bound = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  int bind_errno = errno;
  ::umask(old_mask);
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
      path_(std::move(path)) {}

ControlServer::~ControlServer() {
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
  SetTimeouts(fd, options_.timeout_ms);
  ucred cred;
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || !options_.peer_allowed(cred.uid)) {
    ++refused_;
    (void)WriteAll(fd, ErrorReply(absl::PermissionDeniedError(
                           absl::StrCat("uid ", cred.uid, " may not control process ", ::getpid()))));
    return;
  }
  std::string reply;
  absl::StatusOr<std::string> line = ReadLine(fd, kMaxMessageBytes);
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
  (void)WriteAll(fd, reply);
}

std::vector<Endpoint> ListEndpoints(const std::string& dir_arg) {
  const std::string dir = dir_arg.empty() ? DefaultRuntimeDir() : dir_arg;
  std::vector<Endpoint> out;
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
  std::string path = absl::StrCat(dir, "/", pid, ".sock");
  if (::access(path.c_str(), F_OK) != 0) {
    return absl::NotFoundError(absl::StrCat("process ", pid, " has no vmstash control endpoint in ", dir,
                                            " (not using vmstash, started with control:0, or another user's)"));
  }
  return path;
}

absl::StatusOr<std::string> Call(const std::string& socket_path, const Request& request, int timeout_ms) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("control: socket", errno);
  SetTimeouts(fd, timeout_ms);
  sockaddr_un addr = Address(socket_path);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    absl::Status s = Errno(absl::StrCat("control: connect ", socket_path), errno);
    ::close(fd);
    return s;
  }
  absl::Status sent = WriteAll(fd, FormatRequest(request));
  absl::StatusOr<std::string> line = ReadLine(fd, kMaxReplyBytes);
  ::close(fd);
  if (!line.ok()) return sent.ok() ? line.status() : sent;
  return ParseReply(*line);
}

}  // namespace vmstash::control
