#include "vmm/pinned_pieces.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <system_error>
#include <chrono>
#include <cerrno>
#include <cstring>
#include <functional>
#include <mutex>
#include <numeric>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "vmm/retired_ranges.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older headers lack it
#endif

namespace vmstash {
namespace {

constexpr std::size_t kUnit = std::size_t{2} << 20;

// Faults [p, p + n) in writable. On kernels without MADV_POPULATE_WRITE (EINVAL), writes
// one byte per page instead (the contents of a cold piece are undefined anyway).
absl::Status FaultIn(char* p, std::size_t n) {
  if (madvise(p, n, MADV_POPULATE_WRITE) == 0) return absl::OkStatus();
  const int err = errno;
  if (err == EINVAL) {
    const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    for (std::size_t i = 0; i < n; i += page) reinterpret_cast<volatile char*>(p)[i] = 0;
    return absl::OkStatus();
  }
  std::string what = absl::StrCat("backup memory: faulting in ", n, " bytes of host memory failed: ", std::strerror(err));
  if (err == ENOMEM || err == EFAULT || err == EHWPOISON) return absl::ResourceExhaustedError(what);
  return absl::InternalError(what);
}

}  // namespace

int PinnedPieces::DefaultThreads() {
  const unsigned n = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp(n, 1u, 16u));
}

PinnedPieces::~PinnedPieces() {
  absl::Status s = Release();
  if (!s.ok()) VMSTASH_LOG(kError, "vmstash: releasing backup memory: {}", s.ToString());
}

std::size_t PinnedPieces::PieceSize(std::size_t k) const {
  return std::min(kPieceBytes, capacity_bytes_ - PieceBegin(k));
}

absl::Status PinnedPieces::Reserve(std::size_t size_bytes) {
  if (size_bytes > std::numeric_limits<std::size_t>::max() - kUnit) {
    return absl::InvalidArgumentError(absl::StrCat("backup memory: ", size_bytes, " bytes is not a size"));
  }
  VMSTASH_RETURN_IF_ERROR(Release());
  if (size_bytes == 0) return absl::OkStatus();
  const std::size_t want = (size_bytes + kUnit - 1) / kUnit * kUnit;
  void* p = mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("backup memory: mmap of ", want, " bytes of host memory failed: ", std::strerror(errno)));
  }
  (void)madvise(p, want, MADV_HUGEPAGE);  // advice only: without THP the pages are 4 KiB
  // Registered memory must not be shared copy-on-write with a forked child (a write by
  // this process would move its page away from the device's mapping); the child has no
  // use for it.
  (void)madvise(p, want, MADV_DONTFORK);
  data_ = static_cast<char*>(p);
  capacity_bytes_ = want;
  pieces_.assign((want + kPieceBytes - 1) / kPieceBytes, Piece{});
  return absl::OkStatus();
}

absl::Status PinnedPieces::Release() {
  if (data_ == nullptr) return absl::OkStatus();
  VMSTASH_RETURN_IF_ERROR(Unpin());
  // The pages go back; the addresses stay unused by later mappings (Note [Retired Ranges]).
  VMSTASH_RETURN_IF_ERROR(RetiredRanges::Process().Retire(data_, capacity_bytes_));
  data_ = nullptr;
  capacity_bytes_ = 0;
  pieces_.clear();
  warm_ahead_end_ = 0;
  return absl::OkStatus();
}

