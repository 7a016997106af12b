// PinnedPieces: host memory for backups, page-locked piece by piece as copies need it,
// and handed back to the OS between uses (docs/architecture.md §4; the host-side
// ceilings it is built on: bench/host_ceiling_bench.cc).
//
// Note [Pinned Pieces]
//   Why: a backup that is pinned anew at every pause (cuMemHostAlloc) runs at ~2.5 GB/s
//   and gives the memory back only with a slow free; registering memory that is already
//   resident runs at ~50 GB/s on huge pages, and a copy into a registered piece can run
//   while the next piece is registered. So the memory is one anonymous private mapping
//   (MAP_NORESERVE, advised for transparent huge pages), cut into pieces of kPieceBytes
//   (the last one shorter), each registered (Driver::HostRegister) on its own.
//
//   Each piece is cold (never touched, or handed back: its contents are undefined),
//   warm (resident, written since it was last handed back, not pinned) or pinned:
//     Warm(end)        cold pieces of [0, end) are faulted in writable by `threads`
//                      threads, kWarmUnitBytes at a time (MADV_POPULATE_WRITE: an error,
//                      not a signal, when the host is out of memory); contents are kept.
//                      A faulted page is dirty, so after MADV_FREE the kernel may no
//                      longer discard it silently. On a failure every piece it touched is
//                      warm all the same (partly resident: counted and handed back).
//                      With `stop`, the threads check it before each unit and end early
//                      once it returns true (a background preparation yielding to a
//                      pause): only the pieces a unit of which was faulted in are warm. The
//                      threads also end at the first unit the host refuses.
//     Pin(off, n)      the pieces holding [off, off+n) are warmed (if cold) and registered.
//     CopyIn/CopyOut   queue copies between a device range and [off, off+n), pinning
//                      what they need first and split at piece bounds: the CUDA driver
//                      refuses a copy across two registrations (invalid argument).
//                      Neither registering nor faulting in waits for queued copies, so a
//                      pause pins piece k+1 while the copy engine fills piece k.
//     WarmAheadWithin(end)  a CopyIn that meets a cold piece warms it and every cold
//                      piece after it within [0, end), in one Warm (the owner names the
//                      bytes it has charged for: Note [Host Budget]). A pause into an
//                      arena partly pinned ahead (a preparation cut short) so has the copy
//                      engine fill the pinned pieces while its threads warm the rest.
//                      One Warm of all of it, not one per few pieces: faulting in 12 GiB
//                      in 256 MiB steps between the registrations and copies took 1.5 s
//                      on an H200 machine, in one step 0.4 s (bench/pause_bench.cc).
//                      Reset to 0 (only the piece a copy needs) by Reserve, Release and
//                      the hand-backs.
//     Unpin()          every pinned piece is unregistered; contents are kept (warm).
//     HandBack(lazy)   pinned pieces are unpinned and every piece's pages given back:
//                      lazily (MADV_FREE: counted as available at once, reclaimed when
//                      the OS needs memory, found again without faults when it did not)
//                      or at once (MADV_DONTNEED). Contents are lost (cold). HandBackSome
//                      does it for a bounded number of pinned bytes at a time.
//   Accounting of lazily given-back memory (Linux): MemAvailable counts it as available
//   at once; the process's RSS counts it until the kernel takes it. When a later pause pins
//   it again, MemAvailable keeps counting it as available until the kernel's reclaim next
//   scans it (which then finds it in use and leaves it): MemAvailable over-reports by up to
//   the backup's size while such a tag is paused. The owner's statistic (resident_bytes)
//   is exact. The mapping is MADV_DONTFORK: a forked child does not share registered pages.
//   Unregistering waits for all work queued on the device (the CUDA driver synchronizes
//   the context: bench/host_ceiling_bench.cc, "overlap"), so it cannot run behind a
//   resume's copies; an owner that wants the resume to return at link speed hands the
//   memory back afterwards, in steps (allocator/tag_pool.h, TagPool::GiveBack).
//   A pause into handed-back memory thus costs: Warm (a page-table walk when the OS did
//   not take the pages, faults where it did; done by the owner before the first copy, so
//   that a refusal comes before the device is touched) + registering pipelined with the
//   copies. Only into an arena partly pinned does the warming run behind copies too.
//
//   A failed call changes nothing it has not said: Pin/CopyIn leave the pieces pinned so
//   far pinned (a later call, Unpin or Release handles them); Unpin and HandBackSome stop
//   at the first failure, the pieces not yet unpinned still pinned. Release() unregisters
//   every pinned piece and gives the pages back, keeping the address range from later
//   mappings for a while (vmm/retired_ranges.h, Note [Retired Ranges]).
//
// Thread-safety: none; the owner serializes calls (a tag's transition lock). The threads
// Warm starts are joined before it returns.
#ifndef VMSTASH_VMM_PINNED_PIECES_H_
#define VMSTASH_VMM_PINNED_PIECES_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "vmm/driver.h"

