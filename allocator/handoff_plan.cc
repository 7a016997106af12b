// HandoffPlan: see handoff_plan.h.
#include "allocator/handoff_plan.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "base/bytes.h"

namespace vmstash {

HandoffPlan PlanHandoff(const std::vector<HandoffDonor>& donors, const std::vector<HandoffRecipient>& recipients,
                        std::size_t first_piece_bytes, std::size_t max_piece_bytes, std::size_t granularity) {
  HandoffPlan plan;
  plan.pieces.resize(recipients.size());
  std::vector<std::size_t> gap(recipients.size());
  for (std::size_t r = 0; r < recipients.size(); ++r) gap[r] = recipients[r].size_bytes;
  // Largest donors first (ties: lower index first, so the plan is deterministic); discard
  // donors before backup ones, since they have fewer places to go.
  std::vector<int> order(donors.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    if (donors[a].backed_up != donors[b].backed_up) return !donors[a].backed_up;
    return donors[a].size_bytes > donors[b].size_bytes;
  });
  for (int d : order) {
    const HandoffDonor& donor = donors[d];
    // Best fit: the smallest gap that holds the donor, among recipients allowed to take it.
    std::size_t best = recipients.size();
    for (std::size_t r = 0; r < recipients.size(); ++r) {
      if (recipients[r].restores && !donor.backed_up) continue;
      if (donor.size_bytes == 0 || gap[r] < donor.size_bytes) continue;
      if (best == recipients.size() || gap[r] < gap[best]) best = r;
    }
    if (best == recipients.size()) {
      plan.leftover.push_back(d);
      plan.leftover_bytes += donor.size_bytes;
      continue;
    }
    plan.pieces[best].push_back({donor.size_bytes, d});
    gap[best] -= donor.size_bytes;
    plan.handed_bytes += donor.size_bytes;
  }
  // A gap no remaining donor fits: the smallest leftover that covers it may overhang into
  // the slack after the recipient, if the extra memory stays under 1/kGrowthDivisor of the
  // recipient
  // and at least one granule of the slack stays unused (the cover must not touch the next).
  plan.overhang.assign(recipients.size(), 0);
  for (std::size_t r = 0; r < recipients.size(); ++r) {
    if (gap[r] == 0 || recipients[r].slack_bytes <= granularity) continue;
    const std::size_t allowed = std::min(recipients[r].slack_bytes - granularity, recipients[r].size_bytes / kGrowthDivisor);
    auto best = plan.leftover.end();
    for (auto it = plan.leftover.begin(); it != plan.leftover.end(); ++it) {
      const HandoffDonor& donor = donors[*it];
      if (recipients[r].restores && !donor.backed_up) continue;
      if (donor.size_bytes < gap[r] || donor.size_bytes - gap[r] > allowed) continue;
      if (best == plan.leftover.end() || donor.size_bytes < donors[*best].size_bytes) best = it;
    }
    if (best == plan.leftover.end()) continue;
    const int d = *best;
    plan.leftover.erase(best);
    plan.leftover_bytes -= donors[d].size_bytes;
    plan.handed_bytes += donors[d].size_bytes;
    plan.overhang[r] = donors[d].size_bytes - gap[r];
    plan.pieces[r].push_back({donors[d].size_bytes, d});
    gap[r] = 0;
  }
  std::sort(plan.leftover.begin(), plan.leftover.end());
  for (std::size_t r = 0; r < recipients.size(); ++r) {
    if (gap[r] == 0) continue;
    const std::size_t first = recipients[r].restores ? first_piece_bytes : 0;
    for (std::size_t size : PlanPieces(gap[r], first, max_piece_bytes, granularity)) {
      plan.pieces[r].push_back({size, kNoDonor});
      plan.fresh_bytes += size;
    }
  }
  return plan;
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
