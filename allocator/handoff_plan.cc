// HandoffPlan: see handoff_plan.h.
#include "allocator/handoff_plan.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "base/bytes.h"

namespace vmstash {

std::size_t MaxOverhang(const HandoffRecipient& recipient, std::size_t granularity) {
  // At least one granule of the slack stays unused: the cover must not touch the next.
  if (recipient.slack_bytes <= granularity) return 0;
  return std::min(recipient.slack_bytes - granularity, recipient.size_bytes / kGrowthDivisor);
}

namespace {

// Fresh pieces for what `fit` left open of each recipient.
void AddFreshPieces(HandoffPlan& plan, const std::vector<HandoffRecipient>& recipients,
                    const std::vector<std::size_t>& open, std::size_t first_piece_bytes, std::size_t max_piece_bytes,
                    std::size_t granularity) {
  for (std::size_t r = 0; r < recipients.size(); ++r) {
    if (open[r] == 0) continue;
    const std::size_t first = recipients[r].restores ? first_piece_bytes : 0;
    for (std::size_t size : PlanPieces(open[r], first, max_piece_bytes, granularity)) {
      plan.pieces[r].push_back({size, kNoDonor});
      plan.fresh_bytes += size;
    }
  }
}

}  // namespace

HandoffPlan PlanHandoff(const std::vector<HandoffDonor>& donors, const std::vector<HandoffRecipient>& recipients,
                        std::size_t first_piece_bytes, std::size_t max_piece_bytes, std::size_t granularity) {
  std::vector<FitChunk> chunks;
  for (const HandoffDonor& d : donors) chunks.push_back({d.size_bytes, d.backed_up});
  std::vector<FitGap> gaps;
  for (const HandoffRecipient& r : recipients) gaps.push_back({r.size_bytes, MaxOverhang(r, granularity), r.restores});
  const ChunkFit fit = FitChunks(chunks, gaps);
  HandoffPlan plan;
  plan.pieces.resize(recipients.size());
  plan.overhang = fit.overhang;
  plan.leftover = fit.unused;
  for (int d : fit.unused) plan.leftover_bytes += donors[d].size_bytes;
  for (std::size_t r = 0; r < recipients.size(); ++r) {
    for (int d : fit.placed[r]) {
      plan.pieces[r].push_back({donors[d].size_bytes, d});
      plan.handed_bytes += donors[d].size_bytes;
    }
  }
  AddFreshPieces(plan, recipients, fit.open_bytes, first_piece_bytes, max_piece_bytes, granularity);
  return plan;
}

bool RestoresTakeForeignChunks(std::size_t fresh_bytes, std::optional<std::size_t> free_bytes) {
  return !free_bytes.has_value() || *free_bytes < fresh_bytes + fresh_bytes / 8;
}

HandoffGaps OpenGaps(const HandoffPlan& plan, const std::vector<HandoffRecipient>& recipients,
                     std::size_t granularity, std::size_t max_gaps, bool restoring) {
  HandoffGaps out;
  for (std::size_t r = 0; r < recipients.size() && r < plan.pieces.size(); ++r) {
    if (recipients[r].restores && !restoring) continue;
    std::size_t fresh = 0;
    for (const HandoffPiece& p : plan.pieces[r]) {
      if (p.donor == kNoDonor) fresh += p.size_bytes;
    }
    if (fresh == 0) continue;
    // A recipient with fresh pieces has no overhang (only a gap a donor closes overhangs).
    out.gaps.push_back({fresh, MaxOverhang(recipients[r], granularity), recipients[r].restores});
    out.recipient.push_back(r);
  }
  if (out.gaps.size() <= max_gaps) return out;
  std::vector<std::size_t> order(out.gaps.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return out.gaps[a].size_bytes > out.gaps[b].size_bytes; });
  order.resize(max_gaps);
  std::sort(order.begin(), order.end());
  HandoffGaps kept;
  for (std::size_t g : order) {
    kept.gaps.push_back(out.gaps[g]);
    kept.recipient.push_back(out.recipient[g]);
  }
  return kept;
}

