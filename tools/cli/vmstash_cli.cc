// vmstash: inspect and steer processes that use vmstash, through their control endpoints
// (control/endpoint.h, docs/architecture.md §8).
//
//   vmstash ps [--json]                      processes on this node, per GPU
//   vmstash show PID [--json]                tags: policy, state, bytes, chunks, timings
//   vmstash pause PID TAG [--device=N] [--json]
//   vmstash resume PID TAG [--device=N] [--json]
//   vmstash switch PID --pause A,B --resume C,D [--device=N] [--json]
//                                            one transaction (Note [Switch Protocol])
//   vmstash snapshot PID -o FILE [--format=json|torch]
//                                            our snapshot JSON (allocator/snapshot.h), or a
//                                            pickle PyTorch's memory_viz loads
//   vmstash map PID -o FILE.svg|FILE.html    a picture of the address spaces (map_svg.h)
//   vmstash top [--interval=SECONDS] [--iterations=N]   `ps`, refreshed
//
// Sizes are human-readable unless --json. Exit status: 0 ok, 1 the operation failed (the
// reason on stderr: no such process, permission denied, protocol version mismatch, ...),
// 2 bad usage. VMSTASH_RUNTIME_DIR overrides where endpoints are looked for.
//
// Deadlines: as Note [Client Deadlines] in control/endpoint.h (reads 5 s; pause, resume
// and switch none, since they take as long as the bytes they move: they end with the
// reply, or with an error when the process exits). --timeout=SECONDS gives every request
// of the command that deadline instead (0: none).
#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "control/endpoint.h"
#include "fmt/format.h"
#include "base/bytes.h"
#include "base/json_reader.h"
#include "tools/cli/per_device.h"
#include "tools/cli/map_svg.h"
#include "tools/cli/torch_snapshot.h"

