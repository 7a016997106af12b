// StagingRing: copies between the device and pageable host memory (a pageable or disk
// backup store: allocator/backup_arena.h) through a few pinned slots, at close to the
// link's rate (docs/architecture.md §4; the ceilings: bench/host_ceiling_bench.cc,
// "staged").
//
// Note [Staging Ring]
//   Why: the CUDA driver copies to or from pageable memory through its own small staging
//   buffer, one thread, and the call returns only when the copy is done; memory that
//   never needs registering (a pageable arena, a disk file's mapping) can do better with
//   host threads moving the bytes while the copy engine works. The ring is `slots` pinned
//   slots of `slot_bytes` (one Driver::HostAlloc, made at first use, kept until the ring
//   is destroyed), each with an event. Copies are packed into the current slot, split at
//   its end; a slot is reused only after its event says the device is done with it.
//
//   Device to host (ToHost): the copy into the slot is queued on the caller's stream and
//   the slot remembers where its bytes go. The bytes reach their destination when the
//   ring comes round to the slot again (the caller's thread waits for the slot's event
//   and HostCopyPool moves them, while the copy engine fills the other slots), or at
//   Finish(), which moves every slot's remaining bytes. So a ToHost destination holds
//   its bytes only after Finish(); the device source may be released once the stream
//   passed the copy (an event after it), since the slot holds them.
//   Host to device (ToDevice): the bytes are moved into the slot by HostCopyPool, then the
//   copy out of the slot is queued; the source may be reused when the call returns, the
//   destination holds the bytes once the stream passed the copy. The slot's event is
//   recorded after each such copy, so that the next use of the slot waits for all of them.
//   A slot serves one stream between two waits: a copy on another stream starts a new slot.
//
//   Failures: an error from the driver (a copy, an event) is returned with what was queued
//   before it still queued; the caller waits for its stream and either calls Finish() (the
//   queued bytes arrive) or Abandon() (queued ToHost bytes are forgotten: the caller's
//   failure path; the caller has waited for its stream, so every slot is free again).
//   Making the ring is the first use's ResourceExhausted when the host refuses the pinned
//   memory; nothing is queued then. A slot whose event cannot be waited for (in Finish(),
//   or when the ring comes round to it) keeps its bytes and their destinations: a later
//   Finish() waits again (a switch's rollback reads the arena after one), Abandon()
//   forgets them. A Free() the driver refuses keeps the pinned memory (and says so), so
//   an owner that charged it to a budget refunds only what went back.
//
// Thread-safety: none; the owner serializes calls (a tag's transition lock). Memory
// passed to ToHost must stay mapped until Finish() or Abandon().
#ifndef VMSTASH_VMM_STAGING_RING_H_
#define VMSTASH_VMM_STAGING_RING_H_

#include <cstddef>
#include <vector>

#include "absl/status/status.h"
#include "vmm/driver.h"
#include "vmm/host_copy_pool.h"

namespace vmstash {

class StagingRing {
 public:
  static constexpr std::size_t kSlotBytes = std::size_t{16} << 20;
  static constexpr int kSlots = 8;

  StagingRing(Driver* driver, int device, HostCopyPool* pool = &HostCopyPool::Shared(),
              std::size_t slot_bytes = kSlotBytes, int slots = kSlots)
      : driver_(driver), device_(device), pool_(pool), slot_bytes_(slot_bytes), slot_count_(slots < 2 ? 2 : slots) {}
  ~StagingRing();  // Free(); errors logged
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  // Makes the slots now (else the first copy does): ResourceExhausted (naming the ring)
  // when the host refuses the pinned memory; nothing changes then.
  absl::Status Ready();
  absl::Status ToHost(void* dst, DevicePtr src, std::size_t size_bytes, Stream stream);
  absl::Status Finish();
  absl::Status ToDevice(DevicePtr dst, const void* src, std::size_t size_bytes, Stream stream);
  void Abandon();
  // Gives the slots back now: waits for the device to be done with them, forgets queued
  // ToHost bytes, frees the pinned memory and the events (Ready makes them again). When
  // the driver does not free the memory, its error, the ring as it was (held_bytes()
  // unchanged, the slots empty), for a later Free or the destructor.
  absl::Status Free();
  // Pinned host bytes the ring holds (0 before its first copy).
  std::size_t held_bytes() const { return base_ == nullptr ? 0 : slot_bytes_ * slot_count_; }
  // Destinations whose bytes are still in a slot.
  bool has_pending() const;

 private:
  enum class Use { kNone, kToHost, kToDevice };
  struct Slot {
    Event event = nullptr;
    bool recorded = false;   // the event was recorded since the slot was last waited for
    Use use = Use::kNone;
    Stream stream = nullptr;
    std::size_t fill = 0;    // bytes used since it was opened
    std::vector<HostCopyPool::Span> out;  // ToHost: slot bytes -> their destinations
  };

  char* SlotData(int k) const { return base_ + static_cast<std::size_t>(k) * slot_bytes_; }
  // The current slot with room for more bytes of `use` on `stream`: moves on to the next
  // slot (recording the current one's event) when it is full or serves something else,
  // and empties the next one first (Drain).
  absl::Status Room(Use use, Stream stream);
  // Waits for slot k's event and moves its ToHost bytes to their destinations.
  absl::Status Drain(int k);

  Driver* const driver_;
  const int device_;
  HostCopyPool* const pool_;
  const std::size_t slot_bytes_;
  const int slot_count_;
  char* base_ = nullptr;
  std::vector<Slot> slots_;
  int current_ = 0;
};

}  // namespace vmstash

#endif  // VMSTASH_VMM_STAGING_RING_H_
