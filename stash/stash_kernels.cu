// The paged stash kernels: see stash_kernels.h and reference/paged_stash.md §3.4-3.6.
#include <cuda_runtime.h>

#include "stash/stash_kernels.h"
#include "stash/stash_ops.h"

namespace vmstash::stash {
namespace {

constexpr uint32_t kThreads = 256;  // reset
// Stash/restore launch shape (SetLaunchShape). 264 blocks of 1024 threads (2 per SM of an
// H200) beat 2048 x 256, 1056 x 256 and 528 x 512 at every size of bench/stash_bench.
uint32_t max_grid = 264;
uint32_t copy_threads = 1024;

constexpr uint32_t kUnroll = 4;  // 16-byte vectors each thread loads before it stores

__device__ uint64_t Load(const volatile uint64_t* p) { return *p; }
__device__ uint32_t Load(const volatile uint32_t* p) { return *p; }

// The copies move whole page slots: slot s of a tensor is rows [sP, min(n, sP + P)),
// contiguous both in the tensor and in its page. A slot is cut into pieces of
// blockDim * kUnroll vectors; blocks stride over (slot, piece) items, and each thread
// issues its kUnroll loads before its stores (memory-level parallelism).
struct Geometry {
  uint64_t page_bytes;
  uint64_t pieces;  // per slot
  bool vector;      // 16-byte vectors (tensor, pages and row_bytes 16-byte aligned)
};

__device__ Geometry GeometryOf(const StashState* s, const void* tensor) {
  Geometry g;
  g.page_bytes = s->page_rows * s->row_bytes;
  g.vector = ((reinterpret_cast<uintptr_t>(tensor) | s->row_bytes) & 15) == 0 &&
             ((reinterpret_cast<uintptr_t>(s->tier[0].pages) | reinterpret_cast<uintptr_t>(s->tier[1].pages)) & 15) ==
                 0;
  const uint64_t piece = static_cast<uint64_t>(blockDim.x) * kUnroll * (g.vector ? 16 : 1);
  g.pieces = (g.page_bytes + piece - 1) / piece;
  return g;
}

// Blocks that have work: the same number in every block, from values no launch of this
// kernel writes (the row count, the handle's rows, max_rows), so only they take a ticket
// and the others return at once (an empty stash costs little more than its launch).
__device__ uint64_t Participants(uint64_t items) {
  return items == 0 ? 1 : (items < gridDim.x ? items : gridDim.x);
}

// Copies `bytes` from `src` to `dst` for piece `piece` of a slot (the whole block).
__device__ void CopyPiece(uint8_t* dst, const uint8_t* src, uint64_t bytes, uint64_t piece, bool vector) {
  if (vector) {
    const uint64_t base = piece * blockDim.x * kUnroll + threadIdx.x;
    const uint64_t count = bytes / 16;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    uint4 v[kUnroll];
#pragma unroll
    for (uint32_t k = 0; k < kUnroll; ++k) {
      const uint64_t i = base + k * blockDim.x;
      if (i < count) v[k] = s[i];
    }
#pragma unroll
    for (uint32_t k = 0; k < kUnroll; ++k) {
      const uint64_t i = base + k * blockDim.x;
      if (i < count) d[i] = v[k];
    }
  } else {
    const uint64_t base = piece * blockDim.x * kUnroll + threadIdx.x;
    for (uint32_t k = 0; k < kUnroll; ++k) {
      const uint64_t i = base + k * blockDim.x;
      if (i < bytes) dst[i] = src[i];
    }
  }
}

// Zeroes bytes [from, to) of dst with the participating blocks.
__device__ void ZeroRange(uint8_t* dst, uint64_t from, uint64_t to, uint64_t blocks) {
  const uint64_t stride = blocks * blockDim.x;
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (((reinterpret_cast<uintptr_t>(dst) | from | to) & 15) == 0) {
    uint4* d = reinterpret_cast<uint4*>(dst + from);
    const uint64_t count = (to - from) / 16;
    for (uint64_t i = first; i < count; i += stride) d[i] = make_uint4(0, 0, 0, 0);
  } else {
    for (uint64_t i = from + first; i < to; i += stride) dst[i] = 0;
  }
}

// True in exactly one thread of the last participating block to get here (after a
// fence): it publishes. A launch with one participant needs no ticket (an empty stash).
// Kernel completion makes the published values visible to later launches.
__device__ bool LastBlock(StashState* s, uint64_t participants) {
  __shared__ bool last;
  __syncthreads();
  if (participants == 1) return threadIdx.x == 0;
  if (threadIdx.x == 0) {
    __threadfence();
    const uint32_t ticket = atomicAdd(&s->ticket, 1u);
    last = ticket == participants - 1;
    if (last) s->ticket = 0;  // re-armed for the next launch
  }
  __syncthreads();
  return last && threadIdx.x == 0;
}

// `init` (a kernel argument, frozen at capture) carries the arena's fixed geometry, so a
// reset also rebuilds a state block whose memory was released by a pause (policy discard).
__global__ void ResetKernel(StashState* s, StashState init, uint64_t max_cap) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < max_cap; i += stride) {
    for (int t = 0; t < 2; ++t) {
      if (i < init.tier[t].cap) init.tier[t].free_list[i] = static_cast<uint32_t>(i);
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    for (int t = 0; t < 2; ++t) {
      init.tier[t].head = 0;
      init.tier[t].tail = init.tier[t].cap;
      init.peak_pages[t] = 0;
    }
    init.overflow = 0;
    init.host_spill = 0;
    init.last_failed_pages = 0;
    init.overflow_count = 0;
    init.ticket = 0;
    *s = init;
  }
}

__device__ uint64_t Clamp(int64_t n, uint64_t max_rows) {
  return n < 0 ? 0 : (static_cast<uint64_t>(n) > max_rows ? max_rows : static_cast<uint64_t>(n));
}

// Every thread reads what it needs itself (broadcast loads, issued together): nothing is
// written until the last participant publishes, after every participant's reads, so all
// threads see the same values and no block-wide decision step is needed.
__device__ int ChooseTier(const StashState* s, uint64_t need) {
  if (Load(&s->overflow) != 0) return -1;
  for (int t = 0; t < 2; ++t) {
    const StashTier& tier = s->tier[t];
    if (tier.cap != 0 && Load(&tier.tail) - Load(&tier.head) >= need) return t;
  }
  return -2;
}

__global__ void __launch_bounds__(1024) StashKernel(StashState* s, const uint8_t* src, const int64_t* n_rows, uint64_t max_rows,
                            StashHandleHeader* h) {
  const uint64_t P = s->page_rows, row_bytes = s->row_bytes;
  const uint64_t n = Clamp(*n_rows, max_rows);
  const uint64_t need = (n + P - 1) / P;
  const Geometry g = GeometryOf(s, src);
  const uint64_t participants = Participants(need * g.pieces);
  if (blockIdx.x >= participants) return;  // the same in every thread of the block
  const int tier_id = ChooseTier(s, need);
  const uint64_t head = tier_id >= 0 ? Load(&s->tier[tier_id].head) : 0;
  uint32_t* table = reinterpret_cast<uint32_t*>(h + 1);
  if (tier_id >= 0) {
    const StashTier& tier = s->tier[tier_id];
    for (uint64_t item = blockIdx.x; item < need * g.pieces; item += participants) {
      const uint64_t slot = item / g.pieces, piece = item - slot * g.pieces;
      const uint32_t page = tier.free_list[(head + slot) % tier.cap];
      if (piece == 0 && threadIdx.x == 0) table[slot] = page;
      const uint64_t rows = (slot + 1) * P <= n ? P : n - slot * P;
      CopyPiece(tier.pages + page * g.page_bytes, src + slot * g.page_bytes, rows * row_bytes, piece, g.vector);
    }
  }
  if (LastBlock(s, participants)) {
    h->rows = n;
    if (tier_id >= 0) {
      StashTier& tier = s->tier[tier_id];
      tier.head = head + need;
      const uint64_t used = tier.cap - (tier.tail - tier.head);
      if (used > s->peak_pages[tier_id]) s->peak_pages[tier_id] = used;
      if (tier_id == 1) s->host_spill = 1;
      h->status = tier_id == 0 ? kHandleDevice : kHandleHost;
    } else {
      if (tier_id == -2) {
        s->overflow = 1;
        s->overflow_count += 1;
        s->last_failed_pages = need;
      }
      h->status = kHandleOverflowed;
    }
  }
}

// copy_back: restore (true) or discard (false).
__global__ void __launch_bounds__(1024) RestoreKernel(StashState* s, StashHandleHeader* h, uint8_t* dst, uint64_t max_rows, bool zero_tail,
                              bool copy_back) {
  const uint64_t P = s->page_rows, row_bytes = s->row_bytes;
  // h->rows is written only by a stash, so every block computes the same participants.
  const uint64_t n = h->rows;
  const uint64_t need = (n + P - 1) / P;
  const Geometry g = GeometryOf(s, dst);
  // At most max_rows rows are written to dst (a smaller buffer than the stashed one).
  const uint64_t n_copy = n < max_rows ? n : max_rows;
  uint64_t items = copy_back ? (n_copy + P - 1) / P * g.pieces : 0;
  const uint64_t slot_blocks = (need + blockDim.x - 1) / blockDim.x;
  if (slot_blocks > items) items = slot_blocks;
  if (copy_back && zero_tail && max_rows > items) items = max_rows;
  const uint64_t participants = Participants(items);
  if (blockIdx.x >= participants) return;
  const uint32_t status = Load(&h->status);
  const int tier_id =
      (Load(&s->overflow) != 0 || (status != kHandleDevice && status != kHandleHost)) ? -1 : (status == kHandleDevice ? 0 : 1);
  const uint64_t tail = tier_id >= 0 ? Load(&s->tier[tier_id].tail) : 0;
  const uint32_t* table = reinterpret_cast<const uint32_t*>(h + 1);
  const uint64_t live = tier_id >= 0 ? n_copy : 0;
  if (tier_id >= 0) {
    const StashTier& tier = s->tier[tier_id];
    if (copy_back) {
      for (uint64_t item = blockIdx.x; item < (live + P - 1) / P * g.pieces; item += participants) {
        const uint64_t slot = item / g.pieces, piece = item - slot * g.pieces;
        const uint64_t rows = (slot + 1) * P <= live ? P : live - slot * P;
        CopyPiece(dst + slot * g.page_bytes, tier.pages + table[slot] * g.page_bytes, rows * row_bytes, piece,
                  g.vector);
      }
    }
    // The pages go back in page-table order, one slot per thread (a discard copies nothing).
    const uint64_t stride = participants * blockDim.x;
    for (uint64_t slot = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; slot < need; slot += stride) {
      tier.free_list[(tail + slot) % tier.cap] = table[slot];
    }
  }
  if (copy_back && zero_tail) ZeroRange(dst, live * row_bytes, max_rows * row_bytes, participants);
  if (LastBlock(s, participants)) {
    if (tier_id >= 0) {
      s->tier[tier_id].tail = tail + need;
      h->status = kHandleEmpty;
    } else if (Load(&s->overflow) == 0) {
      h->status = kHandleEmpty;  // an overflowed handle after a reset
    }
  }
}

__global__ void FlagsKernel(const StashState* s, StashFlags* out) {
  out->overflow = s->overflow;
  out->host_spill = s->host_spill;
  out->peak_pages[0] = s->peak_pages[0];
  out->peak_pages[1] = s->peak_pages[1];
  out->overflow_count = s->overflow_count;
  out->last_failed_pages = s->last_failed_pages;
}

}  // namespace

