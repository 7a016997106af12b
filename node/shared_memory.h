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
#include <string>
#include <utility>

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
  // The memfd's identity, the same in every process that maps it ("<dev>:<inode>:<bytes>"):
  // two processes compare it to know they map the same pool (mapped tags' backups,
  // runtime/tag_share.h).
  const std::string& identity() const { return identity_; }

 private:
  SharedHostMemory(int fd, char* data, std::size_t bytes, std::string identity)
      : fd_(fd), data_(data), bytes_(bytes), identity_(std::move(identity)) {}
  static absl::StatusOr<std::unique_ptr<SharedHostMemory>> MapFd(int fd, std::size_t bytes, bool keep_fd);
  const int fd_;
  char* const data_;
  const std::size_t bytes_;
  const std::string identity_;
};

}  // namespace vmstash::node

#endif  // VMSTASH_NODE_SHARED_MEMORY_H_
