// SwitchExecutor: one Switch(pause P, resume R) over TagPools, its lock/hook phase
// (step (1) of Note [Switch Protocol] below); the transaction itself, steps (2)-(5), is a
// SwitchTransaction (switch_transaction.h).
//
// What: the CachingAllocator checks the request and finds the pools (its directory), then
// runs one SwitchExecutor: it takes the control locks of every pool (ascending tag id),
// leaves out the pools already in their requested state, runs the outgoing pools'
// before-pause hooks (a veto undoes the ones that ran), takes the transition locks, runs
// the SwitchTransaction, and then either undoes the hooks and reports the failure, or
// runs the incoming pools' after-resume hooks.
//
// Layering: executors see the TagPool and the TransitionHost (transition_host.h), never
// the allocator.
//
// Thread-safety: an executor is used by one thread for one call.
//
// Note [Switch Protocol] (planned in handoff_plan.h; step (1) executed by SwitchExecutor
//   here, steps (2)-(5) by SwitchTransaction, switch_transaction.h)
//   Switch(pause P, resume R) is one transaction: every tag of P paused and every tag of R
//   resumed, or, on any failure, every tag as it was. It exists because a phase switch run
//   as pauses then resumes costs D2H + H2D although the link carries both directions at
//   once, and releases physical memory only to create as much again right after.
//   (1) Control locks of all its tags, then transition locks of the tags that move, each
//   in ascending tag id order (the one order every multi-tag caller uses); tags already in
//   the requested state do not move (kAlreadyInState when none does), but their control
//   locks are held to the end, so no other call changes or drops them meanwhile. P's before-pause hooks run first; a veto
//   runs the after-resume hooks of the P tags whose before-pause hooks already ran.
//   (2) The device is synchronized once. The outgoing chunks become donors and the
//   incoming covers recipients (PlanHandoff): a donor fitting a recipient's gap is mapped
//   there as a second mapping of the same chunk (no create, no release), the rest of the
//   recipient is created fresh, donors that fit nowhere are released at the commit. A
//   discard tag's chunk only goes where no restore copy writes (a discard recipient).
//   (3) Every piece of R is created (fresh) or mapped (donor) first: a cuMemMap or
//   cuMemSetAccess made while copies stream costs ~1 ms on the H200 (~35 us when idle).
//   Then the D2H copies of P's live bytes are queued at once on one outgoing tag's copy
//   stream, cut per donor chunk and into switch_group_bytes (64 MiB) pieces, an event
//   after each group; then the H2D restore copies on one incoming tag's copy stream:
//   into fresh pieces first, then into donors in the order their D2H copies complete,
//   each after a wait for the event of the last D2H copy reading the bytes it overwrites.
//   Both directions run concurrently; the host waits only at the end.
//   (4) Both streams are synchronized (a disk backup is written back), then P's own
//   mappings are unmapped (handles kept; re-mapped on failure).
//   (5) Commit, which cannot fail: P's heaps pause handing their donors over, leftover
//   donors are released (a refused release is retried later, as in a pause), R's heaps
//   commit their transactions with the donors moved into their pieces. Then (switch_zero,
//   default on) the bytes of handed-over chunks that no restore copy wrote (a discard
//   tag's whole pieces; a backup tag's bytes outside its restored live ranges: cached
//   blocks, free space) are zeroed and waited for, so a tag reads what a resume's freshly
//   created memory reads, not another tag's old bytes (a static KV cache read under a
//   mask would turn them into NaN); a failure there is logged only: those bytes are
//   undefined by contract. Only then are the new states published: until the zeroing
//   has completed, R's tags are "resuming" (no allocation in them, their frees wait, no
//   cache release), so no memset can land on a block allocated meanwhile or on memory
//   released and reused by another tag.
//   A failure in (2)-(4) waits for both streams, unmaps and releases what R's pieces
//   made, re-maps P's chunks, restores from the new backup the live bytes of every P
//   donor that restore copies may have written, gives back what the switch added to P's
//   backup arenas (Note [Host Budget] in backup_arena.h: the host account as it was), and
//   runs P's after-resume hooks; P stays active with its bytes, R paused with its
//   backup. If that rollback itself fails, the P tag concerned is broken (as after a
//   failed pause). R's after-resume hooks run after the commit, without locks.
//   A hook run by a switch may not pause, resume or switch any tag of that switch.
//
// Note [Agreed Switch]
//   A switch can be made one of several (one per process of a job: vmstash.distributed)
//   that all commit or all roll back. The caller passes `agree`, which the switch calls
//   exactly once, whatever happens, with this process's outcome: OK when the transaction
//   has done everything but (5) — every lock held, every copy done and waited for, the
//   outgoing tags unmapped, a rollback still possible — else the local failure (a refused
//   request, a veto, a failure of (1)-(4)); OK too when no tag had to move. `agree` returns
//   OK to commit, or the reason (e.g. another process's failure) to roll back, which the
//   switch then returns, every tag as it was; a local failure rolls back whatever `agree`
//   returns. While `agree` runs (it may wait for other processes, up to its own timeout)
//   this process's tags of the switch stay pausing/resuming: their allocations, frees and
//   transitions wait. `agree` may not call into the allocator. A hook
//   may transition other tags, but never waits for their control locks (ControlLocks, hooks.h): a
//   tag in another transition is refused at once, since that transition may wait for the
//   locks the hook's own transition holds.
#ifndef VMSTASH_ALLOCATOR_SWITCH_H_
#define VMSTASH_ALLOCATOR_SWITCH_H_

