#include "vmm/chunk.h"

#include <utility>

#include "absl/status/status.h"
#include "base/log.h"
#include "base/status_macros.h"

namespace vmstash {

absl::StatusOr<Chunk> Chunk::Create(Driver* driver, int device, std::size_t size_bytes, ChunkOptions options) {
  VMSTASH_ASSIGN_OR_RETURN(ChunkHandle handle, driver->CreateChunk(device, size_bytes, options));
  return Chunk(driver, device, handle, size_bytes);
}

absl::StatusOr<Chunk> Chunk::Import(Driver* driver, int device, int fd, std::size_t size_bytes) {
  VMSTASH_ASSIGN_OR_RETURN(ChunkHandle handle, driver->ImportChunkFd(device, fd, size_bytes));
  return Chunk(driver, device, handle, size_bytes);
}

Chunk::~Chunk() {
  absl::Status status = Release();
  if (!status.ok()) VMSTASH_LOG(kError, "Chunk {:#x} not released: {}", handle_, status.ToString());
}

Chunk::Chunk(Chunk&& other) noexcept
    : driver_(std::exchange(other.driver_, nullptr)),
      device_(other.device_),
      handle_(std::exchange(other.handle_, 0)),
      size_bytes_(std::exchange(other.size_bytes_, 0)) {}

Chunk& Chunk::operator=(Chunk&& other) noexcept {
  if (this != &other) {
    absl::Status status = Release();
    if (!status.ok()) VMSTASH_LOG(kError, "Chunk {:#x} not released: {}", handle_, status.ToString());
    driver_ = std::exchange(other.driver_, nullptr);
    device_ = other.device_;
    handle_ = std::exchange(other.handle_, 0);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
  }
  return *this;
}

absl::Status Chunk::Release() {
  if (driver_ == nullptr) return absl::OkStatus();
  VMSTASH_RETURN_IF_ERROR(driver_->ReleaseChunk(handle_));
  driver_ = nullptr;
  handle_ = 0;
  size_bytes_ = 0;
  return absl::OkStatus();
}

absl::StatusOr<int> Chunk::ExportFd() const {
  if (driver_ == nullptr) return absl::FailedPreconditionError("ExportFd: empty Chunk");
  return driver_->ExportChunkFd(handle_);
}

}  // namespace vmstash
