// SimDriver: a faithful CPU simulation of the Driver, for CI and for running anywhere
// (VMSTASH_DRIVER=sim).
//
// Memory is real, so tests prove that data survives pause/resume at the same address:
//   reservation = mmap(PROT_NONE, MAP_NORESERVE) of host VA; a DevicePtr is a host address
//   chunk       = a memfd of the chunk's size (no RSS until touched)
//   Map         = mmap(MAP_FIXED | MAP_SHARED) of the memfd over the reservation, PROT_NONE
//   SetAccess   = mprotect(PROT_READ | PROT_WRITE)
//   Unmap       = mmap(MAP_FIXED, PROT_NONE, anonymous) back over the range
//   copies      = memcpy, executed eagerly when enqueued (streams and events complete at
//                 once; that is a legal schedule of the CUDA semantics)
//   IPC event   = an event backed by a small POSIX shared-memory object (shm_open, named
//                 in its 64-byte handle) holding how often its exporter recorded it, so
//                 another process opens it by name. A wait on an opened
//                 event that was never recorded fails (FailedPrecondition): the handle
//                 crossed before its record, and on a GPU that wait would order nothing.
//                 The exporter's DestroyEvent unlinks the name; an open after it fails.
//                 The driver that exported a handle cannot open it (FailedPrecondition),
//                 as CUDA refuses it in the exporting process (CUDA_ERROR_INVALID_CONTEXT);
//                 another SimDriver of the process, standing for another process, can.
//   held stream = HoldStream() makes events recorded on a stream stay pending (QueryEvent
//                 false) until ReleaseStream(), or until someone waits for them
//                 (SynchronizeEvent/Stream/Device end the hold, as waiting on a GPU lets the
//                 work finish). Tests use it to model slow GPU work for stream-ordered reuse.
// Device capacity is configurable per device, so out-of-memory happens like on a GPU: a
// chunk's bytes count until its handle is released and its last mapping is gone.
//
// Fault injection: "fail the Nth call of operation X with code E" (FaultRule), set at
// construction (VmmOptions::sim_faults, VMSTASH_CONF sim_fail:...) or at run time. An injected
// failure happens before any state changes, like a real driver error.
//
// Misuse the real driver would only catch as a crash is reported: copies from/to ranges
// that are not mapped with access return InvalidArgument instead of faulting.
//
// Thread-safety: all methods are thread-safe.
#ifndef VMSTASH_VMM_SIM_DRIVER_H_
#define VMSTASH_VMM_SIM_DRIVER_H_

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <utility>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "vmm/driver.h"
#include "vmm/driver_ledger.h"
#include "base/mutex.h"
#include "vmm/vmm_options.h"

namespace vmstash {

struct SimDriverOptions {
  int devices = 1;
  std::size_t capacity_bytes = std::size_t{16} << 30;  // per device
  std::size_t granularity_bytes = std::size_t{2} << 20;
  std::vector<FaultRule> faults;

  static SimDriverOptions FromOptions(const VmmOptions& options);
};

class SimDriver final : public Driver {
 public:
  explicit SimDriver(SimDriverOptions options = {});
  ~SimDriver() override;
  SimDriver(const SimDriver&) = delete;
  SimDriver& operator=(const SimDriver&) = delete;

  // Adds a rule; N counts calls of the rule's operation made after this call.
  void InjectFault(FaultRule rule);
  void ClearFaults();
  // Bytes of device memory in use on `device` (chunks not yet freed).
  std::size_t UsedBytes(int device) const;
  // Whether host address `ptr` is page-locked (registered or HostAlloc'ed), as
  // cudaHostGetFlags(ptr) succeeding tells on a GPU.
  bool HostPageLocked(const void* ptr) const { return ledger_.HostPageLocked(ptr); }
  const SimDriverOptions& options() const { return options_; }
  // See "held stream" above. `stream` may be nullptr (the default stream).
  void HoldStream(int device, Stream stream);
  void ReleaseStream(int device, Stream stream);
  // True while a hold of `stream` has not ended (released, or waited for).
  bool StreamHeld(int device, Stream stream) const;
  // Runs `fn(device)` in the calling thread right after every successful
  // SynchronizeDevice (nullptr: none). Tests use it to act in the window between a
  // synchronization and what the caller does after it.
  void SetAfterSynchronizeDevice(std::function<void(int device)> fn);
  // Runs `fn(op)` in the calling thread at the start of every driver call, before it is
  // counted or faulted (nullptr: none). Tests use it to act at the worst moment between
  // two driver calls of a transition; `fn` may call into the driver (and so see itself).
  void SetBeforeCall(std::function<void(DriverOp op)> fn);

