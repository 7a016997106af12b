// SharedHostMemory: host memory several processes map at once — the node pool's pages
// (docs/node.md): a memfd the daemon makes, sizes and seals at that size (no process can
// shrink it under the others), passed to each client over its socket (SCM_RIGHTS) and
// mapped MAP_SHARED there, so every process sees the same pages.
//
// Nothing is touched or pinned here: pages come into being where a client first writes
// them (and count toward that process's memory cgroup: shmem), and each client registers
// its own mapping with CUDA. The memory lives while any process keeps the fd or a mapping.
//
// Thread-safety: immutable after construction; the bytes are the users' to order.
#ifndef VMSTASH_NODE_SHARED_MEMORY_H_
#define VMSTASH_NODE_SHARED_MEMORY_H_

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"

namespace vmstash::node {

class SharedHostMemory {
 public:
  // A new memfd of `bytes`, mapped here. ResourceExhausted / Internal with the call that failed.
  static absl::StatusOr<std::unique_ptr<SharedHostMemory>> Create(std::size_t bytes);
  // Maps `fd` (of at least `bytes`; taken over: closed once mapped, or on failure — the
  // mapping keeps the memory, and a forked child inherits no descriptor of it; fd() is -1).
  // The mapping is MADV_DONTFORK: a client registers it with CUDA, and a forked child
  // must not share registered pages.
  static absl::StatusOr<std::unique_ptr<SharedHostMemory>> Map(int fd, std::size_t bytes);
  ~SharedHostMemory();  // unmaps, closes
  SharedHostMemory(const SharedHostMemory&) = delete;
  SharedHostMemory& operator=(const SharedHostMemory&) = delete;

  char* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  int fd() const { return fd_; }  // Create's: to pass to another process (it stays ours); Map's: -1

 private:
  SharedHostMemory(int fd, char* data, std::size_t bytes) : fd_(fd), data_(data), bytes_(bytes) {}
  static absl::StatusOr<std::unique_ptr<SharedHostMemory>> MapFd(int fd, std::size_t bytes, bool keep_fd);
  const int fd_;
  char* const data_;
  const std::size_t bytes_;
};

}  // namespace vmstash::node

#endif  // VMSTASH_NODE_SHARED_MEMORY_H_
