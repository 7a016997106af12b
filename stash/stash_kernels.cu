// The paged stash kernels: see stash_kernels.h and docs/architecture.md §6.
#include <cuda_runtime.h>

#include "stash/stash_kernels.h"
#include "stash/stash_ops.h"

namespace vmstash::stash {
namespace {

constexpr uint32_t kThreads = 256;  // reset
// Units each thread has in flight per loop trip: a launch-time choice between the kernels'
// two instantiations (SetLaunchShape; default kDefaultUnroll).
constexpr uint32_t kDefaultUnroll = 4;
uint32_t unroll = kDefaultUnroll;
constexpr uint32_t kBlocksPerSm = 2;  // copy_threads x kBlocksPerSm threads resident per SM
// Stash/restore launch shape (SetLaunchShape): at most max_grid blocks (0: one wave,
// kBlocksPerSm per SM of the device) of copy_threads threads; a launch for fewer bytes
// gets fewer (GridFor), and of those only the blocks the row count read on the device
// needs take part (ActiveBlocks); the others leave at once. Measured on the H200 (bench/
// megatron_stash_bench.py --shapes): one wave of 512-thread blocks is the fastest at
// 128 MB - 2 GB and keeps an empty stash short; 4 waves cost 2x on an empty stash.
uint32_t max_grid = 0;
uint32_t copy_threads = 512;

struct Decision {
  int tier;        // 0 / 1: place there; -1: sticky overflow (no-op); -2: this stash overflows
  uint64_t need;   // pages
  uint64_t n;      // rows
  uint64_t counter;  // head (stash) or tail (restore) read before anyone publishes
  uint64_t start;    // counter % cap of the chosen tier (no modulo per unit)
  uint32_t active;   // blocks taking part in this launch (the others return at once)
};

// q = n / d for a divisor fixed per launch, by multiply and shift (Granlund-Montgomery):
// a page slot per 16-byte unit costs two instructions instead of a division.
struct FastDiv {
  uint32_t d, m, shift;
  __host__ __device__ static FastDiv For(uint32_t divisor) {
    FastDiv f{divisor, 0, 0};
    while ((uint64_t{1} << f.shift) < divisor) ++f.shift;
    f.m = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << f.shift) - divisor)) / divisor + 1);
    return f;
  }
  __device__ uint32_t operator()(uint32_t n) const {
    return static_cast<uint32_t>((static_cast<uint64_t>(__umulhi(n, m)) + n) >> shift);
  }
};

// What a launch's copy needs that the host can work out (a launch argument, so the
// device spends no division on it): the unit (16, 4 or 1 bytes, the widest that the
// tensor's alignment and the row size allow; the tiers' pages are allocation-aligned),
// the units per page and their multiply-shift divisor when the launch's index fits
// 32 bits, log2 of the page rows, and log2 of the bytes a block moves per trip.
struct CopyPlan {
  uint32_t unit;
  bool narrow;         // 32-bit index and `div`
  FastDiv div;         // by the units per page
  uint32_t log_p;      // page_rows = 1 << log_p
  int32_t log_block;   // bytes a block moves per trip = 1 << log_block; -1: not a power of two
};

// Page id of page slot `slot` of the tensor: stash reads the free list from its head,
// restore the handle's page table.
struct FreeListPages {
  const uint32_t* free_list;
  uint64_t start, cap;
  __device__ uint32_t operator()(uint64_t slot) const {
    uint64_t i = start + slot;
    if (i >= cap) i -= cap;  // slot < cap: one wrap at most
    return free_list[i];
  }
};
struct TablePages {
  const uint32_t* table;
  __device__ uint32_t operator()(uint64_t slot) const { return table[slot]; }
};

