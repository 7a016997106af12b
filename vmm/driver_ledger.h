// DriverLedger: the bookkeeping both drivers share.
//
// It records every object a Driver hands out (reservations, chunks, mappings, pinned host
// memory, streams, events), validates arguments against that record before the backend is
// called, and reports what is still alive (CheckNoLeaks). With it CudaDriver and SimDriver
// reject bad input with the same InvalidArgument/FailedPrecondition messages, and the GPU
// conformance suite can prove that nothing leaked on real hardware too.
//
// Note [Ledger Claims]
// Calls that change mappings or release objects run in three steps:
//   validate + claim in the ledger  ->  call the backend  ->  commit, or undo on failure.
// The claim is recorded before the backend runs, so a concurrent conflicting call (two
// Maps of one range, an Unmap racing a Map) fails validation instead of racing inside the
// backend, and the undo restores the ledger exactly: a failed call changes nothing.
// Creations (reserve, create chunk, host alloc, streams, events) call the backend first
// and record after success; there is nothing to conflict with.
//
// Layout: ordered maps for address ranges (reservations, mappings), hash maps for handles.
// Thread-safety: every method takes the ledger's mutex; none calls out while holding it.
#ifndef VMSTASH_VMM_DRIVER_LEDGER_H_
#define VMSTASH_VMM_DRIVER_LEDGER_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "vmm/driver.h"
#include "base/mutex.h"

namespace vmstash {

struct ChunkRecord {
  int device = 0;
  std::size_t size_bytes = 0;
  ChunkOptions options;
  bool released = false;  // handle released; memory lives until the last unmap
  int map_count = 0;
  std::int64_t backend = -1;  // backend-private (SimDriver: the memfd; CudaDriver: an import's descriptor)
  bool imported = false;      // ImportChunkFd: the exporter's memory, not this driver's
  std::uint64_t physical = 0;  // backend-private (SimDriver: the memfd's inode, its memory's identity)
};

struct MappingRecord {
  DevicePtr va = 0;
  std::size_t size_bytes = 0;
  ChunkHandle chunk = 0;
  std::uint64_t access_mask = 0;  // bit d: device d has read/write access
};

// InvalidArgument unless `size_bytes` is a nonzero multiple of `granularity`.
absl::Status CheckGranularSize(const char* what, std::size_t size_bytes, std::size_t granularity);
// InvalidArgument unless `value` is a multiple of `granularity`.
absl::Status CheckGranularAddress(const char* what, std::uint64_t value, std::size_t granularity);
// InvalidArgument unless 0 <= device < device_count.
absl::Status CheckDeviceIndex(int device, int device_count);

class DriverLedger {
 public:
  explicit DriverLedger(std::string driver_name) : driver_name_(std::move(driver_name)) {}

  // Reservations.
  absl::Status AddReservation(DevicePtr va, std::size_t size_bytes);
  // Validates that (va, size) is exactly a reservation with no mapping inside and removes it.
  absl::Status TakeReservation(DevicePtr va, std::size_t size_bytes);

  // Chunks.
  void AddChunk(ChunkHandle chunk, const ChunkRecord& record);
  // The record of a live (unreleased) chunk; InvalidArgument naming the handle otherwise.
  absl::StatusOr<ChunkRecord> GetChunk(ChunkHandle chunk) const;
  // Marks the chunk released (validating it is live). Returns the record and whether its
  // memory is gone now (true when it had no mapping; the record is then erased).
  absl::StatusOr<std::pair<ChunkRecord, bool>> ReleaseChunk(ChunkHandle chunk);
  // Undoes ReleaseChunk after a backend failure.
  void UnreleaseChunk(ChunkHandle chunk, const ChunkRecord& record);

  // Mappings. ClaimMap validates the whole Map contract (chunk live, size equals the
  // chunk's size, aligned, inside one reservation, no overlap) and records the mapping.
  // Returns the chunk's record, so the caller needs no second lookup.
  absl::StatusOr<ChunkRecord> ClaimMap(DevicePtr va, std::size_t size_bytes, ChunkHandle chunk,
                                       std::size_t granularity);
  void AbortMap(DevicePtr va);
  // Validates that (va, size) is exactly one mapping and removes it.
  absl::StatusOr<MappingRecord> ClaimUnmap(DevicePtr va, std::size_t size_bytes);
  void AbortUnmap(const MappingRecord& record);
  // After a successful unmap: drops the chunk's map count. Returns {true, record} when the
  // chunk's memory is gone now (handle released and no mapping left), else {false, ...}.
  std::pair<bool, ChunkRecord> CommitUnmap(const MappingRecord& record);
  // Validates that [va, va+size) is covered contiguously by mappings.
  absl::Status CheckMapped(DevicePtr va, std::size_t size_bytes) const;
  absl::Status GrantAccess(DevicePtr va, std::size_t size_bytes, int device);
  // Validates that [va, va+size) is mapped and accessible to `device`.
  absl::Status CheckAccessible(DevicePtr va, std::size_t size_bytes, int device) const;

  // Host memory, streams, events: presence sets.
  void AddHostAlloc(void* ptr, std::size_t size_bytes);
  absl::StatusOr<std::size_t> TakeHostAlloc(void* ptr);
  absl::Status AddHostRegistration(void* ptr, std::size_t size_bytes);
  absl::StatusOr<std::size_t> TakeHostRegistration(void* ptr);
  // A copy's host range: InvalidArgument when it overlaps a registration (or a HostAlloc)
  // without lying inside it, as the CUDA driver refuses a copy across two registrations.
  absl::Status CheckHostCopy(const void* ptr, std::size_t size_bytes) const;
  // Whether `ptr` lies in a registration or a HostAlloc: where cudaHostGetFlags succeeds.
  bool HostPageLocked(const void* ptr) const;
  void AddStream(Stream stream, int device);
  absl::Status TakeStream(Stream stream, int device);
  absl::Status CheckStream(Stream stream, int device) const;  // nullptr (default) always OK
  void AddEvent(Event event, int device);
  absl::Status TakeEvent(Event event, int device);
  absl::Status CheckEvent(Event event, int device) const;

  absl::Status CheckNoLeaks() const;
  // Streams and events still alive, taken out of the ledger (a driver's teardown frees
  // them, as destroying a CUDA context does).
  std::vector<Stream> TakeAllStreams();
  std::vector<Event> TakeAllEvents();

 private:
  absl::Status CheckMappedLocked(DevicePtr va, std::size_t size_bytes, int device) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string driver_name_;
  mutable Mutex mu_;
  std::map<DevicePtr, std::size_t> reservations_ ABSL_GUARDED_BY(mu_);
  std::map<DevicePtr, MappingRecord> mappings_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<ChunkHandle, ChunkRecord> chunks_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<void*, std::size_t> host_allocs_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<void*, std::size_t> host_registrations_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<Stream, int> streams_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<Event, int> events_ ABSL_GUARDED_BY(mu_);
};

}  // namespace vmstash

#endif  // VMSTASH_VMM_DRIVER_LEDGER_H_
