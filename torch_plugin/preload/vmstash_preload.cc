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
// not "default", or for every thread when VMSTASH_PRELOAD_ALL=1 (TMS_INIT_ENABLE=1 is
// read the same way). Everything else, and every free of a pointer vmstash did not return,
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
#include <initializer_list>

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

bool RouteAll() {
  static const bool all = [] {
    for (const char* name : {"VMSTASH_PRELOAD_ALL", "TMS_INIT_ENABLE"}) {
      const char* v = std::getenv(name);
      if (v != nullptr && (std::strcmp(v, "1") == 0 || std::strcmp(v, "true") == 0)) return true;
    }
    return false;
  }();
  return all;
}

// The calling thread's allocations go to vmstash.
bool Routed() {
  if (depth > 0) return false;
  if (RouteAll()) return true;
  const char* tag = vmstash_get_current_tag();
  return tag != nullptr && std::strcmp(tag, "default") != 0;
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

__attribute__((visibility("default"))) cudaError_t cudaMalloc(void** ptr, size_t size) {
  if (ptr == nullptr) return kCudaErrorInvalidValue;
  if (Routed()) {
    Depth d;
    int device = 0;
    if (const cudaError_t rc = RuntimeDevice(&device); rc != kCudaSuccess) return rc;
    *ptr = vmstash_malloc(size, device, nullptr);
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
    *ptr = vmstash_malloc(size, device, stream);
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
    void* p = vmstash_malloc(size, device, nullptr);
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