namespace vmstash::cli {
namespace {

constexpr const char* kUsage =
    "usage: vmstash ps [--json]\n"
    "       vmstash show PID [--json]\n"
    "       vmstash pause PID TAG [--device=N] [--json]\n"
    "       vmstash resume PID TAG [--device=N] [--json]\n"
    "       vmstash switch PID --pause A,B --resume C,D [--device=N] [--json]\n"
    "       vmstash snapshot PID -o FILE [--format=json|torch]\n"
    "       vmstash map PID -o FILE.svg|FILE.html\n"
    "       vmstash top [--interval=SECONDS] [--iterations=N]\n"
    "options: --timeout=SECONDS  deadline of each request (0: none; default 5 s, none for\n"
    "                            pause/resume/switch)\n";

// The deadlines of every request; set once by Main (--timeout) before any request.
control::CallOptions call_options;

absl::StatusOr<std::string> CallPid(const std::string& path, const control::Request& r) {
  return control::Call(path, r, call_options);
}

int Fail(const absl::Status& status, absl::string_view context) {
  std::string hint;
  if (absl::IsPermissionDenied(status)) hint = " (only the process's own user may control it)";
  if (absl::IsUnavailable(status)) hint = " (the process is gone or its endpoint is stale)";
  if (absl::IsDeadlineExceeded(status)) hint = " (no reply within --timeout; the request may still complete)";
  fmt::print(stderr, "vmstash: {}: {}{}\n", std::string(context), std::string(status.message()), hint);
  return 1;
}

absl::StatusOr<JsonValue> Ask(int pid, control::Request r) {
  absl::StatusOr<std::string> path = control::EndpointOf(pid);
  if (!path.ok()) return path.status();
  absl::StatusOr<std::string> reply = CallPid(*path, r);
  if (!reply.ok()) return reply.status();
  return JsonValue::Parse(*reply);
}

absl::StatusOr<JsonValue> Ask(int pid, control::Op op, const std::string& tag = "", int device = -1) {
  control::Request r;
  r.op = op;
  r.tag = tag;
  r.device = device;
  return Ask(pid, std::move(r));
}

// stats may be one device's object or an array of them (nothing for anything else).
std::vector<const JsonValue*> Devices(const JsonValue& stats) {
  absl::StatusOr<std::vector<const JsonValue*>> d = PerDevice(stats, "stats");
  return d.ok() ? *std::move(d) : std::vector<const JsonValue*>{};
}

int Ps(bool json) {
  std::vector<control::Endpoint> endpoints = control::ListEndpoints();
  std::string out = json ? "[" : "";
  if (!json) {
    out += fmt::format("{:>8}  {:<16} {:>4}  {:>11} {:>11} {:>11} {:>11}\n", "PID", "NAME", "GPU", "RESERVED",
                       "ALLOCATED", "PAUSED", "BACKED-UP");
  }
  bool first = true;
  for (const control::Endpoint& e : endpoints) {
    absl::StatusOr<JsonValue> hello = Ask(e.pid, control::Op::kHello);
    absl::StatusOr<JsonValue> stats = Ask(e.pid, control::Op::kStats);
    if (!hello.ok() || !stats.ok()) {
      const absl::Status& s = hello.ok() ? stats.status() : hello.status();
      if (json) {
        out += fmt::format("{}{{\"pid\":{},\"error\":\"{}\"}}", first ? "" : ",", e.pid, std::string(s.message()));
      } else {
        out += fmt::format("{:>8}  ({})\n", e.pid, std::string(s.message()));
      }
      first = false;
      continue;
    }
    for (const JsonValue* d : Devices(*stats)) {
      const JsonValue& t = (*d)["total"];
      std::int64_t paused = 0, backed = 0;
      for (const JsonValue& tag : (*d)["tags"].items()) {
        paused += tag["paused_bytes"].Int();
        backed += tag["backed_up_bytes"].Int();
      }
      if (json) {
        out += fmt::format(
            "{}{{\"pid\":{},\"name\":\"{}\",\"device\":{},\"reserved_bytes\":{},\"allocated_bytes\":{},"
            "\"paused_bytes\":{},\"backed_up_bytes\":{}}}",
            first ? "" : ",", e.pid, (*hello)["name"].String(), (*d)["device"].Int(),
            t["reserved_bytes"]["current"].Int(), t["allocated_bytes"]["current"].Int(), paused, backed);
      } else {
        out += fmt::format("{:>8}  {:<16} {:>4}  {:>11} {:>11} {:>11} {:>11}\n", e.pid, (*hello)["name"].String(),
                           (*d)["device"].Int(), HumanBytes(t["reserved_bytes"]["current"].Int()),
                           HumanBytes(t["allocated_bytes"]["current"].Int()), HumanBytes(paused), HumanBytes(backed));
      }
      first = false;
    }
  }
  if (json) out += "]\n";
  if (!json && endpoints.empty()) out += "(no process with a vmstash control endpoint for this user)\n";
  fmt::print("{}", out);
  return 0;
}

int Show(int pid, bool json) {
  absl::StatusOr<JsonValue> hello = Ask(pid, control::Op::kHello);
  if (!hello.ok()) return Fail(hello.status(), fmt::format("process {}", pid));
  absl::StatusOr<std::string> path = control::EndpointOf(pid);
  control::Request r;
  r.op = control::Op::kStats;
  absl::StatusOr<std::string> raw = CallPid(*path, r);
  if (!raw.ok()) return Fail(raw.status(), fmt::format("process {}", pid));
  if (json) {
    fmt::print("{}\n", *raw);
    return 0;
  }
  absl::StatusOr<JsonValue> stats = JsonValue::Parse(*raw);
  if (!stats.ok()) return Fail(stats.status(), "reply");
  fmt::print("process {} ({}), vmstash {}, driver {}, {} device(s)\n", pid, (*hello)["name"].String(),
             (*hello)["version"].String(), (*hello)["driver"].String(), (*hello)["device_count"].Int());
  for (const JsonValue* d : Devices(*stats)) {
    const JsonValue& t = (*d)["total"];
    const std::int64_t reserved = t["reserved_bytes"]["current"].Int(), allocated = t["allocated_bytes"]["current"].Int();
    // Fragmentation over active tags: cached (free) bytes inside their reserved chunks.
    double active_reserved = 0, active_allocated = 0;
    for (const JsonValue& tag : (*d)["tags"].items()) {
      if (tag["state"].String() != "active") continue;
      active_reserved += tag["reserved_bytes"]["current"].Number();
      active_allocated += tag["allocated_bytes"]["current"].Number();
    }
    fmt::print("GPU {} ({} driver): reserved {}, allocated {} (paused tags included), free in reserved chunks of "
               "active tags {:.1f}%\n",
               (*d)["device"].Int(), (*d)["driver"].String(), HumanBytes(reserved), HumanBytes(allocated),
               active_reserved > 0 ? 100.0 * (active_reserved - active_allocated) / active_reserved : 0.0);
    fmt::print("  {:<16} {:<8} {:<9} {:>11} {:>11} {:>7} {:>7} {:>11} {:>11} {:>17} {:>17}\n", "TAG", "POLICY", "STATE",
               "RESERVED", "ALLOCATED", "BLOCKS", "CHUNKS", "PAUSED", "BACKED-UP", "LAST PAUSE", "LAST RESUME");
    for (const JsonValue& tag : (*d)["tags"].items()) {
      auto timing = [](double ms, double gibs) {
        return ms <= 0 ? std::string("-") : gibs > 0 ? fmt::format("{:.1f} ms {:.1f}G/s", ms, gibs)
                                                     : fmt::format("{:.1f} ms", ms);
      };
      fmt::print("  {:<16} {:<8} {:<9} {:>11} {:>11} {:>7} {:>7} {:>11} {:>11} {:>17} {:>17}\n", tag["name"].String(),
                 tag["policy"].String(), tag["state"].String(), HumanBytes(tag["reserved_bytes"]["current"].Int()),
                 HumanBytes(tag["allocated_bytes"]["current"].Int()), tag["active_blocks"]["current"].Int(),
                 tag["chunks"].Int(), HumanBytes(tag["paused_bytes"].Int()), HumanBytes(tag["backed_up_bytes"].Int()),
                 timing(tag["last_pause_ms"].Number(), tag["last_pause_gib_per_s"].Number()),
                 timing(tag["last_resume_ms"].Number(), tag["last_resume_gib_per_s"].Number()));
    }
  }
  return 0;
}

int Transition(int pid, const std::string& tag, bool pause, int device, bool json) {
  absl::StatusOr<JsonValue> r = Ask(pid, pause ? control::Op::kPause : control::Op::kResume, tag, device);
  const char* verb = pause ? "pause" : "resume";
  if (!r.ok()) return Fail(r.status(), fmt::format("{} {} of process {}", verb, tag, pid));
  const bool changed = (*r)["changed"].Bool();
  if (json) {
    fmt::print("{{\"pid\":{},\"tag\":\"{}\",\"op\":\"{}\",\"changed\":{}}}\n", pid, tag, verb, changed);
  } else {
    fmt::print("{} {} of process {}: {}\n", verb, tag, pid,
               changed ? "done" : pause ? "already paused (nothing to do)" : "already active (nothing to do)");
  }
  return 0;
}

int Switch(int pid, const std::string& pause, const std::string& resume, int device, bool json) {
  control::Request r;
  r.op = control::Op::kSwitch;
  r.pause = absl::StrSplit(pause, ',', absl::SkipEmpty());
  r.resume = absl::StrSplit(resume, ',', absl::SkipEmpty());
  r.device = device;
  const std::string what = fmt::format("switch of process {} (pause {}; resume {})", pid, pause.empty() ? "-" : pause,
                                       resume.empty() ? "-" : resume);
  absl::StatusOr<JsonValue> reply = Ask(pid, std::move(r));
  if (!reply.ok()) return Fail(reply.status(), what);
  const bool changed = (*reply)["changed"].Bool();
  if (json) {
    fmt::print("{{\"pid\":{},\"op\":\"switch\",\"pause\":\"{}\",\"resume\":\"{}\",\"changed\":{}}}\n", pid, pause,
               resume, changed);
  } else {
    fmt::print("{}: {}\n", what, changed ? "done" : "every tag already in its state (nothing to do)");
  }
  return 0;
}

int Snapshot(int pid, const std::string& file, bool torch_format) {
  absl::StatusOr<std::string> path = control::EndpointOf(pid);
  if (!path.ok()) return Fail(path.status(), fmt::format("process {}", pid));
  control::Request r;
  r.op = control::Op::kSnapshot;
  absl::StatusOr<std::string> raw = CallPid(*path, r);
  if (!raw.ok()) return Fail(raw.status(), fmt::format("snapshot of process {}", pid));
  std::string bytes = *raw + "\n";
  if (torch_format) {
    absl::StatusOr<JsonValue> parsed = JsonValue::Parse(*raw);
    if (!parsed.ok()) return Fail(parsed.status(), "snapshot reply");
    absl::StatusOr<std::string> pickle = TorchSnapshotPickle(*parsed);
    if (!pickle.ok()) return Fail(pickle.status(), "torch format");
    bytes = *std::move(pickle);
  }
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out << bytes;
  if (!out.good()) return Fail(absl::InternalError(fmt::format("cannot write {}", file)), "snapshot");
  fmt::print("snapshot of process {} written to {} ({}, {})\n", pid, file, torch_format ? "torch pickle" : "json",
             HumanBytes(bytes.size()));
  return 0;
}

int Map(int pid, const std::string& file) {
  absl::StatusOr<JsonValue> snap = Ask(pid, control::Op::kSnapshot);
  if (!snap.ok()) return Fail(snap.status(), fmt::format("snapshot of process {}", pid));
  const std::string title = fmt::format("vmstash map of process {}", pid);
  absl::StatusOr<std::string> svg = MapSvg(*snap, title);
  if (!svg.ok()) return Fail(svg.status(), "map");
  const bool html = absl::EndsWith(file, ".html") || absl::EndsWith(file, ".htm");
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out << (html ? MapHtml(*svg, title) : *svg);
  if (!out.good()) return Fail(absl::InternalError(fmt::format("cannot write {}", file)), "map");
  fmt::print("map of process {} written to {}\n", pid, file);
  return 0;
}

int Top(double interval_s, int iterations) {
  for (int i = 0; iterations <= 0 || i < iterations; ++i) {
    if (i > 0) std::this_thread::sleep_for(std::chrono::duration<double>(interval_s));
    fmt::print("\x1b[H\x1b[2Jvmstash top (every {:.1f} s; Ctrl-C quits)\n", interval_s);
    Ps(false);
    std::fflush(stdout);
  }
  return 0;
}

int Main(int argc, char** argv) {
  std::vector<std::string> args;
  bool json = false;
  int device = -1;
  std::string output, format = "json", pause_list, resume_list;
  bool has_lists = false;
  double interval = 1.0;
  int iterations = 0;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--json") {
      json = true;
    } else if (absl::StartsWith(a, "--device=")) {
      if (!absl::SimpleAtoi(a.substr(9), &device) || device < -1) return fmt::print(stderr, "{}", kUsage), 2;
    } else if (absl::StartsWith(a, "--timeout=")) {
      double seconds = 0;
      if (!absl::SimpleAtod(a.substr(10), &seconds) || !(seconds >= 0) || seconds > 1e6) {
        return fmt::print(stderr, "{}", kUsage), 2;
      }
      const int ms = static_cast<int>(seconds * 1000);
      call_options.read_timeout_ms = call_options.transition_timeout_ms = seconds > 0 && ms == 0 ? 1 : ms;
    } else if (absl::StartsWith(a, "--interval=")) {
      if (!absl::SimpleAtod(a.substr(11), &interval) || interval <= 0) return fmt::print(stderr, "{}", kUsage), 2;
    } else if (absl::StartsWith(a, "--iterations=")) {
      if (!absl::SimpleAtoi(a.substr(13), &iterations) || iterations < 0) return fmt::print(stderr, "{}", kUsage), 2;
    } else if (absl::StartsWith(a, "--format=")) {
      format = a.substr(9);
      if (format != "json" && format != "torch") return fmt::print(stderr, "{}", kUsage), 2;
    } else if ((a == "--pause" || a == "--resume") && i + 1 < argc) {
      (a == "--pause" ? pause_list : resume_list) = argv[++i];
      has_lists = true;
    } else if (absl::StartsWith(a, "--pause=") || absl::StartsWith(a, "--resume=")) {
      const bool p = absl::StartsWith(a, "--pause=");
      (p ? pause_list : resume_list) = a.substr(p ? 8 : 9);
      has_lists = true;
    } else if (a == "-o" && i + 1 < argc) {
      output = argv[++i];
    } else if (a == "-h" || a == "--help") {
      fmt::print("{}", kUsage);
      return 0;
    } else {
      args.push_back(a);
    }
  }
  auto pid_arg = [&](int* pid) { return args.size() >= 2 && absl::SimpleAtoi(args[1], pid) && *pid > 0; };
  int pid = 0;
  if (args.size() == 1 && args[0] == "ps") return Ps(json);
  if (args.size() == 2 && args[0] == "show" && pid_arg(&pid)) return Show(pid, json);
  if (args.size() == 3 && (args[0] == "pause" || args[0] == "resume") && pid_arg(&pid)) {
    return Transition(pid, args[2], args[0] == "pause", device, json);
  }
  if (args.size() == 2 && args[0] == "switch" && pid_arg(&pid) && has_lists) {
    return Switch(pid, pause_list, resume_list, device, json);
  }
  if (has_lists) return fmt::print(stderr, "{}", kUsage), 2;  // --pause/--resume belong to switch
  if (args.size() == 1 && args[0] == "top") return Top(interval, iterations);
  if (args.size() == 2 && args[0] == "map" && pid_arg(&pid) && !output.empty()) return Map(pid, output);
  if (args.size() == 2 && args[0] == "snapshot" && pid_arg(&pid) && !output.empty()) return Snapshot(pid, output, format == "torch");
  fmt::print(stderr, "{}", kUsage);
  return 2;
}

}  // namespace
}  // namespace vmstash::cli

int main(int argc, char** argv) { return vmstash::cli::Main(argc, argv); }
