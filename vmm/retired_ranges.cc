// RetiredRanges: see retired_ranges.h.
#include "vmm/retired_ranges.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/log.h"

namespace vmstash {
namespace {

void Unmap(void* p, std::size_t n) {
  if (munmap(p, n) != 0) {
    VMSTASH_LOG(kError, "vmstash: unmapping a retired backup range of {} bytes: {}", n, std::strerror(errno));
  }
}

}  // namespace

RetiredRanges& RetiredRanges::Process() {
  static auto* process = new RetiredRanges(std::size_t{256} << 30, 64);  // leaked: used until exit
  return *process;
}

absl::Status RetiredRanges::Retire(void* p, std::size_t size_bytes) {
  if (p == nullptr || size_bytes == 0) return absl::OkStatus();
  // One call: the old pages are dropped and the addresses stay taken (Note [Retired Ranges]).
  void* r = mmap(p, size_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
  if (r == MAP_FAILED) {
    const int err = errno;
    if (munmap(p, size_bytes) != 0) {
      return absl::InternalError(absl::StrCat("backup memory: munmap failed: ", std::strerror(errno)));
    }
    VMSTASH_LOG(kWarning, "vmstash: backup memory of {} bytes unmapped instead of kept reserved ({}): its "
                "addresses may be reused", size_bytes, std::strerror(err));
    return absl::OkStatus();
  }
  std::vector<std::pair<void*, std::size_t>> evicted;
  {
    MutexLock lock(&mu_);
    retired_.emplace_back(p, size_bytes);
    bytes_ += size_bytes;
    while (retired_.size() > 1 && (bytes_ > max_bytes_ || retired_.size() > max_ranges_)) {
      evicted.push_back(retired_.front());
      bytes_ -= retired_.front().second;
      retired_.pop_front();
    }
  }
  for (const auto& [q, n] : evicted) Unmap(q, n);  // out of the list: nobody else touches them
  return absl::OkStatus();
}

void RetiredRanges::Clear() {
  std::deque<std::pair<void*, std::size_t>> all;
  {
    MutexLock lock(&mu_);
    all.swap(retired_);
    bytes_ = 0;
  }
  for (const auto& [p, n] : all) Unmap(p, n);
}

std::size_t RetiredRanges::bytes() const {
  MutexLock lock(&mu_);
  return bytes_;
}

std::size_t RetiredRanges::ranges() const {
  MutexLock lock(&mu_);
  return retired_.size();
}

}  // namespace vmstash
