#include "allocator/backup_arena.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"

namespace vmstash {
namespace {

constexpr std::size_t kUnit = std::size_t{2} << 20;

std::string Errno(int err) { return std::strerror(err); }

bool IsNoRoom(int err) { return err == ENOSPC || err == EDQUOT || err == EFBIG; }

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14; older headers lack it
#endif

// posix_fallocate(fd, 0, size) with SIGXFSZ blocked on this thread, the signal a file size
// limit makes the kernel send consumed when the call fails with EFBIG (Note [Disk Backup]).
// Returns the error number (0 on success), as posix_fallocate does.
int GrowFileWithoutSignal(int fd, off_t size) {
  sigset_t xfsz, previous;
  sigemptyset(&xfsz);
  sigaddset(&xfsz, SIGXFSZ);
  if (const int err = pthread_sigmask(SIG_BLOCK, &xfsz, &previous); err != 0) return err;
  const int err = posix_fallocate(fd, 0, size);
  if (err == EFBIG && sigismember(&previous, SIGXFSZ) == 0) {
    const timespec now{0, 0};
    while (sigtimedwait(&xfsz, nullptr, &now) < 0 && errno == EINTR) {
    }
  }
  pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  return err;
}

// "... the process's file size limit (RLIMIT_FSIZE) is N bytes" when one is set.
std::string FileSizeLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_FSIZE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return "";
  return absl::StrCat("; the process's file size limit (RLIMIT_FSIZE, `ulimit -f`) is ", limit.rlim_cur, " bytes");
}

}  // namespace

absl::StatusOr<BackupStore::Kind> ParseBackupStoreKind(absl::string_view text) {
  if (text == "pinned") return BackupStore::Kind::kPinned;
  if (text == "pageable") return BackupStore::Kind::kPageable;
  if (text == "disk") return BackupStore::Kind::kDisk;
  return absl::InvalidArgumentError(
      absl::StrCat("backup store '", text, "' is not one of pinned, pageable, disk"));
}

absl::string_view BackupStoreKindName(BackupStore::Kind kind) {
  switch (kind) {
    case BackupStore::Kind::kPinned: return "pinned";
    case BackupStore::Kind::kPageable: return "pageable";
    case BackupStore::Kind::kDisk: return "disk";
  }
  return "?";
}

std::string DescribeBackupStore(const BackupStore& store) {
  if (store.kind != BackupStore::Kind::kDisk) return std::string(BackupStoreKindName(store.kind));
  return absl::StrCat("disk:", store.directory);
}

absl::Status CheckBackupStore(const BackupStore& store) {
  if (store.kind != BackupStore::Kind::kDisk) {
    if (store.directory.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("backup store ", BackupStoreKindName(store.kind),
                                                   " takes no directory (got '", store.directory, "')"));
  }
  if (store.directory.empty()) return absl::InvalidArgumentError("backup store disk needs a directory");
  struct stat st;
  if (stat(store.directory.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("disk backup directory '", store.directory, "': ", Errno(errno)));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::NotFoundError(absl::StrCat("disk backup directory '", store.directory, "' is not a directory"));
  }
  return absl::OkStatus();
}

BackupArena::~BackupArena() {
  absl::Status s = Release();
  if (!s.ok()) VMSTASH_LOG(kError, "vmstash: releasing a backup arena: {}", s.ToString());
}

absl::Status BackupArena::Reserve(std::size_t size_bytes) {
  if (size_bytes <= capacity_bytes_) return absl::OkStatus();
  const std::size_t want = (size_bytes + kUnit - 1) / kUnit * kUnit;
  VMSTASH_RETURN_IF_ERROR(Release());
  switch (store_.kind) {
    case BackupStore::Kind::kPinned: {
      VMSTASH_ASSIGN_OR_RETURN(pinned_, PinnedHostBuffer::Allocate(driver_, device_, want));
      break;
    }
    case BackupStore::Kind::kPageable: {
      void* p = mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) {
        return absl::ResourceExhaustedError(
            absl::StrCat("backup arena: mmap of ", want, " bytes failed: ", Errno(errno)));
      }
      mapped_ = p;
      break;
    }
    case BackupStore::Kind::kDisk:
      VMSTASH_RETURN_IF_ERROR(ReserveDisk(want));
      break;
  }
  capacity_bytes_ = want;
  return absl::OkStatus();
}

absl::Status BackupArena::ReserveDisk(std::size_t want) {
  VMSTASH_RETURN_IF_ERROR(CheckBackupStore(store_));
  std::string path = absl::StrCat(store_.directory, "/vmstash-backup-", getpid(), "-XXXXXX");
  std::vector<char> name(path.begin(), path.end());
  name.push_back('\0');
  const int fd = mkostemp(name.data(), O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    std::string what = absl::StrCat("disk backup directory '", store_.directory, "': cannot create a file: ", Errno(err));
    if (err == ENOENT || err == ENOTDIR) return absl::NotFoundError(what);
    if (IsNoRoom(err)) return absl::ResourceExhaustedError(what);
    return absl::FailedPreconditionError(what);
  }
  unlink(name.data());  // Note [Disk Backup]: nothing is left behind
  const std::string file(name.data());
  if (const int err = GrowFileWithoutSignal(fd, static_cast<off_t>(want)); err != 0) {
    close(fd);
    std::string what = absl::StrCat("disk backup file '", file, "' (unlinked) has no room for ", want,
                                    " bytes: ", Errno(err), err == EFBIG ? FileSizeLimit() : "");
    return IsNoRoom(err) ? absl::ResourceExhaustedError(what) : absl::FailedPreconditionError(what);
  }
  void* p = mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return absl::ResourceExhaustedError(absl::StrCat("disk backup in '", store_.directory, "': mmap of ", want,
                                                     " bytes failed: ", Errno(err)));
  }
  fd_ = fd;
  mapped_ = p;
  path_ = file;
  return absl::OkStatus();
}

