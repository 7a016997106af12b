#include "vmm/cuda_driver.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <set>

#include <cstdint>

#include <utility>

#include "absl/strings/str_cat.h"
#include "vmm/cu_status.h"
#include "base/log.h"
#include "base/status_macros.h"

namespace vmstash {
namespace {

using GetProcAddressFn = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);

// The descriptors imported chunks keep (ImportChunkFd), process-wide: a child forked
// without exec closes its copies at once — it cannot use the parent's CUDA context, and
// its copies would keep the memory allocated until it exits. The lock is held across
// fork (pthread_atfork), so the child never finds it taken.
class KeptDescriptors {
 public:
  static KeptDescriptors& Get() {
    static KeptDescriptors* kept = new KeptDescriptors();  // never destroyed: fork may come late
    return *kept;
  }
  void Add(int fd) {
    std::lock_guard<std::mutex> lock(mu_);
    fds_.insert(fd);
  }
  void Remove(int fd) {
    std::lock_guard<std::mutex> lock(mu_);
    fds_.erase(fd);
  }

 private:
  KeptDescriptors() {
    (void)::pthread_atfork([] { Get().mu_.lock(); }, [] { Get().mu_.unlock(); },
                           [] {
                             KeptDescriptors& k = Get();
                             for (int fd : k.fds_) ::close(fd);
                             k.fds_.clear();
                             k.mu_.unlock();
                           });
  }
  std::mutex mu_;
  std::set<int> fds_;
};

CUmemAllocationProp ChunkProperties(int device, ChunkOptions options) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes =
      options.shareable_fd ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
  prop.allocFlags.gpuDirectRDMACapable = options.gpu_direct_rdma ? 1 : 0;
  return prop;
}

static_assert(sizeof(CUipcEventHandle::reserved) == kIpcEventHandleBytes,
              "kIpcEventHandleBytes is the size of CUipcEventHandle");

CUstream AsCu(Stream s) { return reinterpret_cast<CUstream>(s); }
CUevent AsCu(Event e) { return reinterpret_cast<CUevent>(e); }

}  // namespace

// Pushes a device's primary context for the duration of one call.
class CudaDriver::ScopedContext {
 public:
  explicit ScopedContext(const Api& api) : api_(api) {}
  ~ScopedContext() {
    if (pushed_) {
      CUcontext ignored = nullptr;
      api_.cuCtxPopCurrent(&ignored);
    }
  }
  absl::Status Push(CUcontext context) {
    VMSTASH_RETURN_IF_ERROR(CuStatus(api_.cuCtxPushCurrent(context), "cuCtxPushCurrent"));
    pushed_ = true;
    return absl::OkStatus();
  }

 private:
  const Api& api_;
  bool pushed_ = false;
};

#define VMSTASH_WITH_CONTEXT(device)                                        \
  ScopedContext vmstash_scoped_context_(api_);                              \
  do {                                                                      \
    VMSTASH_ASSIGN_OR_RETURN(CUcontext vmstash_ctx_, Context(device));      \
    VMSTASH_RETURN_IF_ERROR(vmstash_scoped_context_.Push(vmstash_ctx_));    \
  } while (0)

