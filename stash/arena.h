// StashArena: one page class of the paged stash tier on one device
// (docs/architecture.md §6). Host side of the kernels in stash_kernels.h.
//
// Prepare(capacity pages per tier) allocates, from the CachingAllocator under the arena's
// tag (default "stash", policy discard: released when paused, stable VA), the device
// pages, the free list and the state block; the optional host tier is pinned host memory
// (device-accessible through unified addressing), allocated once. Handles live under the
// same tag. Every operation is stream-ordered and capturable except Create/Prepare/
// ReadFlags(host). The arena's tag refuses a pause while pages are in use (a before-pause
// hook reads the state block; the device is already idle at that point) with
// FailedPrecondition; an idle arena pauses without backup and Reset re-initialises it.
//
// The operations run on an injected executor (stash_ops.h): the CUDA kernels, or the host
// executor when the driver is the simulated one (so CI exercises this class).
//
// Handles are checked on the host, in the order the calls are made (which is the stream
// order, captured or not): a handle must be one of this arena's, stash/restore/discard
// may not name more rows than the handle was created for (its page table would
// overflow), a handle holding pages cannot be stashed into again, and a handle stashed
// before the latest Reset cannot be restored or discarded (Reset took its pages back;
// giving them back again would let two handles share pages). Misuse is InvalidArgument
// or FailedPrecondition and launches nothing.
//
// Thread-safety: the launches follow the single-stream rule (stash_kernels.h); host
// methods are not thread-safe. The pause hook is safe against the arena's destruction.
#ifndef VMSTASH_STASH_ARENA_H_
#define VMSTASH_STASH_ARENA_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/caching_allocator.h"
#include "stash/stash_ops.h"
#include "stash/stash_state.h"
#include "vmm/driver.h"

namespace vmstash::stash {

struct StashArenaSpec {
  std::uint64_t row_bytes = 0;
  std::uint32_t page_rows = 64;  // a power of two
  std::string tag = "stash";
  // The executor; null: the CUDA kernels, or the host executor on the simulated driver.
  const StashOps* ops = nullptr;
};

class StashArena {
 public:
  static absl::StatusOr<std::unique_ptr<StashArena>> Create(Driver* driver, CachingAllocator* allocator,
                                                            StashArenaSpec spec);
  ~StashArena();  // frees what Prepare allocated (errors logged)
  StashArena(const StashArena&) = delete;
  StashArena& operator=(const StashArena&) = delete;

  // Allocates the tiers (host_pages 0: no host tier) and resets. FailedPrecondition twice.
  // On failure nothing stays allocated and Prepare may be retried.
  absl::Status Prepare(std::uint64_t device_pages, std::uint64_t host_pages, Stream stream);
  // A handle for tensors of up to max_rows rows (device memory under the arena's tag).
  absl::StatusOr<StashHandleHeader*> NewHandle(std::uint64_t max_rows);
  absl::Status FreeHandle(StashHandleHeader* handle);

  absl::Status Reset(Stream stream);
  // Links flags shared with other arenas (stash_state.h: linked_overflow / linked_host_spill;
  // device-addressable int64s, e.g. Megatron-LM's overflow and host_spill tensors; null
  // unlinks) and resets the arena (stream-ordered). The owner of the flags clears them;
  // this arena's Reset does not.
  absl::Status LinkFlags(Stream stream, std::int64_t* overflow, std::int64_t* host_spill);
  absl::Status Stash(Stream stream, const void* src, const std::int64_t* n_rows_dev, std::uint64_t max_rows,
                     StashHandleHeader* handle);
  absl::Status Restore(Stream stream, StashHandleHeader* handle, void* dst, std::uint64_t max_rows, bool zero_tail);
  absl::Status Discard(Stream stream, StashHandleHeader* handle, std::uint64_t max_rows);
  // Queues a copy of the flags into device memory `out` (capturable).
  absl::Status WriteFlags(Stream stream, StashFlags* out);
  // Host helper after the step: synchronizes `stream` and reads the flags.
  absl::StatusOr<StashFlags> ReadFlags(Stream stream);
  // Pages in use per tier right now (synchronizes `stream`).
  absl::StatusOr<std::uint64_t> PagesInUse(Stream stream);

  TagId tag() const { return tag_; }
  std::uint64_t device_bytes() const { return device_bytes_; }
  StashState* state() const { return state_; }
  const StashArenaSpec& spec() const { return spec_; }
  const StashOps& ops() const { return *ops_; }

 private:
  StashArena(Driver* driver, CachingAllocator* allocator, StashArenaSpec spec, TagId tag);
  absl::Status Launched(int code, const char* what) const;
  absl::Status Allocate(std::uint64_t device_pages, std::uint64_t host_pages, std::uint64_t page_bytes,
                        Stream stream);
  void ReleaseMemory();  // frees what Prepare allocated; unprepared again
  struct HandleInfo {
    std::uint64_t max_rows = 0;
    std::uint64_t stashed_epoch = 0;  // Reset epoch of its pages; 0: holds none
  };
  // The handle's record, or InvalidArgument (not this arena's / more rows than made for).
  absl::StatusOr<HandleInfo*> CheckHandle(StashHandleHeader* handle, std::uint64_t max_rows, const char* what);
  // FailedPrecondition when the handle was stashed before the latest Reset.
  absl::Status CheckStashed(const HandleInfo& info, const char* what) const;

  Driver* const driver_;
  CachingAllocator* const allocator_;
  const StashArenaSpec spec_;
  const TagId tag_;
  const StashOps* ops_;
  struct HookGuard;  // what the pause hook reaches the arena through (nulled on destruction)
  std::shared_ptr<HookGuard> hook_guard_;
  int device_ = 0;
  bool prepared_ = false;
  StashState host_state_{};
  StashState* state_ = nullptr;  // device
  DevicePtr device_pages_ = 0, device_free_list_ = 0, host_free_list_ = 0;
  void* host_pages_ = nullptr;
  std::uint64_t device_bytes_ = 0;
  std::uint64_t max_cap_ = 0;
  StashFlags* flags_scratch_ = nullptr;
  absl::flat_hash_map<const StashHandleHeader*, HandleInfo> handles_;
  std::uint64_t epoch_ = 1;  // bumped by every Reset
};

}  // namespace vmstash::stash

#endif  // VMSTASH_STASH_ARENA_H_
