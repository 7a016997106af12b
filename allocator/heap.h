// Heap: the memory of one tag of one size class (small or large) on one device.
//
// A heap owns one or more segments. A segment is a large VA reservation (heap_va bytes,
// default twice the device memory) into which chunks are mapped on demand; VA is cheap,
// physical memory is what counts. Holes left by ReleaseFreeChunks are reused before the
// reservation's unused tail; when no gap fits, a new segment is reserved.
//
// Chunk sizing (docs/architecture.md §5; "the number of chunks decides pause/resume cost"):
//   small heap: every chunk is small_chunk bytes (2 MiB rounded up to the granularity);
//   large heap: a new chunk is 1/kGrowthDivisor (16, transition_plan.h) of what the heap already maps (geometric growth by
//   6.25%), at least min_chunk and at most max_chunk, and at least the part of the
//   request that the free tail before the gap does not cover; a single larger request
//   gets one chunk of its own size. If the device refuses the growth size, the heap
//   retries with what the request needs. 1/16 keeps the over-reservation at the peak
//   small (trace replay: peak reserved / peak allocated 1.05 vs 1.13 at 1/8 and 1.21 at
//   1/1) while a 64 GiB pool grown in small steps stays near a hundred chunks (about
//   0.2 ms each to map on an H200), and resume re-chunks anyway.
//
// Blocks tile the runs of mapped chunks (see block.h). Free blocks sit in one FreeIndex
// per stream plus a shared index (see Note [Stream-Ordered Reuse] in caching_allocator.h).
//
// Failure: a failed Grow leaves the heap exactly as it was (Chunk, Mapping and Reservation
// roll back by RAII). ReleaseFreeChunks stops at a refused unmap, leaving that chunk
// mapped and the heap valid; a refused release keeps the handle and retries it later.
//
// Thread-safety: none. The owning TagPool's callers serialize the calls; which lock that
// is depends on the tag's state: Note [Heap Locking] in tag_pool.h.
#ifndef VMSTASH_ALLOCATOR_HEAP_H_
#define VMSTASH_ALLOCATOR_HEAP_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/block.h"
#include "allocator/free_index.h"
#include "allocator/handoff_plan.h"
#include "allocator/transition_plan.h"
#include "vmm/chunk.h"
#include "vmm/driver.h"
#include "vmm/mapping.h"
#include "vmm/reservation.h"

namespace vmstash {

struct HeapConfig {
  Driver* driver = nullptr;
  int device = 0;
  std::string name;                  // for messages and snapshots, e.g. "kv_cache/large"
  int owner_id = 0;                  // the owner's key for this heap (the allocator: its tag id)
  std::size_t granularity_bytes = 0;
  bool small = false;
  std::size_t small_chunk_bytes = 0;  // small heaps
  std::size_t min_chunk_bytes = 0;    // large heaps
  std::size_t max_chunk_bytes = 0;
  std::size_t va_bytes = 0;           // per reservation
  std::size_t min_split_bytes = 512;  // a remainder smaller than this is not split off
  ChunkOptions chunk_options;         // every chunk it creates (shareable: AllocatorOptions::share_chunks)
};

// One mapped chunk, as snapshots and Validate see it.
struct ChunkView {
  DevicePtr address = 0;
  std::size_t size_bytes = 0;
  const Chunk* chunk = nullptr;  // the heap's own (valid until the heap changes)
};

class Heap {
 public:
  Heap(HeapConfig config, BlockPool* blocks);
  ~Heap();  // unmaps and releases everything (errors are logged, never thrown)
  Heap(const Heap&) = delete;
  Heap& operator=(const Heap&) = delete;

  const HeapConfig& config() const { return config_; }

  // A cached free block of >= size_bytes usable on `stream` (its own index or the shared
  // one), split to size and marked allocated on `stream`; nullptr when there is none.
  Block* AllocateCached(std::size_t size_bytes, Stream stream);
  // Maps new memory so that a block of size_bytes exists, and allocates it. On failure
  // nothing changed (ResourceExhausted when the device is full).
  absl::StatusOr<Block*> AllocateGrow(std::size_t size_bytes, Stream stream);
  // Returns an allocated (or pending) block to the index of block->stream, merging it
  // with free neighbours of that index. `epoch` stamps the free.
  void Free(Block* block, std::uint64_t epoch);
  // Moves the free blocks of `stream` freed at or before `epoch` into the shared index.
  // Returns how many moved.
  std::size_t ShareFreeBlocks(Stream stream, std::uint64_t epoch);
  // Streams that own free blocks (excluding the shared index).
  std::vector<Stream> StreamsWithFreeBlocks() const;

