// `vmstash daemon ...`: see daemon_cmd.h.
#include "tools/cli/daemon_cmd.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/bytes.h"
#include "base/json_writer.h"
#include "control/runtime_dir.h"
#include "fmt/format.h"
#include "node/client.h"
#include "node/wire.h"

namespace vmstash::cli {
namespace {

std::string Dir() { return control::DefaultRuntimeDir(); }
std::string SocketPath() { return node::SocketPath(Dir()); }
std::string LogPath() { return absl::StrCat(Dir(), "/vmstashd.log"); }

bool Executable(const std::string& path) { return !path.empty() && ::access(path.c_str(), X_OK) == 0; }

// vmstashd's path (daemon_cmd.h: where it is looked for), or "".
std::string DaemonBinary() {
  if (const char* env = std::getenv("VMSTASH_DAEMON"); env != nullptr && *env != '\0') return env;
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return "";
  self[n] = '\0';
  std::string dir(self);
  dir = dir.substr(0, dir.rfind('/'));
  for (const std::string& candidate : {dir + "/vmstashd", dir + "/../vmstashd/vmstashd"}) {
    if (Executable(candidate)) return candidate;
  }
  return "";
}

// The pid of the daemon serving this user's socket, or 0 when none answers.
pid_t ServingPid() {
  absl::StatusOr<int> fd = node::Connect(SocketPath());
  if (!fd.ok()) return 0;
  absl::StatusOr<control::Peer> peer = control::PeerOf(*fd);
  ::close(*fd);
  return peer.ok() && peer->uid == ::getuid() ? peer->pid : 0;
}

std::string LogTail() {
  std::ifstream in(LogPath());
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  std::string out;
  for (std::size_t i = lines.size() > 5 ? lines.size() - 5 : 0; i < lines.size(); ++i) out += "  " + lines[i] + "\n";
  return out;
}

}  // namespace

int DaemonStart(std::uint64_t capacity_bytes) {
  if (const pid_t pid = ServingPid(); pid > 0) {
    fmt::print("vmstash daemon: already running (pid {}) on {}\n", pid, SocketPath());
    return 0;
  }
  const std::string bin = DaemonBinary();
  if (bin.empty()) {
    fmt::print(stderr, "vmstash daemon start: vmstashd not found beside this program; set VMSTASH_DAEMON\n");
    return 1;
  }
  if (absl::Status s = control::EnsurePrivateDir(Dir()); !s.ok()) {
    fmt::print(stderr, "vmstash daemon start: {}\n", std::string(s.message()));
    return 1;
  }
  const std::string capacity = std::to_string(capacity_bytes);
  const std::string dir = Dir();
  const std::string log = LogPath();
  const pid_t child = ::fork();
  if (child < 0) {
    fmt::print(stderr, "vmstash daemon start: fork: {}\n", std::strerror(errno));
    return 1;
  }
  if (child == 0) {  // its own session, then a grandchild that is nobody's child here
    ::setsid();
    if (::fork() != 0) ::_exit(0);
    const int in = ::open("/dev/null", O_RDONLY);
    const int out = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
    if (in >= 0) ::dup2(in, 0);
    if (out >= 0) {
      ::dup2(out, 1);
      ::dup2(out, 2);
    }
    ::execl(bin.c_str(), "vmstashd", "--capacity", capacity.c_str(), "--dir", dir.c_str(), nullptr);
    ::_exit(127);
  }
  ::waitpid(child, nullptr, 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    if (const pid_t pid = ServingPid(); pid > 0) {
      fmt::print("vmstash daemon: started (pid {}), a pool of {} on {}\n", pid, HumanBytes(capacity_bytes),
                 SocketPath());
      return 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  fmt::print(stderr, "vmstash daemon start: vmstashd did not come up within 10 s; the end of {}:\n{}", log, LogTail());
  return 1;
}

int DaemonStop() {
  const pid_t pid = ServingPid();
  if (pid <= 0) {
    fmt::print("vmstash daemon: none running on {}\n", SocketPath());
    return 0;
  }
  if (::kill(pid, SIGTERM) != 0) {
    fmt::print(stderr, "vmstash daemon stop: kill {}: {}\n", pid, std::strerror(errno));
    return 1;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    if (ServingPid() == 0) {
      fmt::print("vmstash daemon: stopped (pid {})\n", pid);
      return 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  fmt::print(stderr, "vmstash daemon stop: pid {} still serves after 10 s\n", pid);
  return 1;
}

int DaemonStatus(bool json) {
  node::ClientOptions options;
  absl::StatusOr<std::unique_ptr<node::NodeClient>> client = node::NodeClient::Connect(options);
  if (!client.ok()) {
    fmt::print(stderr, "vmstash daemon status: {}\n", std::string(client.status().message()));
    return 1;
  }
  absl::StatusOr<node::PoolStats> s = (*client)->Stats();
  if (!s.ok()) {
    fmt::print(stderr, "vmstash daemon status: {}\n", std::string(s.status().message()));
    return 1;
  }
  if (json) {
    JsonWriter w;
    w.BeginObject();
    w.Field("socket", SocketPath());
    w.Field("pid", static_cast<std::int64_t>(ServingPid()));
    w.Field("capacity_bytes", static_cast<std::uint64_t>(s->capacity_bytes));
    w.Field("leased_bytes", static_cast<std::uint64_t>(s->leased_bytes));
    w.Field("peak_bytes", static_cast<std::uint64_t>(s->peak_bytes));
    w.Field("largest_free_bytes", static_cast<std::uint64_t>(s->largest_free_bytes));
    w.Field("leases", static_cast<std::uint64_t>(s->leases));
    w.Field("clients", static_cast<std::uint64_t>(s->clients));
    w.Field("refused", static_cast<std::uint64_t>(s->refused));
    w.EndObject();
    fmt::print("{}\n", w.str());
    return 0;
  }
  fmt::print("vmstashd (pid {}) on {}\n  pool     {}\n  leased   {} (peak {}; largest free run {})\n"
             "  leases   {} held by {} clients ({} refused)\n",
             ServingPid(), SocketPath(), HumanBytes(s->capacity_bytes), HumanBytes(s->leased_bytes),
             HumanBytes(s->peak_bytes), HumanBytes(s->largest_free_bytes), s->leases, s->clients, s->refused);
  return 0;
}

}  // namespace vmstash::cli
