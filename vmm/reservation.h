// Reservation: RAII owner of one VA range (Driver::ReserveAddress/FreeAddress).
//
// Move-only. The destructor frees the range and never fails: if the driver refuses (a
// mapping is still inside, say), it logs the error and the range stays reserved; call
// Free() to see the status. A default-constructed or moved-from Reservation owns nothing.
#ifndef VMSTASH_VMM_RESERVATION_H_
#define VMSTASH_VMM_RESERVATION_H_

#include <cstddef>

#include "absl/status/statusor.h"
#include "vmm/driver.h"

namespace vmstash {

class Reservation {
 public:
  Reservation() = default;
  // `alignment_bytes` 0 means the granularity.
  static absl::StatusOr<Reservation> Create(Driver* driver, int device, std::size_t size_bytes,
                                            std::size_t alignment_bytes = 0);
  ~Reservation();
  Reservation(Reservation&& other) noexcept;
  Reservation& operator=(Reservation&& other) noexcept;
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;

  // Frees the range now; on failure the object still owns it.
  absl::Status Free();

  bool valid() const { return driver_ != nullptr; }
  DevicePtr address() const { return address_; }
  std::size_t size_bytes() const { return size_bytes_; }
  int device() const { return device_; }
  bool Contains(DevicePtr va, std::size_t size_bytes) const {
    return va >= address_ && size_bytes <= size_bytes_ && va - address_ <= size_bytes_ - size_bytes;
  }

 private:
  Reservation(Driver* driver, int device, DevicePtr address, std::size_t size_bytes)
      : driver_(driver), device_(device), address_(address), size_bytes_(size_bytes) {}

  Driver* driver_ = nullptr;
  int device_ = 0;
  DevicePtr address_ = 0;
  std::size_t size_bytes_ = 0;
};

}  // namespace vmstash

#endif  // VMSTASH_VMM_RESERVATION_H_
