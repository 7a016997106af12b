// FitChunks: the one rule by which whole chunks of physical memory are fitted into gaps of
// address space. Two layers place chunks and must place them alike: a switch's plan
// (allocator/handoff_plan.h: a process's outgoing chunks into its incoming covers) and the
// node daemon's handover (node/daemon.h: chunks one process offers into the gaps another
// process would otherwise fill with fresh memory). It lives here, below both, so that
// neither depends on the other.
//
// The rule:
//   1. Chunks are taken largest first (ties: lower index first); chunks that may go only to
//      open gaps (`anywhere` false) before those that may go anywhere, since they have
//      fewer places to go. Each goes to the smallest gap that still holds it whole (best
//      fit), among the gaps allowed to take it: a `strict` gap takes only `anywhere`
//      chunks.
//   2. Then each gap, in order, that some bytes still leave open takes the smallest unused
//      chunk that covers them without running past the gap's end by more than the gap's
//      `max_overhang_bytes` (the caller decides how much address space after a gap may be
//      used: none, when it is 0).
// A chunk of 0 bytes is never placed. Pure: no state, no locks (chunk_fit_test.cc).
#ifndef VMSTASH_BASE_CHUNK_FIT_H_
#define VMSTASH_BASE_CHUNK_FIT_H_

#include <cstddef>
#include <vector>

namespace vmstash {

struct FitChunk {
  std::size_t size_bytes = 0;
  bool anywhere = true;  // false: only into gaps that are not strict
};
struct FitGap {
  std::size_t size_bytes = 0;
  std::size_t max_overhang_bytes = 0;  // how far its last chunk may run past its end
  bool strict = false;                 // takes `anywhere` chunks only
};
struct ChunkFit {
  std::vector<std::vector<int>> placed;  // per gap: chunk indexes in the order placed (an overhanging one last)
  std::vector<std::size_t> open_bytes;   // per gap: bytes no chunk covers
  std::vector<std::size_t> overhang;     // per gap: bytes its last chunk runs past its end
  std::vector<int> unused;               // chunks placed nowhere, ascending
};

ChunkFit FitChunks(const std::vector<FitChunk>& chunks, const std::vector<FitGap>& gaps);

}  // namespace vmstash

#endif  // VMSTASH_BASE_CHUNK_FIT_H_
