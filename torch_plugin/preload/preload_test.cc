// libvmstash_preload.so on the simulator, loaded with dlopen (RTLD_LOCAL, so it does not
// interpose this test): routing by the thread's tag, forwarding of everything else, frees
// of pointers vmstash owns, and the C ABI it carries. No CUDA runtime is loaded here, so
// forwarded calls find no real function and fail cleanly instead of crashing; a stand-in
// (libfake_cudart_for_test.so) provides cudaGetDevice and cudaStreamIsCapturing for the
// routed path.
#include <dlfcn.h>
#include <stdlib.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace {

using MallocFn = int (*)(void**, size_t);
using FreeFn = int (*)(void*);
using MallocAsyncFn = int (*)(void**, size_t, void*);
using FreeAsyncFn = int (*)(void*, void*);
using CuAllocFn = int (*)(unsigned long long*, size_t);
using CuFreeFn = int (*)(unsigned long long);
using InitFn = int (*)(const char*);
using TagFn = int (*)(const char*);
using CreateTagFn = int (*)(const char*, const char*);
using OwnerFn = int (*)(const void*);

std::string LibraryPath(const char* name = "libvmstash_preload.so") {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir != nullptr && workspace != nullptr) {
    return std::string(srcdir) + "/" + workspace + "/torch_plugin/" + name;
  }
  return std::string("torch_plugin/") + name;  // CMake: run from the build directory
}

using SetIntFn = void (*)(int);

template <typename Fn>
Fn Get(void* lib, const char* name) {
  return reinterpret_cast<Fn>(dlsym(lib, name));
}

