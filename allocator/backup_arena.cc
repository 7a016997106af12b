#include "allocator/backup_arena.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"

namespace vmstash {

BackupArena::~BackupArena() {
  absl::Status s = Release();
  if (!s.ok()) VMSTASH_LOG(kError, "vmstash: releasing a backup arena: {}", s.ToString());
}

absl::Status BackupArena::Reserve(std::size_t size_bytes) {
  constexpr std::size_t kUnit = std::size_t{2} << 20;
  if (size_bytes <= capacity_bytes_) return absl::OkStatus();
  const std::size_t want = (size_bytes + kUnit - 1) / kUnit * kUnit;
  VMSTASH_RETURN_IF_ERROR(Release());
  if (kind_ == Kind::kPinned) {
    VMSTASH_ASSIGN_OR_RETURN(pinned_, PinnedHostBuffer::Allocate(driver_, device_, want));
  } else {
    void* p = mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("backup arena: mmap of ", want, " bytes failed: ", std::strerror(errno)));
    }
    pageable_ = p;
  }
  capacity_bytes_ = want;
  return absl::OkStatus();
}

absl::Status BackupArena::Release() {
  if (kind_ == Kind::kPinned) {
    if (pinned_.valid()) VMSTASH_RETURN_IF_ERROR(pinned_.Release());
  } else if (pageable_ != nullptr) {
    if (munmap(pageable_, capacity_bytes_) != 0) {
      return absl::InternalError(absl::StrCat("backup arena: munmap failed: ", std::strerror(errno)));
    }
    pageable_ = nullptr;
  }
  capacity_bytes_ = 0;
  return absl::OkStatus();
}

void BackupArena::DropContents() {
  if (kind_ == Kind::kPageable && pageable_ != nullptr) madvise(pageable_, capacity_bytes_, MADV_DONTNEED);
}

}  // namespace vmstash
