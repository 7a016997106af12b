// The C ABI on the simulator: linked directly, and loaded with dlopen as PyTorch and
// ctypes load it (only vmstash_* and torch_memory_saver's tms_* symbols exported, entry
// points usable by name).
#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "torch_plugin/c_abi/shim.h"
#include "torch_plugin/include/vmstash/vmstash.h"
#include "torch_plugin/include/vmstash/vmstash_stash.h"

namespace {

using ::testing::HasSubstr;

class CAbiTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(vmstash_init("driver:sim,sim_devices:2,sim_capacity:1G"), VMSTASH_OK); }
  void TearDown() override { ASSERT_EQ(vmstash_shutdown(), VMSTASH_OK); }
  // A backup tag `tag` with one block of `n` bytes on device 0 (nullptr on failure).
  static unsigned char* BackupBlock(const char* tag, std::size_t n) {
    if (vmstash_create_tag(tag, "backup") != VMSTASH_OK || vmstash_set_current_tag(tag) != VMSTASH_OK) return nullptr;
    void* p = vmstash_malloc(n, 0, nullptr);
    vmstash_set_current_tag("default");
    return static_cast<unsigned char*>(p);
  }
};

TEST_F(CAbiTest, MallocFreeWithPyTorchSignatures) {
  EXPECT_EQ(vmstash_is_initialized(), 1);
  void* p = vmstash_malloc(1000, 0, nullptr);
  ASSERT_NE(p, nullptr) << vmstash_last_error();
  std::memset(p, 1, 1000);  // simulator memory is real host memory
  vmstash_free(p, 1000, 0, nullptr);
  EXPECT_EQ(vmstash_malloc(1000, 0, nullptr), p);  // cached
  vmstash_free(p, 1000, 0, nullptr);
  void* q = vmstash_malloc(64 << 20, 1, nullptr);  // second device
  ASSERT_NE(q, nullptr);
  vmstash_free(q, 64 << 20, 1, nullptr);
  EXPECT_EQ(vmstash_malloc(0, 0, nullptr), nullptr);
  vmstash_free(nullptr, 0, 0, nullptr);
}

TEST_F(CAbiTest, ErrorsAreCodesAndThreadLocalMessages) {
  EXPECT_EQ(vmstash_malloc(512, 7, nullptr), nullptr);
  EXPECT_THAT(vmstash_last_error(), HasSubstr("device 7 does not exist"));
  std::string other_thread;
  std::thread([&] { other_thread = vmstash_last_error(); }).join();
  EXPECT_EQ(other_thread, "");
  EXPECT_EQ(vmstash_malloc(std::size_t{2} << 30, 0, nullptr), nullptr);
  EXPECT_THAT(vmstash_last_error(), HasSubstr("out of memory on device 0"));
  int x = 0;
  vmstash_free(&x, 4, 0, nullptr);  // not ours: reported, not fatal
  EXPECT_THAT(vmstash_last_error(), HasSubstr("not a live allocation"));
  EXPECT_EQ(vmstash_set_current_tag(""), VMSTASH_INVALID_ARGUMENT);
  EXPECT_EQ(vmstash_set_current_tag(nullptr), VMSTASH_INVALID_ARGUMENT);
  EXPECT_EQ(vmstash_create_tag("t", "keep"), VMSTASH_INVALID_ARGUMENT);
  EXPECT_EQ(vmstash_record_stream(&x, 0, nullptr), VMSTASH_INVALID_ARGUMENT);
  EXPECT_EQ(vmstash_init("driver:cuda"), VMSTASH_FAILED_PRECONDITION);
  EXPECT_EQ(vmstash_init("driver:sim,sim_devices:2,sim_capacity:1G"), VMSTASH_OK);  // same options
  EXPECT_EQ(vmstash_init("bogus:1"), VMSTASH_INVALID_ARGUMENT);
  EXPECT_THAT(vmstash_last_error(), HasSubstr("unknown key 'bogus'"));
}

