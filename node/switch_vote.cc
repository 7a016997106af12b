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
// At most twice this once escaped ('"' and '\\'): a vote stays well under a packet.
constexpr std::size_t kMaxReasonBytes = 2048;
// How long past its deadline a participant keeps trying to record its abort.
constexpr int kRecordRetryMs = 60000;

int MsUntil(Clock::time_point t) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(ms, 0, 1 << 30));
}

absl::Status AsOutcome(const SwitchDecision& d, const std::string& txn) {
  if (d.commit) return absl::OkStatus();
  return absl::AbortedError(absl::StrCat("node switch ", txn, " rolled back: ", d.reason));
}

// One request (AskOnce), its reply waited for until `deadline`: the decision,
// nothing when "pending", or the failure.
absl::StatusOr<std::optional<SwitchDecision>> Ask(const VoteOptions& o, const WireRequest& request,
                                                  Clock::time_point deadline) {
  absl::StatusOr<JsonValue> reply = AskOnce(o.dir, request, MsUntil(deadline));
  if (!reply.ok()) return reply.status();
  const std::string decision = (*reply)["decision"].String();
  if (decision == "pending") return std::optional<SwitchDecision>();
  if (decision != "commit" && decision != "abort") {
    return absl::InternalError(absl::StrCat("node switch: the daemon's decision \"", decision, "\""));
  }
  return std::optional<SwitchDecision>(SwitchDecision{decision == "commit", (*reply)["reason"].String()});
}

// A refusal of the request itself (not a failure to reach the daemon), or a daemon of
// another protocol version, which can count no vote of this library.
bool Refused(const absl::Status& s) {
  return absl::IsInvalidArgument(s) || absl::IsPermissionDenied(s) || IsOtherVersion(s);
}

// A failure's message as a vote's reason: control characters made spaces (JSON escapes
// each into six bytes) and cut, so that the vote fits a packet whatever the message.
std::string VoteReason(absl::string_view message) {
  std::string out(message.substr(0, kMaxReasonBytes));
  for (char& c : out) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = ' ';
  }
  return out;
}

}  // namespace

absl::Status VoteAndWait(const VoteOptions& o, const absl::Status& local) {
  const std::string dir = o.dir.empty() ? control::DefaultRuntimeDir() : o.dir;
  WireRequest vote;
  vote.op = WireOp::kVote;
  vote.txn = o.txn;
  vote.pid = ::getpid();
  vote.ok = local.ok();
  vote.reason = local.ok() ? "" : VoteReason(local.message());
  absl::StatusOr<std::optional<SwitchDecision>> d = Ask(o, vote, o.hard_deadline);
  if (!local.ok()) return local;  // voted (or tried to): a local failure rolls back whatever was decided
  if (d.ok() && d->has_value()) return AsOutcome(**d, o.txn);
  if (!d.ok() && Refused(d.status())) {
    // The daemon refused the vote itself (a malformed id, not a participant, another
    // protocol version): it cannot count it, so the switch cannot commit.
    return absl::Status(d.status().code(), absl::StrCat("node switch ", o.txn, ": the vote was refused: ",
                                                        d.status().message()));
  }
  bool counted = d.ok();  // a reply came ("pending": a daemon that is not the switch's)
  VMSTASH_LOG(kWarning, "vmstash: node switch {}: the vote's reply did not come ({}); looking for the decision",
              o.txn, d.ok() ? "pending" : d.status().message());
  WireRequest outcome;
  outcome.op = WireOp::kOutcome;
  outcome.txn = o.txn;
  outcome.pid = ::getpid();
  const Clock::time_point give_up = o.hard_deadline + std::chrono::milliseconds(kRecordRetryMs);
  absl::Status unrecorded;
  for (;;) {
    absl::StatusOr<std::optional<SwitchDecision>> recorded = ReadDecision(dir, o.txn);
    if (recorded.ok() && recorded->has_value()) return AsOutcome(**recorded, o.txn);
    const bool late = Clock::now() >= o.hard_deadline;
    if (late || DaemonGone(dir)) {
      // No daemon can decide any more (or we waited long enough): abort, unless a decision
      // was recorded meanwhile, which then stands. Never without a record: a daemon only
      // stalled could still record a commit and tell the others.
      absl::StatusOr<SwitchDecision> mine = RecordDecision(
          dir, o.txn, {::getpid()},
          SwitchDecision{false, late ? absl::StrCat("process ", ::getpid(), " had no decision by its deadline")
                                     : "the node daemon died before deciding"});
      if (mine.ok()) return AsOutcome(*mine, o.txn);
      if (unrecorded.ok()) {
        VMSTASH_LOG(kError, "vmstash: node switch {}: cannot record its abort ({}); trying again until {} ms past "
                    "the deadline", o.txn, mine.status().message(), kRecordRetryMs);
      }
      unrecorded = mine.status();
      if (Clock::now() >= give_up) {
        return absl::Status(unrecorded.code(),
                            absl::StrCat("node switch ", o.txn, ": its outcome is unknown (no decision found, and none "
                                         "could be recorded: ", unrecorded.message(), "); this process rolled back"));
      }
    } else {
      // The vote again while it may not have been counted (a refused connection), else the outcome.
      d = Ask(o, counted ? outcome : vote, std::min(o.hard_deadline, Clock::now() + std::chrono::seconds(2)));
      if (d.ok() && d->has_value()) return AsOutcome(**d, o.txn);
      if (!d.ok() && !counted && absl::IsFailedPrecondition(d.status())) counted = true;  // voted already
      if (d.ok()) counted = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(o.retry_ms));
  }
}

}  // namespace vmstash::node
