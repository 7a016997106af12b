// The paged stash C ABI (torch_plugin/include/vmstash/vmstash_stash.h) over
// stash::StashArena, on the process runtime (shim.h). Each arena counts as a dependent of
// the Runtime (it holds an allocator pointer), so a shutdown refuses while one exists. An opaque
// vmstash_stash_arena is a StashArena; handles are the arena's device handle pointers.
//
// Note [Arenas Across Fork]
//   An arena records the Runtime that created it and the process it was created in. A
//   forked child inherits the parent's arenas with the parent's runtime; once it has shut
//   that copy down and initialized a runtime of its own (runtime/process.h, Note [Fork]),
//   an inherited arena still points into the abandoned copy, whose locks a parent thread
//   may have held at fork. So a call on an arena of another runtime or another process is
//   refused with FailedPrecondition before anything is touched, and destroying one frees
//   the handle only: its StashArena (whose destructor would give pages back to the
//   abandoned allocator) is leaked on purpose, and no runtime's dependents change, so the
//   child's own shutdown counts the child's own arenas only. Within one process an arena
//   cannot outlive its runtime (a shutdown refuses while arenas exist), so the check
//   refuses inherited arenas only.
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "stash/arena.h"
#include "stash/stash_kernels.h"
#include "torch_plugin/c_abi/shim.h"
#include "torch_plugin/include/vmstash/vmstash_stash.h"

struct vmstash_stash_arena {
  std::unique_ptr<vmstash::stash::StashArena> arena;
  vmstash::Runtime* owner;  // Note [Arenas Across Fork]
  pid_t pid;                // the process that created it
};

namespace vmstash {
namespace {

static_assert(sizeof(vmstash_stash_flags) == sizeof(stash::StashFlags), "flags layout");

using c_abi::Fail;

// Note [Arenas Across Fork]: whether `arena` belongs to `rt` (the runtime of this call,
// null when there is none) in this process.
bool OwnedHere(const vmstash_stash_arena& arena, const Runtime* rt) {
  return arena.pid == ::getpid() && arena.owner == rt;
}

absl::Status NotOwnedHere(const vmstash_stash_arena& arena) {
  return absl::FailedPreconditionError(absl::StrCat(
      "vmstash stash: this stash arena belongs to the vmstash runtime of process ", arena.pid,
      " (before a fork() or a shutdown); it cannot be used here (process ", ::getpid(),
      "): create the arenas of this runtime anew; vmstash_stash_destroy frees the handle only"));
}

Stream S(cudaStream_t stream) { return reinterpret_cast<Stream>(stream); }
stash::StashHandleHeader* H(void* handle) { return static_cast<stash::StashHandleHeader*>(handle); }

// Runs `fn` on the arena's StashArena, or fails with InvalidArgument for a null arena.
template <typename Fn>
int OnArena(vmstash_stash_arena* arena, Fn fn) noexcept {
  return c_abi::Guard([&](process::Call& call) {
    if (arena == nullptr || arena->arena == nullptr) {
      return Fail(absl::InvalidArgumentError("vmstash stash: null arena"));
    }
    if (!OwnedHere(*arena, call.runtime_if_initialized())) return Fail(NotOwnedHere(*arena));
    absl::Status s = fn(*arena->arena);
    return s.ok() ? 0 : Fail(s);
  });
}

}  // namespace
}  // namespace vmstash

using vmstash::OnArena;
using vmstash::S;
using vmstash::H;
using vmstash::stash::StashArena;

