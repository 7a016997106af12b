// Driver: the narrow seam between vmstash and the GPU.
//
// Everything above vmm/ (allocator, stash, tools) talks to the GPU only through this
// interface, so the same code runs on CudaDriver (libcuda, loaded at run time) and on
// SimDriver (a CPU simulation used by CI and available at run time, VMSTASH_DRIVER=sim).
// The concrete driver is chosen at the top (CreateDriver in driver_factory.h, or a test).
//
// Vocabulary (docs/architecture.md §2): a *reservation* is a VA range; a *chunk* is one physical
// allocation, always mapped whole; the *granularity* is the unit every reservation,
// chunk and mapping size and address is a multiple of (query it, never assume 2 MiB).
//
// Contract shared by all methods:
//   - Every call names its device explicitly; nothing relies on a "current device". For
//     calls on process-wide objects (VA ranges, pinned host memory) `device` names the
//     context the call runs in.
//   - Errors are absl::Status with these codes: InvalidArgument (bad input: zero or
//     misaligned size/address, unknown handle, range outside a reservation; the message
//     names the value), ResourceExhausted (out of device or host memory),
//     FailedPrecondition (state: e.g. freeing a reservation that still has mappings),
//     Unimplemented (feature unsupported by the device), Unavailable (no usable driver),
//     Internal (anything else). CudaDriver messages carry the CUDA call and CUresult.
//   - A failed call changes nothing: no object is created, nothing is leaked.
//   - Async methods (suffix Async, RecordEvent, StreamWaitEvent) enqueue on `stream` and
//     return once queued; errors of the queued work may surface at a later synchronize.
//     Stream nullptr is the device's default stream. Host memory used by an async copy
//     must stay valid until the stream passes the copy; pinned memory makes copies truly
//     asynchronous.
//   - Methods are thread-safe; ordering between threads is the caller's business.
//   - Counters() and CheckNoLeaks() report every object made through this driver, so
//     tests (and the GPU conformance suite) prove that nothing leaked.
#ifndef VMSTASH_VMM_DRIVER_H_
#define VMSTASH_VMM_DRIVER_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "vmm/driver_op.h"

namespace vmstash {

// A device virtual address; same width and meaning as CUdeviceptr.
using DevicePtr = std::uint64_t;
// A chunk (physical allocation); same value as CUmemGenericAllocationHandle. 0 is never valid.
using ChunkHandle = std::uint64_t;
// A stream or event; the same pointer values as CUstream/cudaStream_t and CUevent.
struct StreamOpaque;
using Stream = StreamOpaque*;
struct EventOpaque;
using Event = EventOpaque*;
// The size of an event's handle for another process (Driver::ExportIpcEvent; CUipcEventHandle).
inline constexpr std::size_t kIpcEventHandleBytes = 64;

struct ChunkOptions {
  // Ask for a chunk that can be exported as a POSIX file descriptor (ExportChunkFd),
  // e.g. to share it with another process.
  bool shareable_fd = false;
  // Ask for a chunk usable by GPUDirect RDMA (NICs). Unimplemented where unsupported.
  bool gpu_direct_rdma = false;
};

enum class GranularityKind { kMinimum, kRecommended };

struct DeviceMemoryInfo {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
};

class Driver {
 public:
  virtual ~Driver() = default;

  // "cuda" or "sim".
  virtual absl::string_view Name() const = 0;

  // Number of usable devices (>= 0).
  virtual absl::StatusOr<int> DeviceCount() = 0;
  // Alignment and size unit for chunks with `options` on `device`.
  virtual absl::StatusOr<std::size_t> Granularity(int device, GranularityKind kind, ChunkOptions options) = 0;
  // Free and total device memory, as cuMemGetInfo reports it.
  virtual absl::StatusOr<DeviceMemoryInfo> MemoryInfo(int device) = 0;
  // The device's identity across processes ("GPU-" and its UUID, as nvidia-smi -L prints
  // it; the simulator: "sim-" and the ordinal): two processes share physical memory only on
  // the same device, whatever ordinals CUDA_VISIBLE_DEVICES gave it in each.
  virtual absl::StatusOr<std::string> DeviceUuid(int device) = 0;

