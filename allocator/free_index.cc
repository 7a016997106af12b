#include "allocator/free_index.h"

namespace vmstash {
namespace {

int Log2Floor(std::size_t v) { return 63 - __builtin_clzll(v); }

}  // namespace

void FreeIndex::Classify(std::size_t size_bytes, int* first, int* second) {
  constexpr std::size_t kLinearLimit = std::size_t{1} << (kMinBlockShift + kSecondLevelBits);
  if (size_bytes < kLinearLimit) {
    *first = 0;
    *second = static_cast<int>(size_bytes >> kMinBlockShift);
    return;
  }
  int log2 = Log2Floor(size_bytes);
  *first = log2 - (kMinBlockShift + kSecondLevelBits) + 1;
  *second = static_cast<int>((size_bytes >> (log2 - kSecondLevelBits)) & (kSecondLevels - 1));
}

void FreeIndex::Insert(Block* block) {
  int f, s;
  Classify(block->size_bytes, &f, &s);
  block->index = this;
  block->free_prev = nullptr;
  block->free_next = heads_[f][s];
  if (heads_[f][s] != nullptr) heads_[f][s]->free_prev = block;
  heads_[f][s] = block;
  first_bitmap_ |= std::uint64_t{1} << f;
  second_bitmap_[f] |= std::uint32_t{1} << s;
  ++count_;
  bytes_ += block->size_bytes;
}

void FreeIndex::Remove(Block* block) {
  int f, s;
  Classify(block->size_bytes, &f, &s);
  if (block->free_prev != nullptr) block->free_prev->free_next = block->free_next;
  else heads_[f][s] = block->free_next;
  if (block->free_next != nullptr) block->free_next->free_prev = block->free_prev;
  if (heads_[f][s] == nullptr) {
    second_bitmap_[f] &= ~(std::uint32_t{1} << s);
    if (second_bitmap_[f] == 0) first_bitmap_ &= ~(std::uint64_t{1} << f);
  }
  block->index = nullptr;
  block->free_prev = block->free_next = nullptr;
  --count_;
  bytes_ -= block->size_bytes;
}

Block* FreeIndex::Find(std::size_t size_bytes) const {
  if (count_ == 0) return nullptr;
  int f, s;
  Classify(size_bytes, &f, &s);
  // Best fit among the first few blocks of the request's own class.
  constexpr int kScan = 8;
  Block* best = nullptr;
  int scanned = 0;
  for (Block* b = heads_[f][s]; b != nullptr && scanned < kScan; b = b->free_next, ++scanned) {
    if (b->size_bytes >= size_bytes && (best == nullptr || b->size_bytes < best->size_bytes)) {
      best = b;
      if (b->size_bytes == size_bytes) break;
    }
  }
  if (best != nullptr) return best;
  // Every block of a higher class fits: the first non-empty one above (f, s).
  std::uint32_t above = s + 1 < kSecondLevels ? second_bitmap_[f] & (~std::uint32_t{0} << (s + 1)) : 0;
  if (above != 0) return heads_[f][__builtin_ctz(above)];
  std::uint64_t higher = f + 1 < 64 ? first_bitmap_ & (~std::uint64_t{0} << (f + 1)) : 0;
  if (higher != 0) {
    int hf = __builtin_ctzll(higher);
    return heads_[hf][__builtin_ctz(second_bitmap_[hf])];
  }
  // Nothing above: the rest of the own class is the last chance (so Find never misses a
  // block that fits).
  for (Block* b = heads_[f][s]; b != nullptr; b = b->free_next) {
    if (b->size_bytes >= size_bytes && (best == nullptr || b->size_bytes < best->size_bytes)) best = b;
  }
  return best;
}

}  // namespace vmstash
