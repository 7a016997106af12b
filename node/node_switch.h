// NodeSwitch: one switch over several processes of the node (docs/node.md): the tags
// named to pause, in whichever processes, are paused and those named to resume are
// resumed, all or none — the initiator's side of the protocol below (the participant's
// vote is switch_vote.h, the daemon's ledger switch_ledger.h, the records
// decision_record.h).
//
// Note [Node Switch]
//   A node switch is a two-phase commit over the processes it names, coordinated by the
//   node daemon, each process running an agreed switch (Note [Agreed Switch],
//   allocator/switch.h) of its own tags.
//   (1) The initiator (the CLI, vmstash.node.switch, vmstash_node_switch: any process of
//       the user, a participant or not) asks the daemon to begin a switch of the
//       participants' pids with a timeout; the daemon starts when none serves. It answers
//       with the switch's id.
//   (2) The initiator sends each participant, at once and concurrently, its part over its
//       control endpoint (control/endpoint.h: a switch request with the id and the
//       timeout). Each runs its agreed switch up to the commit: locks, hooks, every copy
//       done, its outgoing mappings unmapped. Then it votes its outcome to the daemon
//       (OK, or its failure) and waits for the decision, its tags held pausing/resuming.
//       The participants' copies run at the same time, D2H in one and H2D in the other.
//   (3) The daemon decides: "abort" at the first failed vote (naming that process and its
//       reason), when a participant exits before voting (watched by pidfd), or when the
//       timeout passes with votes missing (naming those processes: hung, or slower than
//       the timeout); "commit" when every vote is OK. The decision is recorded in
//       `<runtime dir>/vmstashd.switch/<id>` (decision_record.h: the first record wins,
//       atomically) before anyone is told, then sent to every waiting vote.
//   (4) Each participant commits or rolls back as decided, and answers the initiator. The
//       initiator reports, per process, what it did; its result is the decision (OK for
//       commit; Aborted naming the process and the reason for abort), and a commit that a
//       process could not confirm (it died after voting, its after-resume hooks failed)
//       is an error that says so, tag by tag where known.
//   Failures: a participant whose vote's reply never comes (the daemon died or hangs)
//   learns the decision from the record, or from a daemon started again (which presumes
//   "abort" for a switch it did not begin, and records it); when no daemon is alive, or
//   at its own deadline (the timeout plus kVoteGraceMs), it records "abort" itself —
//   unless a decision is recorded already, which it then applies (switch_vote.h: never a
//   rollback without a record, but where none can be written for a minute). The daemon
//   records no commit past the timeout: a vote it reads late (its thread held up) finds
//   the switch expired first. A participant that hangs before voting is decided "abort" at
//   the timeout and rolls back when it runs again. The initiator waits for each
//   participant at most the timeout plus twice the grace; a participant still silent then
//   is reported as such, with the decision, which the initiator asks the daemon for (so
//   the daemon knows it was told). A switch is forgotten once every participant and the
//   initiator have been told or have exited; its record is removed a minute later (the
//   daemon also sweeps, at start, records whose participants are all gone). One undecided
//   switch per process: a second naming a process of an undecided one is refused.
//
// Note [Node Switch Handover]
//   Physical memory changes process in a node switch as it changes tag in a switch of
//   one process (Note [Switch Protocol], allocator/switch.h), where the handover plan
//   allows it (allocator/handoff_plan.h) — through the daemon, during (2):
//   (a) The initiator's begin names the donors: the participants that pause tags.
//   (b) Each part plans its own handover first (its outgoing chunks into its own incoming
//       covers). A part that pauses then offers the chunks that plan leaves over — those
//       it would release at its commit — as descriptors (Driver::ExportChunkFd; only
//       chunks made with share_chunks can be), with its device's UUID, to the daemon
//       (wire.h: offer), if only to say it offers nothing. It offers once its backup
//       copies are queued, each chunk with its use (wire.h ChunkUse): a backup tag's may
//       go anywhere, with the handle of an interprocess event (Driver::CreateIpcEvent,
//       ExportIpcEvent) recorded after the last backup copy that reads it, sent only once
//       recorded; a discard tag's only where no restore copy writes (its bytes have no
//       backup). It never writes them again (its backup copies still read them): its
//       mappings of them go in (4) as for any outgoing chunk.
//   (c) A part left with fresh memory to make for its covers sends those gaps — each with
//       how far a chunk may overrun it, strict where restore copies write it, and those
//       only when its device is short of free memory for the fresh bytes
//       (RestoresTakeForeignChunks: with room, fresh memory in a few large chunks is faster
//       than many imports mapped while copies stream); the largest kMaxTakeGaps (wire.h)
//       when there are more (allocator/handoff_plan.h OpenGaps) —
//       and asks the daemon for chunks of its device offered by the others (take), before
//       it maps anything; a part that also pauses queues its backups and offers first, so
//       two such parts never wait for each other's offers. The daemon answers "not yet"
//       until every other donor has offered, voted (an offer comes before a vote) or
//       exited, or the switch is decided (the part asks again, after 0.1 ms doubling to
//       1 ms, for at most half the timeout: then it goes on with fresh memory, so a donor
//       that hangs is the one named for not voting). Then, once per taker and in the order
//       they ask, it fits the chunks it holds to the taker's gaps by the one rule both
//       layers share (base/chunk_fit.h: a strict gap takes only chunks that may go
//       anywhere), gives that taker those it placed — those placed in gaps that are not
//       strict marked for such gaps only, so that the taker, fitting again what it could
//       import, never moves into a strict gap a chunk whose giver does not wait for it — and
//       notes, for each giver, who took its chunks into strict gaps (switch_ledger.h Took);
//       the rest stay for the next taker. A chunk is mapped whole, so only the gaps can say
//       which chunks fit: two gaps of 4 MiB take two chunks of 4 MiB, not one of 8. The part
//       imports them (Driver::ImportChunkFd: the driver keeps a descriptor per imported
//       chunk, so it can be handed on again; closed with the handle, and in a child forked
//       without exec), drops an import whose handle it holds already (a giver offering one
//       chunk twice), opens each giver's event once (Driver::OpenIpcEvent; one that cannot be
//       opened keeps its chunk out of strict gaps), closes the descriptors, and places the
//       imported ones into the same gaps by the same rule (AddForeignDonors), the rest of its
//       plan unchanged. Its restore copies into another process's chunk are queued last, each
//       after a wait for that chunk's event: they never overwrite bytes the giver's backup
//       copies have not read yet.
//   (d) Commit: the taker keeps the imported chunks as its own (the memory lives while any
//       process holds a handle), zeroes the bytes no restore copy wrote (switch_zero) — after
//       the giver's backup copies are done, since the giver voted only then — and releases
//       those no cover took; the giver releases its handles of every chunk it offered. Abort:
//       the taker waits for its copies, unmaps and releases its imports; the giver maps its
//       chunks again as in any rollback. A chunk that went anywhere may have been written by
//       a taker's restore copies: before it writes such chunks again, the giver asks the
//       daemon until the switch is decided and every taker of its chunks in strict gaps has
//       voted or exited (wire.h: settled; a part votes only once none of its copies runs,
//       failed ones included, and writes no foreign chunk after), then restores their tags'
//       live bytes from the backup this switch made, like a donor of its own switch (Note
//       [Switch Protocol]). The daemon notes each such taker on disk before it sends the
//       chunks (decision_record.h RecordTaker), so a giver whose daemon is gone or started
//       again (not one that only refused a request: it asks again) reads there whether any
//       process took them at all: none, and it restores as above. The notes go with the
//       decision's record, not before every giver and taker noted is gone. When it cannot be
//       known that the takers are done — one hung past its own deadline (the timeout plus
//       kVoteGraceMs), or one noted while the daemon that knew its vote is gone — the giver
//       does not write them, and those tags are broken, with that reason (their chunks may
//       still be written). The daemon keeps an aborted switch whose giver must ask until it
//       has (or exited), and answers "settled" again for it while its record lingers after
//       (an ask repeated once its answer was lost).
//   The daemon holds at most kMaxHeldChunks descriptors (wire.h; fewer under a low
//   descriptor limit), closes those left at the decision, and keeps none past it. Nothing
//   of the trade can fail a switch: an offer the daemon refuses, a chunk that cannot be
//   exported or imported, an event that cannot be made or opened, a device of another
//   UUID (CUDA_VISIBLE_DEVICES renumbering, another GPU) — each only means fresh memory
//   where a chunk would have been handed over, and a release where it would have been
//   given. A mapping of an imported chunk that fails fails the taker's part, so the
//   switch aborts everywhere. So a switch of backed-up tags holds the larger phase's
//   bytes on the GPU, not both, where the chunks fit the covers.
//
// Thread-safety: RunNodeSwitch may be called from any thread; it blocks for the switch.
#ifndef VMSTASH_NODE_NODE_SWITCH_H_
#define VMSTASH_NODE_NODE_SWITCH_H_

