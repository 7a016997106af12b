// Starting the node daemon: see launch.h.
#include "node/launch.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "control/runtime_dir.h"
#include "node/wire.h"

extern char** environ;

namespace vmstash::node {
namespace {

bool Executable(const std::string& path) { return !path.empty() && ::access(path.c_str(), X_OK) == 0; }

std::string DirOf(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

std::string LogTail(const std::string& log) {
  std::ifstream in(log);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  std::vector<std::string> tail(lines.size() > 5 ? lines.end() - 5 : lines.begin(), lines.end());
  return absl::StrJoin(tail, "\n");
}

}  // namespace

absl::StatusOr<std::string> DaemonBinary() {
  std::vector<std::string> looked;
  if (const char* env = std::getenv("VMSTASH_DAEMON"); env != nullptr && *env != '\0') {
    if (Executable(env)) return std::string(env);
    return absl::NotFoundError(absl::StrCat("vmstashd not found: $VMSTASH_DAEMON names ", env,
                                            ", which is not an executable file"));
  }
  std::vector<std::string> candidates;
  char self[4096];
  if (const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1); n > 0) {
    self[n] = '\0';
    const std::string dir = DirOf(self);
    candidates.push_back(dir + "/vmstashd");
    candidates.push_back(dir + "/../vmstashd/vmstashd");
  }
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&DaemonBinary), &info) != 0 && info.dli_fname != nullptr) {
    const std::string dir = DirOf(info.dli_fname);
    candidates.push_back(dir + "/vmstashd");
    candidates.push_back(dir + "/../bin/vmstashd");
  }
  if (const char* path = std::getenv("PATH"); path != nullptr) {
    for (absl::string_view d : absl::StrSplit(path, ':', absl::SkipEmpty())) candidates.push_back(absl::StrCat(d, "/vmstashd"));
  }
  for (const std::string& c : candidates) {
    if (Executable(c)) return c;
  }
  looked.push_back("beside the program, beside the vmstash library, $PATH");
  return absl::NotFoundError(absl::StrCat("vmstashd not found (looked at ", absl::StrJoin(looked, "; "),
                                          "); set VMSTASH_DAEMON to its path"));
}

pid_t ServingPid(const std::string& dir) {
  absl::StatusOr<int> fd = Connect(SocketPath(dir));
  if (!fd.ok()) return 0;
  absl::StatusOr<control::Peer> peer = control::PeerOf(*fd);
  ::close(*fd);
  return peer.ok() && peer->uid == ::getuid() ? peer->pid : 0;
}

std::size_t DefaultCapacityBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 0;
  const std::size_t half = static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) / 2;
  constexpr std::size_t kUnit = std::size_t{2} << 20;
  return half / kUnit * kUnit;
}

absl::StatusOr<Started> StartDaemon(const std::string& dir, std::size_t capacity_bytes, int wait_ms) {
  if (const pid_t pid = ServingPid(dir); pid > 0) return Started{pid, true};
  absl::StatusOr<std::string> bin = DaemonBinary();
  if (!bin.ok()) return bin.status();
  if (absl::Status s = control::EnsurePrivateDir(dir); !s.ok()) return absl::FailedPreconditionError(s.message());
  if (capacity_bytes == 0) return absl::InvalidArgumentError("the node daemon needs a pool size above 0");
  const std::string log = absl::StrCat(dir, "/vmstashd.log");
  const std::string capacity = std::to_string(capacity_bytes);
  std::vector<std::string> env_strings;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    if (!absl::StartsWith(*e, "LD_PRELOAD=")) env_strings.emplace_back(*e);
  }
  std::vector<char*> envp;
  for (std::string& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = {"vmstashd", "--capacity", capacity, "--dir", dir, "--detach"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init(&actions);
  posix_spawnattr_init(&attr);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  // Not O_CLOEXEC: where fd 1 was closed the file opens as 1 itself, and must stay open.
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGINT);
  sigaddset(&defaults, SIGTERM);
  sigaddset(&defaults, SIGPIPE);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  pid_t child = 0;
  const int err = ::posix_spawn(&child, bin->c_str(), &actions, &attr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (err != 0) return absl::UnavailableError(absl::StrCat("starting ", *bin, ": ", std::strerror(err)));
  int status = 0;
  while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  // --detach: the child exits 0 once the daemon runs on its own; anything else is a failed
  // start (the exec, the arguments), said at once.
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::UnavailableError(absl::StrCat(*bin, " did not start (",
                                               WIFEXITED(status) ? absl::StrCat("exit ", WEXITSTATUS(status))
                                                                 : absl::StrCat("signal ", WTERMSIG(status)),
                                               "); the end of ", log, ":\n", LogTail(log)));
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    if (const pid_t pid = ServingPid(dir); pid > 0) return Started{pid, false};
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return absl::UnavailableError(absl::StrCat(*bin, " did not come up within ", wait_ms, " ms on ", SocketPath(dir),
                                             "; the end of ", log, ":\n", LogTail(log)));
}

}  // namespace vmstash::node