absl::StatusOr<std::unique_ptr<CudaDriver>> CudaDriver::Create() {
  void* library = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = ::dlerror();
    return absl::UnavailableError(absl::StrCat("cannot load libcuda.so.1 (no NVIDIA driver?): ",
                                               why == nullptr ? "unknown error" : why));
  }
  auto get_proc = reinterpret_cast<GetProcAddressFn>(::dlsym(library, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    ::dlclose(library);
    return absl::UnavailableError("libcuda.so.1 has no cuGetProcAddress_v2: the NVIDIA driver is older than CUDA 12");
  }
  Api api;
  absl::Status missing = absl::OkStatus();
#define VMSTASH_CU_LOAD(name)                                                                      \
  if (missing.ok()) {                                                                               \
    void* fn = nullptr;                                                                             \
    CUdriverProcAddressQueryResult found{};                                                         \
    CUresult r = get_proc(#name, &fn, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &found);           \
    if (r != CUDA_SUCCESS || fn == nullptr || found != CU_GET_PROC_ADDRESS_SUCCESS) {               \
      missing = absl::UnavailableError(absl::StrCat("libcuda.so.1: entry point " #name              \
                                                    " (CUDA ", CUDA_VERSION, ") not found (",     \
                                                    CuResultName(r), ")"));                        \
    } else {                                                                                        \
      api.name = reinterpret_cast<decltype(api.name)>(fn);                                          \
    }                                                                                               \
  }
  VMSTASH_CU_ENTRY_POINTS(VMSTASH_CU_LOAD)
#undef VMSTASH_CU_LOAD
  if (!missing.ok()) {
    ::dlclose(library);
    return missing;
  }
  absl::Status status = CuStatus(api.cuInit(0), "cuInit");
  int count = 0;
  int version = 0;
  if (status.ok()) status = CuStatus(api.cuDeviceGetCount(&count), "cuDeviceGetCount");
  if (status.ok()) status = CuStatus(api.cuDriverGetVersion(&version), "cuDriverGetVersion");
  if (!status.ok()) {
    ::dlclose(library);
    return absl::UnavailableError(absl::StrCat("CUDA driver unusable: ", status.message()));
  }
  return std::unique_ptr<CudaDriver>(new CudaDriver(library, api, count, version));
}

CudaDriver::CudaDriver(void* library, const Api& api, int device_count, int driver_version)
    : library_(library),
      api_(api),
      device_count_(device_count),
      driver_version_(driver_version),
      contexts_(device_count, nullptr),
      granularity_(new std::atomic<std::size_t>[device_count > 0 ? device_count : 1]) {
  for (int d = 0; d < device_count_; ++d) granularity_[d].store(0);
}

CudaDriver::~CudaDriver() {
  absl::Status leaks = ledger_.CheckNoLeaks();
  if (!leaks.ok()) VMSTASH_LOG(kWarning, "CudaDriver destroyed with live objects: {}", leaks.message());
  MutexLock lock(&context_mu_);
  for (int d = 0; d < device_count_; ++d) {
    if (contexts_[d] == nullptr) continue;
    CUdevice dev = 0;
    if (api_.cuDeviceGet(&dev, d) == CUDA_SUCCESS) api_.cuDevicePrimaryCtxRelease(dev);
  }
  // libcuda stays loaded: other code in the process (PyTorch) may use it, and unloading a
  // driver library at exit is a known source of crashes.
}

absl::Status CudaDriver::Fail(CUresult result, const char* call, absl::string_view detail) {
  counters_.CountFailure();
  return CuStatus(result, call, detail);
}

absl::StatusOr<CUcontext> CudaDriver::Context(int device) {
  VMSTASH_RETURN_IF_ERROR(CheckDeviceIndex(device, device_count_));
  MutexLock lock(&context_mu_);
  if (contexts_[device] != nullptr) return contexts_[device];
  CUdevice dev = 0;
  CUresult r = api_.cuDeviceGet(&dev, device);
  if (r != CUDA_SUCCESS) return Fail(r, "cuDeviceGet");
  int vmm = 0;
  r = api_.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
  if (r != CUDA_SUCCESS) return Fail(r, "cuDeviceGetAttribute");
  if (vmm == 0) {
    return absl::UnimplementedError(absl::StrCat("device ", device, " does not support virtual memory management"));
  }
  CUcontext context = nullptr;
  r = api_.cuDevicePrimaryCtxRetain(&context, dev);
  if (r != CUDA_SUCCESS) return Fail(r, "cuDevicePrimaryCtxRetain");
  contexts_[device] = context;
  return context;
}

absl::StatusOr<std::size_t> CudaDriver::MinimumGranularity(int device) {
  VMSTASH_RETURN_IF_ERROR(CheckDeviceIndex(device, device_count_));
  std::size_t cached = granularity_[device].load(std::memory_order_relaxed);
  if (cached != 0) return cached;
  CUmemAllocationProp prop = ChunkProperties(device, ChunkOptions{});
  std::size_t g = 0;
  CUresult r = api_.cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != CUDA_SUCCESS) return Fail(r, "cuMemGetAllocationGranularity");
  granularity_[device].store(g, std::memory_order_relaxed);
  return g;
}

absl::StatusOr<int> CudaDriver::DeviceCount() {
  counters_.Count(DriverOp::kDeviceCount);
  return device_count_;
}

