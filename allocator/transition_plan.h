// TransitionPlan: the pure half of pause and resume (Note [Pause/Resume Protocol] in
// pause_resume.h).
//
// A pause or resume decides four things before (or while) it calls the driver:
//   extents  which device bytes of which live block are backed up, at which arena offset
//            (the requested bytes of each live block, cut by the caller's live-range hint,
//            each extent at a page-aligned offset, in address order);
//   stages   how a pause pipelines: runs of whole chunks in address order holding about
//            1/kMaxPauseStages of the backed-up bytes each (at least the configured stage
//            size), with the copies that read each stage's chunks;
//   covers   which granule-aligned runs a resume maps to cover the live blocks (touching
//            runs merged, never across segments), and the piece sizes of each run;
//   restores which restore copies a freshly mapped piece receives (a block may span
//            pieces: each part is copied once its piece is mapped).
// These functions make those decisions from plain values — no driver, no locks, no
// state — so that every case is unit-tested alone (transition_plan_test.cc), and the
// allocator and the heaps only execute the plans and roll back what they did.
#ifndef VMSTASH_ALLOCATOR_TRANSITION_PLAN_H_
#define VMSTASH_ALLOCATOR_TRANSITION_PLAN_H_

#include <cstddef>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "allocator/block.h"
#include "vmm/driver.h"

