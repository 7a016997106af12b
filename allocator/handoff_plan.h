// HandoffPlan: the pure half of a switch (Note [Switch Protocol] in switch.h).
//
// A switch pauses outgoing tags and resumes incoming tags in one transaction. Instead of
// releasing the outgoing tags' chunks and creating new ones for the incoming tags, it maps
// outgoing chunks (donors) into the incoming tags' covers (recipients). A chunk is mapped
// whole, so a donor fits a recipient only where the recipient still has a gap at least as
// large as the donor; the rest of each recipient is created fresh, and donors that fit
// nowhere are released at the commit. Two decisions are made here, from plain values:
//
//   pieces   which donors tile which recipients, by the one fitting rule of
//            base/chunk_fit.h (best fit, largest donors first, then the smallest donor
//            that covers a gap left open); a donor may overhang the recipient's end into
//            the unused address space after it (its slack), by at most
//            1/kGrowthDivisor of the recipient (the heap's own growth overshoot) and
//            always less than the slack, so the grown cover never touches what follows
//            it (another cover: two covers touching would be one run of chunks with two
//            heads), so that memory is neither created nor released; fresh pieces fill
//            the remainder (PlanPieces, as a resume makes them). In a switch across
//            processes, the gaps left to fresh memory are offered to the other processes'
//            chunks (OpenGaps, AddForeignDonors), those of covers that restore as
//            strict gaps: only chunks their givers backed up go there;
//   ordering how the device-to-host copies of the outgoing `backup` tags are cut (inside
//            one donor chunk each) and grouped (an event after each group), and which
//            group a host-to-device restore copy into a donor must wait for: only the
//            outgoing copies that read the bytes it overwrites.
//
// Safety rule: a donor of a `discard` tag has no backup of its bytes, so it only goes to
// a recipient that receives no restore copies (a `discard` tag's cover). Were it written
// and the switch then failed, its tag's bytes could not be put back. A `backup` donor may
// go anywhere: a rollback restores its bytes from the backup the switch just made.
//
// No driver, no locks, no state: every case is unit-tested alone (handoff_plan_test.cc).
#ifndef VMSTASH_ALLOCATOR_HANDOFF_PLAN_H_
#define VMSTASH_ALLOCATOR_HANDOFF_PLAN_H_

#include <cstddef>
#include <optional>
#include <vector>

#include "allocator/transition_plan.h"
#include "base/chunk_fit.h"
#include "vmm/driver.h"

