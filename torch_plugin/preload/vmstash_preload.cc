// libvmstash_preload.so: the CUDA allocation calls of a whole process, routed to vmstash
// while a thread is in a region (LD_PRELOAD mode; docs/architecture.md §7, docs/architecture.md §7).
//
// Interposed (exact CUDA signatures, C linkage): cudaMalloc, cudaFree, cudaMallocAsync,
// cudaFreeAsync (runtime) and cuMemAlloc_v2, cuMemFree_v2 (driver; what cuMemAlloc and
// cuMemFree compile to). Not interposed, on purpose: cuMemCreate and the other VMM calls
// (expandable segments, NCCL and vmstash itself build on them; taking them over would
// break their owners), cudaMallocManaged / cudaMallocHost (not device memory of a tag),
// and stream-ordered pools (cudaMallocFromPoolAsync: the pool is the caller's).
//
// Routing: a call goes to vmstash when the calling thread's current tag (vmstash's
// thread-local tag, set by the Python package's region() or vmstash_set_current_tag) is
// not "default", or for every thread in whole-process mode (VMSTASH_PRELOAD_ALL=1, or
// torch_memory_saver's TMS_INIT_ENABLE=1). A thread may override this either way
// (vmstash_preload_set_routed, = tms_set_interesting_region: torch_memory_saver's
// interesting-region flag, kept in torch_plugin/c_abi/tms.h; its disable() and slime's
// DeepEP buffers turn it off). A thread that set torch_memory_saver's per-thread config
// (tms_set_current_tag, ...; vmstash_tms.h) allocates in that config's vmstash tag. The
// library exports torch_memory_saver's tms_* entry points with the C ABI (the drop-in
// wheel carries it under torch_memory_saver's names). In whole-process mode, allocations
// of threads outside any region go to the process tag (VMSTASH_PRELOAD_TAG, default
// "process"), created at the first one with policy backup when VMSTASH_PRELOAD_BACKUP=1,
// TMS_INIT_ENABLE_CPU_BACKUP=1 or TMS_INIT_ENABLE_DISK_BACKUP=1 (where its bytes go is the
// tag's backup store: vmstash_set_backup_store), else discard: pausing it (vmstash_pause of that tag)
// releases what the whole process allocated. PyTorch's expandable_segments builds on
// cuMemCreate, which is not interposed: whole-process mode would then capture nothing,
// so it says so on stderr at load (the Python layer refuses to start).
// Everything else, and every free of a pointer vmstash did not return,
// goes to the real function, found with dlsym(RTLD_NEXT), else in the process's global
// scope (never this library's own hook). A routed call whose helper (cudaGetDevice,
// cuCtxGetDevice, cudaStreamIsCapturing) cannot be found or fails returns an error and
// says so once on stderr: the device is never guessed. cudaFree(NULL) keeps its
// runtime meaning.
//
// Stream capture: a routed cudaMallocAsync / cudaFreeAsync on a capturing stream returns
// cudaErrorStreamCaptureUnsupported. vmstash allocates and frees at once, not as graph
// nodes, so a captured free followed by an allocation would hand the same memory to a
// later replay while the graph still uses it. (PyTorch's caching allocator, the usual
// caller, allocates outside capture with cudaMalloc and never frees during capture.)
//
// This library also carries the whole C ABI (vmstash_*): the Python package uses it when
// it is preloaded, so there is one vmstash runtime in the process. vmstash's own driver
// calls go through cuGetProcAddress, never through these hooks; a thread-local depth
// guard sends any re-entrant call to the real function anyway. Out of memory returns
// cudaErrorMemoryAllocation / CUDA_ERROR_OUT_OF_MEMORY, so PyTorch frees its cache and
// retries. Nothing here exits the process.
#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "torch_plugin/c_abi/tms.h"
#include "torch_plugin/c_abi/tms_env.h"
#include "torch_plugin/include/vmstash/vmstash.h"

