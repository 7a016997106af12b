// RetiredRanges: how backup memory gives its host address range back (PinnedPieces::
// Release, vmm/pinned_pieces.h) so that the addresses are not handed out again at once.
//
// Note [Retired Ranges]
//   Why: a caller may still hold an address into a released backup (torch_memory_saver's
//   get_cpu_backup(zero_copy=True) wraps one in a tensor; allocator/tag_pool.h, Note
//   [Retained Backups]). After a munmap the next mapping of the process could take those
//   addresses: a moment later the background preparation of another tag (allocator/
//   auto_preparer.h) maps its arena, of the same size or larger, at the top of the gap the
//   release opened, and pins it. The stale address is then page-locked again
//   (cudaHostGetFlags succeeds: the released backup looks alive) and reads or writes
//   another backup's bytes.
//   So Retire() replaces the range in one call, mmap(MAP_FIXED) of an inaccessible
//   (PROT_NONE, MAP_NORESERVE) anonymous mapping: its pages go back to the OS as with
//   munmap, nothing of it is registered, no other mapping can be placed there — no gap
//   opens in between, as munmap followed by a new mmap would leave to the other threads —
//   and a stale access faults instead of reaching other data.
//   Bound: only address space is kept. Beyond max_bytes (or max_ranges) retired in all,
//   the oldest ranges are unmapped, the newest always kept: a released backup's addresses
//   stay unused until that much more was released after it (Process(): 256 GiB, 64 ranges,
//   of the 128 TiB of a 47-bit address space).
//   A forked child inherits the retired mappings (they are not MADV_DONTFORK) with the
//   list, so the two agree there too. When the replacement fails (the kernel's limit on
//   mappings), the range is unmapped as before, with a warning.
//
// Thread-safety: thread-safe (one mutex; munmaps run outside it).
#ifndef VMSTASH_VMM_RETIRED_RANGES_H_
#define VMSTASH_VMM_RETIRED_RANGES_H_

#include <cstddef>
#include <deque>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "base/mutex.h"

namespace vmstash {

class RetiredRanges {
 public:
  RetiredRanges(std::size_t max_bytes, std::size_t max_ranges) : max_bytes_(max_bytes), max_ranges_(max_ranges) {}
  // Leaves its ranges mapped (the process's own instance is never destroyed).
  ~RetiredRanges() = default;
  RetiredRanges(const RetiredRanges&) = delete;
  RetiredRanges& operator=(const RetiredRanges&) = delete;

  // The instance the process's backup memory uses.
  static RetiredRanges& Process();

  // [p, p + size_bytes): a whole mapping of this process, page-aligned, of which nothing is
  // registered with the driver any more. Its pages go back to the OS and its addresses
  // stay reserved (see the Note). Internal only when the range could not be unmapped either.
  absl::Status Retire(void* p, std::size_t size_bytes);
  // Unmaps every retired range (tests).
  void Clear();

  std::size_t bytes() const;
  std::size_t ranges() const;

 private:
  const std::size_t max_bytes_;
  const std::size_t max_ranges_;
  mutable Mutex mu_;
  std::deque<std::pair<void*, std::size_t>> retired_ ABSL_GUARDED_BY(mu_);  // oldest first
  std::size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace vmstash

#endif  // VMSTASH_VMM_RETIRED_RANGES_H_
