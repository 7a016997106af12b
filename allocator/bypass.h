// BypassAllocations: the allocations of AllocatorOptions::bypass (caching_allocator.h).
//
// What: every allocation gets its own reservation and chunk straight from the driver, and
// every free synchronizes the device and gives them back: slow, but every byte is the
// user's, for compute-sanitizer and use-after-free hunts. This class holds the live ones
// by address with their tag and sizes; the CachingAllocator keeps the stats and the OOM
// message.
//
// Failure: an allocation that fails leaves nothing behind (Reservation, Chunk and Mapping
// roll back by RAII); a free whose unmap or release fails keeps the allocation.
//
// Thread-safety: none; the owning CachingAllocator calls it under its mutex.
#ifndef VMSTASH_ALLOCATOR_BYPASS_H_
#define VMSTASH_ALLOCATOR_BYPASS_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/snapshot.h"
#include "allocator/tag.h"
#include "vmm/chunk.h"
#include "vmm/driver.h"
#include "vmm/mapping.h"
#include "vmm/reservation.h"

namespace vmstash {

class BypassAllocations {
 public:
  struct Record {
    TagId tag = kDefaultTag;
    std::size_t size_bytes = 0;  // mapped (the request rounded up to the granularity)
    std::size_t requested_bytes = 0;
  };

  BypassAllocations(Driver* driver, int device, std::size_t granularity_bytes)
      : driver_(driver), device_(device), granularity_bytes_(granularity_bytes) {}
  // Unmaps, releases and frees what is left (errors logged).
  ~BypassAllocations() = default;
  BypassAllocations(const BypassAllocations&) = delete;
  BypassAllocations& operator=(const BypassAllocations&) = delete;

  // Maps `rounded` bytes, rounded up to the granularity, for `tag`. When the driver is out
  // of memory, `synchronize` runs (frees queued on the device land) and it tries once
  // more; the driver's error otherwise (ResourceExhausted when the device is full), or
  // synchronize's.
  absl::StatusOr<Record> Allocate(TagId tag, std::size_t requested_bytes, std::size_t rounded,
                                  const std::function<absl::Status()>& synchronize, DevicePtr* ptr);
  // Like cudaFree: synchronizes the device (the memory may still be in use by queued
  // work), then unmaps and releases the allocation at `ptr`, which Contains(). Its record.
  absl::StatusOr<Record> Free(DevicePtr ptr);
  bool Contains(DevicePtr ptr) const { return live_.contains(ptr); }
  std::size_t size() const { return live_.size(); }
  std::size_t BytesOf(TagId tag) const;
  std::size_t CountOf(TagId tag) const;
  // OK when `tag` (named `name`) holds none of these allocations; else FailedPrecondition
  // naming the option: a pause neither copies nor releases them (TransitionHost::
  // CheckPausableLocked).
  absl::Status CheckNoneOf(TagId tag, const std::string& name) const;
  void AppendSnapshot(Snapshot* snap) const;
  void Clear() { live_.clear(); }

 private:
  struct Allocation {
    Reservation reservation;
    Chunk chunk;
    Mapping mapping;
    Record record;
  };

  Driver* const driver_;
  const int device_;
  const std::size_t granularity_bytes_;
  absl::flat_hash_map<DevicePtr, std::unique_ptr<Allocation>> live_;
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_BYPASS_H_
