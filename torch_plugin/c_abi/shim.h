// What every C ABI entry point shares (vmstash_c.cc, stash_c.cc, tms_c.cc): the error convention
// (the message and the code in thread-locals, vmstash_last_error() and
// vmstash_last_error_code(); the absl::StatusCode as the return value, from the one table
// of vmstash.h, Note [Status Codes]), the guard that runs a body inside a process Call
// (runtime/process.h, Note [Shutdown]) and turns exceptions, std::bad_alloc included, into
// codes, and the runtime calls more than one front makes (allocation, free, live ranges,
// backup reads), so that each front talks to the runtime alone.
#ifndef VMSTASH_TORCH_PLUGIN_C_ABI_SHIM_H_
#define VMSTASH_TORCH_PLUGIN_C_ABI_SHIM_H_

#include <cstddef>
#include <functional>
#include <new>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runtime/process.h"
#include "runtime/runtime.h"
#include "torch_plugin/include/vmstash/vmstash.h"

namespace vmstash::c_abi {

// Records `status` as this thread's last error (message, code, done mark); returns its code.
int Fail(const absl::Status& status);
// The status's code, recording the error when it is not OK.
inline int Code(const absl::Status& status) { return status.ok() ? 0 : Fail(status); }
// This thread's last error, kept across calls that would replace it (a rollback's), and
// put back as it was.
struct SavedError {
  std::string message;  // as Fail wrote it: "CODE_NAME: text"
  int code = 0;
  bool done = false;
  // The error as a status again: its code, and the text without the code's name Fail put
  // in front (so a caller adding context to it and failing again does not name it twice).
  // `done` is not carried (it is a payload mark of the original status): Fail on the result
  // records the error as not done.
  absl::Status ToStatus() const;
};
SavedError SaveError();
int RestoreError(const SavedError& saved);  // returns saved.code

// --- The runtime calls both fronts make (vmstash_c.cc defines them) ---------------------
// 0 when changed, VMSTASH_NOOP when nothing changed, else the error's code.
int TransitionCode(const absl::StatusOr<bool>& changed);
// The allocator of `device` in *out (lock-free once it exists): 0, or the failure's code.
int AllocatorFor(Runtime& rt, int device, CachingAllocator** out);
// An allocation of `size` bytes in `tag` on `device`: a code, with the pointer in *out.
int Allocate(Runtime& rt, std::size_t size, int device, cudaStream_t stream, TagId tag, void** out);
// Allocate inside a Call: the pointer, or NULL with the error recorded.
void* MallocIn(std::size_t size, int device, cudaStream_t stream, TagId tag) noexcept;
// A free of `ptr` on `device` (errors logged and recorded): a code.
int Free(Runtime& rt, void* ptr, int device);
// Adds entry `l` of a `what` call's live ranges (vmstash.h: vmstash_live_ranges) to
// `out`, as ranges of tag `id` on the entry's device; InvalidArgument for NULL arrays.
absl::Status AddLiveEntry(const vmstash_live_ranges& l, TagId id, const char* what,
                          Runtime::LiveRangesByDevice* out);
// A backup read on `device`, or (device < 0) on the device whose allocator holds the bytes:
// addresses are unique across devices, so at most one answers other than NOT_FOUND.
int WithBackupOf(Runtime& rt, int device, const std::function<absl::Status(CachingAllocator*)>& read);

// `text` in malloc'ed memory (the caller frees it: vmstash_string_free), or NULL when the
// host is out of memory.
char* CopyOut(const std::string& text);

// Runs fn(process::Call&) -> int inside a Call; a refused call fails.
template <typename Fn>
int Guard(Fn fn) noexcept {
  try {
    process::Call call;
    if (!call.refused().ok()) return Fail(call.refused());
    return fn(call);
  } catch (const std::bad_alloc&) {
    return Fail(absl::ResourceExhaustedError("vmstash: host out of memory"));
  } catch (...) {
    return Fail(absl::InternalError("vmstash: unexpected exception"));
  }
}

// Runs fn(Runtime&) -> int on the process runtime (initialized on first use).
template <typename Fn>
int WithRuntime(Fn fn) noexcept {
  return Guard([&](process::Call& call) {
    Runtime* rt = call.runtime_if_initialized();  // the fast path: a plain pointer
    if (rt == nullptr) {
      absl::StatusOr<Runtime*> made = call.runtime();  // first use: initializes
      if (!made.ok()) return Fail(made.status());
      rt = *made;
    }
    return fn(*rt);
  });
}

}  // namespace vmstash::c_abi

#endif  // VMSTASH_TORCH_PLUGIN_C_ABI_SHIM_H_