absl::StatusOr<std::size_t> CudaDriver::Granularity(int device, GranularityKind kind, ChunkOptions options) {
  counters_.Count(DriverOp::kGranularity);
  VMSTASH_RETURN_IF_ERROR(CheckDeviceIndex(device, device_count_));
  CUmemAllocationProp prop = ChunkProperties(device, options);
  std::size_t g = 0;
  CUresult r = api_.cuMemGetAllocationGranularity(
      &g, &prop,
      kind == GranularityKind::kMinimum ? CU_MEM_ALLOC_GRANULARITY_MINIMUM : CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  if (r != CUDA_SUCCESS) return Fail(r, "cuMemGetAllocationGranularity");
  return g;
}

absl::StatusOr<DeviceMemoryInfo> CudaDriver::MemoryInfo(int device) {
  counters_.Count(DriverOp::kMemoryInfo);
  VMSTASH_WITH_CONTEXT(device);
  DeviceMemoryInfo info;
  CUresult r = api_.cuMemGetInfo(&info.free_bytes, &info.total_bytes);
  if (r != CUDA_SUCCESS) return Fail(r, "cuMemGetInfo");
  return info;
}

absl::StatusOr<std::string> CudaDriver::DeviceUuid(int device) {
  counters_.Count(DriverOp::kDeviceUuid);
  VMSTASH_RETURN_IF_ERROR(CheckDeviceIndex(device, device_count_));
  CUdevice dev = 0;
  CUresult r = api_.cuDeviceGet(&dev, device);
  if (r != CUDA_SUCCESS) return Fail(r, "cuDeviceGet");
  CUuuid uuid{};
  r = api_.cuDeviceGetUuid(&uuid, dev);
  if (r != CUDA_SUCCESS) return Fail(r, "cuDeviceGetUuid");
  const auto* b = reinterpret_cast<const unsigned char*>(uuid.bytes);
  std::string out = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    absl::StrAppend(&out, absl::Hex(b[i], absl::kZeroPad2));
  }
  return out;
}

absl::StatusOr<DevicePtr> CudaDriver::ReserveAddress(int device, std::size_t size_bytes, std::size_t alignment_bytes) {
  counters_.Count(DriverOp::kReserveAddress);
  VMSTASH_ASSIGN_OR_RETURN(std::size_t g, MinimumGranularity(device));
  VMSTASH_RETURN_IF_ERROR(CheckGranularSize("ReserveAddress", size_bytes, g));
  std::size_t align = alignment_bytes == 0 ? g : alignment_bytes;
  if ((align & (align - 1)) != 0 || align % g != 0) {
    return absl::InvalidArgumentError(absl::StrCat("ReserveAddress: alignment ", alignment_bytes,
                                                   " is not a power-of-two multiple of the granularity ", g));
  }
  VMSTASH_WITH_CONTEXT(device);
  CUdeviceptr va = 0;
  CUresult r = api_.cuMemAddressReserve(&va, size_bytes, align, 0, 0);
  if (r != CUDA_SUCCESS) return Fail(r, "cuMemAddressReserve", absl::StrCat(size_bytes, " bytes"));
  absl::Status recorded = ledger_.AddReservation(va, size_bytes);
  if (!recorded.ok()) {
    api_.cuMemAddressFree(va, size_bytes);
    return recorded;
  }
  return static_cast<DevicePtr>(va);
}

absl::Status CudaDriver::FreeAddress(int device, DevicePtr va, std::size_t size_bytes) {
  counters_.Count(DriverOp::kFreeAddress);
  VMSTASH_RETURN_IF_ERROR(CheckDeviceIndex(device, device_count_));
  VMSTASH_RETURN_IF_ERROR(ledger_.TakeReservation(va, size_bytes));
  VMSTASH_WITH_CONTEXT(device);
  CUresult r = api_.cuMemAddressFree(va, size_bytes);
  if (r != CUDA_SUCCESS) {
    (void)ledger_.AddReservation(va, size_bytes);
    return Fail(r, "cuMemAddressFree");
  }
  return absl::OkStatus();
}

