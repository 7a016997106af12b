// BackupArena: host memory holding a paused `backup` tag's live bytes (docs/architecture.md §2, §5).
//
// Pinned (default): page-locked once through the driver and reused across pause/resume
// cycles, so copies run at link speed; pinning costs ~0.4 s/GiB, which is why Prepare()
// exists: pin ahead of the first pause. Pageable (option backup:pageable): an anonymous
// mmap for users short of host RAM; copies are slower, and after a resume its pages are
// given back to the OS (MADV_DONTNEED) so the RSS drops.
//
// Reserve(n) keeps the memory when it is already large enough, else replaces it (the old
// contents are not kept: callers reserve before copying). Release() gives it back.
//
// Thread-safety: none; the owning tag's transition lock guards it.
#ifndef VMSTASH_ALLOCATOR_BACKUP_ARENA_H_
#define VMSTASH_ALLOCATOR_BACKUP_ARENA_H_

#include <cstddef>

#include "absl/status/status.h"
#include "vmm/driver.h"
#include "vmm/pinned_host_buffer.h"

namespace vmstash {

class BackupArena {
 public:
  enum class Kind { kPinned, kPageable };

  BackupArena(Driver* driver, int device, Kind kind) : driver_(driver), device_(device), kind_(kind) {}
  ~BackupArena();
  BackupArena(const BackupArena&) = delete;
  BackupArena& operator=(const BackupArena&) = delete;

  // Capacity >= size_bytes (rounded up to 2 MiB). ResourceExhausted when the host refuses.
  absl::Status Reserve(std::size_t size_bytes);
  absl::Status Release();
  // Pageable arenas: returns the pages to the OS (contents lost). No-op when pinned.
  void DropContents();

  char* data() const { return static_cast<char*>(kind_ == Kind::kPinned ? pinned_.data() : pageable_); }
  std::size_t capacity_bytes() const { return capacity_bytes_; }

 private:
  Driver* const driver_;
  const int device_;
  const Kind kind_;
  PinnedHostBuffer pinned_;
  void* pageable_ = nullptr;
  std::size_t capacity_bytes_ = 0;
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_BACKUP_ARENA_H_
