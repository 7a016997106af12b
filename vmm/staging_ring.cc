#include "vmm/staging_ring.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"

namespace vmstash {

StagingRing::~StagingRing() {
  absl::Status s = Free();
  if (!s.ok()) VMSTASH_LOG(kError, "vmstash: {}", s.ToString());
}

absl::Status StagingRing::Free() {
  if (base_ == nullptr) return absl::OkStatus();
  // Nothing may still use the slots: the open slot gets its event now (its copies queued
  // without one), or, when that cannot be recorded, its stream is waited for.
  for (Slot& s : slots_) {
    if (s.use != Use::kNone && !s.recorded) s.recorded = driver_->RecordEvent(device_, s.event, s.stream).ok();
    if (s.recorded) {
      (void)driver_->SynchronizeEvent(device_, s.event);
    } else if (s.use != Use::kNone) {
      (void)driver_->SynchronizeStream(device_, s.stream);
    }
  }
  Abandon();
  // The memory first: when the driver does not free it, the ring stays whole (and usable).
  if (absl::Status f = driver_->HostFree(device_, base_); !f.ok()) {
    return absl::Status(f.code(), absl::StrCat("staging ring: freeing its pinned slots: ", f.message()));
  }
  base_ = nullptr;
  for (Slot& s : slots_) {
    absl::Status d = driver_->DestroyEvent(device_, s.event);
    if (!d.ok()) VMSTASH_LOG(kError, "vmstash: staging ring: destroying an event: {}", d.ToString());
  }
  slots_.clear();
  current_ = 0;
  return absl::OkStatus();
}

absl::Status StagingRing::Ready() {
  if (base_ != nullptr) return absl::OkStatus();
  std::vector<Slot> slots(slot_count_);
  absl::Status status;
  int made = 0;
  for (; made < slot_count_ && status.ok(); ++made) {
    absl::StatusOr<Event> e = driver_->CreateEvent(device_, /*timing=*/false);
    if (!e.ok()) {
      status = e.status();
      break;
    }
    slots[made].event = *e;
  }
  absl::StatusOr<void*> mem = status.ok() ? driver_->HostAlloc(device_, slot_bytes_ * slot_count_)
                                          : absl::StatusOr<void*>(status);
  if (!mem.ok()) {
    for (int k = 0; k < made; ++k) (void)driver_->DestroyEvent(device_, slots[k].event);
    return absl::Status(mem.status().code(),
                        absl::StrCat("staging ring of ", slot_count_, " x ", slot_bytes_ >> 20,
                                     " MiB pinned slots on device ", device_, ": ", mem.status().message()));
  }
  base_ = static_cast<char*>(*mem);
  slots_ = std::move(slots);
  current_ = 0;
  return absl::OkStatus();
}

absl::Status StagingRing::Drain(int k) {
  Slot& s = slots_[k];
  absl::Status status;
  if (s.use != Use::kNone) {
    status = s.recorded ? driver_->SynchronizeEvent(device_, s.event)
                        : absl::InternalError("staging ring: a slot in use has no event to wait for");
  }
  // On an error the slot keeps its bytes and destinations: a later Finish() waits again
  // (a switch's rollback needs them), Abandon() forgets them (Note [Staging Ring]).
  if (!status.ok()) return status;
  if (!s.out.empty()) pool_->Copy(s.out);
  s.out.clear();
  s.use = Use::kNone;
  s.recorded = false;
  s.stream = nullptr;
  s.fill = 0;
  return status;
}

absl::Status StagingRing::Room(Use use, Stream stream) {
  Slot& s = slots_[current_];
  if (s.use == Use::kNone || (s.use == use && s.stream == stream && s.fill < slot_bytes_)) {
    s.use = use;
    s.stream = stream;
    return absl::OkStatus();
  }
  if (!s.recorded) {  // ToHost slots get their event when they are closed
    VMSTASH_RETURN_IF_ERROR(driver_->RecordEvent(device_, s.event, s.stream));
    s.recorded = true;
  }
  const int next = (current_ + 1) % slot_count_;
  VMSTASH_RETURN_IF_ERROR(Drain(next));
  current_ = next;
  slots_[next].use = use;
  slots_[next].stream = stream;
  return absl::OkStatus();
}

absl::Status StagingRing::ToHost(void* dst, DevicePtr src, std::size_t size_bytes, Stream stream) {
  if (size_bytes == 0) return absl::OkStatus();
  VMSTASH_RETURN_IF_ERROR(Ready());
  char* to = static_cast<char*>(dst);
  while (size_bytes > 0) {
    VMSTASH_RETURN_IF_ERROR(Room(Use::kToHost, stream));
    Slot& s = slots_[current_];
    const std::size_t take = std::min(size_bytes, slot_bytes_ - s.fill);
    char* at = SlotData(current_) + s.fill;
    VMSTASH_RETURN_IF_ERROR(driver_->CopyToHostAsync(device_, at, src, take, stream));
    s.out.push_back({to, at, take});
    s.fill += take;
    to += take;
    src += take;
    size_bytes -= take;
  }
  return absl::OkStatus();
}

absl::Status StagingRing::Finish() {
  if (base_ == nullptr) return absl::OkStatus();
  Slot& cur = slots_[current_];
  absl::Status status;
  if (cur.use == Use::kToHost && !cur.recorded) {
    status = driver_->RecordEvent(device_, cur.event, cur.stream);
    cur.recorded = status.ok();
  }
  // Oldest first, the current slot last.
  for (int i = 1; i <= slot_count_; ++i) {
    const int k = (current_ + i) % slot_count_;
    if (slots_[k].use != Use::kToHost) continue;
    absl::Status drained = Drain(k);
    if (status.ok()) status = drained;
  }
  return status;
}

absl::Status StagingRing::ToDevice(DevicePtr dst, const void* src, std::size_t size_bytes, Stream stream) {
  if (size_bytes == 0) return absl::OkStatus();
  VMSTASH_RETURN_IF_ERROR(Ready());
  const char* from = static_cast<const char*>(src);
  while (size_bytes > 0) {
    VMSTASH_RETURN_IF_ERROR(Room(Use::kToDevice, stream));
    Slot& s = slots_[current_];
    const std::size_t take = std::min(size_bytes, slot_bytes_ - s.fill);
    char* at = SlotData(current_) + s.fill;
    pool_->Copy({{at, from, take}});
    VMSTASH_RETURN_IF_ERROR(driver_->CopyToDeviceAsync(device_, dst, at, take, stream));
    s.fill += take;
    // Recorded after every copy out of the slot: the next use waits for all of them.
    absl::Status recorded = driver_->RecordEvent(device_, s.event, stream);
    s.recorded = s.recorded || recorded.ok();
    VMSTASH_RETURN_IF_ERROR(recorded);
    from += take;
    dst += take;
    size_bytes -= take;
  }
  return absl::OkStatus();
}

void StagingRing::Abandon() {
  for (Slot& s : slots_) {
    s.out.clear();
    s.use = Use::kNone;
    s.recorded = false;
    s.stream = nullptr;
    s.fill = 0;
  }
}

bool StagingRing::has_pending() const {
  return std::any_of(slots_.begin(), slots_.end(), [](const Slot& s) { return !s.out.empty(); });
}

}  // namespace vmstash