  // --- Virtual address space ---------------------------------------------------------
  // Reserves `size_bytes` (a nonzero multiple of the granularity) of VA aligned to
  // `alignment_bytes` (0 = granularity; else a power-of-two multiple of it). Nothing is
  // mapped and no physical memory is used.
  virtual absl::StatusOr<DevicePtr> ReserveAddress(int device, std::size_t size_bytes,
                                                   std::size_t alignment_bytes) = 0;
  // Frees a whole reservation made by ReserveAddress. FailedPrecondition if any part of it
  // is still mapped; InvalidArgument if (va, size_bytes) is not exactly a reservation.
  virtual absl::Status FreeAddress(int device, DevicePtr va, std::size_t size_bytes) = 0;

  // --- Physical memory -----------------------------------------------------------------
  // Creates a chunk of `size_bytes` (a nonzero multiple of the granularity for `options`)
  // on `device`. ResourceExhausted when the device has not enough free memory.
  virtual absl::StatusOr<ChunkHandle> CreateChunk(int device, std::size_t size_bytes, ChunkOptions options) = 0;
  // Releases the handle. If the chunk is still mapped, its memory is freed when the last
  // mapping is unmapped (CUDA semantics). InvalidArgument for an unknown handle.
  virtual absl::Status ReleaseChunk(ChunkHandle chunk) = 0;
  // Exports a chunk created with shareable_fd as a new file descriptor the caller owns
  // (close it with close(2)). FailedPrecondition if it was created without shareable_fd.
  virtual absl::StatusOr<int> ExportChunkFd(ChunkHandle chunk) = 0;
  // A chunk exported by ExportChunkFd — in another process (the descriptor passed over a
  // Unix socket) or this one — as a new handle of this driver: the same physical memory,
  // of `size_bytes` (the exported chunk's size, a multiple of the granularity), on
  // `device` (the exporter's). `fd` stays the caller's (close it when done). The memory is
  // the exporter's: importing it takes no device memory, and it lives until every handle
  // of it, in any process, is released and unmapped. Map, SetAccess, Unmap and
  // ReleaseChunk as for any chunk; ExportChunkFd works on it too (CUDA exports no imported
  // handle: the driver keeps a copy of `fd` while the handle lives, one descriptor per
  // imported chunk, closed in a child forked without exec, and passes on copies of it). InvalidArgument for a
  // negative descriptor, a bad size or device, or a descriptor that is not an exported
  // chunk. A chunk smaller than `size_bytes`: InvalidArgument here on the simulator; CUDA
  // tells no handle's size, so the CUDA driver does not check it (its Map fails).
  virtual absl::StatusOr<ChunkHandle> ImportChunkFd(int device, int fd, std::size_t size_bytes) = 0;

  // Maps the whole `chunk` at `va`. `size_bytes` must equal the chunk's size (a partial
  // chunk is never mapped: InvalidArgument); [va, va+size) must lie inside one reservation,
  // be granularity-aligned and not overlap another mapping. The range is not accessible
  // until SetAccess.
  virtual absl::Status Map(DevicePtr va, std::size_t size_bytes, ChunkHandle chunk) = 0;
  // Unmaps [va, va+size), which must consist exactly of whole mappings (one or more).
  // Does not wait for queued work: the caller makes sure no queued work touches the range.
  virtual absl::Status Unmap(int device, DevicePtr va, std::size_t size_bytes) = 0;
  // Grants `device` read/write access to the mapped range [va, va+size).
  virtual absl::Status SetAccess(DevicePtr va, std::size_t size_bytes, int device) = 0;

  // --- Pinned host memory ----------------------------------------------------------------
  // Page-locked host memory usable by async copies of every device (portable).
  virtual absl::StatusOr<void*> HostAlloc(int device, std::size_t size_bytes) = 0;
  virtual absl::Status HostFree(int device, void* ptr) = 0;
  // Page-locks existing host memory [ptr, ptr+size) (page-aligned) for all devices.
  virtual absl::Status HostRegister(int device, void* ptr, std::size_t size_bytes) = 0;
  virtual absl::Status HostUnregister(int device, void* ptr) = 0;

