// vmstash: inspect and steer processes that use vmstash, through their control endpoints
// (control/endpoint.h, docs/architecture.md §8).
//
//   vmstash ps [--json]                      processes on this node, per GPU
//   vmstash show PID [--json]                tags: policy, state, bytes, chunks, timings
//   vmstash pause PID TAG [--device=N] [--json]
//   vmstash resume PID TAG [--device=N] [--json]
//   vmstash switch PID --pause A,B --resume C,D [--device=N] [--json]
//                                            one transaction (Note [Switch Protocol])
//   vmstash switch --node --pause PID:A,... --resume PID:C,... [--timeout=S] [--json]
//                                            one transaction over processes (daemon_cmd.h)
//   vmstash snapshot PID -o FILE [--format=json|torch]
//                                            our snapshot JSON (allocator/snapshot.h), or a
//                                            pickle PyTorch's memory_viz loads
//   vmstash map PID -o FILE.svg|FILE.html    a picture of the address spaces (map_svg.h)
//   vmstash top [--interval=SECONDS] [--iterations=N]   `ps`, refreshed
//   vmstash daemon start --capacity=SIZE | stop | status [--json]
//                                            the node daemon (daemon_cmd.h)
//   vmstash --version                        the version (base/version.h)
//   vmstash COMMAND --help                   the command's usage (-h too; `vmstash --help`: all)
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
#include "base/conf.h"
#include "base/json_reader.h"
#include "base/version.h"
#include "tools/cli/daemon_cmd.h"
#include "tools/cli/per_device.h"
#include "tools/cli/map_svg.h"
#include "tools/cli/torch_snapshot.h"

