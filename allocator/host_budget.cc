// The process's host-memory account: see host_budget.h.
#include "allocator/host_budget.h"

#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/bytes.h"
#include "base/conf.h"
#include "base/log.h"

namespace vmstash {
namespace {

// "64 GiB (68719476736 bytes)": the human size and the exact count a user can compare.
std::string Bytes(std::size_t bytes) { return absl::StrCat(HumanBytes(bytes), " (", bytes, " bytes)"); }

}  // namespace

HostBudget& HostBudget::Process() {
  static HostBudget* const budget = new HostBudget();  // leaked: arenas may refund at exit
  return *budget;
}

void HostBudget::SetLimit(std::size_t bytes) { limit_bytes_.store(bytes, std::memory_order_release); }

absl::Status HostBudget::Charge(std::size_t bytes, absl::string_view what, HostUse use) {
  if (bytes == 0) return absl::OkStatus();
  std::size_t held = held_bytes_.load(std::memory_order_acquire);
  std::size_t limit = 0;
  for (;;) {
    limit = limit_bytes_.load(std::memory_order_acquire);
    const bool overflows = bytes > std::numeric_limits<std::size_t>::max() - held;
    if (overflows || (limit != 0 && held + bytes > limit)) break;
    if (held_bytes_.compare_exchange_weak(held, held + bytes, std::memory_order_acq_rel, std::memory_order_acquire)) {
      use_bytes_[Index(use)].fetch_add(bytes, std::memory_order_acq_rel);
      return absl::OkStatus();
    }
  }
  if (limit == 0) {
    return absl::ResourceExhaustedError(absl::StrCat("host memory account: ", what, " asks ", Bytes(bytes), " with ",
                                                     Bytes(held), " held, which overflows the count"));
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "host memory cap host_max:", SizeToString(limit), " (VMSTASH_CONF) would be passed: ", what, " needs ", Bytes(bytes),
      " of host memory, and ", Bytes(held), " of the ", Bytes(limit), " allowed are held already (backups ",
      Bytes(held_for(HostUse::kBackup)), ", staging rings of pageable and disk stores ",
      Bytes(held_for(HostUse::kStagingRing)), ") in this process; raise host_max, or set spill_dir:<directory> so backups beyond the cap go to a disk "
      "store there"));
}

void HostBudget::Refund(std::size_t bytes, HostUse use) {
  if (bytes == 0) return;
  std::atomic<std::size_t>& part = use_bytes_[Index(use)];
  std::size_t in_use = part.load(std::memory_order_acquire);
  while (!part.compare_exchange_weak(in_use, in_use >= bytes ? in_use - bytes : 0, std::memory_order_acq_rel,
                                     std::memory_order_acquire)) {
  }
  std::size_t held = held_bytes_.load(std::memory_order_acquire);
  while (!held_bytes_.compare_exchange_weak(held, held >= bytes ? held - bytes : 0, std::memory_order_acq_rel,
                                            std::memory_order_acquire)) {
  }
  if (held < bytes) {
    VMSTASH_LOG(kError, "vmstash: host memory account: a refund of {} bytes with only {} bytes held (a bug: refunded "
                "more than was charged); the account is set to 0", bytes, held);
  }
}

HostCharge::HostCharge(HostCharge&& other) noexcept
    : budget_(other.budget_), use_(other.use_), bytes_(std::exchange(other.bytes_, 0)) {}

HostCharge& HostCharge::operator=(HostCharge&& other) noexcept {
  if (this != &other) {
    Reset();
    budget_ = other.budget_;
    use_ = other.use_;
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

absl::Status HostCharge::Resize(std::size_t bytes, absl::string_view what) {
  if (bytes > bytes_) {
    absl::Status s = budget_->Charge(bytes - bytes_, what, use_);
    if (!s.ok()) return s;
  } else if (bytes < bytes_) {
    budget_->Refund(bytes_ - bytes, use_);
  }
  bytes_ = bytes;
  return absl::OkStatus();
}

void HostCharge::Reset() {
  if (bytes_ != 0) budget_->Refund(std::exchange(bytes_, 0), use_);
}

}  // namespace vmstash
