// What the other parts of the C ABI (stash_c.cc) use of the process-wide runtime that
// vmstash_c.cc owns: a device's allocator, the error convention, and a count of objects
// that hold allocator pointers, so vmstash_shutdown() refuses while any is alive.
#ifndef VMSTASH_TORCH_PLUGIN_C_ABI_RUNTIME_ACCESS_H_
#define VMSTASH_TORCH_PLUGIN_C_ABI_RUNTIME_ACCESS_H_

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/caching_allocator.h"

namespace vmstash::c_abi {

// The allocator of `device`, created (and the runtime initialized) on first use.
absl::StatusOr<CachingAllocator*> DeviceAllocator(int device);
// Records `status` as this thread's last error; returns its code.
int Fail(const absl::Status& status);
// Runs `fn`, turning exceptions into codes (as every entry point does).
int Guarded(absl::FunctionRef<int()> fn) noexcept;
// +1 / -1 as a dependent object (a stash arena) is created / destroyed.
void CountDependent(int delta);
// True when this process has an allocator on `device` (never creates one).
bool DeviceInUse(int device);

}  // namespace vmstash::c_abi

#endif  // VMSTASH_TORCH_PLUGIN_C_ABI_RUNTIME_ACCESS_H_
