// HostBudget: the process's account of the host memory its backup arenas hold, and the
// cap on it (VMSTASH_CONF `host_max`, issue 33).
//
// What is counted: host pages a backup arena holds for `backup` bytes, pinned (allocated
// or registered, prepared ahead of a pause included) or pageable pages that are populated
// (allocator/backup_arena.h, Note [Host Budget]). Not reserved VA that nothing populates,
// not a disk store (its file's blocks, nor the page cache its mapping goes through while
// a pause writes or a resume reads), not the allocator's bookkeeping. The arena charges
// before it pins or populates and refunds once it has given the pages back, so `held`
// is an upper bound of what the arenas hold at any instant, never an undercount: what a
// failed release or hand-back leaves held stays charged (HostCharge::Abandon for memory no
// owner tracks any more).
//
// Two uses are counted apart, for messages only (the cap is on their sum): backups (the
// arenas' own pages) and staging rings (the pinned slots that pageable and disk stores
// copy through, held during and between their transitions but never by a paused tag).
//
// Scope: one account per process (Process()), across every device and tag: the cap says
// how much host memory vmstash may take in this process, whoever's backup it is. Tests
// construct their own instances.
//
// At the cap: Charge is all-or-nothing. It either adds all the bytes or none, and a
// refusal is ResourceExhausted naming the cap as the user wrote it (host_max:<size>), the
// bytes asked, the bytes held and what asked. What happens then is the caller's decision:
// put the backup in the disk store (`spill_dir`) or fail the pause, leaving every tag as
// it was. HostBudget never spills, waits, or evicts anything itself.
//
// Limit changes: SetLimit may go below `held`. Existing charges stay (nothing is taken
// back); later charges fail until refunds bring held + asked within the limit. A Charge
// racing a SetLimit is checked against either the old or the new limit. 0 = no cap.
//
// Refunds: never below zero. Refunding more than is held is a caller bug: it is logged at
// error level and clamped to zero, never a crash.
//
// Thread-safety: every method of HostBudget may be called from any thread at once. The
// account is two atomics updated by compare-and-swap (a charge never lets `held` pass
// the limit it checked), not a lock: nothing can be left locked in a forked child, and a
// charge costs one CAS. HostCharge is not thread-safe; its owner serializes its calls.
//
// Ownership: Process() is leaked (never destroyed), so arenas destroyed at exit may still
// refund. A HostCharge refunds what it holds when destroyed; its budget must outlive it.
#ifndef VMSTASH_ALLOCATOR_HOST_BUDGET_H_
#define VMSTASH_ALLOCATOR_HOST_BUDGET_H_

#include <atomic>
#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace vmstash {

// What a charge holds host memory for (HostBudget's messages tell them apart).
enum class HostUse { kBackup, kStagingRing };

class HostBudget {
 public:
  // No cap.
  HostBudget() = default;
  HostBudget(const HostBudget&) = delete;
  HostBudget& operator=(const HostBudget&) = delete;

  // The process's account (set from VMSTASH_CONF's host_max at vmstash's initialization).
  static HostBudget& Process();

  // The cap in bytes; 0: no cap. See "Limit changes" above.
  void SetLimit(std::size_t bytes);
  std::size_t limit() const { return limit_bytes_.load(std::memory_order_acquire); }
  // Bytes charged and not refunded.
  std::size_t held() const { return held_bytes_.load(std::memory_order_acquire); }
  // The part of held() charged for `use` (read apart from held(): a snapshot, not a sum).
  std::size_t held_for(HostUse use) const { return use_bytes_[Index(use)].load(std::memory_order_acquire); }

  // Adds `bytes` to held, or nothing. ResourceExhausted when held + bytes would pass the
  // limit (or overflow), naming host_max, `bytes`, what backups and staging rings hold
  // and `what` (e.g. "the backup of tag 'kv' on device 0"), and saying what to do: raise
  // host_max, or set spill_dir. Charging 0 bytes is OK and changes nothing.
  absl::Status Charge(std::size_t bytes, absl::string_view what, HostUse use = HostUse::kBackup);
  // Subtracts `bytes` from held (and from `use`'s part); see "Refunds" above.
  void Refund(std::size_t bytes, HostUse use = HostUse::kBackup);

 private:
  static std::size_t Index(HostUse use) { return use == HostUse::kBackup ? 0 : 1; }

  std::atomic<std::size_t> limit_bytes_{0};
  std::atomic<std::size_t> held_bytes_{0};
  std::atomic<std::size_t> use_bytes_[2] = {};  // by Index(use); clamped at zero as held_bytes_
};

// The bytes one owner (e.g. one backup arena) has charged to a budget, refunded when the
// owner resizes, resets or is destroyed. Movable, not copyable.
//
//   HostCharge charge_;  // a member of the arena, on HostBudget::Process()
//   VMSTASH_RETURN_IF_ERROR(charge_.Resize(size_bytes, "the backup of tag 'kv' on device 0"));
//   ... pin or populate size_bytes ...
//   ... give the pages back ... ; charge_.Reset();
class HostCharge {
 public:
  explicit HostCharge(HostBudget* budget = &HostBudget::Process(), HostUse use = HostUse::kBackup)
      : budget_(budget), use_(use) {}
  ~HostCharge() { Reset(); }
  HostCharge(HostCharge&& other) noexcept;
  HostCharge& operator=(HostCharge&& other) noexcept;
  HostCharge(const HostCharge&) = delete;
  HostCharge& operator=(const HostCharge&) = delete;

  // Makes this owner's charge exactly `bytes`: charges the increase (all-or-nothing, the
  // budget's ResourceExhausted on refusal, the charge unchanged) or refunds the decrease.
  absl::Status Resize(std::size_t bytes, absl::string_view what);
  // Refunds everything this owner holds.
  void Reset();
  // Forgets the charge without refunding it: the bytes stay held in the budget for good.
  // For host memory its owner could not give back (a registration the driver refused to
  // undo) and stops tracking, e.g. an arena destroyed after a failed release: the account
  // keeps counting what is still held rather than undercount it.
  void Abandon() { bytes_ = 0; }
  std::size_t bytes() const { return bytes_; }
  HostBudget* budget() const { return budget_; }

 private:
  HostBudget* budget_;
  HostUse use_;
  std::size_t bytes_ = 0;
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_HOST_BUDGET_H_