  // Unmaps and releases every chunk lying entirely inside a free block; frees
  // reservations left empty. The caller has synchronized the device. Returns the bytes
  // released; the first error (if any) goes to *error and the heap stays valid.
  std::size_t ReleaseFreeChunks(absl::Status* error);

  // --- Pause and resume (Note [Pause/Resume Protocol] in pause_resume.h) ----------------
  // While paused the heap has no chunks and no free blocks; its live blocks keep their
  // addresses (the reservations stay) and Free() of one just drops the record.
  bool paused() const { return paused_; }
  // Allocated blocks, segment by segment, in address order inside a segment (paused or not).
  std::vector<Block*> LiveBlocks() const;
  // Mapped chunks, segment by segment (address order inside one), for planning a pause.
  std::vector<ChunkView> Chunks() const;
  // Step 1 of a pause, one chunk at a time (pipelined with the backup copies): unmaps the
  // chunk at `address`, keeping its handle. RemapAll undoes it.
  absl::Status UnmapChunk(DevicePtr address);
  // Step 1 of a pause, all at once: unmaps every chunk, keeping the handles. On failure
  // the chunks unmapped so far stay unmapped: the caller's RemapAll undoes them (and
  // learns whether that worked).
  absl::Status UnmapAll();
  // Undoes UnmapChunk/UnmapAll (used when a later step of the pause fails).
  absl::Status RemapAll();
  // Step 2: releases the handles (a refused release keeps the handle for a later retry and
  // goes to *error), drops free blocks and runs; the heap is paused. Returns the bytes.
  // A switch hands chunks over instead (Note [Switch Protocol] in switch.h):
  // those for which `hand_over(handle)` is true move to *handed, unreleased.
  std::size_t ReleaseAllAndPause(absl::Status* error, const std::function<bool(ChunkHandle)>& hand_over = nullptr,
                                 std::vector<Chunk>* handed = nullptr);
  // Resume, in three steps. PlanResume covers the live blocks with maximal granule-aligned
  // runs (PlanCovers in transition_plan.h; the live blocks in the order it takes them are
  // LiveBlocks()). PrepareResume maps each cover at the same VA, one chunk per cover, or,
  // when first_piece_bytes > 0, in pieces growing geometrically from first_piece_bytes to
  // max_chunk_bytes (PlanPieces), so that creating and mapping piece k+1 overlaps the
  // restore copies of piece k. `on_mapped(va, size)` runs after each piece is mapped (to
  // queue its restore copies). Destroying the ResumeTxn without CommitResume undoes
  // everything it made.
  absl::StatusOr<std::vector<CoverSpan>> PlanResume() const;
  // Where segment `segment` (a CoverSpan::segment) ends: a switch lets a handed-over chunk
  // overhang a cover into the unused address space up to the next cover or this end.
  DevicePtr SegmentEnd(std::size_t segment) const;
  class ResumeTxn {
   public:
    struct Piece {
      DevicePtr address = 0;
      std::size_t size_bytes = 0;
      Chunk chunk;      // empty for a handed-over chunk until the switch commits
      int donor = kNoDonor;  // a switch: the donor (outgoing chunk, owned elsewhere) mapped here
      Mapping mapping;  // declared after the chunk: unmapped before it is released
    };
    struct Cover {
      void* segment = nullptr;  // the Segment it lies in
      CoverSpan span;             // its plan: address, size, the live blocks it covers
      std::vector<Piece> pieces;  // address order, tiling the cover
    };
    std::vector<Cover> covers;  // the plan's order
  };
  // On failure *txn holds what was made so far: the caller waits for the copies it queued
  // into those pieces, then destroys *txn (which unmaps and releases them).
  absl::Status PrepareResume(ResumeTxn* txn, const std::vector<CoverSpan>& covers,
                             const std::function<absl::Status(DevicePtr, std::size_t)>& on_mapped,
                             std::size_t first_piece_bytes = 0);
  // A switch's resume: like PrepareResume, with each cover tiled by `pieces[i]` (sizes
  // summing to the cover's), a piece with a donor mapped to that chunk, donors[donor] (a
  // second mapping of an outgoing chunk; the piece does not own it), the others
  // (kNoDonor) created fresh. `on_mapped(va, size, donor)` runs after each piece is mapped.
  absl::Status PrepareHandoff(ResumeTxn* txn, const std::vector<CoverSpan>& covers,
                              const std::vector<std::vector<HandoffPiece>>& pieces,
                              const std::vector<const Chunk*>& donors,
                              const std::function<absl::Status(DevicePtr, std::size_t, int)>& on_mapped);
  // Rebuilds chunks, runs and free filler blocks from the transaction; never fails. A
  // switch has moved each donor chunk into its piece first.
  void CommitResume(std::unique_ptr<ResumeTxn> txn);