std::vector<int> AddForeignDonors(HandoffPlan& plan, const HandoffGaps& open, const std::vector<FitChunk>& foreign,
                                  int first_donor, std::size_t first_piece_bytes, std::size_t max_piece_bytes,
                                  std::size_t granularity) {
  const ChunkFit fit = FitChunks(foreign, open.gaps);
  for (std::size_t g = 0; g < open.gaps.size(); ++g) {
    if (fit.placed[g].empty()) continue;
    const std::size_t r = open.recipient[g];
    std::vector<HandoffPiece>& pieces = plan.pieces[r];
    for (const HandoffPiece& p : pieces) {
      if (p.donor == kNoDonor) plan.fresh_bytes -= p.size_bytes;
    }
    pieces.erase(std::remove_if(pieces.begin(), pieces.end(), [](const HandoffPiece& p) { return p.donor == kNoDonor; }),
                 pieces.end());
    for (int f : fit.placed[g]) {
      pieces.push_back({foreign[f].size_bytes, first_donor + f});
      plan.handed_bytes += foreign[f].size_bytes;
    }
    plan.overhang[r] = fit.overhang[g];
    const std::size_t first = open.gaps[g].strict ? first_piece_bytes : 0;  // as PlanHandoff cuts it
    for (std::size_t size : PlanPieces(fit.open_bytes[g], first, max_piece_bytes, granularity)) {
      pieces.push_back({size, kNoDonor});
      plan.fresh_bytes += size;
    }
  }
  std::vector<int> unused;
  for (int f : fit.unused) {
    unused.push_back(first_donor + f);
    plan.leftover.push_back(first_donor + f);
    plan.leftover_bytes += foreign[f].size_bytes;
  }
  return unused;
}

absl::StatusOr<std::vector<SwitchCopy>> PlanSwitchCopies(const std::vector<BackupExtent>& extents,
                                                         const std::vector<ChunkSpan>& chunks,
                                                         std::size_t group_bytes, std::size_t first_group) {
  std::vector<SwitchCopy> out;
  std::size_t group = first_group;
  std::size_t in_group = 0;
  for (const BackupExtent& e : extents) {
    DevicePtr at = e.address;
    const DevicePtr end = e.address + e.size_bytes;
    while (at < end) {
      // The chunk holding `at`: the last one starting at or below it.
      auto it = std::upper_bound(chunks.begin(), chunks.end(), at,
                                 [](DevicePtr a, const ChunkSpan& c) { return a < c.address; });
      if (it == chunks.begin() || at >= std::prev(it)->address + std::prev(it)->size_bytes) {
        return absl::InternalError(absl::StrCat("switch plan: backed-up byte ", Hex(at), " lies in no chunk"));
      }
      const ChunkSpan& c = *std::prev(it);
      std::size_t n = std::min<DevicePtr>(end, c.address + c.size_bytes) - at;
      if (group_bytes > 0) n = std::min(n, group_bytes);
      out.push_back({{at, e.arena_offset + (at - e.address), n}, static_cast<std::size_t>(it - chunks.begin() - 1),
                     group});
      at += n;
      in_group += n;
      if (group_bytes == 0 || in_group >= group_bytes) {
        ++group;
        in_group = 0;
      }
    }
  }
  return out;
}

CopyReadiness::CopyReadiness(const std::vector<SwitchCopy>& copies, std::size_t chunk_count) : by_chunk_(chunk_count) {
  for (const SwitchCopy& c : copies) {
    if (c.chunk < chunk_count) by_chunk_[c.chunk].push_back({c.step.device, c.step.device + c.step.size_bytes, c.group});
  }
  for (auto& reads : by_chunk_) {
    std::sort(reads.begin(), reads.end(), [](const Read& a, const Read& b) { return a.start < b.start; });
  }
}

std::optional<std::size_t> CopyReadiness::WaitGroup(std::size_t chunk, DevicePtr address,
                                                    std::size_t size_bytes) const {
  if (chunk >= by_chunk_.size() || size_bytes == 0) return std::nullopt;
  const std::vector<Read>& reads = by_chunk_[chunk];
  const DevicePtr end = address + size_bytes;
  // Reads do not overlap one another; the overlapping ones are a contiguous run ending at
  // the last read starting below `end`. Groups need not grow with the address (tags'
  // copies come one tag after another), so take the largest of that run.
  auto it = std::lower_bound(reads.begin(), reads.end(), end, [](const Read& r, DevicePtr e) { return r.start < e; });
  std::optional<std::size_t> wait;
  while (it != reads.begin()) {
    --it;
    if (it->end <= address) break;
    wait = std::max(wait.value_or(0), it->group);
  }
  return wait;
}

}  // namespace vmstash
