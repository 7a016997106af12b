// FreeIndex: a two-level segregated-fit (TLSF-style) index of free blocks.
//
// Sizes map to (first level = floor(log2), second level = the next kSecondLevelBits bits)
// classes; each class holds an intrusive doubly-linked list of blocks, and two levels of
// bitmaps find the first non-empty class at or above a size in O(1). Find() first scans a
// few blocks of the request's own class for the smallest that fits (best fit in the common
// case), then takes the head of the first non-empty larger class (every block there
// fits). Sizes below kMinBlockBytes share the first classes linearly.
//
// One FreeIndex holds the free blocks of one heap that one stream may reuse at once (see
// Note [Stream-Ordered Reuse] in caching_allocator.h).
//
// Thread-safety: none (guarded by the allocator's mutex).
#ifndef VMSTASH_ALLOCATOR_FREE_INDEX_H_
#define VMSTASH_ALLOCATOR_FREE_INDEX_H_

#include <cstddef>
#include <cstdint>

#include "allocator/block.h"

namespace vmstash {

class FreeIndex {
 public:
  static constexpr int kSecondLevelBits = 4;
  static constexpr int kSecondLevels = 1 << kSecondLevelBits;
  static constexpr int kMinBlockShift = 9;  // 512 B
  static constexpr int kFirstLevels = 64 - kMinBlockShift - kSecondLevelBits + 1;

  explicit FreeIndex(Stream stream) : stream_(stream) {}
  FreeIndex(const FreeIndex&) = delete;
  FreeIndex& operator=(const FreeIndex&) = delete;

  // The stream whose allocations may take these blocks at once (nullptr entries of the
  // shared index: any stream).
  Stream stream() const { return stream_; }
  bool shared() const { return shared_; }
  void set_shared() { shared_ = true; }

  void Insert(Block* block);
  void Remove(Block* block);
  // A free block of at least `size_bytes`, or nullptr. Does not remove it.
  Block* Find(std::size_t size_bytes) const;

  std::size_t count() const { return count_; }
  std::size_t bytes() const { return bytes_; }
  // Calls fn(Block*) for every block; fn must not modify the index.
  template <typename Fn>
  void ForEach(Fn fn) const {
    for (int f = 0; f < kFirstLevels; ++f) {
      if ((first_bitmap_ & (std::uint64_t{1} << f)) == 0) continue;
      for (int s = 0; s < kSecondLevels; ++s) {
        for (Block* b = heads_[f][s]; b != nullptr; b = b->free_next) fn(b);
      }
    }
  }

  // Class of a block of exactly `size_bytes` (exposed for tests).
  static void Classify(std::size_t size_bytes, int* first, int* second);

 private:
  Stream stream_;
  bool shared_ = false;
  std::uint64_t first_bitmap_ = 0;
  std::uint32_t second_bitmap_[kFirstLevels] = {};
  Block* heads_[kFirstLevels][kSecondLevels] = {};
  std::size_t count_ = 0;
  std::size_t bytes_ = 0;
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_FREE_INDEX_H_
