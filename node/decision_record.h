// The records of node switch decisions (node_switch.h, Note [Node Switch]): one file per
// decided switch, `<runtime dir>/vmstashd.switch/<id>`, holding "commit" or "abort", the
// participants' pids and the reason. The record, not any message, is a switch's
// decision: whoever records first decides (the daemon when the votes are in or the
// deadline passed; a participant that finds no daemon alive, or none answering by its own
// deadline, records "abort"), and everyone else reads what was recorded. Recording is a
// link(2) of a file written whole to the record's name, which fails when the name exists:
// two parties recording at once get one decision, and a reader never sees half of one.
//
// Thread-safety: pure functions of the file system.
#ifndef VMSTASH_NODE_DECISION_RECORD_H_
#define VMSTASH_NODE_DECISION_RECORD_H_

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "node/switch_ledger.h"

namespace vmstash::node {

// A new switch id: 32 lowercase hex digits from the kernel's random source.
absl::StatusOr<std::string> NewSwitchId();
// Whether `id` is 32 lowercase hex digits (ids name files: nothing else is accepted).
bool IsSwitchId(const std::string& id);

// Records `decision` for switch `id` of `pids` in `dir` (the runtime directory), unless a
// decision is recorded already. Returns the decision recorded (this one, or the earlier).
absl::StatusOr<SwitchDecision> RecordDecision(const std::string& dir, const std::string& id,
                                              const std::vector<pid_t>& pids, const SwitchDecision& decision);
// The decision recorded for `id`, or nothing.
absl::StatusOr<std::optional<SwitchDecision>> ReadDecision(const std::string& dir, const std::string& id);
// Removes `id`'s record (once every participant knows the outcome), and its takers'.
void RemoveDecision(const std::string& dir, const std::string& id);

// Note [Node Switch Handover]: the daemon notes here, before it sends them, that `taker`
// gets chunks of `giver` for gaps that restore copies write (`<dir>/vmstashd.switch/
// <id>.took`, one line appended per pair), so that a giver whose daemon is gone can still
// tell that no process took its chunks there.
absl::Status RecordTaker(const std::string& dir, const std::string& id, pid_t giver, pid_t taker);
// The takers noted for `giver` in `id` (none when nothing was noted).
absl::StatusOr<std::vector<pid_t>> RecordedTakers(const std::string& dir, const std::string& id, pid_t giver);
// Removes the records none of whose participants (nor givers and takers noted for them)
// is alive (returns how many), temporary
// files of writers that died more than a minute ago, and takers' notes of switches with no
// record left an hour after they were written.
int SweepDecisions(const std::string& dir);

}  // namespace vmstash::node

#endif  // VMSTASH_NODE_DECISION_RECORD_H_