namespace vmstash {

class PinnedPieces {
 public:
  static constexpr std::size_t kPieceBytes = std::size_t{64} << 20;
  // The share of one warming thread at a time (a multiple of the 2 MiB huge page): a
  // step of a few pieces still keeps every thread busy.
  static constexpr std::size_t kWarmUnitBytes = std::size_t{8} << 20;
  // The default number of threads that fault memory in: the hardware's, at most 16.
  static int DefaultThreads();

  PinnedPieces(Driver* driver, int device, int threads = DefaultThreads())
      : driver_(driver), device_(device), threads_(threads < 1 ? 1 : threads) {}
  ~PinnedPieces();  // Release(); errors logged
  PinnedPieces(const PinnedPieces&) = delete;
  PinnedPieces& operator=(const PinnedPieces&) = delete;

  // A new mapping of at least size_bytes (rounded up to 2 MiB), every piece cold; the old
  // one is released first (its contents are not kept). ResourceExhausted when mmap fails.
  absl::Status Reserve(std::size_t size_bytes);
  // Unregisters every pinned piece (waiting for nothing: the caller has drained the copies
  // that use them) and retires the mapping (Note [Retired Ranges]). On an unregister
  // failure the memory stays (an error).
  absl::Status Release();

  absl::Status Warm(std::size_t end, const std::function<bool()>& stop = nullptr);
  void WarmAheadWithin(std::size_t end) { warm_ahead_end_ = std::min(end, capacity_bytes_); }
  absl::Status Pin(std::size_t offset, std::size_t size_bytes);
  absl::Status CopyIn(std::size_t offset, DevicePtr src, std::size_t size_bytes, Stream stream);
  absl::Status CopyOut(DevicePtr dst, std::size_t offset, std::size_t size_bytes, Stream stream);
  absl::Status Unpin();
  absl::Status HandBack(bool lazily);
  // HandBack for at most `max_pinned_bytes` of pinned pieces (and every unpinned warm one
  // met on the way), from the start; *more: pieces are left that are not cold.
  absl::Status HandBackSome(std::size_t max_pinned_bytes, bool lazily, bool* more);

  char* data() const { return data_; }
  std::size_t capacity_bytes() const { return capacity_bytes_; }
  std::size_t pinned_bytes() const;
  // Bytes of the pieces that are not cold (host memory held, pinned or not).
  std::size_t resident_bytes() const;
  // What resident_bytes() becomes once [0, end) is warm (end <= capacity_bytes()).
  std::size_t resident_bytes_with(std::size_t end) const;
  // Whole pieces that are pinned from the start: [0, pinned_prefix_bytes()).
  std::size_t pinned_prefix_bytes() const;
  std::size_t piece_count() const { return pieces_.size(); }
  // Time spent warming and registering since the last call (for a transition's log line).
  struct Timing {
    double warm_ms = 0, register_ms = 0;
    std::size_t registered = 0;  // pieces
  };
  Timing TakeTiming() { return std::exchange(timing_, Timing{}); }

 private:
  enum class State : std::uint8_t { kCold, kWarm, kPinned };
  struct Piece {
    State state = State::kCold;
  };

  std::size_t PieceBegin(std::size_t k) const { return k * kPieceBytes; }
  std::size_t PieceSize(std::size_t k) const;
  // Checks [offset, offset + size) lies in the mapping.
  absl::Status CheckRange(std::size_t offset, std::size_t size_bytes, const char* what) const;
  // Faults in pieces [first, last] that are cold, with up to threads_ threads.
  absl::Status WarmPieces(std::size_t first, std::size_t last, const std::function<bool()>& stop = nullptr);
  absl::Status PinPiece(std::size_t k);
  absl::Status UnpinPiece(std::size_t k);

  Driver* const driver_;
  const int device_;
  const int threads_;
  char* data_ = nullptr;
  std::size_t capacity_bytes_ = 0;
  std::vector<Piece> pieces_;
  std::size_t warm_ahead_end_ = 0;  // WarmAheadWithin
  Timing timing_;
};

}  // namespace vmstash

#endif  // VMSTASH_VMM_PINNED_PIECES_H_