TEST_F(CAbiTest, StashArenaRoundTripPauseRefusalAndShutdownOrder) {
  vmstash_stash_arena* arena = nullptr;
  EXPECT_EQ(vmstash_stash_create(0, "stash", 0, 64, &arena), VMSTASH_INVALID_ARGUMENT);
  EXPECT_THAT(vmstash_last_error(), HasSubstr("row_bytes"));
  EXPECT_EQ(vmstash_stash_prepare(nullptr, 1, 0, nullptr), VMSTASH_INVALID_ARGUMENT);
  ASSERT_EQ(vmstash_stash_create(0, "stash", 256, 4, &arena), VMSTASH_OK) << vmstash_last_error();
  ASSERT_EQ(vmstash_stash_prepare(arena, 16, 4, nullptr), VMSTASH_OK) << vmstash_last_error();
  const char* executor = nullptr;
  uint64_t device_bytes = 0;
  ASSERT_EQ(vmstash_stash_info(arena, &device_bytes, &executor), VMSTASH_OK);
  EXPECT_EQ(device_bytes, 16u * 4 * 256);
  EXPECT_STREQ(executor, "host");
  void* handle = nullptr;
  ASSERT_EQ(vmstash_stash_new_handle(arena, 10, &handle), VMSTASH_OK);
  auto* src = static_cast<uint8_t*>(vmstash_malloc(10 * 256, 0, nullptr));
  auto* dst = static_cast<uint8_t*>(vmstash_malloc(10 * 256, 0, nullptr));
  auto* n = static_cast<int64_t*>(vmstash_malloc(8, 0, nullptr));
  for (int i = 0; i < 10 * 256; ++i) src[i] = static_cast<uint8_t>(i * 3 + 1);
  std::memset(dst, 0xFF, 10 * 256);
  *n = 7;
  ASSERT_EQ(vmstash_stash_stash(arena, nullptr, src, n, 10, handle), VMSTASH_OK);
  uint64_t used = 0;
  ASSERT_EQ(vmstash_stash_pages_in_use(arena, &used), VMSTASH_OK);
  EXPECT_EQ(used, 2u);  // 7 rows in pages of 4
  EXPECT_EQ(vmstash_pause("stash", 0), VMSTASH_FAILED_PRECONDITION);
  EXPECT_THAT(vmstash_last_error(), HasSubstr("live activations"));
  ASSERT_EQ(vmstash_stash_restore(arena, nullptr, handle, dst, 10, 1), VMSTASH_OK);
  EXPECT_EQ(std::memcmp(dst, src, 7 * 256), 0);
  for (int i = 7 * 256; i < 10 * 256; ++i) ASSERT_EQ(dst[i], 0) << i;  // zero tail
  vmstash_stash_flags flags{};
  ASSERT_EQ(vmstash_stash_read_flags(arena, nullptr, &flags), VMSTASH_OK);
  EXPECT_EQ(flags.overflow, 0u);
  EXPECT_EQ(flags.peak_pages[0], 2u);
  EXPECT_EQ(vmstash_pause("stash", 0), VMSTASH_OK);  // idle: released
  EXPECT_EQ(vmstash_resume("stash", 0), VMSTASH_OK);
  ASSERT_EQ(vmstash_stash_reset(arena, nullptr), VMSTASH_OK);
  EXPECT_EQ(vmstash_shutdown(), VMSTASH_FAILED_PRECONDITION);
  EXPECT_THAT(vmstash_last_error(), HasSubstr("stash arena"));
  ASSERT_EQ(vmstash_stash_free_handle(arena, handle), VMSTASH_OK);
  ASSERT_EQ(vmstash_stash_destroy(arena), VMSTASH_OK);
  for (void* p : {static_cast<void*>(src), static_cast<void*>(dst), static_cast<void*>(n)}) {
    vmstash_free(p, 0, 0, nullptr);
  }
}

