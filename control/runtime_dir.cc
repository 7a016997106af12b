// The runtime directory and its trust rules: see runtime_dir.h.
#include "control/runtime_dir.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace vmstash::control {

absl::Status Errno(absl::string_view what, int err) {
  std::string message = absl::StrCat(what, ": ", std::strerror(err));
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(message);
  if (err == ENOENT || err == ECONNREFUSED) return absl::UnavailableError(message);
  return absl::InternalError(message);
}

std::string DefaultRuntimeDir() {
  if (const char* dir = std::getenv("VMSTASH_RUNTIME_DIR"); dir != nullptr && *dir != '\0') return dir;
  if (const char* xdg = std::getenv("XDG_RUNTIME_DIR"); xdg != nullptr && *xdg != '\0') {
    return absl::StrCat(xdg, "/vmstash");
  }
  return absl::StrCat("/tmp/vmstash-", ::getuid());
}

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

absl::Status EnsurePrivateDir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return Errno(absl::StrCat("mkdir ", dir), errno);
  return CheckPrivateDir(dir);
}

sockaddr_un UnixAddress(const std::string& path) {
  sockaddr_un addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), std::min(path.size(), sizeof(addr.sun_path) - 1));
  return addr;
}

absl::StatusOr<Peer> PeerOf(int fd) {
  ucred cred;
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return Errno("SO_PEERCRED", errno);
  return Peer{cred.uid, cred.pid};
}

bool ProcessGone(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  const std::string path = absl::StrCat("/proc/", pid, "/stat");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT;  // gone meanwhile; without /proc, kill's answer stands
  char buf[512];
  const ssize_t n = ::read(fd, buf, sizeof(buf));
  ::close(fd);
  const absl::string_view stat(buf, n > 0 ? static_cast<std::size_t>(n) : 0);
  const std::size_t paren = stat.rfind(')');  // the command name may hold ')' and spaces
  if (paren == absl::string_view::npos || paren + 2 >= stat.size()) return false;
  return stat[paren + 2] == 'Z' || stat[paren + 2] == 'X';
}

}  // namespace vmstash::control