#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace vmstash::node {

// One process's part.
struct NodeSwitchPart {
  pid_t pid = 0;
  std::vector<std::string> pause;
  std::vector<std::string> resume;
};
struct NodeSwitchRequest {
  std::vector<NodeSwitchPart> parts;  // one per process, at least one tag each
  int device = -1;                    // in every process (-1: where its tags are)
  int timeout_ms = 60000;             // (3): the daemon's deadline for the votes
  std::string dir;                    // the runtime directory (empty: the default)
  std::size_t start_capacity = 0;     // the pool of a daemon started here (0: the default)
};
// Parses "PID:TAG,PID:TAG,..." lists (the CLI's --pause/--resume, Python's pairs joined)
// into parts, one per pid in order of first mention. InvalidArgument naming the entry for
// a malformed one (no ':', a pid that is not a positive number, an empty tag) and for a
// tag named twice.
absl::StatusOr<std::vector<NodeSwitchPart>> ParseNodeSwitchParts(const std::string& pause, const std::string& resume);

struct NodeSwitchOutcome {
  pid_t pid = 0;
  absl::Status status;   // the participant's answer (or why there was none)
  bool changed = false;  // a tag of it moved
};
struct NodeSwitchResult {
  std::string txn;
  bool committed = false;
  std::string reason;  // the decision's reason (abort)
  std::vector<NodeSwitchOutcome> processes;
};
// Runs the switch. An error when it could not begin (bad request, no such process, no
// daemon and none could be started); otherwise the result, whatever the decision.
absl::StatusOr<NodeSwitchResult> RunNodeSwitch(const NodeSwitchRequest& request);
// The result as one status: OK when committed and every process confirmed; Aborted for a
// rollback (the decision's reason, then each process's state); Unknown/the participant's
// code for a commit not confirmed everywhere.
absl::Status NodeSwitchStatus(const NodeSwitchResult& result);
// The result as JSON: {"txn","committed","reason","processes":[{"pid","ok","changed",
// "code","message"}]}.
std::string NodeSwitchJson(const NodeSwitchResult& result);

}  // namespace vmstash::node

#endif  // VMSTASH_NODE_NODE_SWITCH_H_