  // --- Streams and events ----------------------------------------------------------------
  // A non-blocking stream (does not synchronize with the default stream).
  virtual absl::StatusOr<Stream> CreateStream(int device) = 0;
  virtual absl::Status DestroyStream(int device, Stream stream) = 0;
  // `timing`: the event can be used with ElapsedMs (costs a little more).
  virtual absl::StatusOr<Event> CreateEvent(int device, bool timing) = 0;
  virtual absl::Status DestroyEvent(int device, Event event) = 0;
  virtual absl::Status RecordEvent(int device, Event event, Stream stream) = 0;
  // True when all work captured by the last RecordEvent has completed (or never recorded).
  virtual absl::StatusOr<bool> QueryEvent(int device, Event event) = 0;
  virtual absl::Status SynchronizeEvent(int device, Event event) = 0;
  // Milliseconds between two completed timing events.
  virtual absl::StatusOr<float> ElapsedMs(int device, Event start, Event end) = 0;
  // Work queued on `stream` after this call waits for `event`.
  virtual absl::Status StreamWaitEvent(int device, Stream stream, Event event) = 0;
  virtual absl::Status SynchronizeStream(int device, Stream stream) = 0;
  // Waits for all work queued on the device by this process.
  virtual absl::Status SynchronizeDevice(int device) = 0;

  // --- Events shared between processes --------------------------------------------------
  // An event that another process using the same device can wait for (CUDA: an
  // interprocess event, without timing). RecordEvent, QueryEvent, SynchronizeEvent,
  // StreamWaitEvent and DestroyEvent as for any event.
  virtual absl::StatusOr<Event> CreateIpcEvent(int device) = 0;
  // The handle of `event` (made by CreateIpcEvent) for another process: kIpcEventHandleBytes
  // opaque bytes. InvalidArgument for an event not made by CreateIpcEvent.
  virtual absl::StatusOr<std::string> ExportIpcEvent(int device, Event event) = 0;
  // Another process's event from its handle, as an event of this process (destroyed with
  // DestroyEvent; the exporter's stays its own). Only StreamWaitEvent, QueryEvent,
  // SynchronizeEvent and DestroyEvent apply to it. A wait orders against the exporter's
  // last RecordEvent *before* the wait is queued: a handle must cross only after its
  // record. InvalidArgument for a malformed handle, or (the simulator) one whose exporter
  // destroyed the event; FailedPrecondition in the process that exported it (CUDA:
  // CUDA_ERROR_INVALID_CONTEXT; the simulator: in the SimDriver that exported it).
  virtual absl::StatusOr<Event> OpenIpcEvent(int device, const std::string& handle) = 0;

  // --- Copies ----------------------------------------------------------------------------
  virtual absl::Status CopyToHostAsync(int device, void* dst, DevicePtr src, std::size_t size_bytes,
                                       Stream stream) = 0;
  virtual absl::Status CopyToDeviceAsync(int device, DevicePtr dst, const void* src, std::size_t size_bytes,
                                         Stream stream) = 0;
  virtual absl::Status CopyDeviceAsync(int device, DevicePtr dst, DevicePtr src, std::size_t size_bytes,
                                       Stream stream) = 0;
  virtual absl::Status MemsetAsync(int device, DevicePtr dst, std::uint8_t value, std::size_t size_bytes,
                                   Stream stream) = 0;

  // --- Threads ---------------------------------------------------------------------------
  // Exempts the calling thread, for the rest of its life, from the rules of other threads'
  // stream captures: a CUDA graph captured in another thread in global mode (torch.cuda.graph's
  // default) is invalidated by any "potentially unsafe" call a thread in global mode makes
  // meanwhile (cuMemHostRegister, cuMemCreate, a synchronization, ...), so vmstash's own
  // background threads call this first (cuThreadExchangeStreamCaptureMode, relaxed). Their
  // calls are not stream-ordered work, so no capture is changed by them. Never fails.
  virtual void RelaxStreamCaptureForThisThread() {}

  // --- Accounting ------------------------------------------------------------------------
  virtual DriverCounters Counters() const = 0;
  // OK when no reservation, chunk, mapping, host allocation/registration, stream or event
  // made through this driver is alive; else FailedPrecondition listing what is.
  virtual absl::Status CheckNoLeaks() const = 0;
};

}  // namespace vmstash

#endif  // VMSTASH_VMM_DRIVER_H_