absl::Status PinnedPieces::CheckRange(std::size_t offset, std::size_t size_bytes, const char* what) const {
  if (offset > capacity_bytes_ || size_bytes > capacity_bytes_ - offset) {
    return absl::InvalidArgumentError(absl::StrCat("backup memory: ", what, " of bytes ", offset, "+", size_bytes,
                                                   " outside its ", capacity_bytes_, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status PinnedPieces::WarmPieces(std::size_t first, std::size_t last, const std::function<bool()>& stop) {
  // The cold pieces' bytes in units of kWarmUnitBytes, shared out among the threads.
  struct Unit {
    std::size_t piece, begin, size;
  };
  std::vector<Unit> units;
  for (std::size_t k = first; k <= last && k < pieces_.size(); ++k) {
    if (pieces_[k].state != State::kCold) continue;
    for (std::size_t at = 0; at < PieceSize(k); at += kWarmUnitBytes) {
      units.push_back({k, PieceBegin(k) + at, std::min(kWarmUnitBytes, PieceSize(k) - at)});
    }
  }
  if (units.empty()) return absl::OkStatus();
  const auto start = std::chrono::steady_clock::now();
  std::atomic<std::size_t> next{0};
  std::atomic<bool> stopped{false};
  std::vector<char> reached(units.size(), 0);  // each written by the one thread that took the unit
  std::mutex mu;
  absl::Status first_error;
  auto work = [&] {
    for (std::size_t i; !stopped.load(std::memory_order_relaxed) && (i = next.fetch_add(1)) < units.size();) {
      if (stop && stop()) {
        stopped.store(true, std::memory_order_relaxed);
        break;
      }
      reached[i] = 1;
      absl::Status s = FaultIn(data_ + units[i].begin, units[i].size);
      if (s.ok()) continue;
      stopped.store(true, std::memory_order_relaxed);  // the host refuses: no more of it
      std::lock_guard<std::mutex> lock(mu);
      if (first_error.ok()) first_error = s;
    }
  };
  const std::size_t helpers = std::min<std::size_t>(static_cast<std::size_t>(threads_), units.size()) - 1;
  std::vector<std::thread> pool;
  pool.reserve(helpers);
  for (std::size_t t = 0; t < helpers; ++t) {
    try {
      pool.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // no more threads: the ones started and this one do the rest
    }
  }
  work();
  for (std::thread& t : pool) t.join();
  // Every piece touched is warm, a failed one too: its other units (and part of the failed
  // one) may be resident, and a warm piece is counted, charged and handed back; a cold one
  // would hold pages nobody accounts for. Registering faults in what is missing.
  for (std::size_t i = 0; i < units.size(); ++i) {
    if (reached[i]) pieces_[units[i].piece].state = State::kWarm;
  }
  timing_.warm_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return first_error;
}

absl::Status PinnedPieces::Warm(std::size_t end, const std::function<bool()>& stop) {
  VMSTASH_RETURN_IF_ERROR(CheckRange(0, end, "warming"));
  if (end == 0) return absl::OkStatus();
  return WarmPieces(0, (end - 1) / kPieceBytes, stop);
}

absl::Status PinnedPieces::PinPiece(std::size_t k) {
  Piece& piece = pieces_[k];
  if (piece.state == State::kPinned) return absl::OkStatus();
  if (piece.state == State::kCold) VMSTASH_RETURN_IF_ERROR(FaultIn(data_ + PieceBegin(k), PieceSize(k)));
  piece.state = State::kWarm;
  const auto start = std::chrono::steady_clock::now();
  VMSTASH_RETURN_IF_ERROR(driver_->HostRegister(device_, data_ + PieceBegin(k), PieceSize(k)));
  timing_.register_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  ++timing_.registered;
  piece.state = State::kPinned;
  return absl::OkStatus();
}

absl::Status PinnedPieces::UnpinPiece(std::size_t k) {
  VMSTASH_RETURN_IF_ERROR(driver_->HostUnregister(device_, data_ + PieceBegin(k)));
  pieces_[k].state = State::kWarm;
  return absl::OkStatus();
}

absl::Status PinnedPieces::Pin(std::size_t offset, std::size_t size_bytes) {
  VMSTASH_RETURN_IF_ERROR(CheckRange(offset, size_bytes, "pinning"));
  if (size_bytes == 0) return absl::OkStatus();
  const std::size_t first = offset / kPieceBytes, last = (offset + size_bytes - 1) / kPieceBytes;
  VMSTASH_RETURN_IF_ERROR(WarmPieces(first, last));
  for (std::size_t k = first; k <= last; ++k) VMSTASH_RETURN_IF_ERROR(PinPiece(k));
  return absl::OkStatus();
}

absl::Status PinnedPieces::CopyIn(std::size_t offset, DevicePtr src, std::size_t size_bytes, Stream stream) {
  VMSTASH_RETURN_IF_ERROR(CheckRange(offset, size_bytes, "a copy in"));
  for (std::size_t done = 0; done < size_bytes;) {
    const std::size_t at = offset + done, k = at / kPieceBytes;
    const std::size_t n = std::min(size_bytes - done, PieceBegin(k) + PieceSize(k) - at);
    if (pieces_[k].state == State::kCold && warm_ahead_end_ > PieceBegin(k)) {
      VMSTASH_RETURN_IF_ERROR(WarmPieces(k, (warm_ahead_end_ - 1) / kPieceBytes));
    }
    VMSTASH_RETURN_IF_ERROR(PinPiece(k));
    VMSTASH_RETURN_IF_ERROR(driver_->CopyToHostAsync(device_, data_ + at, src + done, n, stream));
    done += n;
  }
  return absl::OkStatus();
}

absl::Status PinnedPieces::CopyOut(DevicePtr dst, std::size_t offset, std::size_t size_bytes, Stream stream) {
  VMSTASH_RETURN_IF_ERROR(CheckRange(offset, size_bytes, "a copy out"));
  if (size_bytes == 0) return absl::OkStatus();
  const std::size_t first = offset / kPieceBytes, last = (offset + size_bytes - 1) / kPieceBytes;
  for (std::size_t k = first; k <= last; ++k) {
    if (pieces_[k].state == State::kCold) {
      return absl::InternalError(absl::StrCat("backup memory: a copy out of bytes ", offset, "+", size_bytes,
                                              " reads memory that was handed back (piece ", k, ")"));
    }
  }
  for (std::size_t done = 0; done < size_bytes;) {
    const std::size_t at = offset + done, k = at / kPieceBytes;
    const std::size_t n = std::min(size_bytes - done, PieceBegin(k) + PieceSize(k) - at);
    VMSTASH_RETURN_IF_ERROR(PinPiece(k));  // warm: its bytes are kept, only registered again
    VMSTASH_RETURN_IF_ERROR(driver_->CopyToDeviceAsync(device_, dst + done, data_ + at, n, stream));
    done += n;
  }
  return absl::OkStatus();
}

absl::Status PinnedPieces::Unpin() {
  for (std::size_t k = 0; k < pieces_.size(); ++k) {
    if (pieces_[k].state == State::kPinned) VMSTASH_RETURN_IF_ERROR(UnpinPiece(k));
  }
  return absl::OkStatus();
}

absl::Status PinnedPieces::HandBack(bool lazily) {
  bool more = false;
  return HandBackSome(capacity_bytes_, lazily, &more);
}

absl::Status PinnedPieces::HandBackSome(std::size_t max_pinned_bytes, bool lazily, bool* more) {
  *more = false;
  warm_ahead_end_ = 0;  // the next pause names what it charged for again
  std::size_t unpinned = 0;
  for (std::size_t k = 0; k < pieces_.size(); ++k) {
    if (pieces_[k].state == State::kCold) continue;
    if (pieces_[k].state == State::kPinned) {
      if (unpinned >= max_pinned_bytes) {
        *more = true;
        return absl::OkStatus();
      }
      VMSTASH_RETURN_IF_ERROR(UnpinPiece(k));
      unpinned += PieceSize(k);
    }
    char* const at = data_ + PieceBegin(k);
    // MADV_FREE needs Linux 4.5: without it, give the pages back at once.
    if (madvise(at, PieceSize(k), lazily ? MADV_FREE : MADV_DONTNEED) != 0 &&
        (!lazily || madvise(at, PieceSize(k), MADV_DONTNEED) != 0)) {
      return absl::InternalError(absl::StrCat("backup memory: giving ", PieceSize(k),
                                              " bytes back to the OS failed: ", std::strerror(errno)));
    }
    pieces_[k].state = State::kCold;
  }
  return absl::OkStatus();
}

std::size_t PinnedPieces::pinned_bytes() const {
  std::size_t n = 0;
  for (std::size_t k = 0; k < pieces_.size(); ++k) {
    if (pieces_[k].state == State::kPinned) n += PieceSize(k);
  }
  return n;
}

std::size_t PinnedPieces::resident_bytes() const {
  std::size_t n = 0;
  for (std::size_t k = 0; k < pieces_.size(); ++k) {
    if (pieces_[k].state != State::kCold) n += PieceSize(k);
  }
  return n;
}

std::size_t PinnedPieces::resident_bytes_with(std::size_t end) const {
  std::size_t n = 0;
  for (std::size_t k = 0; k < pieces_.size(); ++k) {
    if (pieces_[k].state != State::kCold || PieceBegin(k) < end) n += PieceSize(k);
  }
  return n;
}

std::size_t PinnedPieces::pinned_prefix_bytes() const {
  std::size_t n = 0;
  for (std::size_t k = 0; k < pieces_.size() && pieces_[k].state == State::kPinned; ++k) n += PieceSize(k);
  return n;
}

}  // namespace vmstash