namespace vmstash {

// Arena offsets are multiples of this (page-aligned pieces copy fastest).
inline constexpr std::size_t kBackupAlignBytes = 4096;
// A pipelined pause has at most this many stages.
inline constexpr std::size_t kMaxPauseStages = 16;
// A large heap grows by 1/kGrowthDivisor of what it maps (heap.h), and a switch lets a
// handed-over chunk overhang a cover by at most 1/kGrowthDivisor of it (handoff_plan.h):
// the same overshoot either way.
inline constexpr std::size_t kGrowthDivisor = 16;

// Device bytes [address, address + size_bytes) are at arena offset arena_offset.
struct BackupExtent {
  DevicePtr address = 0;
  std::size_t size_bytes = 0;
  std::size_t arena_offset = 0;
  friend bool operator==(const BackupExtent& a, const BackupExtent& b) {
    return a.address == b.address && a.size_bytes == b.size_bytes && a.arena_offset == b.arena_offset;
  }
};
using BackupExtents = absl::flat_hash_map<const Block*, std::vector<BackupExtent>>;
// (address, size) pairs, in any order, possibly overlapping or empty.
using ByteRanges = std::vector<std::pair<DevicePtr, std::size_t>>;

// Sorted by address, overlapping and touching ranges merged, empty ones dropped; a range
// running past the end of the address space is cut there (never wraps).
ByteRanges NormalizeRanges(ByteRanges ranges);

struct BackupLayout {
  BackupExtents by_block;            // a block with nothing to copy has an empty list
  std::vector<BackupExtent> in_order;  // all extents, address order = arena order
  std::size_t arena_bytes = 0;       // arena size the extents need
};
// The extents of `live` (any order): each block's requested bytes, or only their parts
// inside `hint` when it is not null.
BackupLayout PlanBackupLayout(std::vector<const Block*> live, const ByteRanges* hint);
// The arena bytes of each block of `layout` that has extents, in arena order: the pieces
// tiling [0, layout.arena_bytes), each a multiple of kBackupAlignBytes (a disk-files
// arena makes one file per piece: backup_arena.h, Note [Disk Backup Files]).
std::vector<std::size_t> BackupPieceBytes(const BackupLayout& layout);
// Where the arena bytes of `extents` end (extents lie at increasing offsets from 0): what
// a resume reads of the arena; 0 when nothing was backed up.
std::size_t BackedUpArenaEnd(const BackupExtents& extents);
// True when some block of `extents` has bytes backed up: a resume must restore them (and
// needs the arena). A pause whose hint covered no live byte made no arena and has none.
inline bool HasBackedUpBytes(const BackupExtents& extents) { return BackedUpArenaEnd(extents) > 0; }

// One copy between device bytes and the arena (either direction).
struct CopyStep {
  DevicePtr device = 0;
  std::size_t arena_offset = 0;
  std::size_t size_bytes = 0;
  friend bool operator==(const CopyStep& a, const CopyStep& b) {
    return a.device == b.device && a.arena_offset == b.arena_offset && a.size_bytes == b.size_bytes;
  }
};

struct ChunkSpan {
  DevicePtr address = 0;
  std::size_t size_bytes = 0;
};
struct PauseStage {
  std::vector<std::size_t> chunks;  // indices into the `chunks` given to PlanPauseStages
  std::vector<CopyStep> copies;     // the parts of extents inside those chunks
  std::size_t bytes = 0;            // sum of the copies' sizes
};
// Stages over every mapped chunk of the tag (`chunks`, any order, non-overlapping),
// each closed once it holds max(min_stage_bytes, layout.arena_bytes / kMaxPauseStages)
// bytes of copies. Every chunk is in exactly one stage (chunks without live bytes too,
// so the stages unmap everything); every byte of every extent is copied exactly once.
std::vector<PauseStage> PlanPauseStages(const BackupLayout& layout, const std::vector<ChunkSpan>& chunks,
                                        std::size_t min_stage_bytes);

// A run that a resume maps at the same VA: granule-aligned, inside segment `segment`.
struct CoverSpan {
  std::size_t segment = 0;  // index into the `segments` given to PlanCovers
  DevicePtr address = 0;
  std::size_t size_bytes = 0;
  std::size_t first_block = 0;  // the live blocks it covers: [first_block, end_block)
  std::size_t end_block = 0;
};
// Covers of the live blocks: each block's [address, end) rounded out to `granularity`,
// merged with the previous cover of the same segment when they touch. `live` lists the
// blocks segment by segment (in the order of `segments`), by address inside a segment;
// `segments` are the reservations' [address, address + size). A block outside that
// order or outside every segment is an Internal error (nothing would map it back).
absl::StatusOr<std::vector<CoverSpan>> PlanCovers(const std::vector<const Block*>& live,
                                                  const std::vector<ChunkSpan>& segments, std::size_t granularity);

// Piece sizes tiling a cover of `cover_bytes`: one piece when first_piece_bytes is 0;
// otherwise pieces growing geometrically (x2) from first_piece_bytes (rounded up to the
// granularity) to max_piece_bytes (likewise, at least one granule), a short last piece
// (under half the next size) joined to the one before it.
std::vector<std::size_t> PlanPieces(std::size_t cover_bytes, std::size_t first_piece_bytes,
                                    std::size_t max_piece_bytes, std::size_t granularity);

// The restore copies of a resume, piece by piece. `live` and `covers` are what
// PlanCovers took and gave; the pieces come in cover order, each inside one cover, in
// address order within it. `extents` holds each block's backed-up bytes (a block
// without an entry gets no copy). Only blocks of the piece's own cover are considered,
// so segments in any address order are safe.
class RestorePlanner {
 public:
  RestorePlanner(std::vector<const Block*> live, std::vector<CoverSpan> covers, const BackupExtents* extents)
      : live_(std::move(live)), covers_(std::move(covers)), extents_(extents) {}
  // The copies into the freshly mapped piece [va, va + size_bytes), arena to device.
  // InvalidArgument when the piece lies in no cover at or after the previous piece's.
  absl::StatusOr<std::vector<CopyStep>> CopiesInto(DevicePtr va, std::size_t size_bytes);

 private:
  std::vector<const Block*> live_;
  std::vector<CoverSpan> covers_;
  const BackupExtents* extents_;
  std::size_t cover_ = 0;   // the cover of the previous piece
  std::size_t cursor_ = 0;  // blocks before it lie entirely in earlier pieces
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_TRANSITION_PLAN_H_
