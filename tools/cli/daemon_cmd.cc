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
#include "node/launch.h"
#include "node/node_switch.h"
#include "node/wire.h"

namespace vmstash::cli {
namespace {

std::string Dir() { return control::DefaultRuntimeDir(); }
std::string SocketPath() { return node::SocketPath(Dir()); }

pid_t ServingPid() { return node::ServingPid(Dir()); }

}  // namespace

int DaemonStart(std::uint64_t capacity_bytes) {
  absl::StatusOr<node::Started> started = node::StartDaemon(Dir(), static_cast<std::size_t>(capacity_bytes));
  if (!started.ok()) {
    fmt::print(stderr, "vmstash daemon start: {}\n", std::string(started.status().message()));
    return 1;
  }
  if (started->already) {
    fmt::print("vmstash daemon: already running (pid {}) on {}\n", started->pid, SocketPath());
  } else {
    fmt::print("vmstash daemon: started (pid {}), a pool of {} on {}\n", started->pid, HumanBytes(capacity_bytes),
               SocketPath());
  }
  return 0;
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

int NodeSwitch(const std::string& pause, const std::string& resume, int device, int timeout_ms, bool json) {
  absl::StatusOr<std::vector<node::NodeSwitchPart>> parts = node::ParseNodeSwitchParts(pause, resume);
  if (!parts.ok()) {
    fmt::print(stderr, "vmstash: switch --node: {}\n", std::string(parts.status().message()));
    return 2;
  }
  node::NodeSwitchRequest request;
  request.parts = std::move(*parts);
  request.device = device;
  request.timeout_ms = timeout_ms;
  absl::StatusOr<node::NodeSwitchResult> result = node::RunNodeSwitch(request);
  if (!result.ok()) {
    fmt::print(stderr, "vmstash: switch --node: {}\n", std::string(result.status().message()));
    return 1;
  }
  const absl::Status status = node::NodeSwitchStatus(*result);
  if (json) {
    fmt::print("{}\n", node::NodeSwitchJson(*result));
  } else if (status.ok()) {
    for (const node::NodeSwitchOutcome& p : result->processes) {
      fmt::print("process {}: {}\n", p.pid, p.changed ? "switched" : "every tag already in its state");
    }
    fmt::print("node switch {}: committed\n", result->txn);
  }
  if (!status.ok()) fmt::print(stderr, "vmstash: {}\n", std::string(status.message()));
  return status.ok() ? 0 : 1;
}

}  // namespace vmstash::cli
