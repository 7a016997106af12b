// SharedHostMemory: see shared_memory.h.
#include "node/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace vmstash::node {
namespace {

absl::Status Failed(const char* call, int err, std::size_t bytes) {
  std::string message = absl::StrCat("node pool: ", call, " of ", bytes, " bytes: ", std::strerror(err));
  if (err == ENOMEM || err == ENOSPC || err == EFBIG) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedHostMemory>> SharedHostMemory::Create(std::size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("node pool: shared memory of 0 bytes");
  const int fd = ::memfd_create("vmstash-node-pool", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return Failed("memfd_create", errno, bytes);
  // Sealed at its size: no client can shrink it under the others (their pages would
  // SIGBUS) or grow it.
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
      ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    const int err = errno;
    ::close(fd);
    return Failed("ftruncate and seal", err, bytes);
  }
  return MapFd(fd, bytes, /*keep_fd=*/true);
}

absl::StatusOr<std::unique_ptr<SharedHostMemory>> SharedHostMemory::Map(int fd, std::size_t bytes) {
  return MapFd(fd, bytes, /*keep_fd=*/false);
}

absl::StatusOr<std::unique_ptr<SharedHostMemory>> SharedHostMemory::MapFd(int fd, std::size_t bytes, bool keep_fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0 || static_cast<std::size_t>(st.st_size) < bytes) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat("node pool: the shared memory passed is smaller than ", bytes,
                                                   " bytes"));
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  if (p == MAP_FAILED || !keep_fd) ::close(fd);  // a client's mapping keeps the memory alive
  if (p == MAP_FAILED) return Failed("mmap", err, bytes);
  // A client registers it with CUDA: a forked child must not share those pages.
  if (!keep_fd) ::madvise(p, bytes, MADV_DONTFORK);
  return std::unique_ptr<SharedHostMemory>(new SharedHostMemory(
      keep_fd ? fd : -1, static_cast<char*>(p), bytes,
      absl::StrCat(static_cast<std::uint64_t>(st.st_dev), ":", static_cast<std::uint64_t>(st.st_ino), ":", bytes)));
}

SharedHostMemory::~SharedHostMemory() {
  ::munmap(data_, bytes_);
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace vmstash::node