absl::Status BackupArena::Release() {
  if (store_.kind == BackupStore::Kind::kPinned) {
    if (pinned_.valid()) VMSTASH_RETURN_IF_ERROR(pinned_.Release());
  } else if (mapped_ != nullptr) {
    if (munmap(mapped_, capacity_bytes_) != 0) {
      return absl::InternalError(absl::StrCat("backup arena: munmap failed: ", Errno(errno)));
    }
    mapped_ = nullptr;
  }
  if (fd_ >= 0) {
    close(fd_);  // the file was unlinked at creation: its blocks are freed now
    fd_ = -1;
    path_.clear();
  }
  capacity_bytes_ = 0;
  return absl::OkStatus();
}

absl::Status BackupArena::Seal() {
  if (store_.kind != BackupStore::Kind::kDisk || mapped_ == nullptr) return absl::OkStatus();
  if (msync(mapped_, capacity_bytes_, MS_SYNC) != 0) {
    const int err = errno;
    std::string what = absl::StrCat("disk backup file '", path_, "' (unlinked): writing ", capacity_bytes_,
                                    " bytes back failed: ", Errno(err));
    return IsNoRoom(err) ? absl::ResourceExhaustedError(what) : absl::DataLossError(what);
  }
  DropContents();
  return absl::OkStatus();
}

// Note [Disk Backup]: every page of the file read in, or an error instead of a SIGBUS.
absl::Status BackupArena::Load(std::size_t offset, std::size_t size_bytes) {
  if (store_.kind != BackupStore::Kind::kDisk || mapped_ == nullptr || size_bytes == 0) return absl::OkStatus();
  if (offset > capacity_bytes_ || size_bytes > capacity_bytes_ - offset) {
    return absl::InvalidArgumentError(absl::StrCat("disk backup file '", path_, "': bytes ", offset, "+", size_bytes,
                                                   " lie outside its ", capacity_bytes_, " bytes"));
  }
  // Whole pages around the range (the mapping is page-aligned, its size a page multiple).
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::size_t begin = offset / page * page;
  const std::size_t end = std::min(capacity_bytes_, (offset + size_bytes + page - 1) / page * page);
  struct stat st;
  if (fstat(fd_, &st) != 0) {
    return absl::DataLossError(
        absl::StrCat("disk backup file '", path_, "' (unlinked): cannot stat it: ", Errno(errno)));
  }
  if (static_cast<std::size_t>(st.st_size) < capacity_bytes_) {
    return absl::DataLossError(absl::StrCat("disk backup file '", path_, "' (unlinked) is ", st.st_size,
                                            " bytes, ", capacity_bytes_,
                                            " expected: it was shortened while the tag was paused"));
  }
  absl::Status status;
  if (madvise(static_cast<char*>(mapped_) + begin, end - begin, MADV_POPULATE_READ) != 0) {
    const int err = errno;
    if (err == EINVAL) {
      status = ReadFileThrough(begin, end);
    } else {
      status = absl::DataLossError(absl::StrCat("disk backup file '", path_, "' (unlinked): reading ",
                                                end - begin, " bytes back failed: ", Errno(err)));
    }
  }
  if (!status.ok()) DropContents();
  return status;
}

absl::Status BackupArena::ReadFileThrough(std::size_t begin, std::size_t end) {
  constexpr std::size_t kStep = std::size_t{1} << 20;
  std::vector<char> buffer(kStep);
  for (std::size_t at = begin; at < end;) {
    const ssize_t n = pread(fd_, buffer.data(), std::min(kStep, end - at), static_cast<off_t>(at));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::DataLossError(absl::StrCat("disk backup file '", path_, "' (unlinked): reading at byte ", at,
                                              " failed: ", n == 0 ? "end of file" : Errno(errno)));
    }
    at += static_cast<std::size_t>(n);
  }
  return absl::OkStatus();
}

void BackupArena::DropContents() {
  if (mapped_ == nullptr) return;
  if (store_.kind == BackupStore::Kind::kPageable) {
    madvise(mapped_, capacity_bytes_, MADV_DONTNEED);
  } else if (store_.kind == BackupStore::Kind::kDisk) {
    // Clean shared pages: dropping them loses nothing (the file has the bytes).
    madvise(mapped_, capacity_bytes_, MADV_DONTNEED);
    posix_fadvise(fd_, 0, static_cast<off_t>(capacity_bytes_), POSIX_FADV_DONTNEED);
  }
}

}  // namespace vmstash
