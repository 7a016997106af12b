// StashArena: see arena.h.
#include "stash/arena.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/mutex.h"
#include "base/status_macros.h"

namespace vmstash::stash {

struct StashArena::HookGuard {
  Mutex mu;
  StashArena* arena ABSL_GUARDED_BY(mu) = nullptr;
};

absl::StatusOr<std::unique_ptr<StashArena>> StashArena::Create(Driver* driver, CachingAllocator* allocator,
                                                               StashArenaSpec spec) {
  if (driver == nullptr || allocator == nullptr) return absl::InvalidArgumentError("StashArena: null driver/allocator");
  if (spec.row_bytes == 0) return absl::InvalidArgumentError("StashArena: row_bytes must be > 0");
  if (spec.page_rows == 0 || (spec.page_rows & (spec.page_rows - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("StashArena: page_rows must be a power of two, got ",
                                                   spec.page_rows));
  }
  if (spec.row_bytes > ~std::uint64_t{0} / spec.page_rows) {
    return absl::InvalidArgumentError(absl::StrCat("StashArena: a page of ", spec.page_rows, " rows of ",
                                                   spec.row_bytes, " bytes overflows 64 bits"));
  }
  VMSTASH_ASSIGN_OR_RETURN(TagId tag, InternTag(spec.tag));
  absl::Status created = allocator->CreateTag(tag, Policy::kDiscard);
  if (!created.ok()) return created;
  auto arena = std::unique_ptr<StashArena>(new StashArena(driver, allocator, std::move(spec), tag));
  // Refuse a pause while pages are in use: the allocator has synchronized nothing yet when
  // the hook runs, so the hook waits for the device before it reads the state block. The
  // hook outlives the arena (the allocator keeps it), hence the guard.
  arena->hook_guard_ = std::make_shared<HookGuard>();
  {
    MutexLock lock(&arena->hook_guard_->mu);
    arena->hook_guard_->arena = arena.get();
  }
  VMSTASH_RETURN_IF_ERROR(allocator->AddHooks(
      tag,
      [guard = arena->hook_guard_](TagId, int) -> absl::Status {
        MutexLock lock(&guard->mu);
        StashArena* self = guard->arena;
        if (self == nullptr || !self->prepared_) return absl::OkStatus();
        absl::StatusOr<std::uint64_t> used = self->PagesInUse(nullptr);
        if (!used.ok()) return used.status();
        if (*used != 0) {
          return absl::FailedPreconditionError(absl::StrCat("stash arena '", self->spec_.tag, "' holds ", *used,
                                                            " page(s) of live activations; restore or discard "
                                                            "them (or reset) before pausing"));
        }
        return absl::OkStatus();
      },
      nullptr));
  return arena;
}

StashArena::StashArena(Driver* driver, CachingAllocator* allocator, StashArenaSpec spec, TagId tag)
    : driver_(driver),
      allocator_(allocator),
      spec_(std::move(spec)),
      tag_(tag),
      ops_(spec_.ops != nullptr ? spec_.ops : (driver->Name() == "sim" ? &HostStashOps() : &KernelStashOps())),
      device_(allocator->device()) {}

StashArena::~StashArena() {
  if (hook_guard_ != nullptr) {
    MutexLock lock(&hook_guard_->mu);
    hook_guard_->arena = nullptr;
  }
  ReleaseMemory();
}

void StashArena::ReleaseMemory() {
  for (DevicePtr* p : {&device_pages_, &device_free_list_, &host_free_list_, reinterpret_cast<DevicePtr*>(&state_),
                       reinterpret_cast<DevicePtr*>(&flags_scratch_)}) {
    if (*p == 0) continue;
    absl::Status s = allocator_->Free(*p);
    if (!s.ok()) VMSTASH_LOG(kError, "vmstash: stash arena teardown: {}", s.ToString());
    *p = 0;
  }
  if (host_pages_ != nullptr) {
    absl::Status s = driver_->HostFree(device_, host_pages_);
    if (!s.ok()) VMSTASH_LOG(kError, "vmstash: stash arena host tier: {}", s.ToString());
    host_pages_ = nullptr;
  }
  prepared_ = false;
}

namespace {
CUstream_st* Cu(Stream stream) { return reinterpret_cast<CUstream_st*>(stream); }
}  // namespace

absl::Status StashArena::Launched(int code, const char* what) const {
  if (code == 0) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("stash ", what, " (", ops_->Name(), "): CUDA launch error ", code));
}

absl::Status StashArena::Prepare(std::uint64_t device_pages, std::uint64_t host_pages, Stream stream) {
  if (prepared_) return absl::FailedPreconditionError("StashArena::Prepare: already prepared");
  if (device_pages == 0) return absl::InvalidArgumentError("StashArena::Prepare: the device tier needs pages");
  for (std::uint64_t cap : {device_pages, host_pages}) {
    if (cap > 0xffffffffull) return absl::InvalidArgumentError("StashArena::Prepare: page ids are 32-bit");
  }
  const std::uint64_t page_bytes = spec_.page_rows * spec_.row_bytes;
  if (device_pages > ~std::uint64_t{0} / page_bytes || host_pages > ~std::uint64_t{0} / page_bytes) {
    return absl::InvalidArgumentError("StashArena::Prepare: the arena's size overflows 64 bits");
  }
  absl::Status s = Allocate(device_pages, host_pages, page_bytes, stream);
  if (!s.ok()) {
    ReleaseMemory();  // nothing half-prepared stays behind; Prepare may be retried
    return s;
  }
  prepared_ = true;
  s = Reset(stream);
  if (!s.ok()) ReleaseMemory();
  return s;
}

absl::Status StashArena::Allocate(std::uint64_t device_pages, std::uint64_t host_pages, std::uint64_t page_bytes,
                                  Stream stream) {
  auto alloc = [&](std::uint64_t bytes) { return allocator_->Allocate(bytes, stream, tag_); };
  VMSTASH_ASSIGN_OR_RETURN(device_pages_, alloc(device_pages * page_bytes));
  device_bytes_ = device_pages * page_bytes;
  VMSTASH_ASSIGN_OR_RETURN(device_free_list_, alloc(device_pages * sizeof(std::uint32_t)));
  if (host_pages != 0) {
    VMSTASH_ASSIGN_OR_RETURN(host_free_list_, alloc(host_pages * sizeof(std::uint32_t)));
    VMSTASH_ASSIGN_OR_RETURN(host_pages_, driver_->HostAlloc(device_, host_pages * page_bytes));
  }
  VMSTASH_ASSIGN_OR_RETURN(DevicePtr state, alloc(sizeof(StashState)));
  state_ = reinterpret_cast<StashState*>(state);
  VMSTASH_ASSIGN_OR_RETURN(DevicePtr flags, alloc(sizeof(StashFlags)));
  flags_scratch_ = reinterpret_cast<StashFlags*>(flags);
  host_state_ = StashState{};
  host_state_.tier[0] = {reinterpret_cast<std::uint32_t*>(device_free_list_),
                         reinterpret_cast<std::uint8_t*>(device_pages_), 0, device_pages, device_pages};
  host_state_.tier[1] = {reinterpret_cast<std::uint32_t*>(host_free_list_), static_cast<std::uint8_t*>(host_pages_),
                         0, host_pages, host_pages};
  host_state_.page_rows = spec_.page_rows;
  host_state_.row_bytes = spec_.row_bytes;
  max_cap_ = device_pages > host_pages ? device_pages : host_pages;
  return absl::OkStatus();
}

absl::StatusOr<StashHandleHeader*> StashArena::NewHandle(std::uint64_t max_rows) {
  if (max_rows > ~std::uint64_t{0} / spec_.row_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("StashArena::NewHandle: ", max_rows, " rows of ", spec_.row_bytes,
                                                   " bytes overflow 64 bits"));
  }
  const std::uint64_t slots = (max_rows + spec_.page_rows - 1) / spec_.page_rows;
  VMSTASH_ASSIGN_OR_RETURN(DevicePtr p, allocator_->Allocate(sizeof(StashHandleHeader) + slots * sizeof(std::uint32_t),
                                                             nullptr, tag_));
  StashHandleHeader header{};
  absl::Status s = driver_->CopyToDeviceAsync(device_, p, &header, sizeof(header), nullptr);
  if (s.ok()) s = driver_->SynchronizeStream(device_, nullptr);
  if (!s.ok()) {
    absl::Status freed = allocator_->Free(p);
    if (!freed.ok()) VMSTASH_LOG(kError, "vmstash: stash handle rollback: {}", freed.ToString());
    return s;
  }
  auto* handle = reinterpret_cast<StashHandleHeader*>(p);
  handles_[handle] = HandleInfo{max_rows, 0};
  return handle;
}

