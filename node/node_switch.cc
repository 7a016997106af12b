// NodeSwitch: see node_switch.h (Note [Node Switch]).
#include "node/node_switch.h"

#include <unistd.h>

#include <algorithm>
#include <set>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/json_reader.h"
#include "base/json_writer.h"
#include "control/endpoint.h"
#include "control/runtime_dir.h"
#include "node/decision_record.h"
#include "node/launch.h"
#include "node/switch_vote.h"
#include "node/wire.h"

namespace vmstash::node {
namespace {

absl::Status CheckRequest(const NodeSwitchRequest& r) {
  if (r.parts.empty()) return absl::InvalidArgumentError("node switch: no process named");
  if (r.timeout_ms <= 0) return absl::InvalidArgumentError(absl::StrCat("node switch: timeout ", r.timeout_ms, " ms"));
  std::set<pid_t> pids;
  for (const NodeSwitchPart& p : r.parts) {
    if (p.pid <= 0) return absl::InvalidArgumentError(absl::StrCat("node switch: pid ", p.pid, " is not a process"));
    if (!pids.insert(p.pid).second) {
      return absl::InvalidArgumentError(absl::StrCat("node switch: process ", p.pid, " named as two parts"));
    }
    if (p.pause.empty() && p.resume.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("node switch: no tag named for process ", p.pid));
    }
  }
  return absl::OkStatus();
}

// Begins the switch with the daemon (started when none serves): its id.
absl::StatusOr<std::string> Begin(const NodeSwitchRequest& r, const std::string& dir) {
  std::vector<std::string> pids, donors;
  for (const NodeSwitchPart& p : r.parts) {
    pids.push_back(absl::StrCat(p.pid));
    if (!p.pause.empty()) donors.push_back(absl::StrCat(p.pid));
  }
  WireRequest begin;
  begin.op = WireOp::kBegin;
  begin.pids = absl::StrJoin(pids, ",");
  begin.donors = absl::StrJoin(donors, ",");
  begin.timeout_ms = static_cast<std::uint64_t>(r.timeout_ms);
  absl::StatusOr<JsonValue> reply = AskOnce(dir, begin, 5000);
  if (!reply.ok() && absl::IsUnavailable(reply.status()) && DaemonGone(dir)) {
    absl::StatusOr<Started> started = StartDaemon(dir, r.start_capacity > 0 ? r.start_capacity : DefaultCapacityBytes());
    if (!started.ok()) {
      return absl::Status(started.status().code(),
                          absl::StrCat("node switch: no node daemon, and none could be started: ",
                                       started.status().message()));
    }
    reply = AskOnce(dir, begin, 5000);
  }
  if (!reply.ok()) return reply.status();
  const std::string txn = (*reply)["txn"].String();
  if (!IsSwitchId(txn)) return absl::InternalError("node switch: the daemon's begin carried no switch id");
  return txn;
}

}  // namespace

absl::StatusOr<std::vector<NodeSwitchPart>> ParseNodeSwitchParts(const std::string& pause, const std::string& resume) {
  std::vector<NodeSwitchPart> parts;
  std::set<std::pair<pid_t, std::string>> seen;
  for (const std::string* list : {&pause, &resume}) {
    for (absl::string_view entry : absl::StrSplit(*list, ',', absl::SkipWhitespace())) {
      const std::size_t colon = entry.find(':');
      int pid = 0;
      if (colon == absl::string_view::npos || !absl::SimpleAtoi(entry.substr(0, colon), &pid) || pid <= 0 ||
          colon + 1 == entry.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("node switch: \"", entry, "\" is not PID:TAG (a process id, a colon, a tag name)"));
      }
      const std::string tag(entry.substr(colon + 1));
      if (!seen.insert({pid, tag}).second) {
        return absl::InvalidArgumentError(absl::StrCat("node switch: ", pid, ":", tag, " is named twice"));
      }
      auto p = std::find_if(parts.begin(), parts.end(), [pid](const NodeSwitchPart& q) { return q.pid == pid; });
      if (p == parts.end()) p = parts.insert(parts.end(), NodeSwitchPart{pid, {}, {}});
      (list == &pause ? p->pause : p->resume).push_back(tag);
    }
  }
  if (parts.empty()) return absl::InvalidArgumentError("node switch: no PID:TAG to pause or resume");
  return parts;
}