#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "allocator/tag.h"
#include "allocator/tag_pool.h"
#include "allocator/transition_host.h"
#include "allocator/switch_transaction.h"
#include "allocator/transition_plan.h"

namespace vmstash {

// Per outgoing tag, the byte ranges known to hold data (CachingAllocator::Switch).
using LiveRangesByTag = absl::flat_hash_map<TagId, ByteRanges>;
// The tags a switch paused and resumed (a caller's rollback switches exactly those back).
struct SwitchChanges {
  std::vector<TagId> paused;
  std::vector<TagId> resumed;
};

class SwitchExecutor {
 public:
  // `out` and `in`: the pools of the request, in its order (none twice); `live` optional.
  // `agree` (optional): Note [Agreed Switch]. `exchange` (optional): the transaction's
  // (switch_transaction.h).
  SwitchExecutor(TransitionHost* host, std::vector<TagPool*> out, std::vector<TagPool*> in,
                 const LiveRangesByTag* live, const SwitchAgree* agree = nullptr, SwitchExchange* exchange = nullptr)
      : host_(host), out_(std::move(out)), in_(std::move(in)), live_(live), agree_(agree), exchange_(exchange) {}
  SwitchExecutor(const SwitchExecutor&) = delete;
  SwitchExecutor& operator=(const SwitchExecutor&) = delete;

  // The whole switch; `changed` (optional) gets the tags it moved.
  absl::StatusOr<TransitionResult> Run(SwitchChanges* changed);

 private:
  // Run, less the agreement where no transaction ran.
  absl::StatusOr<TransitionResult> RunLocked(SwitchChanges* changed);
  // Under the control locks: the pools that move (the others are in their requested
  // state already) and their hooks; FailedPrecondition for a broken one.
  absl::Status Choose();
  // Before-pause hooks of the moving outgoing pools; a veto undoes those that ran.
  absl::Status RunBeforePauseHooks();
  // After a failed transaction (or a veto): the after-resume hooks of the first `n`
  // outgoing pools, which stay active.
  void UndoBeforePauseHooks(std::size_t n);
  // The transaction under every pool's transition lock; the failure, worded for the caller.
  absl::Status Transact();
  absl::Status RunAfterResumeHooks();

  TransitionHost* const host_;
  const std::vector<TagPool*> out_;
  const std::vector<TagPool*> in_;
  const LiveRangesByTag* const live_;
  const SwitchAgree* const agree_;
  SwitchExchange* const exchange_;
  bool agreed_ = false;  // the transaction called agree_
  // Chosen by Choose(): the pools that move, their hooks, and all their tags (the hooks'
  // own: a hook may not transition them).
  std::vector<TagPool*> moving_out_;
  std::vector<TagPool*> moving_in_;
  std::vector<TransitionHooks> out_hooks_;
  std::vector<TransitionHooks> in_hooks_;
  std::vector<TagId> tags_;
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_SWITCH_H_
