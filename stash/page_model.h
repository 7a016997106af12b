// PageModel: the CPU reference model of the paged stash tier's page manager and copies
// (docs/architecture.md §6). Same semantics as the device state
// block and kernels, on host memory, so CI tests the semantics without a GPU and the GPU
// tests use it as their oracle.
//
// An arena of one page class: page = P rows (power of two) of row_bytes each; tier 0 =
// device, tier 1 = host (capacity 0: absent). Per tier a circular FIFO free list of u32
// page ids with monotonic u64 head/tail (free = tail - head; slot = counter mod cap).
//   Stash(rows of src, max_rows, handle): needs ceil(n/P) pages; takes them all from the
//     device tier, else all from the host tier (sets host_spill), else sets the sticky
//     overflow flag and writes nothing. A no-op once overflow is set.
//   Restore(handle, dst, zero_tail): copies the rows back in order (rows [n, max_rows)
//     zeroed with zero_tail) and returns the pages, in the handle's page-table order, to
//     the owning tier's tail. Under overflow: no-op (dst tail zeroed if zero_tail).
//   Discard(handle): returns the pages without copying.
//   Reset(): full free lists, flags and per-step stats cleared (the "initial image").
// Byte offsets are 64-bit (PageRowOffset): arenas above 4 GiB are normal.
// Profiling (host-synchronous): live rows per arena rounded up to pages, and their peak;
// SuggestCapacity(factor) = ceil(factor x peak pages).
//
// Errors are statuses: bad geometry, a handle used twice or foreign, more rows than
// max_rows. Thread-safety: none (one stream's order, like the device's Mode A).
#ifndef VMSTASH_STASH_PAGE_MODEL_H_
#define VMSTASH_STASH_PAGE_MODEL_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace vmstash::stash {

enum class HandleStatus { kEmpty, kDevice, kHost, kOverflowed };

// One stashed tensor: its page table and where it lives (device memory on the GPU).
struct Handle {
  std::vector<std::uint32_t> pages;  // ceil(max_rows / P) slots
  HandleStatus status = HandleStatus::kEmpty;
  std::uint64_t rows = 0;  // live row count captured at stash time
};

struct ArenaSpec {
  std::uint64_t row_bytes = 0;
  std::uint32_t page_rows = 64;         // P, a power of two
  std::uint64_t capacity_pages[2] = {0, 0};  // device, host
  bool keep_data = true;                // model the bytes too (off for huge arenas)
};

struct Flags {
  bool overflow = false;
  bool host_spill = false;
  std::uint64_t peak_pages[2] = {0, 0};
  std::uint64_t overflow_count = 0;
  std::uint64_t last_failed_pages = 0;
};

// Byte offset of row `row_in_page` of page `page` (64-bit throughout).
inline std::uint64_t PageRowOffset(std::uint64_t page, std::uint64_t page_rows, std::uint64_t row_in_page,
                                   std::uint64_t row_bytes) {
  return (page * page_rows + row_in_page) * row_bytes;
}

class PageModel {
 public:
  static absl::StatusOr<PageModel> Create(const ArenaSpec& spec);

  void Reset();
  // `src` holds at least n_rows * row_bytes bytes (may be null when n_rows is 0 or data
  // is not modelled). InvalidArgument if n_rows > max_rows or the handle is in use.
  absl::Status Stash(const std::uint8_t* src, std::uint64_t n_rows, std::uint64_t max_rows, Handle* handle);
  absl::Status Restore(Handle* handle, std::uint8_t* dst, std::uint64_t max_rows, bool zero_tail);
  absl::Status Discard(Handle* handle);

  const Flags& flags() const { return flags_; }
  std::uint64_t free_pages(int tier) const { return tail_[tier] - head_[tier]; }
  std::uint64_t head(int tier) const { return head_[tier]; }
  std::uint64_t tail(int tier) const { return tail_[tier]; }
  // The free list of `tier` in FIFO order (slots head..tail).
  std::vector<std::uint32_t> FreeList(int tier) const;
  const ArenaSpec& spec() const { return spec_; }

  // Profiling: live rows rounded up to pages, and the peak since StartProfiling.
  void StartProfiling();
  std::uint64_t profiled_peak_pages() const { return profile_peak_pages_; }
  std::uint64_t SuggestCapacity(double factor) const;

 private:
  explicit PageModel(const ArenaSpec& spec);
  std::uint64_t PagesFor(std::uint64_t rows) const { return (rows + spec_.page_rows - 1) / spec_.page_rows; }

  ArenaSpec spec_;
  std::vector<std::uint32_t> free_list_[2];
  std::uint64_t head_[2] = {0, 0}, tail_[2] = {0, 0};
  std::vector<std::uint8_t> data_[2];
  Flags flags_;
  bool profiling_ = false;
  std::uint64_t profile_pages_ = 0, profile_peak_pages_ = 0;
};

}  // namespace vmstash::stash

#endif  // VMSTASH_STASH_PAGE_MODEL_H_