namespace vmstash {

// A chunk of an outgoing tag.
struct HandoffDonor {
  std::size_t size_bytes = 0;
  bool backed_up = false;  // its tag's policy is backup
};
// A cover of an incoming tag (PlanCovers).
struct HandoffRecipient {
  std::size_t size_bytes = 0;
  bool restores = false;  // its tag's policy is backup: restore copies are written into it
  // Unused address space right after it, up to the next cover or the segment's end: a
  // donor may overhang into it, but never fill it (overhang < slack_bytes).
  std::size_t slack_bytes = 0;
};
// The one "no donor" value: a piece, copy or mapping made of fresh memory, not of an
// outgoing chunk. Donors are named by their index into the switch's donors everywhere
// (plan, heap transaction, executor).
inline constexpr int kNoDonor = -1;

// One piece of a recipient: a donor (index into the donors) or a fresh chunk (kNoDonor).
struct HandoffPiece {
  std::size_t size_bytes = 0;
  int donor = kNoDonor;
  friend bool operator==(const HandoffPiece& a, const HandoffPiece& b) {
    return a.size_bytes == b.size_bytes && a.donor == b.donor;
  }
};
struct HandoffPlan {
  std::vector<std::vector<HandoffPiece>> pieces;  // per recipient: donors first, then fresh
  std::vector<std::size_t> overhang;              // per recipient: bytes its pieces run past its end
  std::vector<int> leftover;                      // donors used nowhere: released at the commit
  std::size_t handed_bytes = 0;
  std::size_t fresh_bytes = 0;
  std::size_t leftover_bytes = 0;
};
// Every size is a multiple of `granularity`. Each recipient is tiled exactly, or up to
// overhang[r] (< its slack, <= its size / kGrowthDivisor) past its end by its last donor; each donor
// is used at most once, never by a restoring recipient unless backed_up. Fresh remainders are
// cut by PlanPieces(gap, first_piece_bytes if the recipient restores else 0,
// max_piece_bytes, granularity).
HandoffPlan PlanHandoff(const std::vector<HandoffDonor>& donors, const std::vector<HandoffRecipient>& recipients,
                        std::size_t first_piece_bytes, std::size_t max_piece_bytes, std::size_t granularity);

// How far a donor may run past `recipient`'s end: 0, or under its slack by a granule and at
// most its size / kGrowthDivisor.
std::size_t MaxOverhang(const HandoffRecipient& recipient, std::size_t granularity);

// The gaps of `plan` that another process's chunks may fill: each recipient that has
// fresh pieces, as one gap of its fresh bytes (MaxOverhang past it), in recipient order;
// a recipient that restores only when `restoring`, as a strict gap (only chunks their
// giver can restore go there); the `max_gaps` largest of them when there are more (ties:
// the earlier), still in recipient order.
struct HandoffGaps {
  std::vector<FitGap> gaps;
  std::vector<std::size_t> recipient;  // per gap: its recipient
};
HandoffGaps OpenGaps(const HandoffPlan& plan, const std::vector<HandoffRecipient>& recipients,
                     std::size_t granularity, std::size_t max_gaps, bool restoring = true);
// Whether a part's covers that restore should take other processes' chunks: when the
// device's free memory (`free_bytes`; nothing: unknown) is short of the plan's fresh bytes
// and an eighth more. Otherwise fresh memory serves them faster: it comes in few large
// chunks, while another process's chunks come as they were made (often one per tensor),
// each its own import and mapping while the copies stream.
bool RestoresTakeForeignChunks(std::size_t fresh_bytes, std::optional<std::size_t> free_bytes);
// Fits chunks of other processes (`foreign`: sizes, and whether they may go into strict
// gaps; donors first_donor, first_donor + 1, ... of the switch) into `open` (OpenGaps of
// `plan`) by FitChunks. A recipient that gets some has them after its own donors, instead
// of its fresh pieces, and fresh memory for what they leave open (cut as PlanHandoff cuts
// it: `first_piece_bytes` first where it restores). The foreign donors placed nowhere
// join the leftover (released at the commit: this process's imports of them) and are
// returned.
std::vector<int> AddForeignDonors(HandoffPlan& plan, const HandoffGaps& open, const std::vector<FitChunk>& foreign,
                                  int first_donor, std::size_t first_piece_bytes, std::size_t max_piece_bytes,
                                  std::size_t granularity);

// One device-to-host copy of a switch, inside chunk `chunk` of the outgoing chunks.
struct SwitchCopy {
  CopyStep step;
  std::size_t chunk = 0;
  std::size_t group = 0;  // an event is recorded after the last copy of each group
};
// The copies of `extents` (address order, as BackupLayout::in_order), cut at the
// boundaries of `chunks` (sorted by address, non-overlapping; every extent byte lies in
// one) and into pieces of at most `group_bytes` (> 0), numbered into groups of at least
// `group_bytes` starting at `first_group`, so that a restore copy into a handed-over chunk
// waits only for the group that reads the bytes it overwrites.
// InvalidArgument (Internal) when an extent byte lies in no chunk.
absl::StatusOr<std::vector<SwitchCopy>> PlanSwitchCopies(const std::vector<BackupExtent>& extents,
                                                         const std::vector<ChunkSpan>& chunks,
                                                         std::size_t group_bytes, std::size_t first_group);

// Which copy group must complete before device bytes of an outgoing chunk are overwritten.
class CopyReadiness {
 public:
  // `copies` of all outgoing tags (any order), `chunk_count` outgoing chunks.
  CopyReadiness(const std::vector<SwitchCopy>& copies, std::size_t chunk_count);
  // The last group that reads any of [address, address + size_bytes) of chunk `chunk`
  // (conservative: possibly a later group of the same chunk), or nothing when no copy
  // reads them.
  std::optional<std::size_t> WaitGroup(std::size_t chunk, DevicePtr address, std::size_t size_bytes) const;

 private:
  struct Read {
    DevicePtr start = 0;
    DevicePtr end = 0;
    std::size_t group = 0;
  };
  std::vector<std::vector<Read>> by_chunk_;  // each sorted by start
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_HANDOFF_PLAN_H_
