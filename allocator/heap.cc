#include "allocator/heap.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/types/span.h"
#include "base/bytes.h"
#include "base/log.h"
#include "base/status_macros.h"

namespace vmstash {
Heap::Heap(HeapConfig config, BlockPool* blocks)
    : config_(std::move(config)), blocks_(blocks), shared_(std::make_unique<FreeIndex>(nullptr)) {
  shared_->set_shared();
}

Heap::~Heap() {
  // Blocks go back to the pool; chunks unmap and release by RAII (errors are logged).
  for (auto& segment : segments_) {
    for (auto& [start, head] : segment->run_heads) {
      for (Block* b = head; b != nullptr;) {
        Block* next = b->next;
        blocks_->Delete(b);
        b = next;
      }
    }
  }
}

FreeIndex* Heap::FindIndex(Stream stream) const {
  for (const auto& index : indexes_) {
    if (index->stream() == stream) return index.get();
  }
  return nullptr;
}

FreeIndex* Heap::IndexFor(Stream stream) {
  if (cached_index_ != nullptr && cached_stream_ == stream) return cached_index_;
  FreeIndex* index = FindIndex(stream);
  if (index == nullptr) {
    indexes_.push_back(std::make_unique<FreeIndex>(stream));
    index = indexes_.back().get();
  }
  cached_stream_ = stream;
  cached_index_ = index;
  return index;
}

Block* Heap::InsertFree(Block* block, FreeIndex* index) {
  block->allocated = false;
  // A neighbour in the same index merges; so does one in the shared index when `index`
  // belongs to a stream (shared memory may always be restricted to one stream).
  auto mergeable = [&](const Block* n) {
    return n != nullptr && n->index != nullptr && (n->index == index || n->index == shared_.get());
  };
  // Loops: absorbing a shared neighbour can bring a block of `index` next to this one.
  while (mergeable(block->prev)) {
    Block* prev = block->prev;
    prev->index->Remove(prev);
    prev->size_bytes += block->size_bytes;
    prev->next = block->next;
    if (block->next != nullptr) block->next->prev = prev;
    prev->free_epoch = std::max(prev->free_epoch, block->free_epoch);
    blocks_->Delete(block);
    block = prev;
  }
  while (mergeable(block->next)) {
    Block* next = block->next;
    next->index->Remove(next);
    block->size_bytes += next->size_bytes;
    block->next = next->next;
    if (next->next != nullptr) next->next->prev = block;
    block->free_epoch = std::max(block->free_epoch, next->free_epoch);
    blocks_->Delete(next);
  }
  block->stream = index->shared() ? nullptr : index->stream();
  index->Insert(block);
  return block;
}

Block* Heap::Take(Block* block, std::size_t size_bytes, Stream stream) {
  FreeIndex* index = block->index;
  index->Remove(block);
  std::size_t rest = block->size_bytes - size_bytes;
  if (rest >= config_.min_split_bytes) {
    Block* r = blocks_->New();
    r->address = block->address + size_bytes;
    r->size_bytes = rest;
    r->heap = this;
    r->prev = block;
    r->next = block->next;
    r->free_epoch = block->free_epoch;
    if (block->next != nullptr) block->next->prev = r;
    block->next = r;
    block->size_bytes = size_bytes;
    r->stream = block->stream;
    index->Insert(r);  // its neighbours are not free in `index`: block was merged
  }
  block->allocated = true;
  block->stream = stream;
  return block;
}

Block* Heap::AllocateCached(std::size_t size_bytes, Stream stream) {
  FreeIndex* own = IndexFor(stream);
  Block* a = own->Find(size_bytes);
  Block* b = shared_->Find(size_bytes);
  Block* pick = a == nullptr ? b : (b == nullptr || a->size_bytes <= b->size_bytes ? a : b);
  if (pick == nullptr) return nullptr;
  return Take(pick, size_bytes, stream);
}

void Heap::Free(Block* block, std::uint64_t epoch) {
  if (paused_) {  // its bytes are gone with the pause; only the record goes
    paused_live_.erase(std::find(paused_live_.begin(), paused_live_.end(), block));
    blocks_->Delete(block);
    return;
  }
  block->free_epoch = epoch;
  block->requested_bytes = 0;
  InsertFree(block, IndexFor(block->stream));
}

std::size_t Heap::ShareFreeBlocks(Stream stream, std::uint64_t epoch) {
  FreeIndex* own = FindIndex(stream);
  if (own == nullptr || own->count() == 0) return 0;
  std::vector<Block*> moving;
  own->ForEach([&](Block* b) {
    if (b->free_epoch <= epoch) moving.push_back(b);
  });
  for (Block* b : moving) {
    own->Remove(b);
    InsertFree(b, shared_.get());
  }
  return moving.size();
}

std::vector<Stream> Heap::StreamsWithFreeBlocks() const {
  std::vector<Stream> out;
  for (const auto& index : indexes_) {
    if (index->count() != 0) out.push_back(index->stream());
  }
  return out;
}

std::size_t Heap::free_bytes() const {
  std::size_t total = shared_->bytes();
  for (const auto& index : indexes_) total += index->bytes();
  return total;
}

std::size_t Heap::va_bytes() const {
  std::size_t total = 0;
  for (const auto& segment : segments_) total += segment->reservation.size_bytes();
  return total;
}

Block* Heap::LastBlockEndingAt(const Segment& segment, DevicePtr address) const {
  auto it = segment.run_heads.upper_bound(address - 1);
  if (it == segment.run_heads.begin()) return nullptr;
  --it;
  for (Block* b = it->second; b != nullptr; b = b->next) {
    if (b->end() == address) return b;
    if (b->end() > address) return nullptr;
  }
  return nullptr;
}

std::size_t Heap::GrowthBytes(std::size_t need_bytes) const {
  if (config_.small) return std::max(need_bytes, config_.small_chunk_bytes);
  std::size_t growth = std::min(std::max(mapped_bytes_ / kGrowthDivisor, config_.min_chunk_bytes), config_.max_chunk_bytes);
  return std::max(need_bytes, RoundUp(growth, config_.granularity_bytes));
}

bool Heap::FindGap(std::size_t size_bytes, Stream stream, Gap* gap) {
  const std::size_t gran = config_.granularity_bytes;
  FreeIndex* own = FindIndex(stream);
  bool found = false;
  for (auto& segment : segments_) {
    DevicePtr cursor = segment->reservation.address();
    const DevicePtr end = cursor + segment->reservation.size_bytes();
    auto consider = [&](DevicePtr g0, DevicePtr g1) {
      if (g1 <= g0) return;
      Block* left = LastBlockEndingAt(*segment, g0);
      std::size_t left_free = 0;
      if (left != nullptr && left->index != nullptr && (left->index == shared_.get() || left->index == own)) {
        left_free = left->size_bytes;
      }
      std::size_t need = RoundUp(size_bytes > left_free ? size_bytes - left_free : gran, gran);
      if (need > g1 - g0) return;
      if (!found || need < gap->need_bytes) {
        *gap = Gap{segment.get(), g0, g1 - g0, left_free != 0 ? left : nullptr, need};
        found = true;
      }
    };
    for (const auto& [start, mc] : segment->chunks) {
      consider(cursor, start);
      cursor = start + mc.chunk.size_bytes();
    }
    consider(cursor, end);
  }
  return found;
}

absl::StatusOr<Block*> Heap::AllocateGrow(std::size_t size_bytes, Stream stream) {
  const std::size_t gran = config_.granularity_bytes;
  Gap gap;
  std::unique_ptr<Segment> fresh;
  if (!FindGap(size_bytes, stream, &gap)) {
    std::size_t va = std::max(config_.va_bytes, RoundUp(size_bytes, gran));
    VMSTASH_ASSIGN_OR_RETURN(Reservation reservation, Reservation::Create(config_.driver, config_.device, va, 0));
    fresh = std::make_unique<Segment>();
    fresh->reservation = std::move(reservation);
    gap = Gap{fresh.get(), fresh->reservation.address(), va, nullptr, RoundUp(size_bytes, gran)};
  }
  std::size_t chunk_bytes = std::min(gap.size_bytes, GrowthBytes(gap.need_bytes));
  absl::StatusOr<Chunk> chunk = Chunk::Create(config_.driver, config_.device, chunk_bytes, config_.chunk_options);
  if (!chunk.ok() && absl::IsResourceExhausted(chunk.status()) && chunk_bytes > gap.need_bytes) {
    VMSTASH_LOG(kDebug, "{}: {} byte chunk refused, retrying with {}", config_.name, chunk_bytes, gap.need_bytes);
    chunk_bytes = gap.need_bytes;
    chunk = Chunk::Create(config_.driver, config_.device, chunk_bytes, config_.chunk_options);
  }
  if (!chunk.ok()) return chunk.status();
  absl::StatusOr<Mapping> mapping =
      Mapping::Create(config_.driver, config_.device, gap.address, absl::MakeConstSpan(&*chunk, 1));
  if (!mapping.ok()) return mapping.status();
  // Committed: nothing below fails.
  Segment* segment = gap.segment;
  if (fresh != nullptr) segments_.push_back(std::move(fresh));
  segment->chunks.emplace(gap.address, MappedChunk{*std::move(chunk), *std::move(mapping)});
  mapped_bytes_ += chunk_bytes;
  ++chunk_count_;

  Block* block = blocks_->New();
  block->address = gap.address;
  block->size_bytes = chunk_bytes;
  block->heap = this;
  Block* left = LastBlockEndingAt(*segment, gap.address);
  if (left != nullptr) {
    left->next = block;
    block->prev = left;
  } else {
    segment->run_heads[gap.address] = block;
  }
  auto right = segment->run_heads.find(block->end());
  if (right != segment->run_heads.end()) {
    block->next = right->second;
    right->second->prev = block;
    segment->run_heads.erase(right);
  }
  FreeIndex* index = gap.left != nullptr ? gap.left->index : shared_.get();
  block = InsertFree(block, index);
  return Take(block, size_bytes, stream);
}

void Heap::CutFree(Segment& segment, Block* block, DevicePtr from, DevicePtr to) {
  FreeIndex* index = block->index;
  index->Remove(block);
  if (to < block->end()) {
    Block* r = blocks_->New();
    r->address = to;
    r->size_bytes = block->end() - to;
    r->heap = this;
    r->next = block->next;
    r->stream = block->stream;
    r->free_epoch = block->free_epoch;
    if (block->next != nullptr) block->next->prev = r;
    segment.run_heads[to] = r;
    index->Insert(r);
  } else if (block->next != nullptr) {
    block->next->prev = nullptr;
    segment.run_heads[to] = block->next;
  }
  if (from > block->address) {
    block->size_bytes = from - block->address;
    block->next = nullptr;
    index->Insert(block);
  } else {
    if (block->prev != nullptr) block->prev->next = nullptr;
    else segment.run_heads.erase(block->address);
    blocks_->Delete(block);
  }
}

void Heap::RetryOrphans(absl::Status* error) {
  std::vector<Chunk> still;
  for (Chunk& chunk : orphans_) {
    absl::Status s = chunk.Release();
    if (!s.ok()) {
      if (error->ok()) *error = s;
      still.push_back(std::move(chunk));
    }
  }
  orphans_ = std::move(still);
}

std::size_t Heap::ReleaseFreeChunks(absl::Status* error) {
  RetryOrphans(error);
  if (paused_) return 0;  // nothing cached, and the reservations must stay
  std::size_t released = 0;
  for (auto& segment_ptr : segments_) {
    Segment& segment = *segment_ptr;
    // Collect first: the cuts below change the block lists.
    std::vector<Block*> candidates;
    for (auto& [start, head] : segment.run_heads) {
      for (Block* b = head; b != nullptr; b = b->next) {
        if (b->index == nullptr) continue;
        auto it = segment.chunks.lower_bound(b->address);
        if (it != segment.chunks.end() && it->first + it->second.chunk.size_bytes() <= b->end()) {
          candidates.push_back(b);
        }
      }
    }
    bool stop = false;
    for (Block* b : candidates) {
      DevicePtr from = 0, to = 0;
      auto it = segment.chunks.lower_bound(b->address);
      while (it != segment.chunks.end() && it->first + it->second.chunk.size_bytes() <= b->end()) {
        absl::Status s = it->second.mapping.Unmap();
        if (!s.ok()) {
          if (error->ok()) *error = s;
          stop = true;
          break;
        }
        if (to == 0) from = it->first;
        to = it->first + it->second.chunk.size_bytes();
        absl::Status r = it->second.chunk.Release();
        if (!r.ok()) {
          if (error->ok()) *error = r;
          orphans_.push_back(std::move(it->second.chunk));
        }
        mapped_bytes_ -= to - it->first;
        released += to - it->first;
        --chunk_count_;
        it = segment.chunks.erase(it);
      }
      if (to != 0) CutFree(segment, b, from, to);
      if (stop) break;
    }
    if (stop) break;
  }
  // Reservations left without chunks go back too (a new one is made when needed).
  for (auto it = segments_.begin(); it != segments_.end();) {
    if ((*it)->chunks.empty()) {
      absl::Status s = (*it)->reservation.Free();
      if (!s.ok()) {
        if (error->ok()) *error = s;
        ++it;
        continue;
      }
      it = segments_.erase(it);
    } else {
      ++it;
    }
  }
  return released;
}

absl::Status Heap::Validate(std::size_t* allocated_bytes, std::size_t* pending_blocks) const {
  auto fail = [&](const std::string& what) {
    return absl::InternalError(absl::StrCat("heap ", config_.name, ": invariant broken: ", what));
  };
  if (paused_) {
    for (const auto& segment : segments_) {
      if (!segment->chunks.empty() || !segment->run_heads.empty()) return fail("paused heap with chunks or runs");
    }
    for (const Block* b : paused_live_) {
      if (b->allocated) *allocated_bytes += b->size_bytes;
      else ++*pending_blocks;
    }
    return mapped_bytes_ == 0 ? absl::OkStatus() : fail("paused heap with mapped bytes");
  }
  std::size_t mapped = 0, chunks = 0;
  std::size_t free_count = 0;
  for (const auto& segment : segments_) {
    // Maximal runs of contiguous chunks must match the run heads exactly.
    std::vector<std::pair<DevicePtr, DevicePtr>> runs;
    for (const auto& [start, mc] : segment->chunks) {
      if (!mc.mapping.mapped()) return fail(absl::StrCat("chunk at ", Hex(start), " is not mapped"));
      DevicePtr end = start + mc.chunk.size_bytes();
      if (start < segment->reservation.address() ||
          end > segment->reservation.address() + segment->reservation.size_bytes()) {
        return fail(absl::StrCat("chunk at ", Hex(start), " outside its reservation"));
      }
      if (!runs.empty() && runs.back().second > start) return fail("chunks overlap");
      if (!runs.empty() && runs.back().second == start) runs.back().second = end;
      else runs.emplace_back(start, end);
      mapped += mc.chunk.size_bytes();
      ++chunks;
    }
    if (runs.size() != segment->run_heads.size()) {
      return fail(absl::StrCat(runs.size(), " runs of chunks but ", segment->run_heads.size(), " run heads"));
    }
    std::size_t r = 0;
    for (const auto& [start, head] : segment->run_heads) {
      if (runs[r].first != start || head->address != start || head->prev != nullptr) {
        return fail(absl::StrCat("run head at ", Hex(start), " does not start a run of chunks"));
      }
      DevicePtr cursor = start;
      for (const Block* b = head; b != nullptr; b = b->next) {
        if (b->address != cursor) return fail(absl::StrCat("gap or overlap at ", Hex(cursor)));
        if (b->size_bytes == 0) return fail(absl::StrCat("empty block at ", Hex(cursor)));
        if (b->heap != this) return fail(absl::StrCat("block at ", Hex(cursor), " names another heap"));
        if (b->next != nullptr && b->next->prev != b) return fail(absl::StrCat("broken prev link after ", Hex(cursor)));
        if (b->allocated && b->index != nullptr) return fail(absl::StrCat("allocated block in an index at ", Hex(cursor)));
        if (b->allocated) *allocated_bytes += b->size_bytes;
        if (!b->allocated && b->index == nullptr) ++*pending_blocks;
        if (b->index != nullptr) {
          ++free_count;
          if (b->next != nullptr && b->next->index == b->index) {
            return fail(absl::StrCat("unmerged free neighbours at ", Hex(cursor), " (sizes ", b->size_bytes, " and ",
                                     b->next->size_bytes, ", epochs ", b->free_epoch, "/", b->next->free_epoch,
                                     b->index->shared() ? ", shared" : ", per stream", ")"));
          }
          bool known = b->index == shared_.get();
          for (const auto& index : indexes_) known = known || b->index == index.get();
          if (!known) return fail(absl::StrCat("free block at ", Hex(cursor), " in a foreign index"));
        }
        cursor = b->end();
      }
      if (cursor != runs[r].second) return fail(absl::StrCat("run at ", Hex(start), " not tiled to its end"));
      ++r;
    }
  }
  std::size_t indexed = shared_->count();
  for (const auto& index : indexes_) indexed += index->count();
  if (indexed != free_count) return fail(absl::StrCat(indexed, " blocks indexed but ", free_count, " free in runs"));
  if (mapped != mapped_bytes_ || chunks != chunk_count_) return fail("mapped byte or chunk count drifted");
  return absl::OkStatus();
}

std::vector<Heap::SegmentView> Heap::Segments() const {
  std::vector<SegmentView> out;
  for (const auto& segment : segments_) {
    SegmentView view;
    view.address = segment->reservation.address();
    view.va_bytes = segment->reservation.size_bytes();
    for (const auto& [start, mc] : segment->chunks) view.chunks.push_back({start, mc.chunk.size_bytes(), &mc.chunk});
    for (const auto& [start, head] : segment->run_heads) {
      for (const Block* b = head; b != nullptr; b = b->next) view.blocks.push_back(b);
    }
    out.push_back(std::move(view));
  }
  return out;
}

}  // namespace vmstash
