// The paged stash kernels: see stash_kernels.h and docs/architecture.md §6.
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

struct Decision {
  int tier;        // 0 / 1: place there; -1: sticky overflow (no-op); -2: this stash overflows
  uint64_t need;   // pages
  uint64_t n;      // rows
  uint64_t counter;  // head (stash) or tail (restore) read before anyone publishes
};

__device__ uint64_t Load(const volatile uint64_t* p) { return *p; }
__device__ uint32_t Load(const volatile uint32_t* p) { return *p; }

// Copies one row with the whole block: 16-byte vectors when both ends allow it.
__device__ void CopyRow(uint8_t* dst, const uint8_t* src, uint64_t bytes) {
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) & 15) == 0) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (uint64_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) d[i] = s[i];
  } else {
    for (uint64_t i = threadIdx.x; i < bytes; i += blockDim.x) dst[i] = src[i];
  }
}

__device__ void ZeroRow(uint8_t* dst, uint64_t bytes) {
  if (((reinterpret_cast<uintptr_t>(dst) | bytes) & 15) == 0) {
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (uint64_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) d[i] = make_uint4(0, 0, 0, 0);
  } else {
    for (uint64_t i = threadIdx.x; i < bytes; i += blockDim.x) dst[i] = 0;
  }
}

// True in exactly one thread of the last block to get here (after a fence): it publishes.
__device__ bool LastBlock(StashState* s) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const uint32_t ticket = atomicAdd(&s->ticket, 1u);
    last = ticket == gridDim.x - 1;
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

__global__ void StashKernel(StashState* s, const uint8_t* src, const int64_t* n_rows, uint64_t max_rows,
                            StashHandleHeader* h) {
  __shared__ Decision d;
  const uint64_t P = s->page_rows, row_bytes = s->row_bytes;
  if (threadIdx.x == 0) {
    int64_t n = *n_rows;
    d.n = n < 0 ? 0 : (static_cast<uint64_t>(n) > max_rows ? max_rows : static_cast<uint64_t>(n));
    d.need = (d.n + P - 1) / P;
    d.tier = -1;
    if (Load(&s->overflow) == 0) {
      d.tier = -2;
      for (int t = 0; t < 2; ++t) {
        const StashTier& tier = s->tier[t];
        if (tier.cap != 0 && Load(&tier.tail) - Load(&tier.head) >= d.need) {
          d.tier = t;
          break;
        }
      }
    }
    d.counter = d.tier >= 0 ? Load(&s->tier[d.tier].head) : 0;
  }
  __syncthreads();
  uint32_t* table = reinterpret_cast<uint32_t*>(h + 1);
  if (d.tier >= 0) {
    const StashTier& tier = s->tier[d.tier];
    for (uint64_t r = blockIdx.x; r < d.n; r += gridDim.x) {
      const uint64_t slot = r / P;
      const uint32_t page = tier.free_list[(d.counter + slot) % tier.cap];
      if (r % P == 0 && threadIdx.x == 0) table[slot] = page;
      CopyRow(tier.pages + (static_cast<uint64_t>(page) * P + r % P) * row_bytes, src + r * row_bytes, row_bytes);
    }
  }
  if (LastBlock(s)) {
    h->rows = d.n;
    if (d.tier >= 0) {
      StashTier& tier = s->tier[d.tier];
      tier.head = d.counter + d.need;
      const uint64_t used = tier.cap - (tier.tail - tier.head);
      if (used > s->peak_pages[d.tier]) s->peak_pages[d.tier] = used;
      if (d.tier == 1) s->host_spill = 1;
      h->status = d.tier == 0 ? kHandleDevice : kHandleHost;
    } else {
      if (d.tier == -2) {
        s->overflow = 1;
        s->overflow_count += 1;
        s->last_failed_pages = d.need;
      }
      h->status = kHandleOverflowed;
    }
    __threadfence();
  }
}

// copy_back: restore (true) or discard (false).
__global__ void RestoreKernel(StashState* s, StashHandleHeader* h, uint8_t* dst, uint64_t max_rows, bool zero_tail,
                              bool copy_back) {
  __shared__ Decision d;
  const uint64_t P = s->page_rows, row_bytes = s->row_bytes;
  if (threadIdx.x == 0) {
    const uint32_t status = Load(&h->status);
    d.n = h->rows;
    d.need = (d.n + P - 1) / P;
    d.tier = (Load(&s->overflow) != 0 || (status != kHandleDevice && status != kHandleHost))
                 ? -1 : (status == kHandleDevice ? 0 : 1);
    d.counter = d.tier >= 0 ? Load(&s->tier[d.tier].tail) : 0;
  }
  __syncthreads();
  const uint32_t* table = reinterpret_cast<const uint32_t*>(h + 1);
  // At most max_rows rows are written to dst (a smaller buffer than the stashed one).
  const uint64_t live = d.tier >= 0 ? (d.n < max_rows ? d.n : max_rows) : 0;
  if (d.tier >= 0) {
    const StashTier& tier = s->tier[d.tier];
    if (copy_back) {
      for (uint64_t r = blockIdx.x; r < live; r += gridDim.x) {
        const uint64_t page = table[r / P];
        CopyRow(dst + r * row_bytes, tier.pages + (page * P + r % P) * row_bytes, row_bytes);
      }
    }
    // The pages go back in page-table order, one slot per thread (a discard copies nothing).
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    for (uint64_t slot = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; slot < d.need; slot += stride) {
      tier.free_list[(d.counter + slot) % tier.cap] = table[slot];
    }
  }
  if (copy_back && zero_tail) {
    for (uint64_t r = live + blockIdx.x; r < max_rows; r += gridDim.x) ZeroRow(dst + r * row_bytes, row_bytes);
  }
  if (LastBlock(s)) {
    if (d.tier >= 0) {
      s->tier[d.tier].tail = d.counter + d.need;
      h->status = kHandleEmpty;
    } else if (Load(&s->overflow) == 0) {
      h->status = kHandleEmpty;  // an overflowed handle after a reset
    }
    __threadfence();
  }
}

__global__ void FlagsKernel(const StashState* s, StashFlags* out) { CopyFlags(*s, out); }

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
