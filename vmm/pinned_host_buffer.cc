#include "vmm/pinned_host_buffer.h"

#include <utility>

#include "absl/status/status.h"
#include "base/log.h"
#include "base/status_macros.h"

namespace vmstash {

absl::StatusOr<PinnedHostBuffer> PinnedHostBuffer::Allocate(Driver* driver, int device, std::size_t size_bytes) {
  VMSTASH_ASSIGN_OR_RETURN(void* data, driver->HostAlloc(device, size_bytes));
  return PinnedHostBuffer(driver, device, data, size_bytes, /*registered=*/false);
}

absl::StatusOr<PinnedHostBuffer> PinnedHostBuffer::Register(Driver* driver, int device, void* data,
                                                            std::size_t size_bytes) {
  VMSTASH_RETURN_IF_ERROR(driver->HostRegister(device, data, size_bytes));
  return PinnedHostBuffer(driver, device, data, size_bytes, /*registered=*/true);
}

PinnedHostBuffer::~PinnedHostBuffer() {
  absl::Status status = Release();
  if (!status.ok()) VMSTASH_LOG(kError, "PinnedHostBuffer not released: {}", status.ToString());
}

PinnedHostBuffer::PinnedHostBuffer(PinnedHostBuffer&& other) noexcept
    : driver_(std::exchange(other.driver_, nullptr)),
      device_(other.device_),
      data_(std::exchange(other.data_, nullptr)),
      size_bytes_(std::exchange(other.size_bytes_, 0)),
      registered_(other.registered_) {}

PinnedHostBuffer& PinnedHostBuffer::operator=(PinnedHostBuffer&& other) noexcept {
  if (this != &other) {
    absl::Status status = Release();
    if (!status.ok()) VMSTASH_LOG(kError, "PinnedHostBuffer not released: {}", status.ToString());
    driver_ = std::exchange(other.driver_, nullptr);
    device_ = other.device_;
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
    registered_ = other.registered_;
  }
  return *this;
}

absl::Status PinnedHostBuffer::Release() {
  if (driver_ == nullptr) return absl::OkStatus();
  VMSTASH_RETURN_IF_ERROR(registered_ ? driver_->HostUnregister(device_, data_) : driver_->HostFree(device_, data_));
  driver_ = nullptr;
  data_ = nullptr;
  size_bytes_ = 0;
  return absl::OkStatus();
}

}  // namespace vmstash
