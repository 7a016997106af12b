#include "vmm/reservation.h"

#include <utility>

#include "base/log.h"
#include "base/status_macros.h"

namespace vmstash {

absl::StatusOr<Reservation> Reservation::Create(Driver* driver, int device, std::size_t size_bytes,
                                                std::size_t alignment_bytes) {
  VMSTASH_ASSIGN_OR_RETURN(DevicePtr va, driver->ReserveAddress(device, size_bytes, alignment_bytes));
  return Reservation(driver, device, va, size_bytes);
}

Reservation::~Reservation() {
  absl::Status status = Free();
  if (!status.ok()) VMSTASH_LOG(kError, "Reservation {:#x} not freed: {}", address_, status.ToString());
}

Reservation::Reservation(Reservation&& other) noexcept
    : driver_(std::exchange(other.driver_, nullptr)),
      device_(other.device_),
      address_(std::exchange(other.address_, 0)),
      size_bytes_(std::exchange(other.size_bytes_, 0)) {}

Reservation& Reservation::operator=(Reservation&& other) noexcept {
  if (this != &other) {
    absl::Status status = Free();
    if (!status.ok()) VMSTASH_LOG(kError, "Reservation {:#x} not freed: {}", address_, status.ToString());
    driver_ = std::exchange(other.driver_, nullptr);
    device_ = other.device_;
    address_ = std::exchange(other.address_, 0);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
  }
  return *this;
}

absl::Status Reservation::Free() {
  if (driver_ == nullptr) return absl::OkStatus();
  VMSTASH_RETURN_IF_ERROR(driver_->FreeAddress(device_, address_, size_bytes_));
  driver_ = nullptr;
  address_ = 0;
  size_bytes_ = 0;
  return absl::OkStatus();
}

}  // namespace vmstash
