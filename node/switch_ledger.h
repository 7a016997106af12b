// SwitchLedger: the node daemon's table of switches across processes (node_switch.h,
// Note [Node Switch]): who takes part in each, who voted what, by when, and the decision.
//
// What: a transaction begins with its participants (pids) and a deadline; each
// participant votes once, with its local outcome. The first failed vote decides "abort"
// (naming the process and its reason); the last OK vote decides "commit"; a participant
// that exits before voting, or the deadline passing with votes missing, decides "abort"
// naming the processes concerned. A decision is final: the daemon records it
// (decision_record.h) before anyone is told, and when the record says otherwise (another
// party recorded first), Settle makes the record's decision the ledger's. A transaction is
// forgotten once every participant, and the initiator that began it (an observer: it
// votes nothing), has been told its outcome or has exited. For the handover of chunks
// (Note [Node Switch Handover], node_switch.h) it knows which participants pause (donors)
// and which have offered theirs, so a taker knows when every offer is in; and which
// processes took a donor's chunks into covers that restore copies write, so that the
// donor's rollback knows when none of them can write there any more (Unsettled). A donor
// that offered such chunks keeps an aborted transaction in memory until it has asked.
//
// No I/O, no clock, no locks (the daemon's serving thread is its one writer): times are
// milliseconds on the caller's clock; every case is unit-tested alone
// (switch_ledger_test.cc).
#ifndef VMSTASH_NODE_SWITCH_LEDGER_H_
#define VMSTASH_NODE_SWITCH_LEDGER_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace vmstash::node {

struct SwitchDecision {
  bool commit = false;
  std::string reason;  // why it aborted (empty for a commit)
  friend bool operator==(const SwitchDecision& a, const SwitchDecision& b) {
    return a.commit == b.commit && a.reason == b.reason;
  }
};

class SwitchLedger {
 public:
  static constexpr std::size_t kMaxParticipants = 64;
  static constexpr std::size_t kMaxOpen = 256;  // undecided transactions at once

  // A new transaction `id` (unique, chosen by the caller) of `pids` (distinct, > 0, at
  // most kMaxParticipants), to be decided by `deadline_ms`, begun by `observer` (0: none),
  // who learns the outcome too. InvalidArgument for bad pids, AlreadyExists for a known
  // id, FailedPrecondition when a pid takes part in an undecided transaction (one at a
  // time per process: crossing ones would wait for each other's locks until both timed
  // out), ResourceExhausted beyond kMaxOpen undecided ones.
  // `donors`: the participants that pause tags (others are ignored there).
  absl::Status Begin(const std::string& id, const std::vector<pid_t>& pids, std::int64_t deadline_ms,
                     pid_t observer = 0, const std::vector<pid_t>& donors = {});
  // `pid` offers chunks in `id`: its whole offer is made when `last`; `writable`: some of
  // them may go where restore copies write (then `pid` will ask Unsettled at an abort).
  // NotFound for an unknown id, PermissionDenied for a pid that is not a participant,
  // FailedPrecondition once decided.
  absl::Status Offered(const std::string& id, pid_t pid, bool last = true, bool writable = false);
  // `taker` was given chunks of `giver` for gaps that restore copies write. NotFound /
  // PermissionDenied (either pid) as Offered.
  absl::Status Took(const std::string& id, pid_t taker, pid_t giver);
  // What a donor asking Unsettled learns: the processes that took chunks of it (Took) and
  // have neither voted (a vote comes after a part's copies are done) nor exited; settled
  // when that is none and the switch is decided (undecided, more may take).
  struct Settlement {
    std::vector<pid_t> waiting;
    bool settled = false;
  };
  // `pid`'s Settlement in `id`. Once settled, `pid` is done asking, and this very call may
  // forget the transaction (a later one is NotFound). NotFound / PermissionDenied as Offered.
  absl::StatusOr<Settlement> Unsettled(const std::string& id, pid_t pid);
  // Whether `pid` may take the offered chunks of `id` now: every other donor has offered,
  // voted (its offer, if any, came first) or exited — or `id` is decided (nothing is left
  // to take then). NotFound / PermissionDenied as Offered.
  absl::StatusOr<bool> OffersIn(const std::string& id, pid_t pid) const;
  // `pid`'s vote: OK, or its failure `reason`. Returns the decision when the transaction is
  // decided (now, or before: a late vote learns it). NotFound for an unknown id,
  // PermissionDenied for a pid that is not a participant, FailedPrecondition for a second
  // vote of an undecided transaction.
  absl::StatusOr<std::optional<SwitchDecision>> Vote(const std::string& id, pid_t pid, bool ok,
                                                     const std::string& reason);
  // `pid` exited: every undecided transaction it has not voted in aborts. Returns their ids.
  std::vector<std::string> Exited(pid_t pid);
  // Every undecided transaction past its deadline at `now_ms` aborts. Returns their ids.
  std::vector<std::string> Expire(std::int64_t now_ms);
  // The earliest deadline of an undecided transaction.
  std::optional<std::int64_t> NextDeadline() const;
  // The decision of `id` (nothing when undecided); NotFound for an unknown id.
  absl::StatusOr<std::optional<SwitchDecision>> Decision(const std::string& id) const;
  // The decision of `id` is `decision` (the record's, which wins). Unknown ids are ignored.
  void Settle(const std::string& id, const SwitchDecision& decision);
  // `pid` has been told the outcome of `id`: as its observer when `observer` (and it is
  // the observer), else as a participant. Returns true when the transaction is thereby
  // forgotten.
  bool Told(const std::string& id, pid_t pid, bool observer = false);
  // The participants of `id` (empty for an unknown id).
  std::vector<pid_t> Participants(const std::string& id) const;
  // The participants whose exit matters: not exited, and not told the outcome (an
  // undecided transaction's, or a decided one's not yet told) or still to ask Unsettled.
  std::vector<pid_t> Watched() const;
  // The ids forgotten since the last call (their records can go).
  std::vector<std::string> TakeForgotten();
  std::size_t size() const { return txns_.size(); }

 private:
  struct Participant {
    bool donor = false;    // it pauses tags: it offers chunks
    bool offered = false;  // its offer is complete
    bool asks = false;     // it offered writable chunks and has not been answered "settled" after an abort
    std::vector<pid_t> takers;  // those given its chunks for restore gaps (Took)
    bool voted = false;
    bool told = false;
    bool exited = false;
  };
  struct Txn {
    std::map<pid_t, Participant> participants;
    pid_t observer = 0;
    Participant observer_state;  // told, exited
    std::int64_t deadline_ms = 0;
    std::optional<SwitchDecision> decision;
  };
  // Forgets `id` when every participant was told or exited and, unless it committed, no
  // live one is still to ask Unsettled; true when it did.
  bool MaybeForget(const std::string& id);

  std::map<std::string, Txn> txns_;
  std::vector<std::string> forgotten_;
};

}  // namespace vmstash::node

#endif  // VMSTASH_NODE_SWITCH_LEDGER_H_
