// Launchers of the paged stash kernels (stash_kernels.cu). Stream-ordered and CUDA-graph
// capturable: no host reads, syncs or allocations; the launch geometry depends only on
// max_rows; row counts are read on the device through `n_rows` (int64). Each returns the
// CUDA launch status (0 = cudaSuccess); the arena wraps it in an absl::Status.
//
// Single-stream rule (Mode A, docs/architecture.md §6): all operations of one arena
// are issued on one stream; the last block of each launch publishes head/tail after every
// block has read the old value (an atomic ticket), so no block sees a half-updated state.
#ifndef VMSTASH_STASH_STASH_KERNELS_H_
#define VMSTASH_STASH_STASH_KERNELS_H_

#include <stdint.h>

#include "stash/stash_state.h"

struct CUstream_st;

namespace vmstash::stash {

// Blocks of a stash/restore launch for up to `max_rows` rows of `row_bytes` (enough for
// every thread to move kUnroll 16-byte vectors per trip, at most the max grid, at least 1).
uint32_t GridFor(uint64_t max_rows, uint64_t row_bytes);
// Tuning: the most blocks (0, the default: one wave, 2 blocks per SM) and the threads per
// block (default 512; 0 keeps it) of stash/restore/discard launches, and the 16-byte
// units each thread keeps in flight (4, the default, or 8; others keep it). Not thread-safe; call before launching or capturing
// (a captured graph keeps the shape it was captured with).
void SetLaunchShape(uint32_t max_grid, uint32_t threads, uint32_t units_in_flight = 0);

// `init`: the arena's geometry (tier pointers, caps, page_rows, row_bytes); the rest of
// the state is rebuilt (full free lists, zero counters and flags).
int LaunchReset(CUstream_st* stream, StashState* state, const StashState& init, uint64_t max_cap);
int LaunchStash(CUstream_st* stream, StashState* state, const StashState& geo, const void* src, const int64_t* n_rows,
                uint64_t max_rows, StashHandleHeader* handle);
int LaunchRestore(CUstream_st* stream, StashState* state, const StashState& geo, StashHandleHeader* handle, void* dst,
                  uint64_t max_rows, bool zero_tail);
int LaunchDiscard(CUstream_st* stream, StashState* state, const StashState& geo, StashHandleHeader* handle,
                  uint64_t max_rows);
int LaunchReadFlags(CUstream_st* stream, const StashState* state, StashFlags* out);

}  // namespace vmstash::stash

#endif  // VMSTASH_STASH_STASH_KERNELS_H_