TEST(PreloadTest, RoutesByTagForwardsTheRestAndFreesWhatItOwns) {
  void* lib = dlopen(LibraryPath().c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(lib, nullptr) << dlerror();
  auto init = Get<InitFn>(lib, "vmstash_init");
  auto create_tag = Get<CreateTagFn>(lib, "vmstash_create_tag");
  auto set_tag = Get<TagFn>(lib, "vmstash_set_current_tag");
  auto owner = Get<OwnerFn>(lib, "vmstash_owner_device");
  auto cuda_malloc = Get<MallocFn>(lib, "cudaMalloc");
  auto cuda_free = Get<FreeFn>(lib, "cudaFree");
  auto malloc_async = Get<MallocAsyncFn>(lib, "cudaMallocAsync");
  auto free_async = Get<FreeAsyncFn>(lib, "cudaFreeAsync");
  auto cu_alloc = Get<CuAllocFn>(lib, "cuMemAlloc_v2");
  auto cu_free = Get<CuFreeFn>(lib, "cuMemFree_v2");
  for (void* fn : {reinterpret_cast<void*>(cuda_malloc), reinterpret_cast<void*>(cuda_free),
                   reinterpret_cast<void*>(malloc_async), reinterpret_cast<void*>(free_async),
                   reinterpret_cast<void*>(cu_alloc), reinterpret_cast<void*>(cu_free)}) {
    ASSERT_NE(fn, nullptr);
  }
  EXPECT_EQ(dlsym(lib, "cudaMallocManaged"), nullptr);  // not interposed
  ASSERT_EQ(init("driver:sim,sim_devices:2,sim_capacity:1G"), 0);
  ASSERT_EQ(create_tag("preload_kv", "discard"), 0);

  // Issue 16 item 10: without a runtime's cudaGetDevice a routed call fails clearly
  // (cudaErrorInitializationError), instead of silently using device 0.
  ASSERT_EQ(set_tag("preload_kv"), 0);
  void* lost = nullptr;
  EXPECT_EQ(cuda_malloc(&lost, 1 << 20), 3);
  EXPECT_EQ(lost, nullptr);
  ASSERT_EQ(set_tag("default"), 0);
  void* fake = dlopen(LibraryPath("libfake_cudart_for_test.so").c_str(), RTLD_NOW | RTLD_GLOBAL);
  ASSERT_NE(fake, nullptr) << dlerror();
  auto set_device = Get<SetIntFn>(fake, "fake_set_device");
  auto set_capture = Get<SetIntFn>(fake, "fake_set_capture_status");

  // Outside a region: forwarded; with no CUDA runtime in this process that fails cleanly.
  void* p = nullptr;
  EXPECT_EQ(cuda_malloc(&p, 1 << 20), 2);  // cudaErrorMemoryAllocation
  EXPECT_EQ(cuda_malloc(nullptr, 1 << 20), 1);  // cudaErrorInvalidValue
  // In a region (the thread's tag): vmstash memory of that tag.
  ASSERT_EQ(set_tag("preload_kv"), 0);
  ASSERT_EQ(cuda_malloc(&p, 3 << 20), 0);
  ASSERT_NE(p, nullptr);
  std::memset(p, 7, 3 << 20);  // simulator memory is host memory
  EXPECT_EQ(owner(p), 0);
  void* q = nullptr;
  ASSERT_EQ(malloc_async(&q, 1 << 20, nullptr), 0);
  // The runtime's current device is used (not 0).
  set_device(1);
  void* on1 = nullptr;
  ASSERT_EQ(cuda_malloc(&on1, 1 << 20), 0);
  EXPECT_EQ(owner(on1), 1);
  set_device(0);
  // During stream capture, routed stream-ordered calls are refused (the free stays undone).
  set_capture(1);  // cudaStreamCaptureStatusActive
  void* during = nullptr;
  EXPECT_EQ(malloc_async(&during, 1 << 20, nullptr), 900);  // cudaErrorStreamCaptureUnsupported
  EXPECT_EQ(during, nullptr);
  EXPECT_EQ(free_async(q, nullptr), 900);
  EXPECT_EQ(owner(q), 0);  // still allocated
  set_capture(0);
  // No cuCtxGetDevice here: the driver-level call fails clearly too.
  unsigned long long r = 0;
  EXPECT_EQ(cu_alloc(&r, 1 << 20), 3);  // CUDA_ERROR_NOT_INITIALIZED
  EXPECT_EQ(cuda_free(on1), 0);
  // Another thread without a tag is not routed.
  std::thread([&] {
    void* other = nullptr;
    EXPECT_EQ(cuda_malloc(&other, 1 << 20), 2);
  }).join();
  ASSERT_EQ(set_tag("default"), 0);
  // Frees of our pointers go to vmstash, from any thread or tag.
  EXPECT_EQ(cuda_free(p), 0);
  EXPECT_EQ(owner(p), -1);
  EXPECT_EQ(free_async(q, nullptr), 0);
  EXPECT_EQ(owner(q), -1);
  // Not ours: forwarded (no runtime here: invalid value), including cudaFree(NULL).
  int host = 0;
  EXPECT_EQ(cuda_free(&host), 1);
  EXPECT_EQ(cuda_free(nullptr), 1);
  dlclose(lib);
  dlclose(fake);
}

// Whole-process mode (torch_memory_saver's TMS_INIT_ENABLE=1 with
// TMS_INIT_ENABLE_CPU_BACKUP=1) is read from the environment once, so it runs in a child
// process of its own: every thread's allocations go to the process tag with policy
// backup, its pause/resume keeps the bytes, and a thread's override (disable()) sends its
// allocations to CUDA.
#define CHILD_CHECK(cond)                                            \
  do {                                                               \
    if (!(cond)) {                                                   \
      std::fprintf(stderr, "line %d: %s failed\n", __LINE__, #cond); \
      std::_Exit(1);                                                 \
    }                                                                \
  } while (0)

void WholeProcessChild() {
  setenv("TMS_INIT_ENABLE", "1", 1);
  setenv("TMS_INIT_ENABLE_CPU_BACKUP", "1", 1);
  void* fake = dlopen(LibraryPath("libfake_cudart_for_test.so").c_str(), RTLD_NOW | RTLD_GLOBAL);
  CHILD_CHECK(fake != nullptr);
  void* lib = dlopen(LibraryPath().c_str(), RTLD_NOW | RTLD_LOCAL);
  CHILD_CHECK(lib != nullptr);
  CHILD_CHECK(Get<InitFn>(lib, "vmstash_init")("driver:sim,sim_devices:1,sim_capacity:1G") == 0);
  auto cuda_malloc = Get<MallocFn>(lib, "cudaMalloc");
  auto cuda_free = Get<FreeFn>(lib, "cudaFree");
  auto owner = Get<OwnerFn>(lib, "vmstash_owner_device");
  auto pause = Get<int (*)(const char*, int)>(lib, "vmstash_pause");
  auto resume = Get<int (*)(const char*, int)>(lib, "vmstash_resume");
  auto policy = Get<const char* (*)(const char*)>(lib, "vmstash_tag_policy");
  auto set_routed = Get<int (*)(int)>(lib, "vmstash_preload_set_routed");
  auto routed = Get<int (*)()>(lib, "vmstash_preload_routed");
  auto process_tag = Get<const char* (*)()>(lib, "vmstash_preload_process_tag");
  CHILD_CHECK(set_routed != nullptr && routed != nullptr && process_tag != nullptr);
  CHILD_CHECK(std::strcmp(process_tag(), "process") == 0);
  CHILD_CHECK(routed() == 1);

  // No region anywhere: this thread's and another thread's allocations are vmstash's.
  void* p = nullptr;
  CHILD_CHECK(cuda_malloc(&p, 3 << 20) == 0);
  CHILD_CHECK(owner(p) == 0);
  CHILD_CHECK(policy("process") != nullptr && std::strcmp(policy("process"), "backup") == 0);
  void* other = nullptr;
  std::thread([&] { CHILD_CHECK(cuda_malloc(&other, 1 << 20) == 0); }).join();
  CHILD_CHECK(owner(other) == 0);
  std::memset(p, 0x5c, 3 << 20);
  CHILD_CHECK(pause("process", -1) == 0);
  CHILD_CHECK(resume("process", -1) == 0);
  for (int i = 0; i < (3 << 20); i += 4099) CHILD_CHECK(static_cast<unsigned char*>(p)[i] == 0x5c);

  // disable(): this thread's allocations go to CUDA (none here: a clean failure), others'
  // stay routed; dropping the override restores whole-process routing.
  CHILD_CHECK(set_routed(0) == -1);  // no override before
  CHILD_CHECK(routed() == 0);
  void* bypassed = nullptr;
  CHILD_CHECK(cuda_malloc(&bypassed, 1 << 20) == 2);  // forwarded: no CUDA runtime here
  std::thread([&] {
    void* q = nullptr;
    CHILD_CHECK(cuda_malloc(&q, 1 << 20) == 0);
    CHILD_CHECK(cuda_free(q) == 0);
  }).join();
  CHILD_CHECK(set_routed(-1) == 0);
  CHILD_CHECK(routed() == 1);
  CHILD_CHECK(cuda_free(p) == 0 && cuda_free(other) == 0);
  CHILD_CHECK(owner(p) == -1);
  std::_Exit(0);
}

TEST(PreloadTest, WholeProcessModeCapturesEveryThreadIntoABackedUpProcessTag) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(WholeProcessChild(), ::testing::ExitedWithCode(0), "");
}

// torch_memory_saver's entry points as its tests reach them in a preloaded process
// (ctypes.CDLL(None).tms_pause, cdll.tms_get_*): whole-process mode with CPU backup, the
// per-thread config read from TMS_INIT_*, tms_pause/tms_resume of every tag (the process
// tag included), a free while paused, the backup pointer, retain_cpu_backup, the
// interesting flag routing a thread's allocations, and a config set from C routing
// allocations into that tag.
void TmsEntryPointsChild() {
  setenv("TMS_INIT_ENABLE", "1", 1);
  setenv("TMS_INIT_ENABLE_CPU_BACKUP", "1", 1);
  void* fake = dlopen(LibraryPath("libfake_cudart_for_test.so").c_str(), RTLD_NOW | RTLD_GLOBAL);
  CHILD_CHECK(fake != nullptr);
  void* lib = dlopen(LibraryPath().c_str(), RTLD_NOW | RTLD_LOCAL);
  CHILD_CHECK(lib != nullptr);
  CHILD_CHECK(Get<InitFn>(lib, "vmstash_init")("driver:sim,sim_devices:1,sim_capacity:1G,auto_prepare:0") == 0);
  auto cuda_malloc = Get<MallocFn>(lib, "cudaMalloc");
  auto cuda_free = Get<FreeFn>(lib, "cudaFree");
  auto owner = Get<OwnerFn>(lib, "vmstash_owner_device");
  auto pause = Get<int (*)(const char*, int)>(lib, "vmstash_pause");
  auto policy = Get<const char* (*)(const char*)>(lib, "vmstash_tag_policy");
  auto tms_pause = Get<int (*)(const char*)>(lib, "tms_pause");
  auto tms_resume = Get<int (*)(const char*)>(lib, "tms_resume");
  auto interesting = Get<bool (*)()>(lib, "tms_get_interesting_region");
  auto set_interesting = Get<void (*)(bool)>(lib, "tms_set_interesting_region");
  auto cpu_backup = Get<bool (*)()>(lib, "tms_get_enable_cpu_backup");
  auto set_cpu_backup = Get<void (*)(bool)>(lib, "tms_set_enable_cpu_backup");
  auto current_tag = Get<const char* (*)()>(lib, "tms_get_current_tag");
  auto set_tag = Get<void (*)(const char*)>(lib, "tms_set_current_tag");
  auto backend = Get<const char* (*)()>(lib, "tms_get_cpu_backup_backend");
  auto set_retain = Get<void (*)(bool)>(lib, "tms_set_retain_cpu_backup");
  auto pointer = Get<unsigned char* (*)(const unsigned char*, unsigned long long)>(lib, "tms_get_cpu_backup_pointer");
  CHILD_CHECK(pointer != nullptr && set_retain != nullptr && Get<void*>(lib, "set_memory_margin_bytes") != nullptr);
  CHILD_CHECK(interesting() && cpu_backup() && std::strcmp(current_tag(), "default") == 0);
  CHILD_CHECK(std::strcmp(backend(), "pinned") == 0);

  constexpr int kSize = 6912;  // not a multiple of any granularity
  unsigned char* p = nullptr;
  unsigned char* gone = nullptr;
  CHILD_CHECK(cuda_malloc(reinterpret_cast<void**>(&p), kSize) == 0 && owner(p) == 0);
  CHILD_CHECK(cuda_malloc(reinterpret_cast<void**>(&gone), kSize) == 0);
  CHILD_CHECK(std::strcmp(policy("process"), "backup") == 0);
  std::memset(p, 0xa5, kSize);
  CHILD_CHECK(pointer(p, kSize) == nullptr);  // active: no backup
  CHILD_CHECK(tms_pause(nullptr) == 0);
  CHILD_CHECK(pause("process", -1) == -1);  // paused (VMSTASH_NOOP)
  const unsigned char* saved = pointer(p + 100, 16);
  CHILD_CHECK(saved != nullptr && saved[0] == 0xa5 && saved[15] == 0xa5);
  CHILD_CHECK(cuda_free(gone) == 0);  // freed while paused
  CHILD_CHECK(tms_resume(nullptr) == 0);
  CHILD_CHECK(p[0] == 0xa5 && p[kSize - 1] == 0xa5);
  CHILD_CHECK(pointer(p, kSize) == nullptr);  // retain_cpu_backup off: given back
  set_retain(true);
  CHILD_CHECK(tms_pause("default") == 0);
  const unsigned char* kept = pointer(p, kSize);
  CHILD_CHECK(tms_resume("default") == 0);
  CHILD_CHECK(kept != nullptr && pointer(p, kSize) == kept && kept[kSize - 1] == 0xa5);
  set_retain(false);

  // The interesting flag off: this thread's allocations go to CUDA (none here: a failure).
  set_interesting(false);
  void* bypassed = nullptr;
  CHILD_CHECK(!interesting() && cuda_malloc(&bypassed, 1 << 20) == 2);
  set_interesting(true);
  // A config set from C: this thread's allocations go to that tag (discard, no backup).
  set_tag("c_kv");
  set_cpu_backup(false);
  void* q = nullptr;
  CHILD_CHECK(cuda_malloc(&q, 1 << 20) == 0 && owner(q) == 0);
  CHILD_CHECK(policy("c_kv") != nullptr && std::strcmp(policy("c_kv"), "discard") == 0);
  CHILD_CHECK(tms_pause("c_kv") == 0 && pause("c_kv", -1) == -1 && pause("process", -1) == 0);
  CHILD_CHECK(tms_resume(nullptr) == 0);
  set_tag("default");
  set_cpu_backup(true);
  void* r = nullptr;
  CHILD_CHECK(cuda_malloc(&r, 1 << 20) == 0);
  CHILD_CHECK(tms_pause("c_kv") == 0 && pause("process", -1) == 0);  // r is the process tag's
  CHILD_CHECK(tms_resume(nullptr) == 0);
  CHILD_CHECK(cuda_free(p) == 0 && cuda_free(q) == 0 && cuda_free(r) == 0);
  std::_Exit(0);
}

TEST(PreloadTest, TorchMemorySaverEntryPointsInWholeProcessMode) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(TmsEntryPointsChild(), ::testing::ExitedWithCode(0), "");
}

}  // namespace
