// TransitionPlan: see transition_plan.h.
#include "allocator/transition_plan.h"

#include <algorithm>
#include <numeric>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/bytes.h"

namespace vmstash {
namespace {

std::size_t AlignArena(std::size_t v) { return RoundUp(v, kBackupAlignBytes); }

}  // namespace

ByteRanges NormalizeRanges(ByteRanges ranges) {
  // A range running past the end of the address space ("live from here on") ends there:
  // nothing below may wrap.
  for (auto& [a, n] : ranges) n = std::min<std::size_t>(n, ~DevicePtr{0} - a);
  std::sort(ranges.begin(), ranges.end());
  ByteRanges merged;
  for (const auto& [a, n] : ranges) {
    if (n == 0) continue;
    if (!merged.empty() && merged.back().first + merged.back().second >= a) {
      merged.back().second = std::max(merged.back().first + merged.back().second, a + n) - merged.back().first;
    } else {
      merged.emplace_back(a, n);
    }
  }
  return merged;
}

BackupLayout PlanBackupLayout(std::vector<const Block*> live, const ByteRanges* hint) {
  std::sort(live.begin(), live.end(), [](const Block* a, const Block* b) { return a->address < b->address; });
  const ByteRanges ranges = hint != nullptr ? NormalizeRanges(*hint) : ByteRanges{};
  BackupLayout layout;
  std::size_t h = 0;  // first range that may reach the current block
  for (const Block* b : live) {
    const DevicePtr b_end = b->address + b->requested_bytes;
    std::vector<BackupExtent>& mine = layout.by_block[b];
    auto add = [&](DevicePtr from, DevicePtr to) {
      if (to <= from) return;
      mine.push_back({from, to - from, layout.arena_bytes});
      layout.in_order.push_back(mine.back());
      layout.arena_bytes += AlignArena(to - from);
    };
    if (hint == nullptr) {
      add(b->address, b_end);
      continue;
    }
    while (h < ranges.size() && ranges[h].first + ranges[h].second <= b->address) ++h;
    for (std::size_t i = h; i < ranges.size() && ranges[i].first < b_end; ++i) {
      add(std::max<DevicePtr>(ranges[i].first, b->address),
          std::min<DevicePtr>(ranges[i].first + ranges[i].second, b_end));
    }
  }
  return layout;
}

std::vector<std::size_t> BackupPieceBytes(const BackupLayout& layout) {
  std::vector<std::pair<std::size_t, std::size_t>> pieces;  // (arena begin, arena end)
  for (const auto& [block, list] : layout.by_block) {
    if (list.empty()) continue;
    std::size_t begin = list.front().arena_offset, end = 0;
    for (const BackupExtent& e : list) {
      begin = std::min(begin, e.arena_offset);
      end = std::max(end, e.arena_offset + AlignArena(e.size_bytes));
    }
    pieces.emplace_back(begin, end);
  }
  std::sort(pieces.begin(), pieces.end());
  std::vector<std::size_t> sizes;
  for (const auto& [begin, end] : pieces) sizes.push_back(end - begin);
  return sizes;
}

std::size_t BackedUpArenaEnd(const BackupExtents& extents) {
  std::size_t end = 0;
  for (const auto& [block, list] : extents) {
    for (const BackupExtent& e : list) end = std::max(end, e.arena_offset + e.size_bytes);
  }
  return end;
}

std::vector<PauseStage> PlanPauseStages(const BackupLayout& layout, const std::vector<ChunkSpan>& chunks,
                                        std::size_t min_stage_bytes) {
  std::vector<std::size_t> order(chunks.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return chunks[a].address < chunks[b].address; });
  const std::size_t target = std::max<std::size_t>({min_stage_bytes, layout.arena_bytes / kMaxPauseStages, 1});
  const std::vector<BackupExtent>& all = layout.in_order;
  std::vector<PauseStage> stages(1);
  std::size_t next = 0;  // first extent that may reach the current chunk
  for (std::size_t index : order) {
    const ChunkSpan& c = chunks[index];
    const DevicePtr end = c.address + c.size_bytes;
    while (next < all.size() && all[next].address + all[next].size_bytes <= c.address) ++next;
    PauseStage& stage = stages.back();
    // The part of every extent that lies in this chunk (a block may span chunks).
    for (std::size_t i = next; i < all.size() && all[i].address < end; ++i) {
      const BackupExtent& e = all[i];
      const DevicePtr from = std::max<DevicePtr>(e.address, c.address);
      const DevicePtr to = std::min<DevicePtr>(e.address + e.size_bytes, end);
      if (to <= from) continue;
      stage.copies.push_back({from, e.arena_offset + (from - e.address), to - from});
      stage.bytes += to - from;
    }
    stage.chunks.push_back(index);
    if (stage.bytes >= target) stages.emplace_back();
  }
  if (stages.back().chunks.empty()) stages.pop_back();
  return stages;
}

