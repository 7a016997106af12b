// libvmstash_preload.so: the CUDA allocation calls of a whole process, routed to vmstash
// while a thread is in a region (LD_PRELOAD mode; DESIGN §7, torch_integration.md §9).
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
// goes to the real function, found once with dlsym(RTLD_NEXT) (or in the already loaded
// libcudart.so.13 / libcuda.so.1). cudaFree(NULL) keeps its runtime meaning.
//
// This library also carries the whole C ABI (vmstash_*): the Python package uses it when
// it is preloaded, so there is one vmstash runtime in the process. vmstash's own driver
// calls go through cuGetProcAddress, never through these hooks; a thread-local depth
// guard sends any re-entrant call to the real function anyway. Out of memory returns
// cudaErrorMemoryAllocation / CUDA_ERROR_OUT_OF_MEMORY, so PyTorch frees its cache and
// retries. Nothing here exits the process.
#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "torch_plugin/include/vmstash/vmstash.h"

namespace {

using cudaError_t = int;  // the runtime's enum, ABI-compatible
constexpr cudaError_t kCudaSuccess = 0;
constexpr cudaError_t kCudaErrorInvalidValue = 1;
constexpr cudaError_t kCudaErrorMemoryAllocation = 2;
using CUresult = int;
constexpr CUresult kCuSuccess = 0;
constexpr CUresult kCuErrorInvalidValue = 1;
constexpr CUresult kCuErrorOutOfMemory = 2;
using CUdeviceptr = unsigned long long;  // NOLINT: the driver's type
using CUdevice = int;

using MallocFn = cudaError_t (*)(void**, size_t);
using FreeFn = cudaError_t (*)(void*);
using MallocAsyncFn = cudaError_t (*)(void**, size_t, cudaStream_t);
using FreeAsyncFn = cudaError_t (*)(void*, cudaStream_t);
using GetDeviceFn = cudaError_t (*)(int*);
using SyncFn = cudaError_t (*)();
using CuMemAllocFn = CUresult (*)(CUdeviceptr*, size_t);
using CuMemFreeFn = CUresult (*)(CUdeviceptr);
using CuCtxGetDeviceFn = CUresult (*)(CUdevice*);
using CuCtxSynchronizeFn = CUresult (*)();

void* Real(const char* name, const char* library) {
  void* fn = dlsym(RTLD_NEXT, name);
  if (fn != nullptr) return fn;
  void* lib = dlopen(library, RTLD_NOW | RTLD_NOLOAD);  // only if the process has it already
  return lib != nullptr ? dlsym(lib, name) : nullptr;
}

template <typename Fn>
Fn RealFn(std::atomic<void*>& slot, const char* name, const char* library) {
  void* fn = slot.load(std::memory_order_acquire);
  if (fn == nullptr) {
    fn = Real(name, library);
    slot.store(fn, std::memory_order_release);
  }
  return reinterpret_cast<Fn>(fn);
}

constexpr const char* kCudart = "libcudart.so.13";
constexpr const char* kCuda = "libcuda.so.1";
std::atomic<void*> real_malloc{nullptr}, real_free{nullptr}, real_malloc_async{nullptr}, real_free_async{nullptr},
    real_get_device{nullptr}, real_sync{nullptr}, real_cu_alloc{nullptr}, real_cu_free{nullptr},
    real_cu_device{nullptr}, real_cu_sync{nullptr};

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

int RuntimeDevice() {
  auto get = RealFn<GetDeviceFn>(real_get_device, "cudaGetDevice", kCudart);
  int device = 0;
  if (get == nullptr || get(&device) != kCudaSuccess) return 0;
  return device;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) cudaError_t cudaMalloc(void** ptr, size_t size) {
  if (ptr == nullptr) return kCudaErrorInvalidValue;
  if (Routed()) {
    Depth d;
    *ptr = vmstash_malloc(size, RuntimeDevice(), nullptr);
    return *ptr != nullptr || size == 0 ? kCudaSuccess : kCudaErrorMemoryAllocation;
  }
  auto real = RealFn<MallocFn>(real_malloc, "cudaMalloc", kCudart);
  return real != nullptr ? real(ptr, size) : kCudaErrorMemoryAllocation;
}

__attribute__((visibility("default"))) cudaError_t cudaFree(void* ptr) {
  if (ptr != nullptr && depth == 0) {
    const int device = vmstash_owner_device(ptr);
    if (device >= 0) {
      Depth d;
      // cudaFree synchronizes the device; keep that promise before the memory is reused.
      if (auto sync = RealFn<SyncFn>(real_sync, "cudaDeviceSynchronize", kCudart)) sync();
      vmstash_free(ptr, 0, device, nullptr);
      return kCudaSuccess;
    }
  }
  auto real = RealFn<FreeFn>(real_free, "cudaFree", kCudart);
  return real != nullptr ? real(ptr) : kCudaErrorInvalidValue;
}

__attribute__((visibility("default"))) cudaError_t cudaMallocAsync(void** ptr, size_t size, cudaStream_t stream) {
  if (ptr == nullptr) return kCudaErrorInvalidValue;
  if (Routed()) {
    Depth d;
    *ptr = vmstash_malloc(size, RuntimeDevice(), stream);
    return *ptr != nullptr || size == 0 ? kCudaSuccess : kCudaErrorMemoryAllocation;
  }
  auto real = RealFn<MallocAsyncFn>(real_malloc_async, "cudaMallocAsync", kCudart);
  return real != nullptr ? real(ptr, size, stream) : kCudaErrorMemoryAllocation;
}

__attribute__((visibility("default"))) cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream) {
  if (ptr != nullptr && depth == 0) {
    const int device = vmstash_owner_device(ptr);
    if (device >= 0) {
      Depth d;
      // Stream-ordered: reuse waits for `stream` (vmstash's RecordStream) as well as for
      // the stream the block was allocated on.
      (void)vmstash_record_stream(ptr, device, stream);
      vmstash_free(ptr, 0, device, stream);
      return kCudaSuccess;
    }
  }
  auto real = RealFn<FreeAsyncFn>(real_free_async, "cudaFreeAsync", kCudart);
  return real != nullptr ? real(ptr, stream) : kCudaErrorInvalidValue;
}

