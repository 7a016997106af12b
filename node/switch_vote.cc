// A participant's vote in a node switch: see switch_vote.h.
#include "node/switch_vote.h"

#include <unistd.h>

#include <algorithm>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/json_reader.h"
#include "base/log.h"
#include "control/runtime_dir.h"
#include "node/decision_record.h"
#include "node/wire.h"

namespace vmstash::node {
namespace {

using Clock = std::chrono::steady_clock;

int MsUntil(Clock::time_point t) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(ms, 0, 1 << 30));
}

absl::Status AsOutcome(const SwitchDecision& d, const std::string& txn) {
  if (d.commit) return absl::OkStatus();
  return absl::AbortedError(absl::StrCat("node switch ", txn, " rolled back: ", d.reason));
}

// One request on a fresh connection, its reply waited for until `deadline`: the decision,
// nothing when "pending", or the failure.
absl::StatusOr<std::optional<SwitchDecision>> Ask(const VoteOptions& o, const WireRequest& request,
                                                  Clock::time_point deadline) {
  absl::StatusOr<int> fd = ConnectTrusted(o.dir);
  if (!fd.ok()) return fd.status();
  absl::Status s = Send(*fd, FormatRequest(request));
  absl::StatusOr<Received> got = s.ok() ? Receive(*fd, MsUntil(deadline)) : absl::StatusOr<Received>(s);
  ::close(*fd);
  if (!got.ok()) return got.status();
  if (got->fd >= 0) ::close(got->fd);
  absl::StatusOr<JsonValue> reply = ParseReply(got->message);
  if (!reply.ok()) return reply.status();
  const std::string decision = (*reply)["decision"].String();
  if (decision == "pending") return std::optional<SwitchDecision>();
  if (decision != "commit" && decision != "abort") {
    return absl::InternalError(absl::StrCat("node switch: the daemon's decision \"", decision, "\""));
  }
  return std::optional<SwitchDecision>(SwitchDecision{decision == "commit", (*reply)["reason"].String()});
}

}  // namespace

absl::Status VoteAndWait(const VoteOptions& o, const absl::Status& local) {
  const std::string dir = o.dir.empty() ? control::DefaultRuntimeDir() : o.dir;
  WireRequest vote;
  vote.op = WireOp::kVote;
  vote.txn = o.txn;
  vote.pid = ::getpid();
  vote.ok = local.ok();
  vote.reason = local.ok() ? "" : std::string(local.message()).substr(0, 4096);
  absl::StatusOr<std::optional<SwitchDecision>> d = Ask(o, vote, o.hard_deadline);
  if (!local.ok()) return local;  // voted (or tried to): a local failure rolls back whatever was decided
  if (d.ok() && d->has_value()) return AsOutcome(**d, o.txn);
  absl::Status lost = d.ok() ? absl::InternalError("pending") : d.status();
  VMSTASH_LOG(kWarning, "vmstash: node switch {}: the vote's reply did not come ({}); looking for the decision",
              o.txn, lost.message());
  WireRequest outcome;
  outcome.op = WireOp::kOutcome;
  outcome.txn = o.txn;
  outcome.pid = ::getpid();
  for (;;) {
    absl::StatusOr<std::optional<SwitchDecision>> recorded = ReadDecision(dir, o.txn);
    if (recorded.ok() && recorded->has_value()) return AsOutcome(**recorded, o.txn);
    const bool late = Clock::now() >= o.hard_deadline;
    if (late || DaemonGone(dir)) {
      // No daemon can decide any more (or we waited long enough): abort, unless a decision
      // was recorded meanwhile, which then stands.
      absl::StatusOr<SwitchDecision> mine = RecordDecision(
          dir, o.txn, {::getpid()},
          SwitchDecision{false, late ? absl::StrCat("process ", ::getpid(), " had no decision by its deadline")
                                     : "the node daemon died before deciding"});
      if (mine.ok()) return AsOutcome(*mine, o.txn);
      if (late) return absl::Status(mine.status().code(), absl::StrCat("node switch ", o.txn, ": ", mine.status().message()));
    } else {
      d = Ask(o, outcome, std::min(o.hard_deadline, Clock::now() + std::chrono::seconds(2)));
      if (d.ok() && d->has_value()) return AsOutcome(**d, o.txn);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(o.retry_ms));
  }
}

}  // namespace vmstash::node