absl::StatusOr<std::vector<CoverSpan>> PlanCovers(const std::vector<const Block*>& live,
                                                  const std::vector<ChunkSpan>& segments, std::size_t granularity) {
  std::vector<CoverSpan> covers;
  std::size_t i = 0;
  for (std::size_t s = 0; s < segments.size(); ++s) {
    const DevicePtr lo = segments[s].address;
    const DevicePtr hi = lo + segments[s].size_bytes;
    const std::size_t first = i;
    for (; i < live.size() && live[i]->address >= lo && live[i]->address < hi; ++i) {
      if (live[i]->end() > hi) break;  // runs past its segment: reported below
      if (i > first && live[i]->address < live[i - 1]->end()) break;  // out of order: reported below
      const DevicePtr start = live[i]->address / granularity * granularity;
      const DevicePtr end = RoundUp(live[i]->end(), granularity);
      if (!covers.empty() && covers.back().segment == s && covers.back().address + covers.back().size_bytes >= start) {
        CoverSpan& last = covers.back();
        last.size_bytes = std::max<DevicePtr>(last.address + last.size_bytes, end) - last.address;
        last.end_block = i + 1;
      } else {
        covers.push_back({s, start, end - start, i, i + 1});
      }
    }
  }
  if (i < live.size()) {
    return absl::InternalError(absl::StrCat("resume plan: live block ", Hex(live[i]->address), "+",
                                            live[i]->size_bytes, " is outside the segments or their order"));
  }
  return covers;
}

std::vector<std::size_t> PlanPieces(std::size_t cover_bytes, std::size_t first_piece_bytes,
                                    std::size_t max_piece_bytes, std::size_t granularity) {
  const std::size_t max_piece = std::max(RoundUp(max_piece_bytes, granularity), granularity);
  std::size_t piece = first_piece_bytes == 0 ? cover_bytes : std::min(RoundUp(first_piece_bytes, granularity), max_piece);
  std::vector<std::size_t> pieces;
  for (std::size_t done = 0; done < cover_bytes;) {
    std::size_t size = std::min(piece, cover_bytes - done);
    // A short last piece joins the one before it (fewer chunks; nothing left to overlap).
    if (cover_bytes - done - size < piece / 2) size = cover_bytes - done;
    pieces.push_back(size);
    done += size;
    piece = std::min(piece * 2, max_piece);
  }
  return pieces;
}

absl::StatusOr<std::vector<CopyStep>> RestorePlanner::CopiesInto(DevicePtr va, std::size_t size_bytes) {
  const DevicePtr end = va + size_bytes;
  auto inside = [&](const CoverSpan& c) { return va >= c.address && end <= c.address + c.size_bytes; };
  while (cover_ < covers_.size() && !inside(covers_[cover_])) ++cover_;
  if (cover_ == covers_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("resume plan: piece ", Hex(va), "+", size_bytes,
                                                   " lies in no cover at or after the previous piece's"));
  }
  const CoverSpan& cover = covers_[cover_];
  cursor_ = std::max(cursor_, cover.first_block);
  std::vector<CopyStep> copies;
  for (std::size_t i = cursor_; i < cover.end_block && live_[i]->address < end; ++i) {
    const Block* b = live_[i];
    if (b->address + b->requested_bytes <= end && i == cursor_) ++cursor_;  // done with it after this piece
    auto found = extents_->find(b);
    if (found == extents_->end()) continue;
    for (const BackupExtent& e : found->second) {
      const DevicePtr from = std::max<DevicePtr>(e.address, va);
      const DevicePtr to = std::min<DevicePtr>(e.address + e.size_bytes, end);
      if (to <= from) continue;
      copies.push_back({from, e.arena_offset + (from - e.address), to - from});
    }
  }
  return copies;
}

}  // namespace vmstash