TEST_F(CAbiTest, TagsRouteAllocationsAndShowInStats) {
  ASSERT_EQ(vmstash_create_tag("weights", "backup"), VMSTASH_OK);
  EXPECT_EQ(vmstash_create_tag("weights", "backup"), VMSTASH_OK);
  EXPECT_EQ(vmstash_create_tag("weights", "discard"), VMSTASH_FAILED_PRECONDITION);
  EXPECT_STREQ(vmstash_get_current_tag(), "default");
  ASSERT_EQ(vmstash_set_current_tag("weights"), VMSTASH_OK);
  void* w = vmstash_malloc(4096, 0, nullptr);
  ASSERT_EQ(vmstash_set_current_tag("kv_cache"), VMSTASH_OK);
  void* kv = vmstash_malloc(8192, 0, nullptr);
  ASSERT_EQ(vmstash_set_current_tag("default"), VMSTASH_OK);
  ASSERT_NE(w, nullptr);
  ASSERT_NE(kv, nullptr);
  char* stats = vmstash_stats_json(0);
  ASSERT_NE(stats, nullptr);
  std::string s(stats);
  vmstash_string_free(stats);
  EXPECT_THAT(s, HasSubstr("\"name\":\"weights\",\"policy\":\"backup\",\"allocated_bytes\":{\"current\":4096"));
  EXPECT_THAT(s, HasSubstr("\"name\":\"kv_cache\",\"policy\":\"discard\",\"allocated_bytes\":{\"current\":8192"));
  char* snap = vmstash_snapshot_json(-1);
  ASSERT_NE(snap, nullptr);
  EXPECT_EQ(snap[0], '[');
  EXPECT_THAT(std::string(snap), HasSubstr("\"tag\":\"weights\""));
  vmstash_string_free(snap);
  EXPECT_EQ(vmstash_record_stream(kv, 0, reinterpret_cast<cudaStream_t>(0)), VMSTASH_OK);
  vmstash_free(w, 4096, 0, nullptr);
  vmstash_free(kv, 8192, 0, nullptr);
  EXPECT_EQ(vmstash_empty_cache(0, "kv_cache"), VMSTASH_OK);
  EXPECT_EQ(vmstash_empty_cache(-1, nullptr), VMSTASH_OK);
  stats = vmstash_stats_json(0);
  EXPECT_THAT(std::string(stats), HasSubstr("\"total\":{\"name\":\"total\",\"policy\":\"discard\","
                                            "\"allocated_bytes\":{\"current\":0"));
  EXPECT_THAT(std::string(stats), HasSubstr("\"reserved_bytes\":{\"current\":0"));
  vmstash_string_free(stats);
}

// The control endpoint's thread ends with vmstash_shutdown (a library that is dlclose'd
// after its shutdown must leave no thread running in it); a new init serves again.
TEST(CAbiShutdownTest, ShutdownStopsTheControlEndpoint) {
  char tmpl[] = "/tmp/vmstash_c_abi_XXXXXX";  // short: a socket path has at most 107 bytes
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  ASSERT_EQ(setenv("VMSTASH_RUNTIME_DIR", dir.c_str(), 1), 0);
  const std::string socket = dir + "/" + std::to_string(getpid()) + ".sock";
  struct stat st;
  for (int round = 0; round < 2; ++round) {
    ASSERT_EQ(vmstash_init("driver:sim,control:1"), VMSTASH_OK);
    EXPECT_EQ(stat(socket.c_str(), &st), 0) << socket << " missing while initialized";
    ASSERT_EQ(vmstash_shutdown(), VMSTASH_OK);
    EXPECT_NE(stat(socket.c_str(), &st), 0) << socket << " still there after shutdown";
  }
  unsetenv("VMSTASH_RUNTIME_DIR");
  EXPECT_EQ(rmdir(dir.c_str()), 0);
}

TEST(CAbiSharedLibraryTest, LoadsWithDlopenAndExportsOnlyTheCAbi) {
  void* lib = dlopen("torch_plugin/libvmstash.so", RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(lib, nullptr) << dlerror();
  using InitFn = int (*)(const char*);
  using MallocFn = void* (*)(size_t, int, cudaStream_t);
  using FreeFn = void (*)(void*, size_t, int, cudaStream_t);
  using ShutdownFn = int (*)();
  auto init = reinterpret_cast<InitFn>(dlsym(lib, "vmstash_init"));
  auto malloc_fn = reinterpret_cast<MallocFn>(dlsym(lib, "vmstash_malloc"));
  auto free_fn = reinterpret_cast<FreeFn>(dlsym(lib, "vmstash_free"));
  auto shutdown = reinterpret_cast<ShutdownFn>(dlsym(lib, "vmstash_shutdown"));
  ASSERT_TRUE(init && malloc_fn && free_fn && shutdown);
  EXPECT_EQ(dlsym(lib, "_ZN7vmstash16CachingAllocator6CreateEPNS_6DriverEiNS_16AllocatorOptionsE"), nullptr);
  // torch_memory_saver's entry points (vmstash_tms.h), by their names.
  for (const char* name : {"tms_pause", "tms_resume", "tms_get_cpu_backup_pointer", "tms_get_cpu_backup_backend",
                           "tms_set_interesting_region", "tms_torch_malloc", "set_memory_margin_bytes"}) {
    EXPECT_NE(dlsym(lib, name), nullptr) << name;
  }
  ASSERT_EQ(init("driver:sim"), 0);
  void* p = malloc_fn(4096, 0, nullptr);
  ASSERT_NE(p, nullptr);
  free_fn(p, 4096, 0, nullptr);
  EXPECT_EQ(shutdown(), 0);
  dlclose(lib);
}

}  // namespace