namespace vmstash::cli {
namespace {

// The options, as bits of Command::options: which command takes which.
enum Option : unsigned {
  kJson = 1 << 0,
  kDevice = 1 << 1,
  kLists = 1 << 2,  // --pause, --resume
  kOutput = 1 << 3,
  kFormat = 1 << 4,
  kInterval = 1 << 5,
  kIterations = 1 << 6,
  kTimeout = 1 << 7,  // every command
  kCapacity = 1 << 8,
  kNode = 1 << 9,  // switch --node
};

struct OptionHelp {
  Option option;
  const char* name;  // as messages name it
  const char* help;  // its lines of a command's --help
};

// In the order of the synopses.
constexpr OptionHelp kOptionHelp[] = {
    {kLists, "--pause/--resume",
     "  --pause A,B            the tags to pause (also --pause=A,B)\n"
     "  --resume C,D           the tags to resume (also --resume=C,D); either list may be left out\n"},
    {kNode, "--node",
     "  --node                 over the node's processes: every tag is PID:TAG, and --timeout=SECONDS\n"
     "                         is how long each process has to vote (default 60)\n"},
    {kOutput, "-o", "  -o FILE                the file to write\n"},
    {kFormat, "--format", "  --format=json|torch    vmstash's snapshot JSON (default), or a pickle for memory_viz\n"},
    {kDevice, "--device",
     "  --device=N             device N only (default, or -1: every device the process uses)\n"},
    {kJson, "--json", "  --json                 JSON on stdout instead of text\n"},
    {kInterval, "--interval", "  --interval=SECONDS     time between refreshes (default 1)\n"},
    {kIterations, "--iterations", "  --iterations=N         stop after N refreshes (default 0: until Ctrl-C)\n"},
    {kCapacity, "--capacity", "  --capacity=SIZE        the node pool's bytes (64G, 512M, ...; start only)\n"},
    {kTimeout, "--timeout",
     "  --timeout=SECONDS      deadline of each request (0: none; default 5 s, none for\n"
     "                         pause/resume/switch)\n"},
};

struct Command {
  const char* name;
  const char* synopsis;  // after "vmstash "
  const char* summary;
  unsigned options;
  int operands;  // after the command's name: PID, then TAG for pause/resume
};

constexpr Command kCommands[] = {
    {"ps", "ps [--json]",
     "Lists this user's processes that serve a vmstash control endpoint, per GPU: reserved, allocated,\n"
     "paused and backed-up bytes.",
     kJson | kTimeout, 0},
    {"show", "show PID [--json]",
     "Shows the tags of process PID: policy, state, bytes, blocks, chunks, last pause and resume.",
     kJson | kTimeout, 1},
    {"pause", "pause PID TAG [--device=N] [--json]",
     "Pauses TAG in process PID: its physical memory is released (a backup tag's bytes are copied\n"
     "out first); its addresses stay reserved.",
     kDevice | kJson | kTimeout, 2},
    {"resume", "resume PID TAG [--device=N] [--json]",
     "Resumes TAG in process PID at the same addresses (a backup tag's bytes are copied back).",
     kDevice | kJson | kTimeout, 2},
    {"switch", "switch PID --pause A,B --resume C,D [--device=N] [--json]\n"
     "       vmstash switch --node --pause PID:A,... --resume PID:C,... [--device=N] [--json]",
     "Pauses A,B and resumes C,D in process PID in one transaction: all of it or nothing\n"
     "(Note [Switch Protocol]). With --node, tags of several processes in one transaction\n"
     "coordinated by the node daemon (docs/node.md, Note [Node Switch]).",
     kLists | kDevice | kJson | kTimeout | kNode, 1},
    {"snapshot", "snapshot PID -o FILE [--format=json|torch]",
     "Writes the allocator snapshot of process PID to FILE: vmstash's JSON (allocator/snapshot.h),\n"
     "or a pickle PyTorch's memory_viz loads.",
     kOutput | kFormat | kTimeout, 1},
    {"map", "map PID -o FILE.svg|FILE.html",
     "Draws the address spaces of process PID (tags, chunks, blocks; paused tags dashed) as SVG,\n"
     "or as an HTML page around it when FILE ends in .html.",
     kOutput | kTimeout, 1},
    {"top", "top [--interval=SECONDS] [--iterations=N]", "`vmstash ps`, refreshed.",
     kInterval | kIterations | kTimeout, 0},
    {"daemon", "daemon start --capacity=SIZE | stop | status [--json]",
     "Starts (in the background), stops or reports this user's node daemon, vmstashd: one host\n"
     "pool shared by the node's processes (docs/node.md).",
     kCapacity | kJson, 1},
};

const Command* FindCommand(absl::string_view name) {
  for (const Command& c : kCommands) {
    if (name == c.name) return &c;
  }
  return nullptr;
}

// `vmstash --help`: every command's synopsis.
std::string Usage() {
  std::string out;
  for (const Command& c : kCommands) {
    out += fmt::format("{}vmstash {}\n", out.empty() ? "usage: " : "       ", c.synopsis);
  }
  out +=
      "       vmstash --version\n"
      "options: --timeout=SECONDS  deadline of each request (0: none; default 5 s, none for\n"
      "                            pause/resume/switch)\n"
      "`vmstash COMMAND --help` describes a command. Exit status: 0 ok, 1 the operation failed,\n"
      "2 bad usage.\n";
  return out;
}

// `vmstash COMMAND --help`: its synopsis, what it does and its options.
std::string Usage(const Command& c) {
  std::string out = fmt::format("usage: vmstash {}\n{}\noptions:\n", c.synopsis, c.summary);
  for (const OptionHelp& o : kOptionHelp) {
    if (c.options & o.option) out += o.help;
  }
  out += "  -h, --help             this help\n";
  return out;
}

// Bad usage: the reason, then the usage of the command (all of them when there is none), on
// stderr; exit status 2.
int BadUsage(const Command* c, absl::string_view reason) {
  fmt::print(stderr, "vmstash{}{}: {}\n{}", c ? " " : "", c ? c->name : "", std::string(reason),
             c ? Usage(*c) : Usage());
  return 2;
}

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
  std::vector<std::string> args;  // the command and its operands
  bool json = false, help = false, version = false, options_done = false;
  unsigned given = 0;  // Option bits seen
  int device = -1;
  std::string output, format = "json", pause_list, resume_list;
  double interval = 1.0;
  int iterations = 0;
  std::uint64_t capacity = 0;  // daemon start
  std::string error;  // the first bad option; reported once the command is known
  auto bad = [&](std::string reason) {
    if (error.empty()) error = std::move(reason);
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (options_done || a.size() < 2 || a[0] != '-') {
      args.push_back(a);
    } else if (a == "--") {  // the rest are operands (a TAG starting with '-')
      options_done = true;
    } else if (a == "-h" || a == "--help") {
      help = true;
    } else if (a == "--version") {
      version = true;
    } else if (a == "--node") {
      given |= kNode;
    } else if (a == "--json") {
      json = true;
      given |= kJson;
    } else if (absl::StartsWith(a, "--device=")) {
      given |= kDevice;
      if (!absl::SimpleAtoi(a.substr(9), &device) || device < -1) {
        bad(fmt::format("{}: N must be a device number (or -1: every device)", a));
      }
    } else if (absl::StartsWith(a, "--timeout=")) {
      given |= kTimeout;
      double seconds = 0;
      if (!absl::SimpleAtod(a.substr(10), &seconds) || !(seconds >= 0) || seconds > 1e6) {
        bad(fmt::format("{}: SECONDS must be a number from 0 (no deadline) to 1e6", a));
        continue;
      }
      const int ms = static_cast<int>(seconds * 1000);
      call_options.read_timeout_ms = call_options.transition_timeout_ms = seconds > 0 && ms == 0 ? 1 : ms;
    } else if (absl::StartsWith(a, "--interval=")) {
      given |= kInterval;
      if (!absl::SimpleAtod(a.substr(11), &interval) || !(interval > 0) || interval > 1e6) {
        bad(fmt::format("{}: SECONDS must be a number above 0", a));
      }
    } else if (absl::StartsWith(a, "--iterations=")) {
      given |= kIterations;
      if (!absl::SimpleAtoi(a.substr(13), &iterations) || iterations < 0) {
        bad(fmt::format("{}: N must be a count (0: until Ctrl-C)", a));
      }
    } else if (absl::StartsWith(a, "--capacity=")) {
      given |= kCapacity;
      absl::StatusOr<std::uint64_t> size = ParseSize(a.substr(11));
      if (!size.ok() || *size == 0) bad(fmt::format("{}: SIZE must be a size above 0 (64G, 512M, ...)", a));
      else capacity = *size;
    } else if (absl::StartsWith(a, "--format=")) {
      given |= kFormat;
      format = a.substr(9);
      if (format != "json" && format != "torch") bad(fmt::format("{}: the format is json or torch", a));
    } else if (a == "--pause" || a == "--resume" || a == "-o") {
      given |= a == "-o" ? kOutput : kLists;
      if (i + 1 >= argc) {
        bad(fmt::format("{} needs a value", a));
        continue;
      }
      (a == "-o" ? output : a == "--pause" ? pause_list : resume_list) = argv[++i];
    } else if (absl::StartsWith(a, "--pause=") || absl::StartsWith(a, "--resume=")) {
      given |= kLists;
      const bool p = absl::StartsWith(a, "--pause=");
      (p ? pause_list : resume_list) = a.substr(p ? 8 : 9);
    } else {
      bad(fmt::format("unknown option {}", a));
    }
  }
  const Command* command = args.empty() ? nullptr : FindCommand(args[0]);
  if (!args.empty() && command == nullptr) return BadUsage(nullptr, fmt::format("unknown command '{}'", args[0]));
  if (help) {
    fmt::print("{}", command ? Usage(*command) : Usage());
    return 0;
  }
  if (version) {
    fmt::print("vmstash {}\n", kVersion);
    return 0;
  }
  if (command == nullptr) return BadUsage(nullptr, error.empty() ? "no command given" : error);
  if (!error.empty()) return BadUsage(command, error);
  for (const OptionHelp& o : kOptionHelp) {
    if ((given & o.option) && !(command->options & o.option)) {
      return BadUsage(command, fmt::format("{} is not an option of {}", o.name, command->name));
    }
  }
  const int operands = static_cast<int>(args.size()) - 1;
  if (operands > command->operands) {
    return BadUsage(command, fmt::format("unexpected argument '{}'", args[command->operands + 1]));
  }
  const std::string name = command->name;
  if (name == "daemon") {
    const std::string action = operands > 0 ? args[1] : "";
    if (action != "start" && action != "stop" && action != "status") {
      return BadUsage(command, action.empty() ? "start, stop or status is missing"
                                              : fmt::format("'{}' is not start, stop or status", action));
    }
    if ((action == "start") != ((given & kCapacity) != 0)) {
      return BadUsage(command, action == "start" ? "--capacity=SIZE is missing" : "--capacity is for start only");
    }
    if (json && action != "status") return BadUsage(command, "--json is for status only");
    if (action == "start") return DaemonStart(capacity);
    return action == "stop" ? DaemonStop() : DaemonStatus(json);
  }
  if (given & kNode) {  // switch --node: the pids are in the lists
    if (operands > 0) return BadUsage(command, fmt::format("switch --node takes no PID ('{}'): name PID:TAG", args[1]));
    if (pause_list.empty() && resume_list.empty()) {
      return BadUsage(command, "no tag to pause or resume (--pause PID:A,... and/or --resume PID:C,...)");
    }
    const int timeout_ms = (given & kTimeout) ? call_options.transition_timeout_ms : 60000;
    if (timeout_ms <= 0) return BadUsage(command, "--timeout=0: a node switch needs a deadline for its votes");
    return NodeSwitch(pause_list, resume_list, device, timeout_ms, json);
  }
  if (operands < command->operands) {
    return BadUsage(command, operands == 0 ? "PID is missing" : "TAG is missing");
  }
  int pid = 0;
  if (command->operands > 0 && (!absl::SimpleAtoi(args[1], &pid) || pid <= 0)) {
    return BadUsage(command, fmt::format("PID must be a process id (a number above 0), not '{}'", args[1]));
  }
  if ((command->options & kOutput) && output.empty()) return BadUsage(command, "-o FILE is missing");
  if ((command->options & kLists) && pause_list.empty() && resume_list.empty()) {
    return BadUsage(command, "no tag to pause or resume (--pause A,B and/or --resume C,D)");
  }
  if (name == "ps") return Ps(json);
  if (name == "show") return Show(pid, json);
  if (name == "pause" || name == "resume") return Transition(pid, args[2], name == "pause", device, json);
  if (name == "switch") return Switch(pid, pause_list, resume_list, device, json);
  if (name == "snapshot") return Snapshot(pid, output, format == "torch");
  if (name == "map") return Map(pid, output);
  return Top(interval, iterations);
}

}  // namespace
}  // namespace vmstash::cli

int main(int argc, char** argv) { return vmstash::cli::Main(argc, argv); }
