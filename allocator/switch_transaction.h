// SwitchTransaction: the transaction phase of a switch, steps (2)-(5) of Note [Switch
// Protocol] (switch.h): every outgoing pool paused and every incoming pool resumed, with
// the outgoing chunks handed over to the incoming covers and both copy directions at once,
// or, on any failure, every pool as it was.
//
// What: the SwitchExecutor (switch.h) takes the control locks, runs the hooks, takes every
// pool's transition lock and then runs one SwitchTransaction. The transaction moves the
// pools to pausing/resuming (Begin), plans the handoff from the pools' chunks and covers
// (handoff_plan.h: the pure decisions), maps the incoming pieces, queues the D2H and H2D
// copies, waits, unmaps the outgoing mappings, and commits (Commit, which cannot fail) or
// rolls back (RollBack). Its steps are timed into a timeline indexed by Step (the debug
// log's "at ms").
//
// Layering: it sees TagPools and the TransitionHost (transition_host.h), never the
// allocator.
//
// Thread-safety: used by one thread, which holds the transition locks of all its pools
// (OrderedLocks, a lock set clang cannot name: each use of a pool's transition resources
// states it with TagPool::AssertTransitionHeld). The host's mu is taken for state and
// stats changes.
#ifndef VMSTASH_ALLOCATOR_SWITCH_TRANSACTION_H_
#define VMSTASH_ALLOCATOR_SWITCH_TRANSACTION_H_

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "allocator/handoff_plan.h"
#include "allocator/heap.h"
#include "allocator/switch_exchange.h"
#include "allocator/tag_pool.h"
#include "allocator/transition_host.h"
#include "allocator/transition_plan.h"

namespace vmstash {

// Note [Agreed Switch] (switch.h): given this process's outcome of a switch, OK to commit
// or the reason to roll back.
using SwitchAgree = std::function<absl::Status(const absl::Status& local)>;

class SwitchTransaction {
 public:
  // The steps of the timeline, in order (each marks when it ended).
  enum class Step { kPlanned, kRecipientsMapped, kCopiesQueued, kCopiesDone, kOutgoingUnmapped, kCommitted, kZeroed };
  static constexpr std::size_t kSteps = 7;

  // `out`: the pools to pause, each with its live-range hint (or null); `in`: the pools to
  // resume. Every pool's transition lock is held by the caller for the transaction's life.
  // `agree` (optional, Note [Agreed Switch]) is called once by Run, between (4) and (5).
  // `exchange` (optional, Note [Node Switch Handover] in node/node_switch.h): this is one
  // process's part of a switch across processes; the chunks it would release are offered
  // to the other parts, and theirs taken for its covers.
  SwitchTransaction(TransitionHost* host, std::vector<std::pair<TagPool*, const ByteRanges*>> out,
                    std::vector<TagPool*> in, const SwitchAgree* agree = nullptr,
                    SwitchExchange* exchange = nullptr);
  SwitchTransaction(const SwitchTransaction&) = delete;
  SwitchTransaction& operator=(const SwitchTransaction&) = delete;

  // Runs steps (2)-(5): OK when committed; otherwise the failure, every pool rolled back,
  // and *broken names the pools the rollback could not restore (empty when none).
  absl::Status Run(std::string* broken);

 private:
  using Clock = std::chrono::steady_clock;
  struct Out {
    TagPool* pool = nullptr;
    const ByteRanges* live = nullptr;
    BackupLayout layout;
    std::size_t backed_up = 0;
    bool unmapped = false;    // its own mappings are gone (handles kept)
    bool arena_used = false;  // PrepareBackups reserved its arena (ArenaForPause)
    absl::Status undo_error;  // a rollback step for this tag failed
  };
  struct In {
    TagPool* pool = nullptr;
    bool restore = false;
    std::unique_ptr<Heap::ResumeTxn> txn[2];  // small, large
    std::size_t restored = 0;
    // Bytes of donor pieces mapped here that no restore copy writes (all of them for a
    // tag that restores nothing): zeroed before the tag is active (switch_zero).
    std::vector<std::pair<DevicePtr, std::size_t>> unwritten;
  };
  // A donor of another process (taken through the exchange): no outgoing tag, no address.
  static constexpr std::size_t kForeign = static_cast<std::size_t>(-1);
  struct Donor {
    DevicePtr address = 0;
    const Chunk* chunk = nullptr;  // valid until the commit hands it over
    ChunkHandle handle = 0;        // its handle, which stays valid through the commit
    std::size_t out = 0;           // index into `out_`, or kForeign (in `foreign_`)
    Event wait = nullptr;          // foreign: its giver's event (opened) a restore copy into it waits for
  };
  // A chunk this part offers (the plan's leftover, exportable), and how it may be used.
  struct Offered {
    int donor = 0;
    bool anywhere = false;              // a backup tag's: its bytes are restored at an abort
    std::optional<std::size_t> group;   // the last D2H group reading it (its IPC event's)
  };
  // A restore copy, queued once every piece is mapped and every D2H copy queued.
  struct Deferred {
    std::optional<std::size_t> wait;
    Event foreign_wait = nullptr;  // a foreign donor's: its giver's event
    int donor = kNoDonor;  // the donor it writes into (kNoDonor: fresh memory)
    std::size_t in = 0;
    CopyStep step;
  };