uint32_t GridFor(uint64_t max_rows) {
  return max_rows == 0 ? 1u : static_cast<uint32_t>(max_rows < max_grid ? max_rows : max_grid);
}

void SetLaunchShape(uint32_t grid, uint32_t threads) {
  if (grid > 0) max_grid = grid;
  if (threads >= 32 && threads <= 1024 && threads % 32 == 0) copy_threads = threads;
}

int LaunchReset(CUstream_st* stream, StashState* state, const StashState& init, uint64_t max_cap) {
  const uint64_t blocks = (max_cap + kThreads - 1) / kThreads;
  ResetKernel<<<static_cast<uint32_t>(blocks == 0 ? 1 : (blocks < 1024 ? blocks : 1024)), kThreads, 0, stream>>>(
      state, init, max_cap);
  return static_cast<int>(cudaGetLastError());
}

int LaunchStash(CUstream_st* stream, StashState* state, const void* src, const int64_t* n_rows, uint64_t max_rows,
                StashHandleHeader* handle) {
  StashKernel<<<GridFor(max_rows), copy_threads, 0, stream>>>(state, static_cast<const uint8_t*>(src), n_rows, max_rows,
                                                          handle);
  return static_cast<int>(cudaGetLastError());
}

int LaunchRestore(CUstream_st* stream, StashState* state, StashHandleHeader* handle, void* dst, uint64_t max_rows,
                  bool zero_tail) {
  RestoreKernel<<<GridFor(max_rows), copy_threads, 0, stream>>>(state, handle, static_cast<uint8_t*>(dst), max_rows,
                                                            zero_tail, true);
  return static_cast<int>(cudaGetLastError());
}