absl::StatusOr<ChunkHandle> CudaDriver::CreateChunk(int device, std::size_t size_bytes, ChunkOptions options) {
  counters_.Count(DriverOp::kCreateChunk);
  VMSTASH_RETURN_IF_ERROR(CheckDeviceIndex(device, device_count_));
  VMSTASH_WITH_CONTEXT(device);
  CUmemAllocationProp prop = ChunkProperties(device, options);
  // Plain chunks (the pause/resume hot path) use the cached granularity; others ask.
  std::size_t g = 0;
  CUresult r = CUDA_SUCCESS;
  if (!options.shareable_fd && !options.gpu_direct_rdma) {
    VMSTASH_ASSIGN_OR_RETURN(g, MinimumGranularity(device));
  } else {
    r = api_.cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (r != CUDA_SUCCESS) return Fail(r, "cuMemGetAllocationGranularity");
  }
  VMSTASH_RETURN_IF_ERROR(CheckGranularSize("CreateChunk", size_bytes, g));
  if (options.gpu_direct_rdma) {
    CUdevice dev = 0;
    int supported = 0;
    r = api_.cuDeviceGet(&dev, device);
    if (r == CUDA_SUCCESS) {
      r = api_.cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, dev);
    }
    if (r != CUDA_SUCCESS) return Fail(r, "cuDeviceGetAttribute");
    if (supported == 0) {
      return absl::UnimplementedError(
          absl::StrCat("CreateChunk: device ", device, " does not support GPUDirect RDMA with VMM chunks"));
    }
  }
  CUmemGenericAllocationHandle handle = 0;
  r = api_.cuMemCreate(&handle, size_bytes, &prop, 0);
  if (r != CUDA_SUCCESS) {
    return Fail(r, "cuMemCreate", absl::StrCat(size_bytes, " bytes on device ", device));
  }
  ChunkRecord record;
  record.device = device;
  record.size_bytes = size_bytes;
  record.options = options;
  ledger_.AddChunk(handle, record);
  counters_.AddChunkBytes(size_bytes);
  return static_cast<ChunkHandle>(handle);
}

