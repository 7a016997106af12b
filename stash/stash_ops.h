// StashOps: the executor of the paged stash operations on an arena's state block, an
// injected backend (as vmm/driver.h is for the driver):
//   KernelStashOps() (stash_kernels.cu) launches the CUDA kernels of stash_kernels.h;
//   HostStashOps()   (host_stash_ops.cc) runs the same operations on the host, in call
//                    order, on memory the host can address: the simulated driver's
//                    "device" memory (a DevicePtr is a host address there), whose streams
//                    complete work when it is queued. With it the arena, the C ABI and the
//                    Python wrappers run in CI without a GPU.
// Both implement the semantics of docs/architecture.md §6, which the CPU model
// (page_model.h) states independently; tests compare each executor with the model.
//
// Every method returns 0 on success or a nonzero CUDA error code. Stateless; thread-safe.
#ifndef VMSTASH_STASH_STASH_OPS_H_
#define VMSTASH_STASH_STASH_OPS_H_

#include <stdint.h>

#include "stash/stash_state.h"

struct CUstream_st;

namespace vmstash::stash {

class StashOps {
 public:
  virtual ~StashOps() = default;
  virtual const char* Name() const = 0;
  // `init`: the arena's geometry; the rest of the state is rebuilt.
  virtual int Reset(CUstream_st* stream, StashState* state, const StashState& init, uint64_t max_cap) const = 0;
  // `geo`: the arena's host copy of the state block's fixed part (tier pointers and caps,
  // page_rows, row_bytes, linked flags); the kernels take it as a launch argument, so only
  // the counters and flags are read from device memory.
  virtual int Stash(CUstream_st* stream, StashState* state, const StashState& geo, const void* src,
                    const int64_t* n_rows, uint64_t max_rows, StashHandleHeader* handle) const = 0;
  // Writes min(rows stashed, max_rows) rows to dst (zero_tail: zeroes the rest up to max_rows).
  virtual int Restore(CUstream_st* stream, StashState* state, const StashState& geo, StashHandleHeader* handle,
                      void* dst, uint64_t max_rows, bool zero_tail) const = 0;
  virtual int Discard(CUstream_st* stream, StashState* state, const StashState& geo, StashHandleHeader* handle,
                      uint64_t max_rows) const = 0;
  virtual int ReadFlags(CUstream_st* stream, const StashState* state, StashFlags* out) const = 0;
};

const StashOps& KernelStashOps();
const StashOps& HostStashOps();

}  // namespace vmstash::stash

#endif  // VMSTASH_STASH_STASH_OPS_H_