  absl::string_view Name() const override { return "sim"; }
  absl::StatusOr<int> DeviceCount() override;
  absl::StatusOr<std::size_t> Granularity(int device, GranularityKind kind, ChunkOptions options) override;
  absl::StatusOr<DeviceMemoryInfo> MemoryInfo(int device) override;
  absl::StatusOr<std::string> DeviceUuid(int device) override;
  absl::StatusOr<DevicePtr> ReserveAddress(int device, std::size_t size_bytes, std::size_t alignment_bytes) override;
  absl::Status FreeAddress(int device, DevicePtr va, std::size_t size_bytes) override;
  absl::StatusOr<ChunkHandle> CreateChunk(int device, std::size_t size_bytes, ChunkOptions options) override;
  absl::Status ReleaseChunk(ChunkHandle chunk) override;
  absl::StatusOr<int> ExportChunkFd(ChunkHandle chunk) override;
  absl::StatusOr<ChunkHandle> ImportChunkFd(int device, int fd, std::size_t size_bytes) override;
  absl::Status Map(DevicePtr va, std::size_t size_bytes, ChunkHandle chunk) override;
  absl::Status Unmap(int device, DevicePtr va, std::size_t size_bytes) override;
  absl::Status SetAccess(DevicePtr va, std::size_t size_bytes, int device) override;
  absl::StatusOr<void*> HostAlloc(int device, std::size_t size_bytes) override;
  absl::Status HostFree(int device, void* ptr) override;
  absl::Status HostRegister(int device, void* ptr, std::size_t size_bytes) override;
  absl::Status HostUnregister(int device, void* ptr) override;
  absl::StatusOr<Stream> CreateStream(int device) override;
  absl::Status DestroyStream(int device, Stream stream) override;
  absl::StatusOr<Event> CreateEvent(int device, bool timing) override;
  absl::Status DestroyEvent(int device, Event event) override;
  absl::Status RecordEvent(int device, Event event, Stream stream) override;
  absl::StatusOr<bool> QueryEvent(int device, Event event) override;
  absl::Status SynchronizeEvent(int device, Event event) override;
  absl::StatusOr<float> ElapsedMs(int device, Event start, Event end) override;
  absl::Status StreamWaitEvent(int device, Stream stream, Event event) override;
  absl::Status SynchronizeStream(int device, Stream stream) override;
  absl::Status SynchronizeDevice(int device) override;
  absl::StatusOr<Event> CreateIpcEvent(int device) override;
  absl::StatusOr<std::string> ExportIpcEvent(int device, Event event) override;
  absl::StatusOr<Event> OpenIpcEvent(int device, const std::string& handle) override;
  absl::Status CopyToHostAsync(int device, void* dst, DevicePtr src, std::size_t size_bytes, Stream stream) override;
  absl::Status CopyToDeviceAsync(int device, DevicePtr dst, const void* src, std::size_t size_bytes,
                                 Stream stream) override;
  absl::Status CopyDeviceAsync(int device, DevicePtr dst, DevicePtr src, std::size_t size_bytes,
                               Stream stream) override;
  absl::Status MemsetAsync(int device, DevicePtr dst, std::uint8_t value, std::size_t size_bytes,
                           Stream stream) override;
  DriverCounters Counters() const override { return counters_.Snapshot(); }
  // Leaks, and ordering violations: an Unmap of memory that an async copy or memset
  // queued on some stream may still touch, because nothing synchronized with it (the
  // stream, the device, or an event recorded after it). The simulator executes work
  // eagerly, so it cannot fault like a GPU would; it remembers instead.
  absl::Status CheckNoLeaks() const override;
  // The ordering part of CheckNoLeaks alone.
  absl::Status CheckOrdering() const;

 private:
  struct ArmedRule {
    FaultRule rule;
    std::uint64_t base = 0;  // calls of rule.op before the rule was armed
  };

  // Counts the call and applies fault rules; a non-OK result is the injected failure.
  absl::Status Enter(DriverOp op);
  absl::Status CheckDevice(int device) const { return CheckDeviceIndex(device, options_.devices); }
  void FreeChunkMemory(const ChunkRecord& record);
  // True while `event` (a SimEvent) waits for a hold that has not ended.
  bool EventPending(int device, const void* event) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(hold_mu_);

  const SimDriverOptions options_;
  const std::uint64_t instance_;  // this driver among the process's, for OpenIpcEvent
  OpCounters counters_;
  DriverLedger ledger_{"sim"};
  std::unique_ptr<std::atomic<std::size_t>[]> used_bytes_;
  // The memory of the chunks created here, by memfd inode: how many handles (the chunk's,
  // and imports of it in this driver) still hold it; counted in used_bytes_ until none does.
  struct Physical {
    int device = 0;
    std::size_t size_bytes = 0;
    int holders = 0;
  };
  mutable Mutex physical_mu_;
  absl::flat_hash_map<std::uint64_t, Physical> physical_ ABSL_GUARDED_BY(physical_mu_);
  std::atomic<ChunkHandle> next_chunk_{1};
  mutable Mutex fault_mu_;
  std::vector<ArmedRule> faults_ ABSL_GUARDED_BY(fault_mu_);
  mutable Mutex hook_mu_;
  std::function<void(int)> after_sync_ ABSL_GUARDED_BY(hook_mu_);
  std::function<void(DriverOp)> before_call_ ABSL_GUARDED_BY(hook_mu_);
  std::atomic<bool> has_before_call_{false};
  mutable Mutex hold_mu_;
  absl::flat_hash_map<std::pair<int, Stream>, std::uint64_t> held_ ABSL_GUARDED_BY(hold_mu_);
  std::uint64_t hold_generation_ ABSL_GUARDED_BY(hold_mu_) = 0;
  // Work queued per (device, stream) and not yet synchronized with.
  struct InFlight {
    DevicePtr va;
    std::size_t size_bytes;
    std::uint64_t seq;
  };
  void NoteInFlight(int device, Stream stream, DevicePtr va, std::size_t size_bytes);
  void Synchronized(int device, Stream stream, std::uint64_t up_to_seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hold_mu_);
  absl::flat_hash_map<std::pair<int, Stream>, std::vector<InFlight>> in_flight_ ABSL_GUARDED_BY(hold_mu_);
  std::uint64_t seq_ ABSL_GUARDED_BY(hold_mu_) = 0;
  std::vector<std::string> ordering_violations_ ABSL_GUARDED_BY(hold_mu_);
};

}  // namespace vmstash

#endif  // VMSTASH_VMM_SIM_DRIVER_H_