absl::Status StashArena::FreeHandle(StashHandleHeader* handle) {
  auto it = handles_.find(handle);
  if (it == handles_.end()) {
    return absl::InvalidArgumentError("StashArena::FreeHandle: not a live handle of this arena");
  }
  VMSTASH_RETURN_IF_ERROR(allocator_->Free(reinterpret_cast<DevicePtr>(handle)));
  handles_.erase(it);
  return absl::OkStatus();
}

absl::StatusOr<StashArena::HandleInfo*> StashArena::CheckHandle(StashHandleHeader* handle, std::uint64_t max_rows,
                                                                const char* what) {
  auto it = handles_.find(handle);
  if (handle == nullptr || it == handles_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("StashArena::", what, ": not a live handle of this arena"));
  }
  if (max_rows > it->second.max_rows) {
    return absl::InvalidArgumentError(absl::StrCat("StashArena::", what, ": max_rows ", max_rows,
                                                   " is more than the handle was created for (",
                                                   it->second.max_rows, ")"));
  }
  return &it->second;
}

absl::Status StashArena::Reset(Stream stream) {
  if (!prepared_) return absl::FailedPreconditionError("StashArena: Prepare first");
  VMSTASH_RETURN_IF_ERROR(Launched(ops_->Reset(Cu(stream), state_, host_state_, max_cap_), "reset"));
  ++epoch_;  // every page is free again: handles stashed before hold none
  return absl::OkStatus();
}

