// PageModel: see page_model.h.
#include "stash/page_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace vmstash::stash {

absl::StatusOr<PageModel> PageModel::Create(const ArenaSpec& spec) {
  if (spec.row_bytes == 0) return absl::InvalidArgumentError("stash arena: row_bytes must be > 0");
  if (spec.page_rows == 0 || (spec.page_rows & (spec.page_rows - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("stash arena: page_rows must be a power of two, got ",
                                                   spec.page_rows));
  }
  if (spec.capacity_pages[0] == 0) return absl::InvalidArgumentError("stash arena: the device tier needs pages");
  for (std::uint64_t cap : spec.capacity_pages) {
    if (cap > std::uint64_t{0xffffffff}) {
      return absl::InvalidArgumentError(absl::StrCat("stash arena: ", cap, " pages exceed 32-bit page ids"));
    }
  }
  return PageModel(spec);
}

PageModel::PageModel(const ArenaSpec& spec) : spec_(spec) {
  for (int t = 0; t < 2; ++t) {
    free_list_[t].resize(spec.capacity_pages[t]);
    if (spec.keep_data) data_[t].resize(spec.capacity_pages[t] * spec.page_rows * spec.row_bytes);
  }
  Reset();
}

void PageModel::Reset() {
  for (int t = 0; t < 2; ++t) {
    for (std::uint64_t i = 0; i < spec_.capacity_pages[t]; ++i) free_list_[t][i] = static_cast<std::uint32_t>(i);
    head_[t] = 0;
    tail_[t] = spec_.capacity_pages[t];
  }
  flags_ = Flags{};
}

std::vector<std::uint32_t> PageModel::FreeList(int tier) const {
  std::vector<std::uint32_t> out;
  const std::uint64_t cap = spec_.capacity_pages[tier];
  for (std::uint64_t c = head_[tier]; c < tail_[tier] && cap != 0; ++c) out.push_back(free_list_[tier][c % cap]);
  return out;
}

absl::Status PageModel::Stash(const std::uint8_t* src, std::uint64_t n_rows, std::uint64_t max_rows,
                              Handle* handle) {
  if (handle == nullptr) return absl::InvalidArgumentError("stash: null handle");
  if (n_rows > max_rows) {
    return absl::InvalidArgumentError(absl::StrCat("stash: ", n_rows, " rows exceed max_rows ", max_rows));
  }
  if (handle->status == HandleStatus::kDevice || handle->status == HandleStatus::kHost) {
    return absl::FailedPreconditionError("stash: the handle still holds a stashed tensor");
  }
  handle->pages.assign(PagesFor(max_rows), 0);
  handle->rows = n_rows;
  if (flags_.overflow) {  // sticky: every later stash of the step is a no-op
    handle->status = HandleStatus::kOverflowed;
    return absl::OkStatus();
  }
  const std::uint64_t need = PagesFor(n_rows);
  int tier = -1;
  if (free_pages(0) >= need) {
    tier = 0;
  } else if (spec_.capacity_pages[1] != 0 && free_pages(1) >= need) {
    tier = 1;
    flags_.host_spill = true;
  }
  if (tier < 0) {
    flags_.overflow = true;
    ++flags_.overflow_count;
    flags_.last_failed_pages = need;
    handle->status = HandleStatus::kOverflowed;
    return absl::OkStatus();
  }
  const std::uint64_t cap = spec_.capacity_pages[tier];
  for (std::uint64_t s = 0; s < need; ++s) handle->pages[s] = free_list_[tier][(head_[tier] + s) % cap];
  head_[tier] += need;
  flags_.peak_pages[tier] = std::max(flags_.peak_pages[tier], cap - free_pages(tier));
  handle->status = tier == 0 ? HandleStatus::kDevice : HandleStatus::kHost;
  if (spec_.keep_data && src != nullptr) {
    for (std::uint64_t r = 0; r < n_rows; ++r) {
      std::memcpy(&data_[tier][PageRowOffset(handle->pages[r / spec_.page_rows], spec_.page_rows,
                                             r % spec_.page_rows, spec_.row_bytes)],
                  src + r * spec_.row_bytes, spec_.row_bytes);
    }
  }
  if (profiling_) {
    profile_pages_ += need;
    profile_peak_pages_ = std::max(profile_peak_pages_, profile_pages_);
  }
  return absl::OkStatus();
}

absl::Status PageModel::Restore(Handle* handle, std::uint8_t* dst, std::uint64_t max_rows, bool zero_tail) {
  if (handle == nullptr) return absl::InvalidArgumentError("restore: null handle");
  if (handle->status == HandleStatus::kEmpty) return absl::FailedPreconditionError("restore: nothing stashed");
  if (flags_.overflow || handle->status == HandleStatus::kOverflowed) {
    if (zero_tail && dst != nullptr) std::memset(dst, 0, max_rows * spec_.row_bytes);
    if (!flags_.overflow) handle->status = HandleStatus::kEmpty;  // after a reset
    return absl::OkStatus();
  }
  const int tier = handle->status == HandleStatus::kDevice ? 0 : 1;
  const std::uint64_t n = handle->rows;
  if (spec_.keep_data && dst != nullptr) {
    for (std::uint64_t r = 0; r < n; ++r) {
      std::memcpy(dst + r * spec_.row_bytes,
                  &data_[tier][PageRowOffset(handle->pages[r / spec_.page_rows], spec_.page_rows,
                                             r % spec_.page_rows, spec_.row_bytes)],
                  spec_.row_bytes);
    }
    if (zero_tail && max_rows > n) std::memset(dst + n * spec_.row_bytes, 0, (max_rows - n) * spec_.row_bytes);
  }
  return Discard(handle);
}

absl::Status PageModel::Discard(Handle* handle) {
  if (handle == nullptr) return absl::InvalidArgumentError("discard: null handle");
  if (flags_.overflow) return absl::OkStatus();  // nothing moves until reset
  if (handle->status != HandleStatus::kDevice && handle->status != HandleStatus::kHost) {
    handle->status = HandleStatus::kEmpty;  // an overflowed handle after a reset, as Restore
    return absl::OkStatus();
  }
  const int tier = handle->status == HandleStatus::kDevice ? 0 : 1;
  const std::uint64_t cap = spec_.capacity_pages[tier];
  const std::uint64_t pages = PagesFor(handle->rows);
  for (std::uint64_t s = 0; s < pages; ++s) free_list_[tier][(tail_[tier] + s) % cap] = handle->pages[s];
  tail_[tier] += pages;
  handle->status = HandleStatus::kEmpty;
  if (profiling_) profile_pages_ -= std::min(profile_pages_, pages);
  return absl::OkStatus();
}

void PageModel::StartProfiling() {
  profiling_ = true;
  profile_pages_ = 0;
  profile_peak_pages_ = 0;
}

std::uint64_t PageModel::SuggestCapacity(double factor) const {
  return static_cast<std::uint64_t>(std::ceil(factor * static_cast<double>(profile_peak_pages_)));
}

}  // namespace vmstash::stash
