// Heap: pause and resume. See Note [Pause/Resume Protocol] in pause_resume.h.
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
    for (const auto& [start, mc] : segment->chunks) out.push_back({start, mc.chunk.size_bytes(), &mc.chunk});
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

std::size_t Heap::ReleaseAllAndPause(absl::Status* error, const std::function<bool(ChunkHandle)>& hand_over,
                                     std::vector<Chunk>* handed) {
  paused_live_.clear();
  for (auto& segment : segments_) {
    for (auto& [start, mc] : segment->chunks) {
      mc.mapping = Mapping();  // unmapped already (UnmapAll): nothing to undo
      if (hand_over && handed != nullptr && hand_over(mc.chunk.handle())) {
        handed->push_back(std::move(mc.chunk));
        continue;
      }
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

absl::StatusOr<std::vector<CoverSpan>> Heap::PlanResume() const {
  std::vector<ChunkSpan> segments;
  for (const auto& segment : segments_) {
    segments.push_back({segment->reservation.address(), segment->reservation.size_bytes()});
  }
  return PlanCovers(std::vector<const Block*>(paused_live_.begin(), paused_live_.end()), segments,
                    config_.granularity_bytes);
}

DevicePtr Heap::SegmentEnd(std::size_t segment) const {
  if (segment >= segments_.size()) return 0;
  return segments_[segment]->reservation.address() + segments_[segment]->reservation.size_bytes();
}

absl::Status Heap::MakePiece(ResumeTxn::Cover* cover, DevicePtr va, std::size_t size_bytes, int donor,
                             const Chunk* chunk) {
  ResumeTxn::Piece p;
  p.address = va;
  p.size_bytes = size_bytes;
  if (donor != kNoDonor) {
    if (chunk == nullptr || chunk->size_bytes() != size_bytes) {
      return absl::InternalError(absl::StrCat(config_.name, ": handed-over chunk of ",
                                              chunk == nullptr ? 0 : chunk->size_bytes(),
                                              " bytes planned for a piece of ", size_bytes));
    }
    p.donor = donor;
    VMSTASH_ASSIGN_OR_RETURN(p.mapping, Mapping::Create(config_.driver, config_.device, va,
                                                        absl::MakeConstSpan(chunk, 1)));
  } else {
    VMSTASH_ASSIGN_OR_RETURN(p.chunk, Chunk::Create(config_.driver, config_.device, size_bytes, config_.chunk_options));
    VMSTASH_ASSIGN_OR_RETURN(p.mapping, Mapping::Create(config_.driver, config_.device, va,
                                                        absl::MakeConstSpan(&p.chunk, 1)));
  }
  cover->pieces.push_back(std::move(p));
  return absl::OkStatus();
}

absl::Status Heap::PrepareResume(ResumeTxn* txn, const std::vector<CoverSpan>& covers,
                                 const std::function<absl::Status(DevicePtr, std::size_t)>& on_mapped,
                                 std::size_t first_piece_bytes) {
  std::vector<std::vector<HandoffPiece>> pieces;
  for (const CoverSpan& span : covers) {
    std::vector<HandoffPiece>& p = pieces.emplace_back();
    for (std::size_t size :
         PlanPieces(span.size_bytes, first_piece_bytes, config_.max_chunk_bytes, config_.granularity_bytes)) {
      p.push_back({size, kNoDonor});
    }
  }
  return PrepareHandoff(txn, covers, pieces, {}, [&](DevicePtr va, std::size_t size, int) { return on_mapped(va, size); });
}

absl::Status Heap::PrepareHandoff(ResumeTxn* txn, const std::vector<CoverSpan>& covers,
                                  const std::vector<std::vector<HandoffPiece>>& pieces,
                                  const std::vector<const Chunk*>& donors,
                                  const std::function<absl::Status(DevicePtr, std::size_t, int)>& on_mapped) {
  if (pieces.size() != covers.size()) {
    return absl::InternalError(absl::StrCat(config_.name, ": ", pieces.size(), " piece lists for ", covers.size(),
                                            " covers"));
  }
  for (std::size_t i = 0; i < covers.size(); ++i) {
    const CoverSpan& span = covers[i];
    if (span.segment >= segments_.size()) {
      return absl::InvalidArgumentError(absl::StrCat(config_.name, ": resume plan names segment ", span.segment,
                                                     " of ", segments_.size()));
    }
    std::size_t total = 0;
    for (const HandoffPiece& p : pieces[i]) total += p.size_bytes;
    if (total != span.size_bytes) {
      return absl::InternalError(absl::StrCat(config_.name, ": pieces of ", total, " bytes for a cover of ",
                                              span.size_bytes));
    }
    CoverChunk& c = txn->covers.emplace_back();
    c.segment = segments_[span.segment].get();
    c.span = span;
    DevicePtr va = span.address;
    for (const HandoffPiece& p : pieces[i]) {
      const bool known = p.donor >= 0 && static_cast<std::size_t>(p.donor) < donors.size();
      const Chunk* chunk = known ? donors[p.donor] : nullptr;
      VMSTASH_RETURN_IF_ERROR(MakePiece(&c, va, p.size_bytes, p.donor, chunk));
      // Copies queued into this piece may still run if a later step fails: the caller
      // drains them before *txn is destroyed.
      VMSTASH_RETURN_IF_ERROR(on_mapped(va, p.size_bytes, p.donor));
      va += p.size_bytes;
    }
  }
  return absl::OkStatus();
}

void Heap::CommitResume(std::unique_ptr<ResumeTxn> txn) {
  for (CoverChunk& c : txn->covers) {
    auto* segment = static_cast<Segment*>(c.segment);
    const DevicePtr end = c.span.address + c.span.size_bytes;
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
    // The cover's own live blocks (the plan names them: segments need not be in address
    // order, so "every block below the cover's end" could reach into another segment).
    DevicePtr cursor = c.span.address;
    for (std::size_t i = c.span.first_block; i < c.span.end_block; ++i) {
      Block* b = paused_live_[i];
      filler(cursor, b->address);
      append(b);
      cursor = b->end();
    }
    filler(cursor, end);
    segment->run_heads[c.span.address] = first;
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
