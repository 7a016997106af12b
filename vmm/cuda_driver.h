// CudaDriver: the Driver on a real GPU, through the CUDA driver API.
//
// libcuda.so.1 is loaded at run time (dlopen + cuGetProcAddress_v2, entry points listed
// once in cu_entry_points.h), so nothing links libcuda at build time and every binary
// loads on machines without a GPU; Create() then returns Unavailable.
//
// Contexts: each device's primary context (the one the CUDA runtime and PyTorch use) is
// retained on first use and pushed around every call that needs one, then popped, so the
// caller's current context is never changed and no call depends on it.
//
// Streams and events: any CUstream of the device is accepted (PyTorch's too); only those
// this driver created are counted by the leak check. Chunks are CU_MEM_ALLOCATION_TYPE_PINNED
// device memory, optionally exportable as POSIX fds and GPUDirect-RDMA capable.
//
// Interprocess events (CreateIpcEvent) are CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING
// events; their handle is the 64 bytes of CUipcEventHandle. An opened one (OpenIpcEvent)
// is a CUevent of this process, counted and destroyed like any event this driver made.
// CUDA refuses to open a handle in the process that exported it (CUDA_ERROR_INVALID_CONTEXT:
// FailedPrecondition; seen on an H200).
//
// Thread-safety: all methods are thread-safe. The object must outlive everything made
// through it.
#ifndef VMSTASH_VMM_CUDA_DRIVER_H_
#define VMSTASH_VMM_CUDA_DRIVER_H_

#include <cuda.h>

#include <atomic>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "vmm/cu_entry_points.h"
#include "vmm/driver.h"
#include "vmm/driver_ledger.h"
#include "base/mutex.h"

namespace vmstash {

class CudaDriver final : public Driver {
 public:
  // Unavailable when libcuda.so.1 cannot be loaded or initialized (no driver, no GPU).
  static absl::StatusOr<std::unique_ptr<CudaDriver>> Create();
  ~CudaDriver() override;
  CudaDriver(const CudaDriver&) = delete;
  CudaDriver& operator=(const CudaDriver&) = delete;

  // CUDA driver version, e.g. 13000.
  int driver_version() const { return driver_version_; }

  absl::string_view Name() const override { return "cuda"; }
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
  void RelaxStreamCaptureForThisThread() override;
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
  absl::Status CheckNoLeaks() const override { return ledger_.CheckNoLeaks(); }

 private:
  struct Api {
#define VMSTASH_CU_MEMBER(name) decltype(&::name) name = nullptr;
    VMSTASH_CU_ENTRY_POINTS(VMSTASH_CU_MEMBER)
#undef VMSTASH_CU_MEMBER
  };
  class ScopedContext;

  CudaDriver(void* library, const Api& api, int device_count, int driver_version);
  // Retains the device's primary context on first use.
  absl::StatusOr<CUcontext> Context(int device);
  absl::StatusOr<std::size_t> MinimumGranularity(int device);
  absl::Status Fail(CUresult result, const char* call, absl::string_view detail = {});

  void* const library_;
  const Api api_;
  const int device_count_;
  const int driver_version_;
  OpCounters counters_;
  DriverLedger ledger_{"cuda"};
  Mutex context_mu_;
  std::vector<CUcontext> contexts_ ABSL_GUARDED_BY(context_mu_);
  std::unique_ptr<std::atomic<std::size_t>[]> granularity_;  // minimum, 0 until queried
  // The events CreateIpcEvent made and DestroyEvent has not destroyed: the only ones
  // ExportIpcEvent accepts (CUDA would also export an opened one; the contract does not).
  Mutex ipc_mu_;
  std::unordered_set<Event> ipc_events_ ABSL_GUARDED_BY(ipc_mu_);
};

}  // namespace vmstash

#endif  // VMSTASH_VMM_CUDA_DRIVER_H_