namespace {

using cudaError_t = int;  // the runtime's enum, ABI-compatible
constexpr cudaError_t kCudaSuccess = 0;
constexpr cudaError_t kCudaErrorInvalidValue = 1;
constexpr cudaError_t kCudaErrorMemoryAllocation = 2;
constexpr cudaError_t kCudaErrorInitializationError = 3;
constexpr cudaError_t kCudaErrorStreamCaptureUnsupported = 900;
using CUresult = int;
constexpr CUresult kCuSuccess = 0;
constexpr CUresult kCuErrorInvalidValue = 1;
constexpr CUresult kCuErrorOutOfMemory = 2;
constexpr CUresult kCuErrorNotInitialized = 3;
using CUdeviceptr = unsigned long long;  // NOLINT: the driver's type
using CUdevice = int;

using MallocFn = cudaError_t (*)(void**, size_t);
using FreeFn = cudaError_t (*)(void*);
using MallocAsyncFn = cudaError_t (*)(void**, size_t, cudaStream_t);
using FreeAsyncFn = cudaError_t (*)(void*, cudaStream_t);
using GetDeviceFn = cudaError_t (*)(int*);
using IsCapturingFn = cudaError_t (*)(cudaStream_t, int*);
using SyncFn = cudaError_t (*)();
using CuMemAllocFn = CUresult (*)(CUdeviceptr*, size_t);
using CuMemFreeFn = CUresult (*)(CUdeviceptr);
using CuCtxGetDeviceFn = CUresult (*)(CUdevice*);
using CuCtxSynchronizeFn = CUresult (*)();

bool InThisLibrary(void* fn) {
  static int anchor;
  Dl_info mine{}, theirs{};
  return dladdr(&anchor, &mine) != 0 && dladdr(fn, &theirs) != 0 && mine.dli_fbase == theirs.dli_fbase;
}

// The next definition of `name` after this library, else the one in the global scope
// (a runtime loaded RTLD_GLOBAL), never this library's own hook; nullptr when none.
void* Real(const char* name) {
  void* fn = dlsym(RTLD_NEXT, name);
  if (fn != nullptr && !InThisLibrary(fn)) return fn;
  fn = dlsym(RTLD_DEFAULT, name);
  return fn != nullptr && !InThisLibrary(fn) ? fn : nullptr;
}

template <typename Fn>
Fn RealFn(std::atomic<void*>& slot, const char* name) {
  void* fn = slot.load(std::memory_order_acquire);
  if (fn == nullptr) {
    fn = Real(name);  // not cached while missing: a runtime loaded later is found then
    if (fn != nullptr) slot.store(fn, std::memory_order_release);
  }
  return reinterpret_cast<Fn>(fn);
}

// One line on stderr per distinct problem (a hook has no other channel to the user).
void SayOnce(std::atomic<bool>& said, const char* what) {
  if (!said.exchange(true)) std::fprintf(stderr, "vmstash preload: %s\n", what);
}

std::atomic<void*> real_malloc{nullptr}, real_free{nullptr}, real_malloc_async{nullptr}, real_free_async{nullptr},
    real_get_device{nullptr}, real_sync{nullptr}, real_cu_alloc{nullptr}, real_cu_free{nullptr},
    real_cu_device{nullptr}, real_cu_sync{nullptr}, real_is_capturing{nullptr};
std::atomic<bool> said_no_device{false}, said_no_cu_device{false}, said_no_capture_query{false},
    said_capture{false};

thread_local int depth = 0;  // > 0 while inside a hook

struct Depth {
  Depth() { ++depth; }
  ~Depth() { --depth; }
};

bool RouteAll() { return vmstash::tms::Env().whole_process; }

// The whole-process tag's name (only meaningful when RouteAll()).
const char* ProcessTagName() {
  static const char* const name = [] {
    const char* v = std::getenv("VMSTASH_PRELOAD_TAG");
    return v != nullptr && *v != '\0' ? v : "process";
  }();
  return name;
}

bool InRegion() {
  const char* tag = vmstash_get_current_tag();
  return tag != nullptr && std::strcmp(tag, "default") != 0;
}

// The calling thread's allocations go to vmstash (ignoring the re-entrancy guard).
bool RoutedByState() {
  const int routed = vmstash::tms::RoutedOverride();  // torch_memory_saver's interesting-region flag
  if (routed >= 0) return routed == 1;
  return RouteAll() || InRegion();
}

bool Routed() { return depth == 0 && RoutedByState(); }

std::atomic<bool> said_process_tag{false};

// The backed-up process tag's store, from torch_memory_saver's variables, set before its
// first allocation so that no pinned arena is prepared for a disk or pageable backup:
// TMS_INIT_ENABLE_DISK_BACKUP=1 -> disk_files (torch_memory_saver's layout: a file per
// backed-up allocation while paused) in TMS_DISK_BACKUP_DIR (default /tmp);
// TMS_INIT_CPU_BACKUP_BACKEND=mmap -> pageable; else the VMSTASH_CONF default. A refusal
// (a missing directory) is said on stderr; the pause then reports it.
void ChooseProcessStore() {
  const vmstash::tms::Environment& env = vmstash::tms::Env();
  int rc = 0;
  if (env.DefaultSetting() == vmstash::tms::Setting::kDisk) {
    rc = vmstash_set_backup_store(ProcessTagName(), "disk_files", env.disk_dir.c_str());
  } else if (env.DefaultSetting() == vmstash::tms::Setting::kMmap) {
    rc = vmstash_set_backup_store(ProcessTagName(), "pageable", nullptr);
  }
  if (rc != 0) {
    std::fprintf(stderr, "vmstash preload: backup store of the whole-process tag '%s': %s\n", ProcessTagName(),
                 vmstash_last_error());
  }
}

// Creates the whole-process tag once; false (said on stderr) when that failed.
bool ProcessTagReady() {
  static const bool ready = [] {
    const char* policy = vmstash::tms::Env().DefaultSetting() != vmstash::tms::Setting::kDiscard ? "backup" : "discard";
    if (vmstash_create_tag(ProcessTagName(), policy) != 0) {
      std::fprintf(stderr, "vmstash preload: cannot create the whole-process tag '%s' (%s): %s; its allocations "
                   "fail\n", ProcessTagName(), policy, vmstash_last_error());
      return false;
    }
    if (std::strcmp(policy, "backup") == 0) ChooseProcessStore();
    return true;
  }();
  return ready;
}

std::atomic<bool> said_tms_tag{false};

// vmstash_malloc into `tag` for this call (the thread's current tag put back after).
void* MallocIn(const char* tag, size_t size, int device, cudaStream_t stream) {
  const char* previous = vmstash_get_current_tag();
  if (vmstash_set_current_tag(tag) != 0) {
    SayOnce(said_process_tag, "cannot switch to the tag of a routed allocation; such allocations fail");
    return nullptr;
  }
  void* p = vmstash_malloc(size, device, stream);
  (void)vmstash_set_current_tag(previous != nullptr ? previous : "default");
  return p;
}

// vmstash_malloc into the thread's tag: the vmstash tag of its torch_memory_saver config
// when it set one (tms.h, AllocationTag), else its current tag, or, for a thread outside
// any region in whole-process mode, the process tag. The caller holds a Depth.
void* RoutedMalloc(size_t size, int device, cudaStream_t stream) {
  bool error = false;
  const char* tms_tag = vmstash::tms::AllocationTag(&error);
  if (error) {
    SayOnce(said_tms_tag, "the vmstash tag of a thread's torch_memory_saver config cannot be made; its allocations "
                          "fail (vmstash_last_error says why)");
    return nullptr;
  }
  const bool process = RouteAll() && (tms_tag != nullptr ? std::strcmp(tms_tag, "default") == 0 : !InRegion());
  if (!process) return tms_tag != nullptr ? MallocIn(tms_tag, size, device, stream) : vmstash_malloc(size, device, stream);
  if (!ProcessTagReady()) return nullptr;
  return MallocIn(ProcessTagName(), size, device, stream);
}

// At load: torch_memory_saver's entry points learn the process tag (its tag "default" in
// whole-process mode); whole-process mode cannot see expandable segments (cuMemCreate).
// PyTorch reads PYTORCH_ALLOC_CONF, else PYTORCH_CUDA_ALLOC_CONF (the Python drop-in
// refuses the start and a pause that would leave live tensors behind: _alloc_conf.py).
__attribute__((constructor)) void AtLoad() {
  if (RouteAll()) vmstash::tms::SetProcessTag(ProcessTagName());
  for (const char* name : {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"}) {
    const char* conf = std::getenv(name);
    if (conf == nullptr) continue;  // set, even empty, it is the one PyTorch reads
    if (RouteAll() && std::strstr(conf, "expandable_segments:True") != nullptr) {
      std::fprintf(stderr, "vmstash preload: whole-process mode (TMS_INIT_ENABLE / VMSTASH_PRELOAD_ALL) cannot see "
                           "PyTorch's expandable segments (cuMemCreate is not interposed); unset "
                           "expandable_segments:True in %s\n", name);
    }
    break;  // the one PyTorch reads
  }
}

// The runtime's current device, or the error to return (never a guessed device 0).
cudaError_t RuntimeDevice(int* device) {
  auto get = RealFn<GetDeviceFn>(real_get_device, "cudaGetDevice");
  if (get == nullptr) {
    SayOnce(said_no_device, "cudaGetDevice not found in the process (no CUDA runtime loaded?); routed allocations "
                            "fail with cudaErrorInitializationError");
    return kCudaErrorInitializationError;
  }
  return get(device);
}

// kCudaSuccess when `stream` is not capturing; the error to return otherwise.
cudaError_t NotCapturing(cudaStream_t stream) {
  auto query = RealFn<IsCapturingFn>(real_is_capturing, "cudaStreamIsCapturing");
  if (query == nullptr) {
    SayOnce(said_no_capture_query, "cudaStreamIsCapturing not found in the process; routed stream-ordered calls "
                                   "fail with cudaErrorInitializationError");
    return kCudaErrorInitializationError;
  }
  int status = 0;  // cudaStreamCaptureStatusNone
  const cudaError_t rc = query(stream, &status);
  if (rc != kCudaSuccess) return rc;
  if (status == 0) return kCudaSuccess;
  SayOnce(said_capture, "cudaMallocAsync/cudaFreeAsync of vmstash memory during stream capture is refused "
                        "(cudaErrorStreamCaptureUnsupported): allocate before capturing");
  return kCudaErrorStreamCaptureUnsupported;
}

}  // namespace

extern "C" {

// The thread's routing override: 1 routes its allocations to vmstash, 0 sends them to
// CUDA (torch_memory_saver's interesting-region flag), -1 drops the override. Returns
// the previous override in the same terms (to restore it).
__attribute__((visibility("default"))) int vmstash_preload_set_routed(int routed) {
  return vmstash::tms::SetRoutedOverride(routed);  // = vmstash_tms_set_interesting
}
// Whether the calling thread's allocations go to vmstash now (1) or not (0).
__attribute__((visibility("default"))) int vmstash_preload_routed(void) { return RoutedByState() ? 1 : 0; }
// The whole-process tag's name, or NULL when whole-process mode is off.
__attribute__((visibility("default"))) const char* vmstash_preload_process_tag(void) {
  return RouteAll() ? ProcessTagName() : nullptr;
}

__attribute__((visibility("default"))) cudaError_t cudaMalloc(void** ptr, size_t size) {
  if (ptr == nullptr) return kCudaErrorInvalidValue;
  if (Routed()) {
    Depth d;
    int device = 0;
    if (const cudaError_t rc = RuntimeDevice(&device); rc != kCudaSuccess) return rc;
    *ptr = RoutedMalloc(size, device, nullptr);
    return *ptr != nullptr || size == 0 ? kCudaSuccess : kCudaErrorMemoryAllocation;
  }
  auto real = RealFn<MallocFn>(real_malloc, "cudaMalloc");
  return real != nullptr ? real(ptr, size) : kCudaErrorMemoryAllocation;
}

__attribute__((visibility("default"))) cudaError_t cudaFree(void* ptr) {
  if (ptr != nullptr && depth == 0) {
    const int device = vmstash_owner_device(ptr);
    if (device >= 0) {
      Depth d;
      // cudaFree synchronizes the device; keep that promise before the memory is reused.
      if (auto sync = RealFn<SyncFn>(real_sync, "cudaDeviceSynchronize")) sync();
      vmstash_free(ptr, 0, device, nullptr);
      return kCudaSuccess;
    }
  }
  auto real = RealFn<FreeFn>(real_free, "cudaFree");
  return real != nullptr ? real(ptr) : kCudaErrorInvalidValue;
}

__attribute__((visibility("default"))) cudaError_t cudaMallocAsync(void** ptr, size_t size, cudaStream_t stream) {
  if (ptr == nullptr) return kCudaErrorInvalidValue;
  if (Routed()) {
    Depth d;
    if (const cudaError_t rc = NotCapturing(stream); rc != kCudaSuccess) return rc;
    int device = 0;
    if (const cudaError_t rc = RuntimeDevice(&device); rc != kCudaSuccess) return rc;
    *ptr = RoutedMalloc(size, device, stream);
    return *ptr != nullptr || size == 0 ? kCudaSuccess : kCudaErrorMemoryAllocation;
  }
  auto real = RealFn<MallocAsyncFn>(real_malloc_async, "cudaMallocAsync");
  return real != nullptr ? real(ptr, size, stream) : kCudaErrorMemoryAllocation;
}

__attribute__((visibility("default"))) cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream) {
  if (ptr != nullptr && depth == 0) {
    const int device = vmstash_owner_device(ptr);
    if (device >= 0) {
      Depth d;
      if (const cudaError_t rc = NotCapturing(stream); rc != kCudaSuccess) return rc;
      // Stream-ordered: reuse waits for `stream` (vmstash's RecordStream) as well as for
      // the stream the block was allocated on.
      (void)vmstash_record_stream(ptr, device, stream);
      vmstash_free(ptr, 0, device, stream);
      return kCudaSuccess;
    }
  }
  auto real = RealFn<FreeAsyncFn>(real_free_async, "cudaFreeAsync");
  return real != nullptr ? real(ptr, stream) : kCudaErrorInvalidValue;
}

__attribute__((visibility("default"))) CUresult cuMemAlloc_v2(CUdeviceptr* ptr, size_t size) {
  if (ptr == nullptr) return kCuErrorInvalidValue;
  if (Routed()) {
    Depth d;
    CUdevice device = 0;
    auto get = RealFn<CuCtxGetDeviceFn>(real_cu_device, "cuCtxGetDevice");
    if (get == nullptr) {
      SayOnce(said_no_cu_device, "cuCtxGetDevice not found in the process; routed cuMemAlloc fails with "
                                 "CUDA_ERROR_NOT_INITIALIZED");
      return kCuErrorNotInitialized;
    }
    if (const CUresult rc = get(&device); rc != kCuSuccess) return rc;
    void* p = RoutedMalloc(size, device, nullptr);
    *ptr = reinterpret_cast<CUdeviceptr>(p);
    return p != nullptr || size == 0 ? kCuSuccess : kCuErrorOutOfMemory;
  }
  auto real = RealFn<CuMemAllocFn>(real_cu_alloc, "cuMemAlloc_v2");
  return real != nullptr ? real(ptr, size) : kCuErrorOutOfMemory;
}

__attribute__((visibility("default"))) CUresult cuMemFree_v2(CUdeviceptr ptr) {
  if (ptr != 0 && depth == 0) {
    const int device = vmstash_owner_device(reinterpret_cast<void*>(ptr));
    if (device >= 0) {
      Depth d;
      if (auto sync = RealFn<CuCtxSynchronizeFn>(real_cu_sync, "cuCtxSynchronize")) sync();
      vmstash_free(reinterpret_cast<void*>(ptr), 0, device, nullptr);
      return kCuSuccess;
    }
  }
  auto real = RealFn<CuMemFreeFn>(real_cu_free, "cuMemFree_v2");
  return real != nullptr ? real(ptr) : kCuErrorInvalidValue;
}

}  // extern "C"