extern "C" {

int vmstash_stash_create(int device, const char* tag, uint64_t row_bytes, uint32_t page_rows,
                         vmstash_stash_arena** out) noexcept {
  return vmstash::c_abi::WithRuntime([&](vmstash::Runtime& rt) {
    if (out == nullptr) return vmstash::c_abi::Fail(absl::InvalidArgumentError("vmstash_stash_create: null out"));
    *out = nullptr;
    absl::StatusOr<vmstash::CachingAllocator*> a = rt.Allocator(device);
    if (!a.ok()) return vmstash::c_abi::Fail(a.status());
    vmstash::stash::StashArenaSpec spec;
    spec.row_bytes = row_bytes;
    spec.page_rows = page_rows;
    if (tag != nullptr && tag[0] != '\0') spec.tag = tag;
    absl::StatusOr<std::unique_ptr<StashArena>> arena = StashArena::Create((*a)->driver(), *a, std::move(spec));
    if (!arena.ok()) return vmstash::c_abi::Fail(arena.status());
    *out = new vmstash_stash_arena{*std::move(arena), &rt, ::getpid()};
    rt.AddDependent(+1);
    return 0;
  });
}

int vmstash_stash_prepare(vmstash_stash_arena* arena, uint64_t device_pages, uint64_t host_pages,
                          cudaStream_t stream) noexcept {
  return OnArena(arena, [&](StashArena& a) { return a.Prepare(device_pages, host_pages, S(stream)); });
}

// Note [Arenas Across Fork]: an arena of another runtime or process loses its handle only.
int vmstash_stash_destroy(vmstash_stash_arena* arena) noexcept {
  // Note [Arenas Across Fork]: an arena of another process or runtime loses its handle only.
  auto drop_handle = [&] {
    (void)arena->arena.release();
    delete arena;
    return 0;
  };
  if (arena == nullptr) return 0;
  if (arena->pid != ::getpid()) return drop_handle();  // inherited: whatever this process's runtime state
  return vmstash::c_abi::WithRuntime([&](vmstash::Runtime& rt) {
    if (!vmstash::OwnedHere(*arena, &rt)) return drop_handle();
    delete arena;
    rt.AddDependent(-1);
    return 0;
  });
}

int vmstash_stash_new_handle(vmstash_stash_arena* arena, uint64_t max_rows, void** out) noexcept {
  return OnArena(arena, [&](StashArena& a) -> absl::Status {
    if (out == nullptr) return absl::InvalidArgumentError("vmstash_stash_new_handle: null out");
    absl::StatusOr<vmstash::stash::StashHandleHeader*> h = a.NewHandle(max_rows);
    if (!h.ok()) return h.status();
    *out = *h;
    return absl::OkStatus();
  });
}

int vmstash_stash_free_handle(vmstash_stash_arena* arena, void* handle) noexcept {
  return OnArena(arena, [&](StashArena& a) { return a.FreeHandle(H(handle)); });
}

int vmstash_stash_reset(vmstash_stash_arena* arena, cudaStream_t stream) noexcept {
  return OnArena(arena, [&](StashArena& a) { return a.Reset(S(stream)); });
}

int vmstash_stash_link_flags(vmstash_stash_arena* arena, cudaStream_t stream, int64_t* overflow,
                             int64_t* host_spill) noexcept {
  return OnArena(arena, [&](StashArena& a) { return a.LinkFlags(S(stream), overflow, host_spill); });
}

int vmstash_stash_set_launch_shape(uint32_t max_grid, uint32_t threads, uint32_t units_in_flight) noexcept {
  if (threads != 0 && (threads < 32 || threads > 1024 || threads % 32 != 0)) {
    return vmstash::c_abi::Fail(absl::InvalidArgumentError(
        absl::StrCat("vmstash_stash_set_launch_shape: threads must be a multiple of 32 in [32, 1024], got ", threads)));
  }
  if (units_in_flight != 0 && units_in_flight != 4 && units_in_flight != 8) {
    return vmstash::c_abi::Fail(absl::InvalidArgumentError(
        absl::StrCat("vmstash_stash_set_launch_shape: units in flight must be 4 or 8, got ", units_in_flight)));
  }
  vmstash::stash::SetLaunchShape(max_grid, threads, units_in_flight);
  return VMSTASH_OK;
}

int vmstash_stash_stash(vmstash_stash_arena* arena, cudaStream_t stream, const void* src, const int64_t* n_rows,
                        uint64_t max_rows, void* handle) noexcept {
  return OnArena(arena, [&](StashArena& a) { return a.Stash(S(stream), src, n_rows, max_rows, H(handle)); });
}

int vmstash_stash_restore(vmstash_stash_arena* arena, cudaStream_t stream, void* handle, void* dst,
                          uint64_t max_rows, int zero_tail) noexcept {
  return OnArena(arena,
                 [&](StashArena& a) { return a.Restore(S(stream), H(handle), dst, max_rows, zero_tail != 0); });
}

int vmstash_stash_discard(vmstash_stash_arena* arena, cudaStream_t stream, void* handle,
                          uint64_t max_rows) noexcept {
  return OnArena(arena, [&](StashArena& a) { return a.Discard(S(stream), H(handle), max_rows); });
}

int vmstash_stash_write_flags(vmstash_stash_arena* arena, cudaStream_t stream, vmstash_stash_flags* out) noexcept {
  return OnArena(arena, [&](StashArena& a) -> absl::Status {
    if (out == nullptr) return absl::InvalidArgumentError("vmstash_stash_write_flags: null out");
    return a.WriteFlags(S(stream), reinterpret_cast<vmstash::stash::StashFlags*>(out));
  });
}

int vmstash_stash_read_flags(vmstash_stash_arena* arena, cudaStream_t stream, vmstash_stash_flags* out) noexcept {
  return OnArena(arena, [&](StashArena& a) -> absl::Status {
    if (out == nullptr) return absl::InvalidArgumentError("vmstash_stash_read_flags: null out");
    absl::StatusOr<vmstash::stash::StashFlags> f = a.ReadFlags(S(stream));
    if (!f.ok()) return f.status();
    *reinterpret_cast<vmstash::stash::StashFlags*>(out) = *f;
    return absl::OkStatus();
  });
}

int vmstash_stash_pages_in_use(vmstash_stash_arena* arena, uint64_t* out) noexcept {
  return OnArena(arena, [&](StashArena& a) -> absl::Status {
    if (out == nullptr) return absl::InvalidArgumentError("vmstash_stash_pages_in_use: null out");
    absl::StatusOr<std::uint64_t> used = a.PagesInUse(nullptr);
    if (!used.ok()) return used.status();
    *out = *used;
    return absl::OkStatus();
  });
}

int vmstash_stash_info(vmstash_stash_arena* arena, uint64_t* device_bytes, const char** executor) noexcept {
  return OnArena(arena, [&](StashArena& a) {
    if (device_bytes != nullptr) *device_bytes = a.device_bytes();
    if (executor != nullptr) *executor = a.ops().Name();
    return absl::OkStatus();
  });
}

}  // extern "C"
