// Heap: pause and resume. See Note [Pause/Resume Protocol] in caching_allocator.h.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "allocator/heap.h"
#include "base/bytes.h"
#include "base/log.h"
#include "base/status_macros.h"

namespace vmstash {

using CoverChunk = Heap::ResumeTxn::Cover;

std::vector<Block*> Heap::LiveBlocks() const {
  if (paused_) return paused_live_;
  std::vector<Block*> out;
  for (const auto& segment : segments_) {
    for (const auto& [start, head] : segment->run_heads) {
      for (Block* b = head; b != nullptr; b = b->next) {
        if (b->allocated) out.push_back(b);
      }
    }
  }
  return out;
}

std::vector<ChunkView> Heap::Chunks() const {
  std::vector<ChunkView> out;
  for (const auto& segment : segments_) {
    for (const auto& [start, mc] : segment->chunks) out.push_back({start, mc.chunk.size_bytes()});
  }
  return out;
}

absl::Status Heap::UnmapChunk(DevicePtr address) {
  for (auto& segment : segments_) {
    auto it = segment->chunks.find(address);
    if (it != segment->chunks.end()) return it->second.mapping.Unmap();
  }
  return absl::InvalidArgumentError(absl::StrCat(config_.name, ": no chunk at ", Hex(address)));
}

absl::Status Heap::UnmapAll() {
  for (auto& segment : segments_) {
    for (auto& [start, mc] : segment->chunks) {
      VMSTASH_RETURN_IF_ERROR(mc.mapping.Unmap());  // the caller's RemapAll undoes the rest
    }
  }
  return absl::OkStatus();
}

absl::Status Heap::RemapAll() {
  absl::Status first;
  for (auto& segment : segments_) {
    for (auto& [start, mc] : segment->chunks) {
      if (mc.mapping.mapped()) continue;
      absl::StatusOr<Mapping> m =
          Mapping::Create(config_.driver, config_.device, start, absl::MakeConstSpan(&mc.chunk, 1));
      if (!m.ok()) {
        if (first.ok()) first = m.status();
        continue;
      }
      mc.mapping = *std::move(m);
    }
  }
  return first;
}

std::size_t Heap::ReleaseAllAndPause(absl::Status* error) {
  paused_live_.clear();
  for (auto& segment : segments_) {
    for (auto& [start, mc] : segment->chunks) {
      absl::Status s = mc.chunk.Release();
      if (!s.ok()) {
        if (error->ok()) *error = s;
        orphans_.push_back(std::move(mc.chunk));
      }
    }
    for (auto& [start, head] : segment->run_heads) {
      for (Block* b = head; b != nullptr;) {
        Block* next = b->next;
        if (b->allocated || b->index == nullptr) {
          // Live (or waiting for RecordStream events): keeps its address.
          b->prev = b->next = nullptr;
          paused_live_.push_back(b);
        } else {
          b->index->Remove(b);
          blocks_->Delete(b);
        }
        b = next;
      }
    }
    segment->run_heads.clear();
    segment->chunks.clear();
  }
  const std::size_t released = mapped_bytes_;
  mapped_bytes_ = 0;
  chunk_count_ = 0;
  paused_ = true;
  return released;
}

absl::Status Heap::PrepareResume(ResumeTxn* txn, const std::function<absl::Status(DevicePtr, std::size_t)>& on_mapped,
                                 std::size_t first_piece_bytes) {
  const std::size_t gran = config_.granularity_bytes;
  // Covers: granule-aligned extents of the live blocks, merged when they touch.
  std::size_t i = 0;
  for (auto& segment : segments_) {
    const DevicePtr lo = segment->reservation.address();
    const DevicePtr hi = lo + segment->reservation.size_bytes();
    while (i < paused_live_.size() && paused_live_[i]->address >= lo && paused_live_[i]->address < hi) {
      DevicePtr start = paused_live_[i]->address / gran * gran;
      DevicePtr end = (paused_live_[i]->end() + gran - 1) / gran * gran;
      if (!txn->covers.empty() && txn->covers.back().segment == segment.get() &&
          txn->covers.back().address + txn->covers.back().size_bytes >= start) {
        CoverChunk& last = txn->covers.back();
        last.size_bytes = std::max(last.address + last.size_bytes, end) - last.address;
      } else {
        CoverChunk c;
        c.segment = segment.get();
        c.address = start;
        c.size_bytes = end - start;
        txn->covers.push_back(std::move(c));
      }
      ++i;
    }
  }
  const std::size_t max_piece = std::max(RoundUp(config_.max_chunk_bytes, gran), gran);
  for (CoverChunk& c : txn->covers) {
    std::size_t piece = first_piece_bytes == 0 ? c.size_bytes : std::min(RoundUp(first_piece_bytes, gran), max_piece);
    for (std::size_t done = 0; done < c.size_bytes;) {
      std::size_t size = std::min(piece, c.size_bytes - done);
      // A short last piece joins the one before it (fewer chunks; nothing left to overlap).
      if (c.size_bytes - done - size < piece / 2) size = c.size_bytes - done;
      ResumeTxn::Piece p;
      p.address = c.address + done;
      p.size_bytes = size;
      VMSTASH_ASSIGN_OR_RETURN(p.chunk, Chunk::Create(config_.driver, config_.device, size, ChunkOptions{}));
      VMSTASH_ASSIGN_OR_RETURN(p.mapping, Mapping::Create(config_.driver, config_.device, p.address,
                                                          absl::MakeConstSpan(&p.chunk, 1)));
      c.pieces.push_back(std::move(p));
      // Copies queued into this piece may still run if a later step fails: the caller
      // drains them before *txn is destroyed.
      VMSTASH_RETURN_IF_ERROR(on_mapped(c.address + done, size));
      done += size;
      piece = std::min(piece * 2, max_piece);
    }
  }
  return absl::OkStatus();
}

void Heap::CommitResume(std::unique_ptr<ResumeTxn> txn) {
  std::size_t next_live = 0;
  for (CoverChunk& c : txn->covers) {
    auto* segment = static_cast<Segment*>(c.segment);
    const DevicePtr end = c.address + c.size_bytes;
    Block* first = nullptr;
    Block* last = nullptr;
    auto append = [&](Block* b) {
      b->prev = last;
      b->next = nullptr;
      if (last != nullptr) last->next = b;
      else first = b;
      last = b;
    };
    auto filler = [&](DevicePtr from, DevicePtr to) {
      if (to <= from) return;
      Block* f = blocks_->New();
      f->address = from;
      f->size_bytes = to - from;
      f->heap = this;
      append(f);
      shared_->Insert(f);
    };
    DevicePtr cursor = c.address;
    while (next_live < paused_live_.size() && paused_live_[next_live]->address < end) {
      Block* b = paused_live_[next_live++];
      filler(cursor, b->address);
      append(b);
      cursor = b->end();
    }
    filler(cursor, end);
    segment->run_heads[c.address] = first;
    for (ResumeTxn::Piece& p : c.pieces) {
      segment->chunks.emplace(p.address, MappedChunk{std::move(p.chunk), std::move(p.mapping)});
      mapped_bytes_ += p.size_bytes;
      ++chunk_count_;
    }
  }
  paused_live_.clear();
  paused_ = false;
}

}  // namespace vmstash