__attribute__((visibility("default"))) CUresult cuMemAlloc_v2(CUdeviceptr* ptr, size_t size) {
  if (ptr == nullptr) return kCuErrorInvalidValue;
  if (Routed()) {
    Depth d;
    CUdevice device = 0;
    if (auto get = RealFn<CuCtxGetDeviceFn>(real_cu_device, "cuCtxGetDevice", kCuda)) get(&device);
    void* p = vmstash_malloc(size, device, nullptr);
    *ptr = reinterpret_cast<CUdeviceptr>(p);
    return p != nullptr || size == 0 ? kCuSuccess : kCuErrorOutOfMemory;
  }
  auto real = RealFn<CuMemAllocFn>(real_cu_alloc, "cuMemAlloc_v2", kCuda);
  return real != nullptr ? real(ptr, size) : kCuErrorOutOfMemory;
}

__attribute__((visibility("default"))) CUresult cuMemFree_v2(CUdeviceptr ptr) {
  if (ptr != 0 && depth == 0) {
    const int device = vmstash_owner_device(reinterpret_cast<void*>(ptr));
    if (device >= 0) {
      Depth d;
      if (auto sync = RealFn<CuCtxSynchronizeFn>(real_cu_sync, "cuCtxSynchronize", kCuda)) sync();
      vmstash_free(reinterpret_cast<void*>(ptr), 0, device, nullptr);
      return kCuSuccess;
    }
  }
  auto real = RealFn<CuMemFreeFn>(real_cu_free, "cuMemFree_v2", kCuda);
  return real != nullptr ? real(ptr) : kCuErrorInvalidValue;
}

}  // extern "C"
