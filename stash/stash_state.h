// The paged stash tier's device-side data (docs/architecture.md §6): one POD state
// block per arena at a fixed device address, and one handle per stashed tensor. Shared by
// the CUDA kernels (stash_kernels.cu) and the host code; no abseil, no host-only types.
//
// Counters are monotonic u64 (free = tail - head; slot = counter mod cap); page ids are
// u32; every byte offset is computed in 64-bit. A tier with cap 0 is absent.
#ifndef VMSTASH_STASH_STASH_STATE_H_
#define VMSTASH_STASH_STASH_STATE_H_

#include <stdint.h>

namespace vmstash::stash {

struct StashTier {
  uint32_t* free_list;  // cap entries
  uint8_t* pages;       // cap * page_rows * row_bytes bytes (device memory, or mapped pinned host)
  uint64_t head;
  uint64_t tail;
  uint64_t cap;
};

struct StashState {
  StashTier tier[2];  // 0: device, 1: pinned host
  uint64_t page_rows;
  uint64_t row_bytes;
  uint32_t overflow;    // sticky until reset
  uint32_t host_spill;
  uint64_t peak_pages[2];
  uint64_t overflow_count;
  uint64_t last_failed_pages;
  uint32_t ticket;  // last-block-publishes counter; 0 between launches
  uint32_t reserved;
  // Optional flags shared with other arenas (null: none), e.g. Megatron-LM's one int64
  // overflow and host-spill tensors for all its buffers: a nonzero linked overflow makes
  // this arena's stashes and restores no-ops as its own sticky overflow does, and this
  // arena's overflow / host spill sets them too. Reset leaves them alone (their owner
  // clears them).
  int64_t* linked_overflow;
  int64_t* linked_host_spill;
};

// Handle status values (device memory).
enum : uint32_t { kHandleEmpty = 0, kHandleDevice = 1, kHandleHost = 2, kHandleOverflowed = 3 };

// A handle: this header followed by ceil(max_rows / page_rows) u32 page ids.
struct StashHandleHeader {
  uint32_t status;
  uint32_t reserved;
  uint64_t rows;
};

// Flags a host helper reads after the step (a copy of these fields).
struct StashFlags {
  uint32_t overflow;
  uint32_t host_spill;
  uint64_t peak_pages[2];
  uint64_t overflow_count;
  uint64_t last_failed_pages;
};

#ifdef __CUDACC__
#define VMSTASH_HOST_DEVICE __host__ __device__
#else
#define VMSTASH_HOST_DEVICE
#endif

// Whether stashes and restores are no-ops: this arena's sticky overflow or a linked one.
VMSTASH_HOST_DEVICE inline bool Overflowed(const StashState& s) {
  return *static_cast<const volatile uint32_t*>(&s.overflow) != 0 ||
         (s.linked_overflow != nullptr && *static_cast<const volatile int64_t*>(s.linked_overflow) != 0);
}

// The flags of a state block, for both executors (the kernels and the host one).
VMSTASH_HOST_DEVICE inline void CopyFlags(const StashState& s, StashFlags* out) {
  out->overflow = s.overflow;
  out->host_spill = s.host_spill;
  out->peak_pages[0] = s.peak_pages[0];
  out->peak_pages[1] = s.peak_pages[1];
  out->overflow_count = s.overflow_count;
  out->last_failed_pages = s.last_failed_pages;
}

}  // namespace vmstash::stash

#endif  // VMSTASH_STASH_STASH_STATE_H_