// Page slot k of a tensor (rows kP .. kP+P-1) is contiguous on both sides: page_bytes
// bytes at tensor + k * page_bytes and at pages + page_id * page_bytes. So the copy is one
// flat index over the live bytes in units; each unit finds its slot by a division by the
// units per page, its page id by one cached load. Narrow rows (MXFP8 scales: 224 bytes)
// keep every thread busy; wide rows pay no per-row work.
template <uint32_t kUnroll, typename Unit, typename Index, typename Div, typename PageOf>
__device__ void CopyLinear(uint8_t* pages, uint8_t* tensor, Index items, Index per_page, const Div& div,
                           const PageOf& page_of, bool to_pages, uint32_t* table, uint32_t active) {
  const Index stride = static_cast<Index>(active) * blockDim.x;
  Unit* const flat = reinterpret_cast<Unit*>(tensor);
  Unit* const paged = reinterpret_cast<Unit*>(pages);
  for (Index base = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; base < items;
       base += stride * kUnroll) {
    Unit v[kUnroll];
    Unit* to[kUnroll];
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) {
      const Index i = base + u * stride;
      to[u] = nullptr;
      if (i < items) {
        const Index slot = div(i);
        const Index off = i - slot * per_page;
        const uint32_t page = page_of(slot);
        Unit* p = paged + static_cast<uint64_t>(page) * per_page + off;
        if (to_pages) {
          if (table != nullptr && off == 0) table[slot] = page;
          v[u] = flat[i];
          to[u] = p;
        } else {
          v[u] = *p;
          to[u] = flat + i;
        }
      }
    }
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) {
      if (to[u] != nullptr) *to[u] = v[u];
    }
  }
}

// counter % cap in 32 bits when both fit (a 64-bit remainder is a long instruction sequence).
__device__ uint64_t Mod(uint64_t counter, uint64_t cap) {
  if ((counter | cap) >> 32 == 0) return static_cast<uint32_t>(counter) % static_cast<uint32_t>(cap);
  return counter % cap;
}

struct SlowDiv {
  uint64_t d;
  __device__ uint64_t operator()(uint64_t n) const { return n / d; }
};

template <uint32_t kUnroll, typename Unit, typename PageOf>
__device__ void CopyUnits(uint8_t* pages, uint8_t* tensor, uint64_t n, uint64_t page_bytes, uint64_t row_bytes,
                          const CopyPlan& plan, const PageOf& page_of, bool to_pages, uint32_t* table,
                          uint32_t active) {
  const uint64_t items = n * (row_bytes / sizeof(Unit));
  const uint64_t per_page = page_bytes / sizeof(Unit);
  if (plan.narrow) {
    CopyLinear<kUnroll, Unit, uint32_t>(pages, tensor, static_cast<uint32_t>(items), static_cast<uint32_t>(per_page),
                                        plan.div, page_of, to_pages, table, active);
  } else {
    CopyLinear<kUnroll, Unit, uint64_t>(pages, tensor, items, per_page, SlowDiv{per_page}, page_of, to_pages, table, active);
  }
}