absl::Status StashArena::LinkFlags(Stream stream, std::int64_t* overflow, std::int64_t* host_spill) {
  if (!prepared_) return absl::FailedPreconditionError("StashArena: Prepare first");
  StashState before = host_state_;
  host_state_.linked_overflow = overflow;
  host_state_.linked_host_spill = host_spill;
  absl::Status s = Reset(stream);
  if (!s.ok()) {
    host_state_ = before;
    return s;
  }
  return absl::OkStatus();
}

absl::Status StashArena::Stash(Stream stream, const void* src, const std::int64_t* n_rows_dev, std::uint64_t max_rows,
                               StashHandleHeader* handle) {
  if (!prepared_) return absl::FailedPreconditionError("StashArena: Prepare first");
  if (handle == nullptr || n_rows_dev == nullptr || (src == nullptr && max_rows != 0)) {
    return absl::InvalidArgumentError("StashArena::Stash: null argument");
  }
  VMSTASH_ASSIGN_OR_RETURN(HandleInfo * info, CheckHandle(handle, max_rows, "Stash"));
  if (info->stashed_epoch == epoch_) {
    return absl::FailedPreconditionError(
        "StashArena::Stash: the handle still holds a stashed tensor; restore or discard it first");
  }
  VMSTASH_RETURN_IF_ERROR(
      Launched(ops_->Stash(Cu(stream), state_, host_state_, src, n_rows_dev, max_rows, handle), "stash"));
  info->stashed_epoch = epoch_;
  return absl::OkStatus();
}

absl::Status StashArena::Restore(Stream stream, StashHandleHeader* handle, void* dst, std::uint64_t max_rows,
                                 bool zero_tail) {
  if (!prepared_) return absl::FailedPreconditionError("StashArena: Prepare first");
  if (handle == nullptr || (dst == nullptr && max_rows != 0)) {
    return absl::InvalidArgumentError("StashArena::Restore: null argument");
  }
  VMSTASH_ASSIGN_OR_RETURN(HandleInfo * info, CheckHandle(handle, max_rows, "Restore"));
  VMSTASH_RETURN_IF_ERROR(CheckStashed(*info, "Restore"));
  VMSTASH_RETURN_IF_ERROR(
      Launched(ops_->Restore(Cu(stream), state_, host_state_, handle, dst, max_rows, zero_tail), "restore"));
  info->stashed_epoch = 0;
  return absl::OkStatus();
}

absl::Status StashArena::Discard(Stream stream, StashHandleHeader* handle, std::uint64_t max_rows) {
  if (!prepared_) return absl::FailedPreconditionError("StashArena: Prepare first");
  if (handle == nullptr) return absl::InvalidArgumentError("StashArena::Discard: null handle");
  VMSTASH_ASSIGN_OR_RETURN(HandleInfo * info, CheckHandle(handle, max_rows, "Discard"));
  VMSTASH_RETURN_IF_ERROR(CheckStashed(*info, "Discard"));
  VMSTASH_RETURN_IF_ERROR(Launched(ops_->Discard(Cu(stream), state_, host_state_, handle, max_rows), "discard"));
  info->stashed_epoch = 0;
  return absl::OkStatus();
}

absl::Status StashArena::CheckStashed(const HandleInfo& info, const char* what) const {
  // A handle holding nothing (never stashed, or restored/discarded already) is a no-op
  // for the kernels; one stashed before the latest Reset would give pages back twice.
  if (info.stashed_epoch == 0 || info.stashed_epoch == epoch_) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "StashArena::", what, ": the handle was stashed before the last reset, which took its pages back; "
      "stash it again (a reset invalidates every stashed tensor not yet restored)"));
}

absl::Status StashArena::WriteFlags(Stream stream, StashFlags* out) {
  if (!prepared_) return absl::FailedPreconditionError("StashArena: Prepare first");
  return Launched(ops_->ReadFlags(Cu(stream), state_, out), "flags");
}

absl::StatusOr<StashFlags> StashArena::ReadFlags(Stream stream) {
  VMSTASH_RETURN_IF_ERROR(WriteFlags(stream, flags_scratch_));
  StashFlags out{};
  VMSTASH_RETURN_IF_ERROR(
      driver_->CopyToHostAsync(device_, &out, reinterpret_cast<DevicePtr>(flags_scratch_), sizeof(out), stream));
  VMSTASH_RETURN_IF_ERROR(driver_->SynchronizeStream(device_, stream));
  return out;
}

absl::StatusOr<std::uint64_t> StashArena::PagesInUse(Stream stream) {
  if (!prepared_) return 0;
  VMSTASH_RETURN_IF_ERROR(driver_->SynchronizeDevice(device_));
  StashState now{};
  VMSTASH_RETURN_IF_ERROR(
      driver_->CopyToHostAsync(device_, &now, reinterpret_cast<DevicePtr>(state_), sizeof(now), stream));
  VMSTASH_RETURN_IF_ERROR(driver_->SynchronizeStream(device_, stream));
  std::uint64_t used = 0;
  for (const StashTier& t : now.tier) used += t.cap - (t.tail - t.head);
  return used;
}

}  // namespace vmstash::stash