absl::Status CudaDriver::ReleaseChunk(ChunkHandle chunk) {
  counters_.Count(DriverOp::kReleaseChunk);
  VMSTASH_ASSIGN_OR_RETURN(auto released, ledger_.ReleaseChunk(chunk));
  CUresult r = api_.cuMemRelease(chunk);
  if (r != CUDA_SUCCESS) {
    ledger_.UnreleaseChunk(chunk, released.first);
    return Fail(r, "cuMemRelease");
  }
  if (released.first.backend >= 0) {  // an import's descriptor
    KeptDescriptors::Get().Remove(static_cast<int>(released.first.backend));
    ::close(static_cast<int>(released.first.backend));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> CudaDriver::ExportChunkFd(ChunkHandle chunk) {
  counters_.Count(DriverOp::kExportChunkFd);
  VMSTASH_ASSIGN_OR_RETURN(ChunkRecord record, ledger_.GetChunk(chunk));
  if (!record.options.shareable_fd) {
    return absl::FailedPreconditionError(
        absl::StrCat("ExportChunkFd: chunk ", chunk, " was created without shareable_fd"));
  }
  int fd = -1;
  if (record.backend >= 0) {  // imported: CUDA exports no imported handle; the descriptor it came by does
    fd = ::fcntl(static_cast<int>(record.backend), F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return absl::ResourceExhaustedError(absl::StrCat("ExportChunkFd: fcntl: ", std::strerror(errno)));
    return fd;
  }
  CUresult r = api_.cuMemExportToShareableHandle(&fd, chunk, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (r != CUDA_SUCCESS) return Fail(r, "cuMemExportToShareableHandle");
  return fd;
}

absl::StatusOr<ChunkHandle> CudaDriver::ImportChunkFd(int device, int fd, std::size_t size_bytes) {
  counters_.Count(DriverOp::kImportChunkFd);
  VMSTASH_RETURN_IF_ERROR(CheckDeviceIndex(device, device_count_));
  if (fd < 0) return absl::InvalidArgumentError(absl::StrCat("ImportChunkFd: descriptor ", fd));
  VMSTASH_ASSIGN_OR_RETURN(std::size_t g, MinimumGranularity(device));
  VMSTASH_RETURN_IF_ERROR(CheckGranularSize("ImportChunkFd", size_bytes, g));
  VMSTASH_WITH_CONTEXT(device);
  // Kept while the handle lives: CUDA does not export an imported handle again, so
  // ExportChunkFd passes on a copy of this descriptor instead.
  const int own = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0) return absl::ResourceExhaustedError(absl::StrCat("ImportChunkFd: fcntl: ", std::strerror(errno)));
  CUmemGenericAllocationHandle handle = 0;
  CUresult r = api_.cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd)),
                                                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (r != CUDA_SUCCESS) {  // a descriptor that is no exported chunk: CUDA_ERROR_INVALID_VALUE (InvalidArgument)
    ::close(own);
    return Fail(r, "cuMemImportFromShareableHandle", absl::StrCat("descriptor ", fd, ", ", size_bytes, " bytes"));
  }
  // CUDA tells no handle's size: a handle shorter than `size_bytes` is refused by its Map.
  ChunkRecord record;
  record.device = device;
  record.size_bytes = size_bytes;
  record.options.shareable_fd = true;
  record.imported = true;
  record.backend = own;
  KeptDescriptors::Get().Add(own);
  ledger_.AddChunk(handle, record);
  return static_cast<ChunkHandle>(handle);
}

absl::Status CudaDriver::Map(DevicePtr va, std::size_t size_bytes, ChunkHandle chunk) {
  counters_.Count(DriverOp::kMap);
  VMSTASH_ASSIGN_OR_RETURN(ChunkRecord record, ledger_.GetChunk(chunk));
  VMSTASH_ASSIGN_OR_RETURN(std::size_t g, MinimumGranularity(record.device));
  VMSTASH_RETURN_IF_ERROR(CheckGranularSize("Map", size_bytes, g));
  VMSTASH_RETURN_IF_ERROR(ledger_.ClaimMap(va, size_bytes, chunk, g).status());
  CUresult r = api_.cuMemMap(va, size_bytes, 0, chunk, 0);
  if (r != CUDA_SUCCESS) {
    ledger_.AbortMap(va);
    return Fail(r, "cuMemMap");
  }
  return absl::OkStatus();
}

absl::Status CudaDriver::Unmap(int device, DevicePtr va, std::size_t size_bytes) {
  counters_.Count(DriverOp::kUnmap);
  VMSTASH_RETURN_IF_ERROR(CheckDeviceIndex(device, device_count_));
  VMSTASH_ASSIGN_OR_RETURN(MappingRecord mapping, ledger_.ClaimUnmap(va, size_bytes));
  CUresult r = api_.cuMemUnmap(va, size_bytes);
  if (r != CUDA_SUCCESS) {
    ledger_.AbortUnmap(mapping);
    return Fail(r, "cuMemUnmap");
  }
  ledger_.CommitUnmap(mapping);
  return absl::OkStatus();
}

absl::Status CudaDriver::SetAccess(DevicePtr va, std::size_t size_bytes, int device) {
  counters_.Count(DriverOp::kSetAccess);
  VMSTASH_ASSIGN_OR_RETURN(std::size_t g, MinimumGranularity(device));
  VMSTASH_RETURN_IF_ERROR(CheckGranularSize("SetAccess", size_bytes, g));
  VMSTASH_RETURN_IF_ERROR(ledger_.CheckMapped(va, size_bytes));
  CUmemAccessDesc desc{};
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc.location.id = device;
  desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUresult r = api_.cuMemSetAccess(va, size_bytes, &desc, 1);
  if (r != CUDA_SUCCESS) return Fail(r, "cuMemSetAccess");
  return ledger_.GrantAccess(va, size_bytes, device);
}

absl::StatusOr<void*> CudaDriver::HostAlloc(int device, std::size_t size_bytes) {
  counters_.Count(DriverOp::kHostAlloc);
  if (size_bytes == 0) return absl::InvalidArgumentError("HostAlloc: size 0 is not allowed");
  VMSTASH_WITH_CONTEXT(device);
  void* p = nullptr;
  CUresult r = api_.cuMemHostAlloc(&p, size_bytes, CU_MEMHOSTALLOC_PORTABLE);
  if (r != CUDA_SUCCESS) return Fail(r, "cuMemHostAlloc", absl::StrCat(size_bytes, " bytes"));
  ledger_.AddHostAlloc(p, size_bytes);
  return p;
}

absl::Status CudaDriver::HostFree(int device, void* ptr) {
  counters_.Count(DriverOp::kHostFree);
  VMSTASH_ASSIGN_OR_RETURN(std::size_t size, ledger_.TakeHostAlloc(ptr));
  VMSTASH_WITH_CONTEXT(device);
  CUresult r = api_.cuMemFreeHost(ptr);
  if (r != CUDA_SUCCESS) {
    ledger_.AddHostAlloc(ptr, size);
    return Fail(r, "cuMemFreeHost");
  }
  return absl::OkStatus();
}

absl::Status CudaDriver::HostRegister(int device, void* ptr, std::size_t size_bytes) {
  counters_.Count(DriverOp::kHostRegister);
  if (ptr == nullptr || size_bytes == 0) return absl::InvalidArgumentError("HostRegister: null pointer or size 0");
  VMSTASH_WITH_CONTEXT(device);
  // Claim first (Note [Ledger Claims]): a second registration is refused by the ledger
  // with FailedPrecondition, the same as on SimDriver.
  VMSTASH_RETURN_IF_ERROR(ledger_.AddHostRegistration(ptr, size_bytes));
  CUresult r = api_.cuMemHostRegister(ptr, size_bytes, CU_MEMHOSTREGISTER_PORTABLE);
  if (r != CUDA_SUCCESS) {
    (void)ledger_.TakeHostRegistration(ptr);
    return Fail(r, "cuMemHostRegister", absl::StrCat(size_bytes, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status CudaDriver::HostUnregister(int device, void* ptr) {
  counters_.Count(DriverOp::kHostUnregister);
  VMSTASH_ASSIGN_OR_RETURN(std::size_t size, ledger_.TakeHostRegistration(ptr));
  VMSTASH_WITH_CONTEXT(device);
  CUresult r = api_.cuMemHostUnregister(ptr);
  if (r != CUDA_SUCCESS) {
    (void)ledger_.AddHostRegistration(ptr, size);
    return Fail(r, "cuMemHostUnregister");
  }
  return absl::OkStatus();
}

void CudaDriver::RelaxStreamCaptureForThisThread() {
  CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
  (void)api_.cuThreadExchangeStreamCaptureMode(&mode);  // thread-local state: it cannot fail here
}

absl::StatusOr<Stream> CudaDriver::CreateStream(int device) {
  counters_.Count(DriverOp::kCreateStream);
  VMSTASH_WITH_CONTEXT(device);
  CUstream stream = nullptr;
  CUresult r = api_.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING);
  if (r != CUDA_SUCCESS) return Fail(r, "cuStreamCreate");
  ledger_.AddStream(reinterpret_cast<Stream>(stream), device);
  return reinterpret_cast<Stream>(stream);
}

absl::Status CudaDriver::DestroyStream(int device, Stream stream) {
  counters_.Count(DriverOp::kDestroyStream);
  VMSTASH_RETURN_IF_ERROR(ledger_.TakeStream(stream, device));
  VMSTASH_WITH_CONTEXT(device);
  CUresult r = api_.cuStreamDestroy(AsCu(stream));
  if (r != CUDA_SUCCESS) {
    ledger_.AddStream(stream, device);
    return Fail(r, "cuStreamDestroy");
  }
  return absl::OkStatus();
}

absl::StatusOr<Event> CudaDriver::CreateEvent(int device, bool timing) {
  counters_.Count(DriverOp::kCreateEvent);
  VMSTASH_WITH_CONTEXT(device);
  CUevent event = nullptr;
  CUresult r = api_.cuEventCreate(&event, timing ? CU_EVENT_DEFAULT : CU_EVENT_DISABLE_TIMING);
  if (r != CUDA_SUCCESS) return Fail(r, "cuEventCreate");
  ledger_.AddEvent(reinterpret_cast<Event>(event), device);
  return reinterpret_cast<Event>(event);
}

absl::Status CudaDriver::DestroyEvent(int device, Event event) {
  counters_.Count(DriverOp::kDestroyEvent);
  VMSTASH_RETURN_IF_ERROR(ledger_.TakeEvent(event, device));
  // Claimed before the backend call (Note [Ledger Claims]): once destroyed, CUDA may hand
  // the same pointer to a new event made meanwhile by another thread.
  bool was_ipc = false;
  {
    MutexLock lock(&ipc_mu_);
    was_ipc = ipc_events_.erase(event) != 0;
  }
  auto undo = [&] {
    if (was_ipc) {
      MutexLock lock(&ipc_mu_);
      ipc_events_.insert(event);
    }
    ledger_.AddEvent(event, device);
  };
  absl::StatusOr<CUcontext> context = Context(device);
  if (!context.ok()) {
    undo();
    return context.status();
  }
  ScopedContext scoped(api_);
  absl::Status pushed = scoped.Push(*context);
  if (!pushed.ok()) {
    undo();
    return pushed;
  }
  CUresult r = api_.cuEventDestroy(AsCu(event));
  if (r != CUDA_SUCCESS) {
    undo();
    return Fail(r, "cuEventDestroy");
  }
  return absl::OkStatus();
}

absl::Status CudaDriver::RecordEvent(int device, Event event, Stream stream) {
  counters_.Count(DriverOp::kRecordEvent);
  VMSTASH_WITH_CONTEXT(device);
  CUresult r = api_.cuEventRecord(AsCu(event), AsCu(stream));
  return r == CUDA_SUCCESS ? absl::OkStatus() : Fail(r, "cuEventRecord");
}

absl::StatusOr<bool> CudaDriver::QueryEvent(int device, Event event) {
  counters_.Count(DriverOp::kQueryEvent);
  VMSTASH_WITH_CONTEXT(device);
  CUresult r = api_.cuEventQuery(AsCu(event));
  if (r == CUDA_SUCCESS) return true;
  if (r == CUDA_ERROR_NOT_READY) return false;
  return Fail(r, "cuEventQuery");
}

absl::Status CudaDriver::SynchronizeEvent(int device, Event event) {
  counters_.Count(DriverOp::kSynchronizeEvent);
  VMSTASH_WITH_CONTEXT(device);
  CUresult r = api_.cuEventSynchronize(AsCu(event));
  return r == CUDA_SUCCESS ? absl::OkStatus() : Fail(r, "cuEventSynchronize");
}

absl::StatusOr<float> CudaDriver::ElapsedMs(int device, Event start, Event end) {
  counters_.Count(DriverOp::kElapsedTime);
  VMSTASH_WITH_CONTEXT(device);
  float ms = 0;
  CUresult r = api_.cuEventElapsedTime(&ms, AsCu(start), AsCu(end));
  if (r != CUDA_SUCCESS) return Fail(r, "cuEventElapsedTime");
  return ms;
}

absl::Status CudaDriver::StreamWaitEvent(int device, Stream stream, Event event) {
  counters_.Count(DriverOp::kStreamWaitEvent);
  VMSTASH_WITH_CONTEXT(device);
  CUresult r = api_.cuStreamWaitEvent(AsCu(stream), AsCu(event), 0);
  return r == CUDA_SUCCESS ? absl::OkStatus() : Fail(r, "cuStreamWaitEvent");
}

absl::Status CudaDriver::SynchronizeStream(int device, Stream stream) {
  counters_.Count(DriverOp::kSynchronizeStream);
  VMSTASH_WITH_CONTEXT(device);
  CUresult r = api_.cuStreamSynchronize(AsCu(stream));
  return r == CUDA_SUCCESS ? absl::OkStatus() : Fail(r, "cuStreamSynchronize");
}

absl::Status CudaDriver::SynchronizeDevice(int device) {
  counters_.Count(DriverOp::kSynchronizeDevice);
  VMSTASH_WITH_CONTEXT(device);
  CUresult r = api_.cuCtxSynchronize();
  return r == CUDA_SUCCESS ? absl::OkStatus() : Fail(r, "cuCtxSynchronize");
}

absl::StatusOr<Event> CudaDriver::CreateIpcEvent(int device) {
  counters_.Count(DriverOp::kCreateIpcEvent);
  VMSTASH_WITH_CONTEXT(device);
  CUevent event = nullptr;
  CUresult r = api_.cuEventCreate(&event, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING);
  if (r != CUDA_SUCCESS) return Fail(r, "cuEventCreate", "CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING");
  {
    MutexLock lock(&ipc_mu_);
    ipc_events_.insert(reinterpret_cast<Event>(event));
  }
  ledger_.AddEvent(reinterpret_cast<Event>(event), device);
  return reinterpret_cast<Event>(event);
}

absl::StatusOr<std::string> CudaDriver::ExportIpcEvent(int device, Event event) {
  counters_.Count(DriverOp::kExportIpcEvent);
  VMSTASH_RETURN_IF_ERROR(CheckDeviceIndex(device, device_count_));
  VMSTASH_RETURN_IF_ERROR(ledger_.CheckEvent(event, device));
  {
    MutexLock lock(&ipc_mu_);
    if (ipc_events_.count(event) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("ExportIpcEvent: event ",
                                                     absl::Hex(reinterpret_cast<std::uintptr_t>(event)),
                                                     " on device ", device, " was not made by CreateIpcEvent"));
    }
  }
  VMSTASH_WITH_CONTEXT(device);
  CUipcEventHandle handle{};
  CUresult r = api_.cuIpcGetEventHandle(&handle, AsCu(event));
  if (r != CUDA_SUCCESS) return Fail(r, "cuIpcGetEventHandle");
  return std::string(handle.reserved, sizeof(handle.reserved));
}

absl::StatusOr<Event> CudaDriver::OpenIpcEvent(int device, const std::string& handle) {
  counters_.Count(DriverOp::kOpenIpcEvent);
  VMSTASH_RETURN_IF_ERROR(CheckDeviceIndex(device, device_count_));
  if (handle.size() != kIpcEventHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("OpenIpcEvent: a handle of ", handle.size(),
                                                   " bytes (an event's handle has ", kIpcEventHandleBytes, ")"));
  }
  VMSTASH_WITH_CONTEXT(device);
  CUipcEventHandle cu_handle{};
  std::memcpy(cu_handle.reserved, handle.data(), sizeof(cu_handle.reserved));
  CUevent event = nullptr;
  CUresult r = api_.cuIpcOpenEventHandle(&event, cu_handle);
  if (r != CUDA_SUCCESS) return Fail(r, "cuIpcOpenEventHandle", absl::StrCat("device ", device));
  ledger_.AddEvent(reinterpret_cast<Event>(event), device);
  return reinterpret_cast<Event>(event);
}

absl::Status CudaDriver::CopyToHostAsync(int device, void* dst, DevicePtr src, std::size_t size_bytes,
                                         Stream stream) {
  counters_.Count(DriverOp::kCopyToHost);
  VMSTASH_WITH_CONTEXT(device);
  CUresult r = api_.cuMemcpyDtoHAsync(dst, src, size_bytes, AsCu(stream));
  if (r != CUDA_SUCCESS) return Fail(r, "cuMemcpyDtoHAsync", absl::StrCat(size_bytes, " bytes"));
  counters_.AddBytesToHost(size_bytes);
  return absl::OkStatus();
}

absl::Status CudaDriver::CopyToDeviceAsync(int device, DevicePtr dst, const void* src, std::size_t size_bytes,
                                           Stream stream) {
  counters_.Count(DriverOp::kCopyToDevice);
  VMSTASH_WITH_CONTEXT(device);
  CUresult r = api_.cuMemcpyHtoDAsync(dst, src, size_bytes, AsCu(stream));
  if (r != CUDA_SUCCESS) return Fail(r, "cuMemcpyHtoDAsync", absl::StrCat(size_bytes, " bytes"));
  counters_.AddBytesToDevice(size_bytes);
  return absl::OkStatus();
}

absl::Status CudaDriver::CopyDeviceAsync(int device, DevicePtr dst, DevicePtr src, std::size_t size_bytes,
                                         Stream stream) {
  counters_.Count(DriverOp::kCopyDevice);
  VMSTASH_WITH_CONTEXT(device);
  CUresult r = api_.cuMemcpyDtoDAsync(dst, src, size_bytes, AsCu(stream));
  return r == CUDA_SUCCESS ? absl::OkStatus() : Fail(r, "cuMemcpyDtoDAsync");
}

absl::Status CudaDriver::MemsetAsync(int device, DevicePtr dst, std::uint8_t value, std::size_t size_bytes,
                                     Stream stream) {
  counters_.Count(DriverOp::kMemset);
  VMSTASH_WITH_CONTEXT(device);
  CUresult r = api_.cuMemsetD8Async(dst, value, size_bytes, AsCu(stream));
  return r == CUDA_SUCCESS ? absl::OkStatus() : Fail(r, "cuMemsetD8Async");
}

#undef VMSTASH_WITH_CONTEXT

}  // namespace vmstash