absl::StatusOr<NodeSwitchResult> RunNodeSwitch(const NodeSwitchRequest& r) {
  if (absl::Status s = CheckRequest(r); !s.ok()) return s;
  const std::string dir = r.dir.empty() ? control::DefaultRuntimeDir() : r.dir;
  std::vector<std::string> endpoints;
  for (const NodeSwitchPart& p : r.parts) {
    absl::StatusOr<std::string> e = control::EndpointOf(p.pid, dir);
    if (!e.ok()) {
      return absl::Status(e.status().code(), absl::StrCat("node switch: process ", p.pid, ": ", e.status().message()));
    }
    endpoints.push_back(*e);
  }
  absl::StatusOr<std::string> txn = Begin(r, dir);
  if (!txn.ok()) return txn.status();

  NodeSwitchResult result;
  result.txn = *txn;
  result.processes.resize(r.parts.size());
  // (2): every part at once; each answers after the decision, or is given up on.
  const int wait_ms = r.timeout_ms + 2 * kVoteGraceMs;
  std::vector<std::thread> threads;
  threads.reserve(r.parts.size());
  const auto part = [&](std::size_t i) {
    control::Request q;
    q.op = control::Op::kSwitch;
    q.pause = r.parts[i].pause;
    q.resume = r.parts[i].resume;
    q.device = r.device;
    q.txn = *txn;
    q.timeout_ms = r.timeout_ms;
    NodeSwitchOutcome& out = result.processes[i];
    out.pid = r.parts[i].pid;
    absl::StatusOr<std::string> reply = control::Call(endpoints[i], q, wait_ms);
    if (!reply.ok()) {
      out.status = reply.status();
      return;
    }
    absl::StatusOr<JsonValue> doc = JsonValue::Parse(*reply);
    out.changed = doc.ok() && (*doc)["changed"].Bool(false);
  };
  for (std::size_t i = 0; i < r.parts.size(); ++i) {
    try {
      threads.emplace_back(part, i);
    } catch (const std::system_error&) {  // no thread: this part from here, after the others are off
      part(i);
    }
  }
  for (std::thread& t : threads) t.join();

  // The decision, from the daemon (which then knows this initiator was told, and can
  // forget the switch), else from its record.
  WireRequest outcome;
  outcome.op = WireOp::kOutcome;
  outcome.txn = *txn;
  outcome.pid = ::getpid();
  absl::StatusOr<JsonValue> reply = AskOnce(dir, outcome, 5000);
  const std::string decision = reply.ok() ? (*reply)["decision"].String() : "";
  if (decision == "commit" || decision == "abort") {
    result.committed = decision == "commit";
    result.reason = (*reply)["reason"].String();
  } else {
    absl::StatusOr<std::optional<SwitchDecision>> recorded = ReadDecision(dir, *txn);
    if (recorded.ok() && recorded->has_value()) {
      result.committed = (*recorded)->commit;
      result.reason = (*recorded)->reason;
    } else {
      result.committed = false;
      result.reason = absl::StrCat("the decision is unknown here (", !reply.ok() ? reply.status().message()
                                   : decision == "pending" ? "the daemon has not decided: it hangs?" : decision,
                                   "); each process's answer says what it did");
    }
  }
  return result;
}

absl::Status NodeSwitchStatus(const NodeSwitchResult& r) {
  std::vector<std::string> lines;
  absl::StatusCode code = absl::StatusCode::kOk;
  for (const NodeSwitchOutcome& p : r.processes) {
    if (p.status.ok()) {
      lines.push_back(absl::StrCat("process ", p.pid, ": ", r.committed ? "switched" : "?"));
      continue;
    }
    if (code == absl::StatusCode::kOk) code = p.status.code();
    lines.push_back(absl::StrCat("process ", p.pid, ": ", p.status.message()));
  }
  if (!r.committed) {
    return absl::AbortedError(absl::StrCat("node switch ", r.txn, " rolled back (", r.reason,
                                           "); every process is as before: ", absl::StrJoin(lines, "; ")));
  }
  if (code == absl::StatusCode::kOk) return absl::OkStatus();
  return absl::Status(code, absl::StrCat("node switch ", r.txn, " committed, but not every process confirmed it: ",
                                         absl::StrJoin(lines, "; ")));
}

std::string NodeSwitchJson(const NodeSwitchResult& r) {
  JsonWriter w;
  w.BeginObject();
  w.Field("txn", r.txn);
  w.Field("committed", r.committed);
  w.Field("reason", r.reason);
  w.Key("processes");
  w.BeginArray();
  for (const NodeSwitchOutcome& p : r.processes) {
    w.BeginObject();
    w.Field("pid", static_cast<std::int64_t>(p.pid));
    w.Field("ok", p.status.ok());
    w.Field("changed", p.changed);
    w.Field("code", absl::StatusCodeToString(p.status.code()));
    w.Field("message", p.status.message());
    w.EndObject();
  }
  w.EndArray();
  w.EndObject();
  return w.str();
}

}  // namespace vmstash::node