  std::size_t mapped_bytes() const { return mapped_bytes_; }
  std::size_t chunk_count() const { return chunk_count_; }
  std::size_t free_bytes() const;
  std::size_t va_bytes() const;

  // Invariant walker (see block.h); InvalidArgument/Internal naming the first violation.
  // `pending` counts blocks that are neither allocated nor in an index.
  absl::Status Validate(std::size_t* allocated_bytes, std::size_t* pending_blocks) const;

  // For snapshots: segments in address order, each with its chunks and blocks.
  struct SegmentView {
    DevicePtr address = 0;
    std::size_t va_bytes = 0;
    std::vector<ChunkView> chunks;
    std::vector<const Block*> blocks;
  };
  std::vector<SegmentView> Segments() const;

 private:
  struct MappedChunk {
    Chunk chunk;
    Mapping mapping;  // destroyed first: unmaps before the chunk is released
  };
  struct Segment {
    Reservation reservation;
    std::map<DevicePtr, MappedChunk> chunks;  // by address
    std::map<DevicePtr, Block*> run_heads;    // first block of each run, by address
  };
  struct Gap {
    Segment* segment = nullptr;
    DevicePtr address = 0;
    std::size_t size_bytes = 0;
    Block* left = nullptr;  // last block of the run ending at `address`, if any
    std::size_t need_bytes = 0;
  };

  FreeIndex* IndexFor(Stream stream);
  FreeIndex* FindIndex(Stream stream) const;
  // Inserts a free block into `index`, merging with neighbours in the same index.
  Block* InsertFree(Block* block, FreeIndex* index);
  // Takes `block` out of its index, splits it to size and marks it allocated.
  Block* Take(Block* block, std::size_t size_bytes, Stream stream);
  Block* LastBlockEndingAt(const Segment& segment, DevicePtr address) const;
  bool FindGap(std::size_t size_bytes, Stream stream, Gap* gap);
  std::size_t GrowthBytes(std::size_t need_bytes) const;
  void CutFree(Segment& segment, Block* block, DevicePtr from, DevicePtr to);
  void RetryOrphans(absl::Status* error);
  // Creates (or maps donor `donor`, `chunk`, for) one piece at `va`, appended to `cover`.
  absl::Status MakePiece(ResumeTxn::Cover* cover, DevicePtr va, std::size_t size_bytes, int donor,
                         const Chunk* chunk);

  const HeapConfig config_;
  BlockPool* const blocks_;
  std::vector<std::unique_ptr<Segment>> segments_;
  std::vector<std::unique_ptr<FreeIndex>> indexes_;  // one per stream
  std::unique_ptr<FreeIndex> shared_;                // blocks any stream may take
  Stream cached_stream_ = nullptr;  // one-entry cache of IndexFor
  FreeIndex* cached_index_ = nullptr;
  std::vector<Chunk> orphans_;  // unmapped chunks whose release was refused
  bool paused_ = false;
  std::vector<Block*> paused_live_;  // live blocks while paused, in address order
  std::size_t mapped_bytes_ = 0;
  std::size_t chunk_count_ = 0;
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_HEAP_H_