  // The pools move to pausing / resuming (under the host's mu).
  absl::Status Begin();
  // (2)-(4): synchronize, plan, map, queue, wait, unmap. On failure RollBack undoes it.
  absl::Status Execute();
  // (2) The donors (outgoing chunks), the covers of the incoming heaps and the handoff plan.
  absl::Status Plan();
  // After the trade: covers grown by their overhang; the plan is final.
  void FinishPlan();
  // Through the exchange (Note [Node Switch Handover]). None of them fails the switch: a
  // chunk not offered is released at the commit, fresh memory replaces one not taken.
  // PlanOffer: which donors `plan_` leaves over are offered, and the interprocess events
  // (one per D2H group that last reads an offered backup chunk) QueueBackups records.
  void PlanOffer();
  // Offers them, once their events are recorded (QueueBackups).
  void OfferChunks();
  // When covers still need fresh memory, sends their gaps (OpenGaps; restoring ones
  // strict), takes the other processes' chunks that the daemon fitted to them, opens their
  // givers' events, and places them by the same rule (AddForeignDonors).
  void TakeChunks();
  // After an abort, before any offered chunk is written again: waits until no taker can
  // write them (SwitchExchange::AwaitTakers); then they are restored from the backup like
  // any donor written here, or, when that cannot be known, their tags are broken.
  void SettleOffered();
  // Waits for this switch's copy streams (before a vote, and before a rollback touches
  // memory).
  void DrainStreams();
  // Destroys the interprocess events made or opened (the switch is over).
  void DestroyIpcEvents();
  absl::Status PrepareBackups();
  absl::Status MapRecipients();
  absl::Status QueueBackups();
  absl::Status QueueRestores();
  // Returns what it could not restore ("tag 'x' is broken: ..."), empty when every tag is
  // as it was.
  std::string RollBack(const absl::Status& cause);
  // (5) Cannot fail.
  void Commit();
  void ZeroHandedOver();
  // Appends the parts of donor piece [va, va + size_bytes) that the restore copies
  // `written` do not cover (switch_zero zeroes them).
  static void NoteUnwritten(DevicePtr va, std::size_t size_bytes, std::vector<CopyStep> written,
                            std::vector<std::pair<DevicePtr, std::size_t>>* out);
  void Log() const;
  std::size_t GroupBytes() const;
  void Mark(Step step) { at_[static_cast<std::size_t>(step)] = Clock::now(); }
  double MsAt(Step step) const;

  TransitionHost* const host_;
  Driver* const driver_;
  const int device_;
  const SwitchAgree* const agree_;
  SwitchExchange* const exchange_;
  std::vector<Out> out_;
  std::vector<In> in_;
  std::vector<Donor> donors_;           // every mapped chunk of the outgoing tags, by address, then foreign ones
  std::size_t local_donors_ = 0;        // donors_[0, local_donors_): this process's
  std::vector<Chunk> foreign_;          // imported through the exchange (released unless handed over)
  std::vector<SwitchCopy> copies_;      // D2H, in queue order
  std::vector<std::vector<CoverSpan>> covers_;  // per (in, heap): index 2 * in + heap
  HandoffPlan plan_;
  std::vector<Deferred> deferred_;
  std::vector<bool> written_;  // per donor: restore copies were queued into it
  std::vector<HandoffRecipient> recipients_;  // the plan's
  std::vector<Offered> offered_;              // PlanOffer's
  bool offered_anywhere_ = false;             // OfferChunks offered chunks that takers may write
  std::vector<std::pair<std::size_t, Event>> ipc_events_;  // by D2H group: made here, recorded after it
  std::vector<Event> opened_events_;          // other processes' (TakeChunks)
  Stream d2h_ = nullptr;
  Stream h2d_ = nullptr;
  std::vector<Event>* events_ = nullptr;  // the D2H pool's copy events: one per group
  std::uint64_t synced_before_ = 0;
  Clock::time_point start_;
  std::array<Clock::time_point, kSteps> at_{};  // indexed by Step
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_SWITCH_TRANSACTION_H_
