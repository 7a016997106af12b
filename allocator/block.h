// Block: one user allocation (or one free range) inside a segment, and BlockPool, the
// slab the allocator takes Block records from (no malloc on the allocation path).
//
// Layout: the blocks of a run (a maximal VA range of contiguous mapped chunks of one
// segment) tile it exactly and are linked in address order through prev/next; a run's
// first block has prev == nullptr and its last next == nullptr. A block may span several
// chunks of its run. Blocks of different tags never share a chunk, because each tag's
// heaps have their own reservations.
//
// Invariants (checked by CachingAllocator::Validate):
//   - next->address == address + size_bytes, and next->prev == this;
//   - a free block sits in exactly one FreeIndex (`index`), an allocated one in none;
//   - two neighbours are never both free in the same FreeIndex (they are merged);
//   - when two blocks merge, the lower one survives, and a split keeps the lower part in
//     the original record, so the first block of a run is stable on the fast path.
//
// Thread-safety: none; blocks are guarded by their allocator's mutex.
#ifndef VMSTASH_ALLOCATOR_BLOCK_H_
#define VMSTASH_ALLOCATOR_BLOCK_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "vmm/driver.h"

namespace vmstash {

class FreeIndex;
class Heap;

struct Block {
  DevicePtr address = 0;
  std::size_t size_bytes = 0;
  std::size_t requested_bytes = 0;  // what the user asked for (allocated blocks)
  Heap* heap = nullptr;
  Block* prev = nullptr;  // address-order neighbours in the run
  Block* next = nullptr;
  // Free blocks: the index they sit in and their list links inside it.
  FreeIndex* index = nullptr;
  Block* free_prev = nullptr;
  Block* free_next = nullptr;
  Stream stream = nullptr;          // allocation stream (allocated) / owner stream (free)
  std::uint64_t free_epoch = 0;     // allocator-wide count of frees when this was freed
  bool allocated = false;
  // Streams given through RecordStream besides `stream` (rare; empty on the fast path).
  std::vector<Stream> other_streams;
  DevicePtr end() const { return address + size_bytes; }
};

// Hands out Block records from slabs; freed records are recycled, slabs are kept until
// the pool is destroyed.
class BlockPool {
 public:
  Block* New() {
    if (free_ == nullptr) Refill();
    Block* b = free_;
    free_ = b->next;
    *b = Block();
    ++live_;
    return b;
  }
  void Delete(Block* b) {
    b->other_streams.clear();
    b->other_streams.shrink_to_fit();
    b->next = free_;
    free_ = b;
    --live_;
  }
  std::size_t live() const { return live_; }

 private:
  static constexpr std::size_t kSlabBlocks = 256;
  void Refill() {
    slabs_.push_back(std::make_unique<Block[]>(kSlabBlocks));
    Block* slab = slabs_.back().get();
    for (std::size_t i = 0; i < kSlabBlocks; ++i) {
      slab[i].next = free_;
      free_ = &slab[i];
    }
  }
  std::vector<std::unique_ptr<Block[]>> slabs_;
  Block* free_ = nullptr;
  std::size_t live_ = 0;
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_BLOCK_H_
