// SwitchLedger: see switch_ledger.h.
#include "node/switch_ledger.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace vmstash::node {

absl::Status SwitchLedger::Begin(const std::string& id, const std::vector<pid_t>& pids, std::int64_t deadline_ms,
                                 pid_t observer, const std::vector<pid_t>& donors) {
  if (pids.empty()) return absl::InvalidArgumentError("node switch: no participant");
  if (pids.size() > kMaxParticipants) {
    return absl::InvalidArgumentError(
        absl::StrCat("node switch: ", pids.size(), " participants (at most ", kMaxParticipants, ")"));
  }
  if (txns_.count(id) != 0) return absl::AlreadyExistsError(absl::StrCat("node switch ", id, " exists already"));
  std::size_t open = 0;
  for (const auto& [_, t] : txns_) open += t.decision.has_value() ? 0 : 1;
  if (open >= kMaxOpen) {
    return absl::ResourceExhaustedError(absl::StrCat("node switch: ", open, " switches undecided already"));
  }
  // One undecided switch per process: two crossing switches would each hold one process's
  // tags while waiting for the other's, until both timed out.
  for (const auto& [other, t] : txns_) {
    if (t.decision.has_value()) continue;
    for (pid_t pid : pids) {
      if (t.participants.count(pid) != 0) {
        return absl::FailedPreconditionError(absl::StrCat("node switch: process ", pid, " takes part in switch ", other,
                                                          ", not decided yet; try again once it is"));
      }
    }
  }
  Txn txn;
  txn.deadline_ms = deadline_ms;
  txn.observer = observer;
  txn.observer_state.told = observer <= 0;
  for (pid_t pid : pids) {
    if (pid <= 0) return absl::InvalidArgumentError(absl::StrCat("node switch: pid ", pid, " is not a process"));
    if (!txn.participants.emplace(pid, Participant{}).second) {
      return absl::InvalidArgumentError(absl::StrCat("node switch: process ", pid, " named twice"));
    }
  }
  for (pid_t pid : donors) {
    auto p = txn.participants.find(pid);
    if (p != txn.participants.end()) p->second.donor = true;
  }
  txns_.emplace(id, std::move(txn));
  return absl::OkStatus();
}

absl::Status SwitchLedger::Offered(const std::string& id, pid_t pid, bool last, bool writable) {
  auto t = txns_.find(id);
  if (t == txns_.end()) return absl::NotFoundError(absl::StrCat("node switch ", id, " is not known"));
  auto p = t->second.participants.find(pid);
  if (p == t->second.participants.end()) {
    return absl::PermissionDeniedError(absl::StrCat("process ", pid, " takes no part in node switch ", id));
  }
  if (t->second.decision.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat("node switch ", id, " is decided: nothing more is offered"));
  }
  p->second.offered = p->second.offered || last;
  p->second.asks = p->second.asks || writable;
  return absl::OkStatus();
}

absl::Status SwitchLedger::Took(const std::string& id, pid_t taker, pid_t giver) {
  auto t = txns_.find(id);
  if (t == txns_.end()) return absl::NotFoundError(absl::StrCat("node switch ", id, " is not known"));
  auto g = t->second.participants.find(giver);
  for (pid_t pid : {taker, giver}) {
    if (t->second.participants.count(pid) == 0) {
      return absl::PermissionDeniedError(absl::StrCat("process ", pid, " takes no part in node switch ", id));
    }
  }
  std::vector<pid_t>& takers = g->second.takers;
  if (std::find(takers.begin(), takers.end(), taker) == takers.end()) takers.push_back(taker);
  return absl::OkStatus();
}

absl::StatusOr<SwitchLedger::Settlement> SwitchLedger::Unsettled(const std::string& id, pid_t pid) {
  auto t = txns_.find(id);
  if (t == txns_.end()) return absl::NotFoundError(absl::StrCat("node switch ", id, " is not known"));
  auto p = t->second.participants.find(pid);
  if (p == t->second.participants.end()) {
    return absl::PermissionDeniedError(absl::StrCat("process ", pid, " takes no part in node switch ", id));
  }
  Settlement s;
  for (pid_t taker : p->second.takers) {
    const Participant& q = t->second.participants.at(taker);
    if (!q.voted && !q.exited) s.waiting.push_back(taker);
  }
  // Undecided, more chunks may still be given (the asker's own vote was not counted, say).
  s.settled = s.waiting.empty() && t->second.decision.has_value();
  if (s.settled) {
    p->second.asks = false;
    MaybeForget(id);  // `t` may be gone from here on
  }
  return s;
}

absl::StatusOr<bool> SwitchLedger::OffersIn(const std::string& id, pid_t pid) const {
  auto t = txns_.find(id);
  if (t == txns_.end()) return absl::NotFoundError(absl::StrCat("node switch ", id, " is not known"));
  if (t->second.participants.count(pid) == 0) {
    return absl::PermissionDeniedError(absl::StrCat("process ", pid, " takes no part in node switch ", id));
  }
  if (t->second.decision.has_value()) return true;
  for (const auto& [other, p] : t->second.participants) {
    if (other != pid && p.donor && !p.offered && !p.voted && !p.exited) return false;
  }
  return true;
}

