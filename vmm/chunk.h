// Chunk: RAII owner of one physical allocation (Driver::CreateChunk/ReleaseChunk).
//
// A chunk is always mapped whole (see Mapping). Releasing a chunk that is still mapped is
// allowed: the memory is freed at its last unmap. Move-only; the destructor releases and
// never fails (it logs a refused release; Release() returns the status).
#ifndef VMSTASH_VMM_CHUNK_H_
#define VMSTASH_VMM_CHUNK_H_

#include <cstddef>

#include "absl/status/statusor.h"
#include "vmm/driver.h"

namespace vmstash {

class Chunk {
 public:
  Chunk() = default;
  static absl::StatusOr<Chunk> Create(Driver* driver, int device, std::size_t size_bytes,
                                      ChunkOptions options = {});
  // A chunk exported by another process (Driver::ImportChunkFd): its own handle of that
  // memory, released like any. `fd` stays the caller's.
  static absl::StatusOr<Chunk> Import(Driver* driver, int device, int fd, std::size_t size_bytes);
  ~Chunk();
  Chunk(Chunk&& other) noexcept;
  Chunk& operator=(Chunk&& other) noexcept;
  Chunk(const Chunk&) = delete;
  Chunk& operator=(const Chunk&) = delete;

  absl::Status Release();
  // A new POSIX file descriptor for a chunk created with shareable_fd; the caller closes it.
  absl::StatusOr<int> ExportFd() const;

  bool valid() const { return driver_ != nullptr; }
  ChunkHandle handle() const { return handle_; }
  std::size_t size_bytes() const { return size_bytes_; }
  int device() const { return device_; }

 private:
  Chunk(Driver* driver, int device, ChunkHandle handle, std::size_t size_bytes)
      : driver_(driver), device_(device), handle_(handle), size_bytes_(size_bytes) {}

  Driver* driver_ = nullptr;
  int device_ = 0;
  ChunkHandle handle_ = 0;
  std::size_t size_bytes_ = 0;
};

}  // namespace vmstash

#endif  // VMSTASH_VMM_CHUNK_H_