namespace {

int hook_calls = 0;
int VetoOnce(const char* tag, int device, void* user) {
  ++hook_calls;
  int* veto = static_cast<int*>(user);
  return (*veto)-- > 0 ? 7 : 0;
}
int AfterResume(const char* tag, int, void*) { return std::string(tag) == "ckpt" ? 0 : 1; }

TEST_F(CAbiTest, PauseResumeThroughTheCAbi) {
  ASSERT_EQ(vmstash_create_tag("ckpt", "backup"), VMSTASH_OK);
  int veto = 1;
  ASSERT_EQ(vmstash_register_hooks("ckpt", VetoOnce, AfterResume, &veto), VMSTASH_OK);
  ASSERT_EQ(vmstash_set_current_tag("ckpt"), VMSTASH_OK);
  auto* p = static_cast<unsigned char*>(vmstash_malloc(3 << 20, 0, nullptr));
  ASSERT_EQ(vmstash_set_current_tag("default"), VMSTASH_OK);
  ASSERT_NE(p, nullptr);
  p[0] = 42;
  p[(3 << 20) - 1] = 43;
  ASSERT_EQ(vmstash_prepare("ckpt", 0, 0), VMSTASH_OK);
  EXPECT_EQ(vmstash_pause("ckpt", 0), VMSTASH_ABORTED);  // the hook vetoed
  EXPECT_THAT(vmstash_last_error(), HasSubstr("before-pause hook returned 7"));
  ASSERT_EQ(vmstash_pause("ckpt", 0), VMSTASH_OK);
  EXPECT_EQ(vmstash_pause("ckpt", -1), VMSTASH_NOOP);
  ASSERT_EQ(vmstash_set_current_tag("ckpt"), VMSTASH_OK);
  EXPECT_EQ(vmstash_malloc(512, 0, nullptr), nullptr);
  EXPECT_THAT(vmstash_last_error(), HasSubstr("'ckpt' is paused"));
  ASSERT_EQ(vmstash_set_current_tag("default"), VMSTASH_OK);
  char* stats = vmstash_stats_json(0);
  EXPECT_THAT(std::string(stats), HasSubstr("\"state\":\"paused\""));
  vmstash_string_free(stats);
  EXPECT_EQ(vmstash_release_backup("ckpt", 0), VMSTASH_FAILED_PRECONDITION);
  ASSERT_EQ(vmstash_resume("ckpt", -1), VMSTASH_OK);
  EXPECT_EQ(vmstash_resume("ckpt", 0), VMSTASH_NOOP);
  EXPECT_EQ(p[0], 42);
  EXPECT_EQ(p[(3 << 20) - 1], 43);
  EXPECT_EQ(hook_calls, 2);
  vmstash_free(p, 3 << 20, 0, nullptr);
  EXPECT_EQ(vmstash_release_backup("ckpt", -1), VMSTASH_OK);
  EXPECT_EQ(vmstash_pause(nullptr, 0), VMSTASH_INVALID_ARGUMENT);
  EXPECT_EQ(vmstash_pause("bad tag", 0), VMSTASH_INVALID_ARGUMENT);
}

TEST_F(CAbiTest, TagSlotsAllocateInTheirTagFromAnyThreadAndPauseTakesALiveHint) {
  ASSERT_EQ(vmstash_create_tag("slotted", "backup"), VMSTASH_OK);
  const int slot = vmstash_bind_tag_slot("slotted");
  ASSERT_GE(slot, 0);
  EXPECT_EQ(vmstash_bind_tag_slot("slotted"), slot);  // stable
  const int other = vmstash_bind_tag_slot("slotted_other");
  ASSERT_GE(other, 0);
  EXPECT_NE(other, slot);
  using MallocFn = void* (*)(size_t, int, cudaStream_t);
  void* self = dlopen(nullptr, RTLD_NOW);
  auto fn = reinterpret_cast<MallocFn>(dlsym(self, ("vmstash_malloc_slot" + std::to_string(slot)).c_str()));
  ASSERT_NE(fn, nullptr);
  // The current tag of the calling thread does not matter.
  unsigned char* p = nullptr;
  std::thread([&] { p = static_cast<unsigned char*>(fn(20 << 20, 0, nullptr)); }).join();
  ASSERT_NE(p, nullptr);
  char* stats = vmstash_stats_json(0);
  EXPECT_THAT(std::string(stats), HasSubstr("\"name\":\"slotted\""));
  vmstash_string_free(stats);
  p[(1 << 20)] = 11;
  p[(2 << 20) - 1] = 12;
  p[(5 << 20)] = 13;  // outside the hint: not preserved
  const uint64_t starts[] = {reinterpret_cast<uint64_t>(p) + (1 << 20)};
  const uint64_t sizes[] = {1 << 20};
  ASSERT_EQ(vmstash_pause_live("slotted", 0, starts, sizes, 1), VMSTASH_OK);
  stats = vmstash_stats_json(0);
  EXPECT_THAT(std::string(stats), HasSubstr("\"backed_up_bytes\":1048576"));
  vmstash_string_free(stats);
  ASSERT_EQ(vmstash_resume("slotted", 0), VMSTASH_OK);
  EXPECT_EQ(p[1 << 20], 11);
  EXPECT_EQ(p[(2 << 20) - 1], 12);
  vmstash_free(p, 20 << 20, 0, nullptr);
  EXPECT_EQ(vmstash_pause_live("slotted", 0, nullptr, sizes, 1), VMSTASH_INVALID_ARGUMENT);
  // An unbound slot refuses.
  auto unbound = reinterpret_cast<MallocFn>(dlsym(self, "vmstash_malloc_slot31"));
  ASSERT_NE(unbound, nullptr);
  if (vmstash_bind_tag_slot("slotted") != 31 && other != 31) {
    EXPECT_EQ(unbound(512, 0, nullptr), nullptr);
    EXPECT_THAT(vmstash_last_error(), HasSubstr("not bound"));
  }
  dlclose(self);
}

TEST_F(CAbiTest, SwitchThroughTheCAbiWithALiveHint) {
  unsigned char* t = BackupBlock("sw_train", 8 << 20);
  unsigned char* r = BackupBlock("sw_roll", 8 << 20);
  ASSERT_NE(t, nullptr) << vmstash_last_error();
  ASSERT_NE(r, nullptr) << vmstash_last_error();
  t[0] = 1;
  t[(8 << 20) - 1] = 2;
  ASSERT_EQ(vmstash_pause("sw_train", 0), VMSTASH_OK);
  r[(1 << 20)] = 3;
  r[(6 << 20)] = 4;  // outside the hint: not preserved
  const char* pause[] = {"sw_roll"};
  const char* resume[] = {"sw_train"};
  const uint64_t starts[] = {reinterpret_cast<uint64_t>(r) + (1 << 20)};
  const uint64_t sizes[] = {1 << 20};
  const vmstash_live_ranges live[] = {{"sw_roll", 0, starts, sizes, 1}};
  ASSERT_EQ(vmstash_switch(pause, 1, resume, 1, -1, live, 1), VMSTASH_OK) << vmstash_last_error();
  EXPECT_EQ(t[0], 1);
  EXPECT_EQ(t[(8 << 20) - 1], 2);
  char* stats = vmstash_stats_json(0);
  EXPECT_THAT(std::string(stats), HasSubstr("\"backed_up_bytes\":1048576"));
  EXPECT_THAT(std::string(stats), HasSubstr("\"switches\":1,"));
  vmstash_string_free(stats);
  EXPECT_EQ(vmstash_switch(pause, 1, resume, 1, -1, nullptr, 0), VMSTASH_NOOP);
  ASSERT_EQ(vmstash_switch(resume, 1, pause, 1, 0, nullptr, 0), VMSTASH_OK);
  EXPECT_EQ(r[1 << 20], 3);
  // Bad input: NULL arrays, a tag in both lists, a tag nobody used; nothing changes.
  EXPECT_EQ(vmstash_switch(nullptr, 1, resume, 1, -1, nullptr, 0), VMSTASH_INVALID_ARGUMENT);
  EXPECT_EQ(vmstash_switch(pause, 1, pause, 1, -1, nullptr, 0), VMSTASH_INVALID_ARGUMENT);
  EXPECT_THAT(vmstash_last_error(), HasSubstr("both paused and resumed"));
  const char* typo[] = {"sw_trian"};
  EXPECT_EQ(vmstash_switch(pause, 1, typo, 1, -1, nullptr, 0), VMSTASH_NOT_FOUND);
  const vmstash_live_ranges bad[] = {{"sw_roll", 0, nullptr, sizes, 1}};
  EXPECT_EQ(vmstash_switch(pause, 1, resume, 1, -1, bad, 1), VMSTASH_INVALID_ARGUMENT);
  EXPECT_EQ(r[1 << 20], 3);
  ASSERT_EQ(vmstash_resume("sw_train", 0), VMSTASH_OK);
  EXPECT_EQ(t[0], 1);
  vmstash_free(t, 8 << 20, 0, nullptr);
  vmstash_free(r, 8 << 20, 0, nullptr);
}

// vmstash_switch_agreed (Note [Agreed Switch]): the agreement is called once on every
// path, refusals included; 0 commits, nonzero rolls back with its reason as the message.
struct Votes {
  int calls = 0;
  int last_code = -1;
  std::string last_message;
  int answer = 0;  // 0: commit
  const char* reason = "";
};

int Vote(void* ctx, int local_code, const char* local_message, char* reason, size_t reason_size) {
  auto* v = static_cast<Votes*>(ctx);
  ++v->calls;
  v->last_code = local_code;
  v->last_message = local_message;
  std::snprintf(reason, reason_size, "%s", v->reason);
  return v->answer;
}

TEST_F(CAbiTest, AgreedSwitchCallsTheAgreementOnceAndObeysIt) {
  unsigned char* t = BackupBlock("ag_train", 8 << 20);
  unsigned char* r = BackupBlock("ag_roll", 8 << 20);
  ASSERT_NE(t, nullptr) << vmstash_last_error();
  ASSERT_NE(r, nullptr) << vmstash_last_error();
  t[5] = 11;
  r[7] = 22;
  ASSERT_EQ(vmstash_pause("ag_roll", 0), VMSTASH_OK);
  const char* train[] = {"ag_train"};
  const char* roll[] = {"ag_roll"};
  // Another rank said no: rolled back, the reason is the message.
  Votes no{0, -1, "", 1, "rank 1 of 2: out of memory"};
  EXPECT_EQ(vmstash_switch_agreed(train, 1, roll, 1, 0, nullptr, 0, Vote, &no), VMSTASH_ABORTED);
  EXPECT_EQ(no.calls, 1);
  EXPECT_EQ(no.last_code, VMSTASH_OK);
  EXPECT_THAT(vmstash_last_error(), HasSubstr("rank 1 of 2: out of memory"));
  EXPECT_EQ(t[5], 11);  // training still active with its bytes
  // Yes: committed (device -1: the one device holding these tags).
  Votes yes;
  ASSERT_EQ(vmstash_switch_agreed(train, 1, roll, 1, -1, nullptr, 0, Vote, &yes), VMSTASH_OK) << vmstash_last_error();
  EXPECT_EQ(yes.calls, 1);
  EXPECT_EQ(r[7], 22);
  // Already in state: the agreement hears OK, the call is a no-op.
  yes = Votes();
  EXPECT_EQ(vmstash_switch_agreed(train, 1, roll, 1, 0, nullptr, 0, Vote, &yes), VMSTASH_NOOP);
  EXPECT_EQ(yes.calls, 1);
  EXPECT_EQ(yes.last_code, VMSTASH_OK);
  // Refusals before the runtime are heard too.
  const char* typo[] = {"ag_trian"};
  yes = Votes();
  EXPECT_EQ(vmstash_switch_agreed(roll, 1, typo, 1, 0, nullptr, 0, Vote, &yes), VMSTASH_NOT_FOUND);
  EXPECT_EQ(yes.calls, 1);
  EXPECT_EQ(yes.last_code, VMSTASH_NOT_FOUND);
  yes = Votes();
  EXPECT_EQ(vmstash_switch_agreed(nullptr, 1, train, 1, 0, nullptr, 0, Vote, &yes), VMSTASH_INVALID_ARGUMENT);
  EXPECT_EQ(yes.calls, 1);
  EXPECT_EQ(vmstash_switch_agreed(roll, 1, train, 1, 0, nullptr, 0, nullptr, nullptr), VMSTASH_INVALID_ARGUMENT);
  ASSERT_EQ(vmstash_switch(roll, 1, train, 1, 0, nullptr, 0), VMSTASH_OK);
  EXPECT_EQ(t[5], 11);
  // Tags with memory on two devices: an agreed switch covers one.
  ASSERT_EQ(vmstash_set_current_tag("ag_train"), VMSTASH_OK);
  void* t1 = vmstash_malloc(1 << 20, 1, nullptr);
  ASSERT_EQ(vmstash_set_current_tag("default"), VMSTASH_OK);
  ASSERT_NE(t1, nullptr);
  yes = Votes();
  EXPECT_EQ(vmstash_switch_agreed(train, 1, nullptr, 0, -1, nullptr, 0, Vote, &yes), VMSTASH_INVALID_ARGUMENT);
  EXPECT_THAT(vmstash_last_error(), HasSubstr("one device per process"));
  EXPECT_EQ(yes.calls, 1);
  vmstash_free(t1, 1 << 20, 1, nullptr);
  vmstash_free(t, 8 << 20, 0, nullptr);
  vmstash_free(r, 8 << 20, 0, nullptr);
}

// Note [Status Codes]: the C table holds every absl::StatusCode, in order from 0, each
// under absl's own name (StatusCodeToString) and number; nothing past it is a code.
TEST(CAbiStatusCodesTest, TheTableIsEveryAbslStatusCodeByNameAndNumber) {
  struct Entry {
    const char* name;
    int number;
  };
#define VMSTASH_TEST_ENTRY(name, number) {#name, number},
  const Entry table[] = {VMSTASH_STATUS_CODES(VMSTASH_TEST_ENTRY)};
#undef VMSTASH_TEST_ENTRY
  int next = 0;
  for (const Entry& e : table) {
    EXPECT_EQ(e.number, next++) << e.name;
    EXPECT_EQ(absl::StatusCodeToString(static_cast<absl::StatusCode>(e.number)), e.name);
    EXPECT_STREQ(vmstash_code_name(e.number), e.name);
  }
  EXPECT_EQ(next, static_cast<int>(absl::StatusCode::kUnauthenticated) + 1);
  EXPECT_EQ(absl::StatusCodeToString(static_cast<absl::StatusCode>(next)), "");
  EXPECT_EQ(vmstash_code_name(next), nullptr);
  EXPECT_EQ(vmstash_code_name(VMSTASH_NOOP), nullptr);
  // The enum is made from the table (spot checks of the names callers use).
  EXPECT_EQ(VMSTASH_ABORTED, static_cast<int>(absl::StatusCode::kAborted));
  EXPECT_EQ(VMSTASH_FAILED_PRECONDITION, static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(VMSTASH_UNAVAILABLE, static_cast<int>(absl::StatusCode::kUnavailable));
  EXPECT_LT(VMSTASH_NOOP, 0);
}

int VetoAlways(const char*, int, void*) { return 1; }

// A saved error made a status again (a caller adding context and failing anew, as
// tms_resume does): the same code, the text once, and the code's name once in the message.
TEST(CAbiSavedErrorTest, ASavedErrorIsItsStatusAgainWithoutTheCodeNamedTwice) {
  const absl::Status original = absl::FailedPreconditionError("tag 'kv' is paused: resume it first");
  vmstash::c_abi::Fail(original);
  EXPECT_EQ(vmstash::c_abi::SaveError().ToStatus(), original);
  vmstash::c_abi::Fail(absl::Status(original.code(),
                                    absl::StrCat(vmstash::c_abi::SaveError().ToStatus().message(), " (more)")));
  EXPECT_STREQ(vmstash_last_error(), "FAILED_PRECONDITION: tag 'kv' is paused: resume it first (more)");
  // A message that does not start with the code's name is kept whole.
  vmstash::c_abi::SavedError odd{"no code name here", static_cast<int>(absl::StatusCode::kInternal), false};
  EXPECT_EQ(odd.ToStatus(), absl::InternalError("no code name here"));
}

// A hook's veto is VMSTASH_ABORTED, and calls that return NULL or -1 leave their code in
// vmstash_last_error_code() (the code of the last failed call, kept across successes).
TEST_F(CAbiTest, AVetoIsAbortedAndCallsWithoutACodeLeaveItInLastErrorCode) {
  ASSERT_EQ(vmstash_create_tag("vetoed", "backup"), VMSTASH_OK);
  ASSERT_EQ(vmstash_register_hooks("vetoed", VetoAlways, nullptr, nullptr), VMSTASH_OK);
  ASSERT_EQ(vmstash_set_current_tag("vetoed"), VMSTASH_OK);
  void* p = vmstash_malloc(4096, 0, nullptr);
  ASSERT_EQ(vmstash_set_current_tag("default"), VMSTASH_OK);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(vmstash_pause("vetoed", -1), VMSTASH_ABORTED);
  EXPECT_EQ(vmstash_last_error_code(), VMSTASH_ABORTED);
  EXPECT_THAT(vmstash_last_error(), HasSubstr("ABORTED: "));
  EXPECT_EQ(vmstash_last_error_done(), 0);
  EXPECT_EQ(vmstash_tag_policy("never_declared"), nullptr);
  EXPECT_EQ(vmstash_last_error_code(), VMSTASH_NOT_FOUND);
  EXPECT_EQ(vmstash_bind_tag_slot("bad tag"), -1);
  EXPECT_EQ(vmstash_last_error_code(), VMSTASH_INVALID_ARGUMENT);
  EXPECT_STREQ(vmstash_tag_policy("vetoed"), "backup");  // a success keeps the last failure's code
  EXPECT_EQ(vmstash_last_error_code(), VMSTASH_INVALID_ARGUMENT);
  EXPECT_EQ(vmstash_stats_json(9), nullptr);
  EXPECT_EQ(vmstash_last_error_code(), VMSTASH_INVALID_ARGUMENT);
  EXPECT_EQ(vmstash_backup_store("never_declared"), nullptr);
  EXPECT_EQ(vmstash_last_error_code(), VMSTASH_NOT_FOUND);
  std::thread([] { EXPECT_EQ(vmstash_last_error_code(), VMSTASH_OK); }).join();  // per thread
  vmstash_free(p, 4096, 0, nullptr);
}

// Note [Liveness Hints] as vmstash.region's MemPools give them, in one call for both
// devices: a pool segment's active bytes plus every byte outside the pool's segments, up
// to the end of the address space. The tag's block that is no pool segment is copied
// whole; the segment's inactive bytes are not copied.
TEST_F(CAbiTest, APoolHintCopiesTheSegmentsActiveBytesAndEveryOtherBlockWhole) {
  ASSERT_EQ(vmstash_create_tag("pooled", "backup"), VMSTASH_OK);
  ASSERT_EQ(vmstash_set_current_tag("pooled"), VMSTASH_OK);
  unsigned char* seg[2] = {static_cast<unsigned char*>(vmstash_malloc(8 << 20, 0, nullptr)),
                           static_cast<unsigned char*>(vmstash_malloc(8 << 20, 1, nullptr))};
  auto* other = static_cast<unsigned char*>(vmstash_malloc(1 << 20, 0, nullptr));  // global mode
  ASSERT_EQ(vmstash_set_current_tag("default"), VMSTASH_OK);
  ASSERT_TRUE(seg[0] != nullptr && seg[1] != nullptr && other != nullptr) << vmstash_last_error();
  std::memset(other, 0x3c, 1 << 20);
  uint64_t starts[2][3], sizes[2][3];
  vmstash_live_ranges live[2];
  for (int d = 0; d < 2; ++d) {
    std::memset(seg[d] + (2 << 20), 0x40 + d, 1 << 20);  // the active block
    const uint64_t s = reinterpret_cast<uint64_t>(seg[d]), end = s + (8 << 20);
    starts[d][0] = 0, sizes[d][0] = s;                     // below the segment
    starts[d][1] = s + (2 << 20), sizes[d][1] = 1 << 20;   // active in it
    starts[d][2] = end, sizes[d][2] = uint64_t{0} - end;   // above it, to the end
    live[d] = {"pooled", d, starts[d], sizes[d], 3};
  }
  ASSERT_EQ(vmstash_pause_live_devices("pooled", -1, live, 2), VMSTASH_OK) << vmstash_last_error();
  for (int d = 0; d < 2; ++d) {
    char* stats = vmstash_stats_json(d);
    const std::string copied = d == 0 ? "\"backed_up_bytes\":2097152" : "\"backed_up_bytes\":1048576";
    EXPECT_THAT(std::string(stats), HasSubstr(copied)) << "device " << d;
    vmstash_string_free(stats);
  }
  ASSERT_EQ(vmstash_resume("pooled", -1), VMSTASH_OK) << vmstash_last_error();
  for (int d = 0; d < 2; ++d) {
    EXPECT_EQ(seg[d][2 << 20], 0x40 + d);
    EXPECT_EQ(seg[d][(3 << 20) - 1], 0x40 + d);
    vmstash_free(seg[d], 0, d, nullptr);
  }
  EXPECT_EQ(other[0], 0x3c);
  EXPECT_EQ(other[(1 << 20) - 1], 0x3c);
  vmstash_free(other, 0, 0, nullptr);
}

}  // namespace