int LaunchDiscard(CUstream_st* stream, StashState* state, StashHandleHeader* handle, uint64_t max_rows) {
  RestoreKernel<<<GridFor(max_rows), copy_threads, 0, stream>>>(state, handle, nullptr, max_rows, false, false);
  return static_cast<int>(cudaGetLastError());
}

int LaunchReadFlags(CUstream_st* stream, const StashState* state, StashFlags* out) {
  FlagsKernel<<<1, 1, 0, stream>>>(state, out);
  return static_cast<int>(cudaGetLastError());
}

namespace {
class KernelOps final : public StashOps {
 public:
  const char* Name() const override { return "cuda kernels"; }
  int Reset(CUstream_st* stream, StashState* state, const StashState& init, uint64_t max_cap) const override {
    return LaunchReset(stream, state, init, max_cap);
  }
  int Stash(CUstream_st* stream, StashState* state, const void* src, const int64_t* n_rows, uint64_t max_rows,
            StashHandleHeader* handle) const override {
    return LaunchStash(stream, state, src, n_rows, max_rows, handle);
  }
  int Restore(CUstream_st* stream, StashState* state, StashHandleHeader* handle, void* dst, uint64_t max_rows,
              bool zero_tail) const override {
    return LaunchRestore(stream, state, handle, dst, max_rows, zero_tail);
  }
  int Discard(CUstream_st* stream, StashState* state, StashHandleHeader* handle, uint64_t max_rows) const override {
    return LaunchDiscard(stream, state, handle, max_rows);
  }
  int ReadFlags(CUstream_st* stream, const StashState* state, StashFlags* out) const override {
    return LaunchReadFlags(stream, state, out);
  }
};
}  // namespace

const StashOps& KernelStashOps() {
  static const KernelOps ops;
  return ops;
}

}  // namespace vmstash::stash
