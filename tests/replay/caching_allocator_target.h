// ReplayTarget for vmstash's CachingAllocator (streams are created on demand per index).
#ifndef VMSTASH_TESTS_REPLAY_CACHING_ALLOCATOR_TARGET_H_
#define VMSTASH_TESTS_REPLAY_CACHING_ALLOCATOR_TARGET_H_

#include <vector>

#include "allocator/caching_allocator.h"
#include "tests/replay/trace.h"

namespace vmstash {

class CachingAllocatorTarget : public ReplayTarget {
 public:
  explicit CachingAllocatorTarget(CachingAllocator* alloc) : alloc_(alloc) {}
  ~CachingAllocatorTarget() override {
    for (Stream s : streams_) {
      if (s != nullptr) (void)alloc_->driver()->DestroyStream(alloc_->device(), s);
    }
  }
  absl::StatusOr<std::uint64_t> Allocate(std::uint64_t size_bytes, int stream) override {
    while (static_cast<int>(streams_.size()) <= stream) {
      if (streams_.empty()) {
        streams_.push_back(nullptr);
        continue;
      }
      absl::StatusOr<Stream> s = alloc_->driver()->CreateStream(alloc_->device());
      if (!s.ok()) return s.status();
      streams_.push_back(*s);
    }
    return alloc_->Allocate(size_bytes, streams_[stream]);
  }
  absl::Status Free(std::uint64_t ptr) override { return alloc_->Free(ptr); }
  std::uint64_t PeakReservedBytes() override { return alloc_->Stats().total.reserved_bytes.peak; }

 private:
  CachingAllocator* alloc_;
  std::vector<Stream> streams_;
};

}  // namespace vmstash

#endif  // VMSTASH_TESTS_REPLAY_CACHING_ALLOCATOR_TARGET_H_
