// PinnedHostBuffer: RAII page-locked host memory, the only kind of host memory the
// copy engines move at link speed (pageable D2H runs ~30x slower; docs/architecture.md §4).
//
// Two ways to get one: Allocate() (Driver::HostAlloc, pinned by the driver), or Register()
// of memory the caller already owns (Driver::HostRegister; e.g. an mmap-backed arena; the
// buffer then unregisters but never frees it). Pinning costs ~0.46 s/GiB, so owners
// allocate once and reuse. Move-only; the destructor never fails (logs).
#ifndef VMSTASH_VMM_PINNED_HOST_BUFFER_H_
#define VMSTASH_VMM_PINNED_HOST_BUFFER_H_

#include <cstddef>

#include "absl/status/statusor.h"
#include "vmm/driver.h"

namespace vmstash {

class PinnedHostBuffer {
 public:
  PinnedHostBuffer() = default;
  static absl::StatusOr<PinnedHostBuffer> Allocate(Driver* driver, int device, std::size_t size_bytes);
  static absl::StatusOr<PinnedHostBuffer> Register(Driver* driver, int device, void* data, std::size_t size_bytes);
  ~PinnedHostBuffer();
  PinnedHostBuffer(PinnedHostBuffer&& other) noexcept;
  PinnedHostBuffer& operator=(PinnedHostBuffer&& other) noexcept;
  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer& operator=(const PinnedHostBuffer&) = delete;

  // Frees (or unregisters) now; on failure the object still owns the memory.
  absl::Status Release();

  bool valid() const { return driver_ != nullptr; }
  void* data() const { return data_; }
  std::size_t size_bytes() const { return size_bytes_; }
  bool registered() const { return registered_; }

 private:
  PinnedHostBuffer(Driver* driver, int device, void* data, std::size_t size_bytes, bool registered)
      : driver_(driver), device_(device), data_(data), size_bytes_(size_bytes), registered_(registered) {}

  Driver* driver_ = nullptr;
  int device_ = 0;
  void* data_ = nullptr;
  std::size_t size_bytes_ = 0;
  bool registered_ = false;
};

}  // namespace vmstash

#endif  // VMSTASH_VMM_PINNED_HOST_BUFFER_H_
