// A participant's vote in a node switch (node_switch.h, Note [Node Switch]): given this
// process's outcome of its part (Note [Agreed Switch], allocator/switch.h), the decision
// of the whole switch, which this process then applies: OK to commit, else the reason to
// roll back.
//
// The vote goes to the node daemon on a connection of its own, whose reply comes with
// the decision. When that connection fails, or the daemon does not answer, the decision
// is looked for until `hard_deadline`: in its record (decision_record.h), by asking a
// daemon (the same one come back, or a new one, which presumes "abort" for a switch it
// did not begin and records it), and, when no daemon is alive at all, by recording
// "abort" itself. At the hard deadline with no decision anywhere, it records "abort"
// itself: a record already there (a commit recorded a moment earlier) wins, and that is
// what is returned. So the outcome is always the switch's one decision, never a guess —
// except where no record can be written at all (the runtime directory broken): it tries
// again for a minute past the deadline, then rolls back with an error saying the outcome
// is unknown. A vote the daemon refuses as such (a malformed id, a process that takes no
// part) is final: the switch cannot commit without it. A vote whose connection failed is
// sent again until a reply shows it was counted.
//
// Thread-safety: a pure function of the file system and the daemon; it blocks.
#ifndef VMSTASH_NODE_SWITCH_VOTE_H_
#define VMSTASH_NODE_SWITCH_VOTE_H_

#include <chrono>
#include <string>

#include "absl/status/status.h"

namespace vmstash::node {

// How long past the switch's timeout a participant waits for the decision before it
// records "abort" itself (the daemon decides at the timeout).
inline constexpr int kVoteGraceMs = 5000;

struct VoteOptions {
  std::string dir;   // the runtime directory (empty: control::DefaultRuntimeDir())
  std::string txn;   // the switch's id (the daemon's begin)
  // When this process stops waiting and records "abort" itself (the daemon's own
  // deadline for the switch comes first).
  std::chrono::steady_clock::time_point hard_deadline;
  int retry_ms = 50;  // between attempts to learn the decision after a failure
};

// This process's vote (`local`: OK, or its failure) and the switch's decision: OK to
// commit, Aborted naming the process that failed and why otherwise. A local failure is
// voted, and its own status returned whatever the decision.
absl::Status VoteAndWait(const VoteOptions& options, const absl::Status& local);

}  // namespace vmstash::node

#endif  // VMSTASH_NODE_SWITCH_VOTE_H_