absl::StatusOr<std::optional<SwitchDecision>> SwitchLedger::Vote(const std::string& id, pid_t pid, bool ok,
                                                                 const std::string& reason) {
  auto t = txns_.find(id);
  if (t == txns_.end()) return absl::NotFoundError(absl::StrCat("node switch ", id, " is not known"));
  Txn& txn = t->second;
  auto p = txn.participants.find(pid);
  if (p == txn.participants.end()) {
    return absl::PermissionDeniedError(absl::StrCat("process ", pid, " takes no part in node switch ", id));
  }
  if (txn.decision.has_value()) {
    p->second.voted = true;
    return txn.decision;
  }
  if (p->second.voted) {
    return absl::FailedPreconditionError(absl::StrCat("process ", pid, " voted already in node switch ", id));
  }
  p->second.voted = true;
  if (!ok) {
    txn.decision = SwitchDecision{false, absl::StrCat("process ", pid, ": ", reason)};
    return txn.decision;
  }
  for (const auto& [_, q] : txn.participants) {
    if (!q.voted) return std::optional<SwitchDecision>();
  }
  txn.decision = SwitchDecision{true, ""};
  return txn.decision;
}

std::vector<std::string> SwitchLedger::Exited(pid_t pid) {
  std::vector<std::string> decided, forgotten;
  for (auto& [id, txn] : txns_) {
    if (txn.observer == pid) {
      txn.observer_state.exited = true;
      if (txn.decision.has_value()) forgotten.push_back(id);
    }
    auto p = txn.participants.find(pid);
    if (p == txn.participants.end()) continue;
    p->second.exited = true;
    if (!txn.decision.has_value() && !p->second.voted) {
      txn.decision = SwitchDecision{false, absl::StrCat("process ", pid, " exited before it voted")};
      decided.push_back(id);
    } else if (txn.decision.has_value()) {
      forgotten.push_back(id);
    }
  }
  for (const std::string& id : forgotten) MaybeForget(id);
  for (const std::string& id : decided) MaybeForget(id);  // the last one watched may be gone
  return decided;
}

std::vector<std::string> SwitchLedger::Expire(std::int64_t now_ms) {
  std::vector<std::string> decided;
  for (auto& [id, txn] : txns_) {
    if (txn.decision.has_value() || now_ms < txn.deadline_ms) continue;
    std::vector<std::string> missing;
    for (const auto& [pid, p] : txn.participants) {
      if (!p.voted) missing.push_back(absl::StrCat(pid));
    }
    txn.decision = SwitchDecision{
        false, absl::StrCat(missing.size() == 1 ? "process " : "processes ", absl::StrJoin(missing, ", "),
                            " did not vote by the deadline (hung, or slower than the switch's timeout)")};
    decided.push_back(id);
  }
  return decided;
}

std::optional<std::int64_t> SwitchLedger::NextDeadline() const {
  std::optional<std::int64_t> next;
  for (const auto& [_, txn] : txns_) {
    if (txn.decision.has_value()) continue;
    if (!next.has_value() || txn.deadline_ms < *next) next = txn.deadline_ms;
  }
  return next;
}

absl::StatusOr<std::optional<SwitchDecision>> SwitchLedger::Decision(const std::string& id) const {
  auto t = txns_.find(id);
  if (t == txns_.end()) return absl::NotFoundError(absl::StrCat("node switch ", id, " is not known"));
  return t->second.decision;
}

void SwitchLedger::Settle(const std::string& id, const SwitchDecision& decision) {
  auto t = txns_.find(id);
  if (t != txns_.end()) t->second.decision = decision;
}

bool SwitchLedger::Told(const std::string& id, pid_t pid, bool observer) {
  auto t = txns_.find(id);
  if (t == txns_.end()) return false;
  if (observer && t->second.observer == pid) {
    if (!t->second.decision.has_value()) return false;
    t->second.observer_state.told = true;
    return MaybeForget(id);
  }
  auto p = t->second.participants.find(pid);
  if (p == t->second.participants.end() || !t->second.decision.has_value()) return false;
  p->second.told = true;
  return MaybeForget(id);
}

std::vector<pid_t> SwitchLedger::Participants(const std::string& id) const {
  std::vector<pid_t> out;
  auto t = txns_.find(id);
  if (t == txns_.end()) return out;
  for (const auto& [pid, _] : t->second.participants) out.push_back(pid);
  return out;
}

std::vector<pid_t> SwitchLedger::Watched() const {
  std::vector<pid_t> out;
  for (const auto& [_, txn] : txns_) {
    for (const auto& [pid, p] : txn.participants) {
      if ((!p.told || p.asks) && !p.exited) out.push_back(pid);
    }
    if (!txn.observer_state.told && !txn.observer_state.exited) out.push_back(txn.observer);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

bool SwitchLedger::MaybeForget(const std::string& id) {
  auto t = txns_.find(id);
  if (t == txns_.end() || !t->second.decision.has_value()) return false;
  for (const auto& [_, p] : t->second.participants) {
    if (!p.told && !p.exited) return false;
    if (p.asks && !p.exited && !t->second.decision->commit) return false;
  }
  if (!t->second.observer_state.told && !t->second.observer_state.exited) return false;
  txns_.erase(t);
  forgotten_.push_back(id);
  return true;
}

std::vector<std::string> SwitchLedger::TakeForgotten() {
  std::vector<std::string> out;
  out.swap(forgotten_);
  return out;
}

}  // namespace vmstash::node
