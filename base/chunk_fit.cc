// FitChunks: see chunk_fit.h.
#include "base/chunk_fit.h"

#include <algorithm>
#include <numeric>

namespace vmstash {

ChunkFit FitChunks(const std::vector<FitChunk>& chunks, const std::vector<FitGap>& gaps) {
  ChunkFit fit;
  fit.placed.resize(gaps.size());
  fit.overhang.assign(gaps.size(), 0);
  fit.open_bytes.resize(gaps.size());
  std::vector<std::size_t>& open = fit.open_bytes;
  for (std::size_t g = 0; g < gaps.size(); ++g) open[g] = gaps[g].size_bytes;
  auto allowed = [&](const FitChunk& c, std::size_t g) { return c.anywhere || !gaps[g].strict; };

  std::vector<int> order(chunks.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    if (chunks[a].anywhere != chunks[b].anywhere) return !chunks[a].anywhere;
    return chunks[a].size_bytes > chunks[b].size_bytes;
  });
  std::vector<int> unused;  // in the order taken
  for (int c : order) {
    const FitChunk& chunk = chunks[c];
    std::size_t best = gaps.size();
    for (std::size_t g = 0; g < gaps.size(); ++g) {
      if (!allowed(chunk, g) || chunk.size_bytes == 0 || open[g] < chunk.size_bytes) continue;
      if (best == gaps.size() || open[g] < open[best]) best = g;
    }
    if (best == gaps.size()) {
      unused.push_back(c);
      continue;
    }
    fit.placed[best].push_back(c);
    open[best] -= chunk.size_bytes;
  }
  for (std::size_t g = 0; g < gaps.size(); ++g) {
    if (open[g] == 0 || gaps[g].max_overhang_bytes == 0) continue;
    auto best = unused.end();
    for (auto it = unused.begin(); it != unused.end(); ++it) {
      const FitChunk& chunk = chunks[*it];
      if (!allowed(chunk, g) || chunk.size_bytes < open[g]) continue;
      if (chunk.size_bytes - open[g] > gaps[g].max_overhang_bytes) continue;
      if (best == unused.end() || chunk.size_bytes < chunks[*best].size_bytes) best = it;
    }
    if (best == unused.end()) continue;
    fit.overhang[g] = chunks[*best].size_bytes - open[g];
    fit.placed[g].push_back(*best);
    open[g] = 0;
    unused.erase(best);
  }
  std::sort(unused.begin(), unused.end());
  fit.unused = std::move(unused);
  return fit;
}

}  // namespace vmstash