template <uint32_t kUnroll, typename PageOf>
__device__ void Copy(uint8_t* pages, uint8_t* tensor, uint64_t n, uint64_t P, uint64_t row_bytes, const CopyPlan& plan,
                     const PageOf& page_of, bool to_pages, uint32_t* table, uint32_t active) {
  const uint64_t page_bytes = P * row_bytes;
  if (plan.unit == 16) {
    CopyUnits<kUnroll, uint4>(pages, tensor, n, page_bytes, row_bytes, plan, page_of, to_pages, table, active);
  } else if (plan.unit == 4) {
    CopyUnits<kUnroll, uint32_t>(pages, tensor, n, page_bytes, row_bytes, plan, page_of, to_pages, table, active);
  } else {
    CopyUnits<kUnroll, uint8_t>(pages, tensor, n, page_bytes, row_bytes, plan, page_of, to_pages, table, active);
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

// Blocks that take part in moving `rows` rows (at least one: block 0 publishes).
__device__ uint32_t ActiveBlocks(uint64_t rows, uint64_t row_bytes, int32_t log_block) {
  // One 16-byte unit per thread: a small copy spreads over as many SMs as it can use
  // (measured: 65 KB of MXFP8 scale rows on 3 blocks kept the busiest SM twice as long as
  // Megatron's 438 one-row blocks did); a large one gets the whole wave anyway.
  const uint64_t per_block = static_cast<uint64_t>(blockDim.x) * 16;
  const uint64_t want = log_block >= 0 ? (rows * row_bytes + per_block - 1) >> log_block
                                       : (rows * row_bytes + per_block - 1) / per_block;
  return want == 0 ? 1u : (want < gridDim.x ? static_cast<uint32_t>(want) : gridDim.x);
}

// True in exactly one thread of the last of `active` blocks to get here (after a fence):
// it publishes. Blocks past `active` never call it.
__device__ bool LastBlock(StashState* s, uint32_t active) {
  __shared__ bool last;
  if (active == 1) return threadIdx.x == 0;  // block 0 alone: the next launch sees all it wrote
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const uint32_t ticket = atomicAdd(&s->ticket, 1u);
    last = ticket == active - 1;
    if (last) s->ticket = 0;  // re-armed for the next launch
  }
  __syncthreads();
  return last && threadIdx.x == 0;
}

// The counters and flags a launch decides on, loaded at once (independent loads, one
// round trip); the fixed geometry and the linked flags' addresses are launch arguments.
struct Live {
  uint64_t head[2], tail[2];
  bool overflowed;
};
__device__ Live LoadLive(const StashState* s, const StashState& geo) {
  Live l;
  const uint32_t own = s->overflow;
  const int64_t linked = geo.linked_overflow != nullptr ? *geo.linked_overflow : 0;
  for (int t = 0; t < 2; ++t) {
    l.head[t] = s->tier[t].head;
    l.tail[t] = s->tier[t].tail;
  }
  l.overflowed = own != 0 || linked != 0;
  return l;
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

template <uint32_t kUnroll>
__global__ void StashKernel(StashState* s, const StashState geo, const CopyPlan plan, const uint8_t* src,
                            const int64_t* n_rows, uint64_t max_rows, StashHandleHeader* h) {
  __shared__ Decision d;
  const uint64_t P = geo.page_rows, row_bytes = geo.row_bytes;
  if (threadIdx.x == 0) {
    const int64_t n = *n_rows;
    const Live live = LoadLive(s, geo);
    d.n = n < 0 ? 0 : (static_cast<uint64_t>(n) > max_rows ? max_rows : static_cast<uint64_t>(n));
    d.need = (d.n + P - 1) >> plan.log_p;
    d.tier = -1;
    if (!live.overflowed) {
      d.tier = -2;
      for (int t = 0; t < 2; ++t) {
        if (geo.tier[t].cap != 0 && live.tail[t] - live.head[t] >= d.need) {
          d.tier = t;
          break;
        }
      }
    }
    d.counter = d.tier == 0 ? live.head[0] : (d.tier == 1 ? live.head[1] : 0);
    d.start = d.tier >= 0 ? Mod(d.counter, d.tier == 0 ? geo.tier[0].cap : geo.tier[1].cap) : 0;
    d.active = ActiveBlocks(d.tier >= 0 ? d.n : 0, row_bytes, plan.log_block);
  }
  __syncthreads();
  if (blockIdx.x >= d.active) return;
  uint32_t* table = reinterpret_cast<uint32_t*>(h + 1);
  if (d.tier >= 0) {
    const StashTier tier = d.tier == 0 ? geo.tier[0] : geo.tier[1];  // no dynamic index: no stack
    Copy<kUnroll>(tier.pages, const_cast<uint8_t*>(src), d.n, P, row_bytes, plan, FreeListPages{tier.free_list, d.start, tier.cap},
         /*to_pages=*/true, table, d.active);
  }
  if (LastBlock(s, d.active)) {
    h->rows = d.n;
    if (d.tier >= 0) {
      StashTier& tier = s->tier[d.tier];
      tier.head = d.counter + d.need;
      const uint64_t used = tier.cap - (tier.tail - tier.head);
      if (used > s->peak_pages[d.tier]) s->peak_pages[d.tier] = used;
      if (d.tier == 1) {
        s->host_spill = 1;
        if (geo.linked_host_spill != nullptr) *geo.linked_host_spill = 1;
      }
      h->status = d.tier == 0 ? kHandleDevice : kHandleHost;
    } else {
      if (d.tier == -2) {
        s->overflow = 1;
        s->overflow_count += 1;
        s->last_failed_pages = d.need;
        if (geo.linked_overflow != nullptr) *geo.linked_overflow = 1;
      }
      h->status = kHandleOverflowed;
    }
    __threadfence();
  }
}

// copy_back: restore (true) or discard (false).
template <uint32_t kUnroll>
__global__ void RestoreKernel(StashState* s, const StashState geo, const CopyPlan plan, StashHandleHeader* h,
                              uint8_t* dst, uint64_t max_rows, bool zero_tail, bool copy_back) {
  __shared__ Decision d;
  const uint64_t P = geo.page_rows, row_bytes = geo.row_bytes;
  if (threadIdx.x == 0) {
    const uint32_t status = h->status;
    const uint64_t rows = h->rows;
    const Live live = LoadLive(s, geo);
    d.n = rows;
    d.need = (d.n + P - 1) >> plan.log_p;
    d.tier = (live.overflowed || (status != kHandleDevice && status != kHandleHost))
                 ? -1 : (status == kHandleDevice ? 0 : 1);
    d.counter = d.tier == 0 ? live.tail[0] : (d.tier == 1 ? live.tail[1] : 0);
    d.start = d.tier >= 0 ? Mod(d.counter, d.tier == 0 ? geo.tier[0].cap : geo.tier[1].cap) : 0;
    const uint64_t n_live = d.tier >= 0 ? (d.n < max_rows ? d.n : max_rows) : 0;
    // Blocks for the copy, the zeroed tail, and the page ids given back (one per thread).
    uint32_t active = ActiveBlocks(copy_back ? (zero_tail ? max_rows : n_live) : 0, row_bytes, plan.log_block);
    const uint64_t give = d.tier < 0 ? 0
                          : ((blockDim.x & (blockDim.x - 1)) == 0 ? (d.need + blockDim.x - 1) >> (__ffs(blockDim.x) - 1)
                                                                  : (d.need + blockDim.x - 1) / blockDim.x);
    if (give > active) active = give < gridDim.x ? static_cast<uint32_t>(give) : gridDim.x;
    d.active = active;
  }
  __syncthreads();
  if (blockIdx.x >= d.active) return;
  const uint32_t* table = reinterpret_cast<const uint32_t*>(h + 1);
  // At most max_rows rows are written to dst (a smaller buffer than the stashed one).
  const uint64_t n_live = d.tier >= 0 ? (d.n < max_rows ? d.n : max_rows) : 0;
  if (d.tier >= 0) {
    const StashTier tier = d.tier == 0 ? geo.tier[0] : geo.tier[1];  // no dynamic index: no stack
    if (copy_back) {
      Copy<kUnroll>(tier.pages, dst, n_live, P, row_bytes, plan, TablePages{table}, /*to_pages=*/false, nullptr, d.active);
    }
    // The pages go back in page-table order, one slot per thread (a discard copies nothing).
    const uint64_t stride = static_cast<uint64_t>(d.active) * blockDim.x;
    for (uint64_t slot = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; slot < d.need; slot += stride) {
      uint64_t i = d.start + slot;
      if (i >= tier.cap) i -= tier.cap;
      tier.free_list[i] = table[slot];
    }
  }
  if (copy_back && zero_tail) {
    for (uint64_t r = n_live + blockIdx.x; r < max_rows; r += d.active) ZeroRow(dst + r * row_bytes, row_bytes);
  }
  if (LastBlock(s, d.active)) {
    if (d.tier >= 0) {
      s->tier[d.tier].tail = d.counter + d.need;
      h->status = kHandleEmpty;
    } else if (!Overflowed(*s)) {
      h->status = kHandleEmpty;  // an overflowed handle after a reset
    }
    __threadfence();
  }
}

__global__ void FlagsKernel(const StashState* s, StashFlags* out) { CopyFlags(*s, out); }

}  // namespace

namespace {
// One wave: kBlocksPerSm blocks per SM of the current device (asked once per device).
uint32_t OneWave() {
  static uint32_t sms[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 264;
  if (sms[device] == 0) {
    int count = 0;
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || count <= 0) {
      return 264;
    }
    sms[device] = static_cast<uint32_t>(count);
  }
  return sms[device] * kBlocksPerSm;
}
}  // namespace

namespace {
int32_t Log2IfPow2(uint64_t v) {
  if (v == 0 || (v & (v - 1)) != 0) return -1;
  int32_t l = 0;
  while ((uint64_t{1} << l) < v) ++l;
  return l;
}

CopyPlan PlanCopy(const StashState& geo, const void* tensor, uint64_t max_rows, uint32_t grid, uint32_t unroll_now) {
  CopyPlan plan{};
  const uint64_t bits = reinterpret_cast<uintptr_t>(tensor) | geo.row_bytes;
  plan.unit = (bits & 15) == 0 ? 16 : ((bits & 3) == 0 ? 4 : 1);
  const uint64_t per_page = geo.page_rows * geo.row_bytes / plan.unit;
  const uint64_t items = max_rows * (geo.row_bytes / plan.unit);
  plan.narrow = per_page <= 0xffffffffull &&
                items + static_cast<uint64_t>(grid) * copy_threads * unroll_now <= 0xffffffffull;
  plan.div = FastDiv::For(plan.narrow ? static_cast<uint32_t>(per_page) : 1u);
  plan.log_p = static_cast<uint32_t>(Log2IfPow2(geo.page_rows));
  plan.log_block = Log2IfPow2(static_cast<uint64_t>(copy_threads) * 16);
  return plan;
}
}  // namespace

uint32_t GridFor(uint64_t max_rows, uint64_t row_bytes) {
  const uint64_t per_block = static_cast<uint64_t>(copy_threads) * 16;  // as ActiveBlocks
  const uint64_t want = (max_rows * row_bytes + per_block - 1) / per_block;
  const uint64_t cap = max_grid != 0 ? max_grid : OneWave();
  return want == 0 ? 1u : static_cast<uint32_t>(want < cap ? want : cap);
}

void SetLaunchShape(uint32_t grid, uint32_t threads, uint32_t units_in_flight) {
  max_grid = grid;
  if (units_in_flight == 4 || units_in_flight == 8) unroll = units_in_flight;
  if (threads >= 32 && threads <= 1024 && threads % 32 == 0) copy_threads = threads;
}

int LaunchReset(CUstream_st* stream, StashState* state, const StashState& init, uint64_t max_cap) {
  const uint64_t blocks = (max_cap + kThreads - 1) / kThreads;
  ResetKernel<<<static_cast<uint32_t>(blocks == 0 ? 1 : (blocks < 1024 ? blocks : 1024)), kThreads, 0, stream>>>(
      state, init, max_cap);
  return static_cast<int>(cudaGetLastError());
}

int LaunchStash(CUstream_st* stream, StashState* state, const StashState& geo, const void* src, const int64_t* n_rows,
                uint64_t max_rows, StashHandleHeader* handle) {
  auto* kernel = unroll == 8 ? &StashKernel<8> : &StashKernel<kDefaultUnroll>;
  const uint32_t grid = GridFor(max_rows, geo.row_bytes);
  kernel<<<grid, copy_threads, 0, stream>>>(state, geo, PlanCopy(geo, src, max_rows, grid, unroll),
                                            static_cast<const uint8_t*>(src), n_rows, max_rows, handle);
  return static_cast<int>(cudaGetLastError());
}

int LaunchRestore(CUstream_st* stream, StashState* state, const StashState& geo, StashHandleHeader* handle, void* dst,
                  uint64_t max_rows, bool zero_tail) {
  auto* kernel = unroll == 8 ? &RestoreKernel<8> : &RestoreKernel<kDefaultUnroll>;
  const uint32_t grid = GridFor(max_rows, geo.row_bytes);
  kernel<<<grid, copy_threads, 0, stream>>>(state, geo, PlanCopy(geo, dst, max_rows, grid, unroll), handle,
                                            static_cast<uint8_t*>(dst), max_rows, zero_tail, true);
  return static_cast<int>(cudaGetLastError());
}

int LaunchDiscard(CUstream_st* stream, StashState* state, const StashState& geo, StashHandleHeader* handle,
                  uint64_t max_rows) {
  auto* kernel = unroll == 8 ? &RestoreKernel<8> : &RestoreKernel<kDefaultUnroll>;
  const uint32_t grid = GridFor(max_rows, geo.row_bytes);
  kernel<<<grid, copy_threads, 0, stream>>>(state, geo, PlanCopy(geo, nullptr, max_rows, grid, unroll), handle, nullptr,
                                            max_rows, false, false);
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
  int Stash(CUstream_st* stream, StashState* state, const StashState& geo, const void* src, const int64_t* n_rows,
            uint64_t max_rows, StashHandleHeader* handle) const override {
    return LaunchStash(stream, state, geo, src, n_rows, max_rows, handle);
  }
  int Restore(CUstream_st* stream, StashState* state, const StashState& geo, StashHandleHeader* handle, void* dst,
              uint64_t max_rows, bool zero_tail) const override {
    return LaunchRestore(stream, state, geo, handle, dst, max_rows, zero_tail);
  }
  int Discard(CUstream_st* stream, StashState* state, const StashState& geo, StashHandleHeader* handle,
              uint64_t max_rows) const override {
    return LaunchDiscard(stream, state, geo, handle, max_rows);
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
