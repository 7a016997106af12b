// Regression tests of the C ABI for defects found in review (issue 16): 5 shutdown racing
// concurrent calls and silent re-initialization, 6 all-or-nothing pause/resume across
// devices and unknown tags, 3 a hook calling shutdown, 11 stash handle misuse; and the
// review of issue 28's fixes: stash arenas inherited across fork(), and the entries of
// vmstash_pause_live_devices. Run under ASAN and TSAN in CI (scripts/run_tests.sh).
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "allocator/tag.h"
#include "control/endpoint.h"
#include "base/byte_pattern.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "torch_plugin/include/vmstash/vmstash.h"
#include "torch_plugin/include/vmstash/vmstash_stash.h"

namespace {

using ::testing::HasSubstr;

bool StateIs(int device, const char* tag, const char* state) {
  char* json = vmstash_stats_json(device);
  if (json == nullptr) return false;
  const std::string s(json);
  vmstash_string_free(json);
  const std::size_t at = s.find(std::string("\"name\":\"") + tag + "\"");
  if (at == std::string::npos) return false;
  const std::size_t st = s.find("\"state\":\"", at);
  return st != std::string::npos && s.compare(st + 9, std::strlen(state), state) == 0;
}

void* MallocIn(const char* tag, std::size_t n, int device) {
  EXPECT_EQ(vmstash_set_current_tag(tag), VMSTASH_OK);
  void* p = vmstash_malloc(n, device, nullptr);
  EXPECT_EQ(vmstash_set_current_tag("default"), VMSTASH_OK);
  return p;
}

// Item 5: calls racing a shutdown complete or fail with a clear error (ASAN/TSAN find any
// use of a destroyed allocator); after it, nothing re-initializes silently.
TEST(CAbiHardeningTest, ShutdownIsSafeAgainstConcurrentCallsAndDoesNotReinitializeSilently) {
  for (int round = 0; round < 3; ++round) {
    ASSERT_EQ(vmstash_init("driver:sim,sim_devices:2,sim_capacity:1G,control:0"), VMSTASH_OK);
    ASSERT_EQ(vmstash_create_tag("race", "discard"), VMSTASH_OK);
    std::atomic<bool> stop{false};
    std::atomic<int> ok_calls{0}, refused{0}, other_errors{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        int i = 0;
        while (!stop.load()) {
          const int device = (t + i++) % 2;
          void* p = vmstash_malloc(4096 * (1 + i % 7), device, nullptr);
          if (p != nullptr) {
            vmstash_free(p, 0, device, nullptr);
            ok_calls.fetch_add(1);
          } else if (std::string(vmstash_last_error()).find("shut") != std::string::npos) {
            refused.fetch_add(1);
          } else {
            other_errors.fetch_add(1);
          }
          if (char* json = vmstash_stats_json(-1)) vmstash_string_free(json);
          const int rc = i % 2 == 0 ? vmstash_pause("race", -1) : vmstash_resume("race", -1);
          if (rc != VMSTASH_OK && rc != VMSTASH_NOOP && rc != VMSTASH_FAILED_PRECONDITION) other_errors.fetch_add(1);
        }
      });
    }
    // Wait on progress, not on a clock: a loaded machine may not run the callers for a while.
    auto wait_for = [](const std::atomic<int>& n, int at_least) {
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (n.load() < at_least && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
    };
    wait_for(ok_calls, 8);
    ASSERT_EQ(vmstash_shutdown(), VMSTASH_OK) << vmstash_last_error();
    wait_for(refused, 4);
    stop.store(true);
    for (auto& th : threads) th.join();
    EXPECT_GT(ok_calls.load(), 0);
    EXPECT_GT(refused.load(), 0);  // calls after the shutdown were refused, not re-initialized
    EXPECT_EQ(other_errors.load(), 0);
    EXPECT_EQ(vmstash_is_initialized(), 0);
    EXPECT_EQ(vmstash_malloc(512, 0, nullptr), nullptr);
    EXPECT_THAT(vmstash_last_error(), HasSubstr("vmstash_init"));
    EXPECT_EQ(vmstash_shutdown(), VMSTASH_OK);  // twice: nothing to do
  }
  // vmstash_init starts it again.
  ASSERT_EQ(vmstash_init("driver:sim,control:0"), VMSTASH_OK);
  void* p = vmstash_malloc(512, 0, nullptr);
  ASSERT_NE(p, nullptr) << vmstash_last_error();
  vmstash_free(p, 512, 0, nullptr);
  ASSERT_EQ(vmstash_shutdown(), VMSTASH_OK);
}

int shutdown_from_hook = 0;
int ShutdownHook(const char*, int, void*) {
  shutdown_from_hook = vmstash_shutdown();
  return 0;
}

// Item 5/3: a shutdown from a hook would wait for the call running the hook: it fails.
TEST(CAbiHardeningTest, ShutdownFromAHookFailsInsteadOfHanging) {
  ASSERT_EQ(vmstash_init("driver:sim,control:0"), VMSTASH_OK);
  ASSERT_EQ(vmstash_create_tag("hooked", "discard"), VMSTASH_OK);
  ASSERT_EQ(vmstash_register_hooks("hooked", ShutdownHook, nullptr, nullptr), VMSTASH_OK);
  void* p = MallocIn("hooked", 4096, 0);
  ASSERT_NE(p, nullptr);
  ASSERT_EQ(vmstash_pause("hooked", 0), VMSTASH_OK);
  EXPECT_EQ(shutdown_from_hook, VMSTASH_FAILED_PRECONDITION);
  ASSERT_EQ(vmstash_resume("hooked", 0), VMSTASH_OK);
  vmstash_free(p, 4096, 0, nullptr);
  ASSERT_EQ(vmstash_shutdown(), VMSTASH_OK);
}

// A backup tag with a 3 MiB block on each of two simulated devices, filled with
// patterns `seed` and `seed + 1`, the driver failing as `faults` (sim_fail) says.
struct TwoDevices {
  void* block[2] = {nullptr, nullptr};
  unsigned seed = 0;
  static constexpr std::size_t kBytes = 3 << 20;
  bool Intact() const { return vmstash::WrongBytes(block[0], kBytes, seed) == 0 && vmstash::WrongBytes(block[1], kBytes, seed + 1) == 0; }
};
TwoDevices SetUpTwoDevices(const char* tag, const char* faults, unsigned seed) {
  TwoDevices t;
  t.seed = seed;
  const std::string conf = std::string("driver:sim,sim_devices:2,sim_capacity:1G,auto_prepare:0,control:0,sim_fail:") +
                           faults;
  EXPECT_EQ(vmstash_init(conf.c_str()), VMSTASH_OK) << vmstash_last_error();
  EXPECT_EQ(vmstash_create_tag(tag, "backup"), VMSTASH_OK);
  for (int d = 0; d < 2; ++d) {
    t.block[d] = MallocIn(tag, TwoDevices::kBytes, d);
    EXPECT_NE(t.block[d], nullptr) << vmstash_last_error();
    if (t.block[d] != nullptr) vmstash::FillPattern(t.block[d], TwoDevices::kBytes, seed + d);
  }
  return t;
}
void TearDownTwoDevices(const TwoDevices& t) {
  for (int d = 0; d < 2; ++d) vmstash_free(t.block[d], 0, d, nullptr);
  EXPECT_EQ(vmstash_shutdown(), VMSTASH_OK);
}

// Item 6: a pause over all devices that fails on device 1 resumes device 0 again (the
// second copy to host of the run fails: device 0's block was copied, device 1's not).
TEST(CAbiHardeningTest, PauseOverAllDevicesIsAllOrNothing) {
  const TwoDevices t = SetUpTwoDevices("md", "copy_to_host@2=internal", 11);
  EXPECT_EQ(vmstash_pause("md", -1), VMSTASH_INTERNAL);
  EXPECT_THAT(vmstash_last_error(), HasSubstr("failed on device 1"));
  EXPECT_THAT(vmstash_last_error(), HasSubstr("device 0 resumed again"));
  EXPECT_TRUE(StateIs(0, "md", "active"));
  EXPECT_TRUE(StateIs(1, "md", "active"));
  EXPECT_TRUE(t.Intact());
  // The fault is spent: both pause and resume, bytes intact.
  ASSERT_EQ(vmstash_pause("md", -1), VMSTASH_OK) << vmstash_last_error();
  EXPECT_TRUE(StateIs(0, "md", "paused"));
  EXPECT_TRUE(StateIs(1, "md", "paused"));
  ASSERT_EQ(vmstash_resume("md", -1), VMSTASH_OK) << vmstash_last_error();
  EXPECT_TRUE(t.Intact());
  TearDownTwoDevices(t);
}

// Item 6: a resume over all devices that fails (out of memory) on device 1 pauses device
// 0 again, with its bytes backed up again.
TEST(CAbiHardeningTest, ResumeOverAllDevicesIsAllOrNothing) {
  // Maps: one per malloc (2), then device 0's resume (3) and device 1's (4, refused).
  const TwoDevices t = SetUpTwoDevices("mr", "map@4=oom", 33);
  ASSERT_EQ(vmstash_pause("mr", -1), VMSTASH_OK) << vmstash_last_error();
  EXPECT_EQ(vmstash_resume("mr", -1), VMSTASH_RESOURCE_EXHAUSTED);
  EXPECT_THAT(vmstash_last_error(), HasSubstr("failed on device 1"));
  EXPECT_THAT(vmstash_last_error(), HasSubstr("device 0 paused again"));
  EXPECT_TRUE(StateIs(0, "mr", "paused"));
  EXPECT_TRUE(StateIs(1, "mr", "paused"));
  ASSERT_EQ(vmstash_resume("mr", -1), VMSTASH_OK) << vmstash_last_error();
  EXPECT_TRUE(t.Intact());
  TearDownTwoDevices(t);
}

// Item 6: a typo is NOT_FOUND and creates nothing; a known tag without memory on the
// named device is a no-op, and a device the process never used gets no allocator.
TEST(CAbiHardeningTest, UnknownTagsAreNotFoundAndUnusedDevicesStayUntouched) {
  ASSERT_EQ(vmstash_init("driver:sim,sim_devices:2,sim_capacity:1G,control:0"), VMSTASH_OK);
  ASSERT_EQ(vmstash_create_tag("kv", "discard"), VMSTASH_OK);
  void* p = MallocIn("kv", 4096, 0);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(vmstash_pause("kv_cahce", -1), VMSTASH_NOT_FOUND);
  EXPECT_THAT(vmstash_last_error(), HasSubstr("'kv_cahce' does not exist"));
  EXPECT_EQ(vmstash_resume("kv_cahce", 0), VMSTASH_NOT_FOUND);
  EXPECT_EQ(vmstash_pause("kv", 1), VMSTASH_NOOP);  // device 1 never used
  EXPECT_EQ(vmstash_pause("kv", 2), VMSTASH_INVALID_ARGUMENT);
  char* json = vmstash_stats_json(-1);
  ASSERT_NE(json, nullptr);
  EXPECT_THAT(std::string(json), ::testing::Not(HasSubstr("\"device\":1")));
  EXPECT_THAT(std::string(json), ::testing::Not(HasSubstr("kv_cahce")));
  vmstash_string_free(json);
  // Later allocations into the typo's name still work (it was not created paused).
  void* q = MallocIn("kv_cahce", 4096, 0);
  EXPECT_NE(q, nullptr) << vmstash_last_error();
  vmstash_free(q, 0, 0, nullptr);
  ASSERT_EQ(vmstash_pause("kv", -1), VMSTASH_OK);
  ASSERT_EQ(vmstash_resume("kv", -1), VMSTASH_OK);
  vmstash_free(p, 0, 0, nullptr);
  ASSERT_EQ(vmstash_shutdown(), VMSTASH_OK);
}

// Issue 28 item 4: the calls that only name an existing tag answer NOT_FOUND for a name
// never created, without interning it: 5000 unknown names leave the tag table as it was,
// and new tags can still be created.
TEST(CAbiHardeningTest, UnknownNamesInTransitionCallsAreNotFoundAndNeverInterned) {
  ASSERT_EQ(vmstash_init("driver:sim,sim_capacity:1G,control:0,auto_prepare:0"), VMSTASH_OK);
  ASSERT_EQ(vmstash_create_tag("ni_kv", "backup"), VMSTASH_OK);
  void* p = MallocIn("ni_kv", 4096, 0);
  ASSERT_NE(p, nullptr);
  const int before = vmstash::TagCount();
  const uint64_t start = 0, size = 0;
  for (int i = 0; i < 5000; ++i) {
    const std::string s = "ni_unknown_" + std::to_string(i);
    const char* name = s.c_str();
    int rc = 0;
    switch (i % 10) {
      case 0: rc = vmstash_pause(name, -1); break;
      case 1: rc = vmstash_pause_live(name, 0, &start, &size, 1); break;
      case 2: rc = vmstash_resume(name, 0); break;
      case 3: rc = vmstash_switch(&name, 1, nullptr, 0, -1, nullptr, 0); break;
      case 4: {
        const char* known = "ni_kv";
        const vmstash_live_ranges live{name, 0, &start, &size, 1};
        rc = vmstash_switch(&known, 1, nullptr, 0, -1, &live, 1);
        break;
      }
      case 5: rc = vmstash_prepare(name, 0, 0); break;
      case 6: rc = vmstash_release_backup(name, -1); break;
      case 7: rc = vmstash_set_backup_store(name, "pageable", nullptr); break;
      case 8: rc = vmstash_empty_cache(-1, name); break;
      case 9: {
        EXPECT_EQ(vmstash_tag_policy(name), nullptr);
        rc = VMSTASH_NOT_FOUND;
        char* store = vmstash_backup_store(name);
        EXPECT_EQ(store, nullptr);
        vmstash_string_free(store);
        break;
      }
    }
    ASSERT_EQ(rc, VMSTASH_NOT_FOUND) << "call " << i % 10 << ": " << vmstash_last_error();
    ASSERT_THAT(vmstash_last_error(), HasSubstr("'" + s + "'")) << "call " << i % 10;
  }
  EXPECT_EQ(vmstash::TagCount(), before) << "unknown names were interned";
  EXPECT_TRUE(StateIs(0, "ni_kv", "active")) << "a refused switch changed a tag";
  EXPECT_EQ(vmstash_pause("bad name", -1), VMSTASH_INVALID_ARGUMENT);
  EXPECT_EQ(vmstash_create_tag("ni_fresh", "discard"), VMSTASH_OK) << vmstash_last_error();
  ASSERT_EQ(vmstash_pause("ni_kv", -1), VMSTASH_OK) << vmstash_last_error();
  ASSERT_EQ(vmstash_resume("ni_kv", -1), VMSTASH_OK) << vmstash_last_error();
  vmstash_free(p, 0, 0, nullptr);
  ASSERT_EQ(vmstash_shutdown(), VMSTASH_OK);
}

// Item 4: ReadBackup ranges that wrap are INVALID_ARGUMENT, not a segfault.
// Issue 28 item 3 at the C ABI: a vetoed switch (nothing changed) and a switch done with
// an after-resume hook failed both return ABORTED; vmstash_last_error_done() tells them
// apart, and the message carries no status payload text.
int veto_code = 0, after_code = 0;
int VetoHook(const char*, int, void*) { return veto_code; }
int AfterHook(const char*, int, void*) { return after_code; }
TEST(CAbiHardeningTest, AVetoedSwitchAndADoneSwitchWithAFailedHookAreToldApart) {
  ASSERT_EQ(vmstash_init("driver:sim,sim_capacity:1G,control:0,auto_prepare:0"), VMSTASH_OK);
  ASSERT_EQ(vmstash_create_tag("td_a", "backup"), VMSTASH_OK);
  ASSERT_EQ(vmstash_create_tag("td_b", "backup"), VMSTASH_OK);
  void* pa = MallocIn("td_a", 4096, 0);
  void* pb = MallocIn("td_b", 4096, 0);
  ASSERT_EQ(vmstash_pause("td_b", -1), VMSTASH_OK);
  ASSERT_EQ(vmstash_register_hooks("td_a", VetoHook, nullptr, nullptr), VMSTASH_OK);
  ASSERT_EQ(vmstash_register_hooks("td_b", nullptr, AfterHook, nullptr), VMSTASH_OK);
  const char* a = "td_a";
  const char* b = "td_b";
  veto_code = 3;
  EXPECT_EQ(vmstash_switch(&a, 1, &b, 1, -1, nullptr, 0), VMSTASH_ABORTED);
  EXPECT_EQ(vmstash_last_error_done(), 0) << vmstash_last_error();
  veto_code = 0;
  after_code = 3;
  EXPECT_EQ(vmstash_switch(&a, 1, &b, 1, -1, nullptr, 0), VMSTASH_ABORTED);
  EXPECT_EQ(vmstash_last_error_done(), 1) << vmstash_last_error();
  EXPECT_THAT(vmstash_last_error(), HasSubstr("done on every device"));
  EXPECT_THAT(vmstash_last_error(), ::testing::Not(HasSubstr("type.vmstash.dev")));
  after_code = 0;
  EXPECT_EQ(vmstash_resume("td_a", -1), VMSTASH_OK);
  vmstash_free(pa, 0, 0, nullptr);
  vmstash_free(pb, 0, 0, nullptr);
  ASSERT_EQ(vmstash_shutdown(), VMSTASH_OK);
}

TEST(CAbiHardeningTest, ReadBackupOfAWrappingRangeIsInvalidArgument) {
  ASSERT_EQ(vmstash_init("driver:sim,control:0,auto_prepare:0"), VMSTASH_OK);
  ASSERT_EQ(vmstash_create_tag("rb", "backup"), VMSTASH_OK);
  auto* p = static_cast<unsigned char*>(MallocIn("rb", 1 << 20, 0));
  ASSERT_NE(p, nullptr);
  ASSERT_EQ(vmstash_pause("rb", 0), VMSTASH_OK);
  unsigned char buf[64];
  EXPECT_EQ(vmstash_read_backup(p + 16, SIZE_MAX - 15, 0, buf), VMSTASH_INVALID_ARGUMENT);
  EXPECT_EQ(vmstash_read_backup(p + 16, 64, 0, buf), VMSTASH_OK);
  ASSERT_EQ(vmstash_resume("rb", 0), VMSTASH_OK);
  vmstash_free(p, 0, 0, nullptr);
  ASSERT_EQ(vmstash_shutdown(), VMSTASH_OK);
}

// Item 11: the stash C ABI refuses handle misuse and page sizes that overflow.
TEST(CAbiHardeningTest, StashHandleMisuseIsRefused) {
  ASSERT_EQ(vmstash_init("driver:sim,control:0"), VMSTASH_OK);
  vmstash_stash_arena* arena = nullptr;
  EXPECT_EQ(vmstash_stash_create(0, "stash", uint64_t{1} << 58, 64, &arena), VMSTASH_INVALID_ARGUMENT);
  EXPECT_THAT(vmstash_last_error(), HasSubstr("overflows"));
  ASSERT_EQ(vmstash_stash_create(0, "stash", 256, 4, &arena), VMSTASH_OK) << vmstash_last_error();
  ASSERT_EQ(vmstash_stash_prepare(arena, 16, 0, nullptr), VMSTASH_OK) << vmstash_last_error();
  void* handle = nullptr;
  ASSERT_EQ(vmstash_stash_new_handle(arena, 8, &handle), VMSTASH_OK);
  auto* src = static_cast<uint8_t*>(vmstash_malloc(64 * 256, 0, nullptr));
  auto* n = static_cast<int64_t*>(vmstash_malloc(8, 0, nullptr));
  *n = 8;
  EXPECT_EQ(vmstash_stash_stash(arena, nullptr, src, n, 64, handle), VMSTASH_INVALID_ARGUMENT);
  EXPECT_THAT(vmstash_last_error(), HasSubstr("created for"));
  ASSERT_EQ(vmstash_stash_stash(arena, nullptr, src, n, 8, handle), VMSTASH_OK);
  ASSERT_EQ(vmstash_stash_reset(arena, nullptr), VMSTASH_OK);
  EXPECT_EQ(vmstash_stash_restore(arena, nullptr, handle, src, 8, 0), VMSTASH_FAILED_PRECONDITION);
  EXPECT_EQ(vmstash_stash_discard(arena, nullptr, handle, 8), VMSTASH_FAILED_PRECONDITION);
  int local = 0;
  EXPECT_EQ(vmstash_stash_free_handle(arena, &local), VMSTASH_INVALID_ARGUMENT);
  ASSERT_EQ(vmstash_stash_free_handle(arena, handle), VMSTASH_OK);
  ASSERT_EQ(vmstash_stash_destroy(arena), VMSTASH_OK);
  vmstash_free(src, 0, 0, nullptr);
  vmstash_free(n, 0, 0, nullptr);
  ASSERT_EQ(vmstash_shutdown(), VMSTASH_OK);
}

// Item 10 (fork) and item 9 (devices never used): a forked child that shuts vmstash down
// leaves the parent's endpoint serving; a control request naming a device this process
// never used creates no allocator there.
TEST(CAbiHardeningTest, AForkedChildLeavesTheEndpointAloneAndRemoteRequestsCreateNoAllocator) {
  char tmpl[] = "/tmp/vmstash_fork_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = std::string(tmpl) + "/run";
  ASSERT_EQ(setenv("VMSTASH_RUNTIME_DIR", dir.c_str(), 1), 0);
  ASSERT_EQ(vmstash_init("driver:sim,sim_devices:2,control:1"), VMSTASH_OK);
  void* p = vmstash_malloc(4096, 0, nullptr);
  ASSERT_NE(p, nullptr);
  const std::string socket = dir + "/" + std::to_string(getpid()) + ".sock";
  const pid_t child = fork();
  if (child == 0) {
    const int rc = vmstash_shutdown();  // the child's runtime only
    _exit(rc == VMSTASH_OK ? 0 : 10 + rc);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  struct stat st;
  EXPECT_EQ(stat(socket.c_str(), &st), 0) << "the child removed the parent's socket";
  vmstash::control::Request stats;
  stats.op = vmstash::control::Op::kStats;
  stats.device = 0;
  absl::StatusOr<std::string> r = vmstash::control::Call(socket, stats);
  ASSERT_TRUE(r.ok()) << r.status();  // the parent's endpoint still serves
  stats.device = 1;  // never used by this process
  r = vmstash::control::Call(socket, stats);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  vmstash::control::Request pause;
  pause.op = vmstash::control::Op::kPause;
  pause.tag = "default";
  pause.device = 1;
  r = vmstash::control::Call(socket, pause);
  EXPECT_TRUE(r.ok()) << r.status();
  char* json = vmstash_stats_json(-1);
  ASSERT_NE(json, nullptr);
  EXPECT_THAT(std::string(json), ::testing::Not(HasSubstr("\"device\":1")));
  vmstash_string_free(json);
  vmstash_free(p, 0, 0, nullptr);
  ASSERT_EQ(vmstash_shutdown(), VMSTASH_OK);
  EXPECT_NE(stat(socket.c_str(), &st), 0);
  unsetenv("VMSTASH_RUNTIME_DIR");
  rmdir(dir.c_str());
  rmdir(tmpl);
}

// Waits at most `timeout_ms` for `child` to exit: its exit code, or -1 when it was
// killed for running over (a hang) or died of a signal.
int WaitForChild(pid_t child, int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  int status = 0;
  for (;;) {
    const pid_t got = waitpid(child, &status, WNOHANG);
    if (got == child) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (got < 0) return -1;
    if (std::chrono::steady_clock::now() >= deadline) {
      kill(child, SIGKILL);
      waitpid(child, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// Review of issue 28, defect 3: in a forked child that shut the parent's runtime copy down
// and initialized its own, an inherited stash arena passed the call guard and worked on
// the abandoned copy: destroying it took a dependent off the child's new runtime (whose
// shutdown then failed "-1 stash arena(s)"), and prepare could hang on a lock a parent
// thread held at fork. Now every call on such an arena is FAILED_PRECONDITION, and destroy
// drops only the handle (OK, nothing else touched). Each child reports through its exit
// code; a child that hangs is killed and fails the test.
TEST(CAbiHardeningTest, StashArenasInheritedAcrossForkAreRefusedInTheChildsRuntime) {
  ASSERT_EQ(vmstash_init("driver:sim,control:0,auto_prepare:0"), VMSTASH_OK);
  vmstash_stash_arena* arena = nullptr;
  ASSERT_EQ(vmstash_stash_create(0, "stash", 256, 4, &arena), VMSTASH_OK) << vmstash_last_error();
  ASSERT_EQ(vmstash_stash_prepare(arena, 4, 0, nullptr), VMSTASH_OK) << vmstash_last_error();
  for (const bool destroy : {true, false}) {
    const pid_t child = fork();
    if (child == 0) {
      if (vmstash_shutdown() != VMSTASH_OK) _exit(2);  // drops the parent's copy
      if (vmstash_init("driver:sim,control:0,auto_prepare:0") != VMSTASH_OK) _exit(3);
      const std::string belongs = "belongs to the vmstash runtime of process " + std::to_string(getppid());
      if (destroy) {
        if (vmstash_stash_destroy(arena) != VMSTASH_OK) _exit(4);
      } else {
        if (vmstash_stash_prepare(arena, 8, 0, nullptr) != VMSTASH_FAILED_PRECONDITION) _exit(5);
        if (std::string(vmstash_last_error()).find(belongs) == std::string::npos) _exit(6);
        uint64_t pages = 0;
        if (vmstash_stash_pages_in_use(arena, &pages) != VMSTASH_FAILED_PRECONDITION) _exit(7);
      }
      // The child's own arenas still count, and its runtime shuts down cleanly.
      vmstash_stash_arena* own = nullptr;
      if (vmstash_stash_create(0, "stash", 256, 4, &own) != VMSTASH_OK) _exit(8);
      if (vmstash_shutdown() != VMSTASH_FAILED_PRECONDITION) _exit(9);
      if (vmstash_stash_destroy(own) != VMSTASH_OK) _exit(10);
      _exit(vmstash_shutdown() == VMSTASH_OK ? 0 : 11);
    }
    EXPECT_EQ(WaitForChild(child, 20000), 0) << (destroy ? "destroy" : "prepare") << " in the child";
  }
  // The parent's arena is untouched.
  uint64_t pages = 1;
  EXPECT_EQ(vmstash_stash_pages_in_use(arena, &pages), VMSTASH_OK) << vmstash_last_error();
  EXPECT_EQ(pages, 0u);
  ASSERT_EQ(vmstash_stash_destroy(arena), VMSTASH_OK);
  ASSERT_EQ(vmstash_shutdown(), VMSTASH_OK) << vmstash_last_error();
}

// Review of issue 28, defect 6: vmstash_pause_live_devices accepted entries for devices
// out of range, negative, -1, repeated, or other than the one paused, as if they were not
// there. Each is INVALID_ARGUMENT naming the entry, and nothing is paused.
TEST(CAbiHardeningTest, PauseLiveDevicesRefusesEntriesOfBadDevices) {
  ASSERT_EQ(vmstash_init("driver:sim,sim_devices:2,sim_capacity:1G,control:0,auto_prepare:0"), VMSTASH_OK);
  ASSERT_EQ(vmstash_create_tag("pld", "backup"), VMSTASH_OK);
  void* p[2] = {MallocIn("pld", 4096, 0), MallocIn("pld", 4096, 1)};
  ASSERT_NE(p[0], nullptr);
  ASSERT_NE(p[1], nullptr);
  const uint64_t start[2] = {reinterpret_cast<uint64_t>(p[0]), reinterpret_cast<uint64_t>(p[1])};
  const uint64_t size = 4096;
  auto entry = [&](int d) { return vmstash_live_ranges{"pld", d, &start[d < 0 || d > 1 ? 0 : d], &size, 1}; };
  struct Case {
    int device;
    std::vector<vmstash_live_ranges> live;
    const char* says;
  };
  const Case cases[] = {
      {-1, {entry(0), entry(2)}, "entry 1 names device 2"},
      {0, {entry(7)}, "entry 0 names device 7"},
      {-1, {entry(-1)}, "entry 0 names device -1"},
      {-1, {entry(1), entry(-3)}, "entry 1 names device -3"},
      {-1, {entry(0), entry(1), entry(0)}, "entry 2 names device 0 again"},
      {0, {entry(1)}, "entry 0 names device 1, not the paused device 0"},
      {1, {entry(1), entry(1)}, "entry 1 names device 1 again"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(vmstash_pause_live_devices("pld", c.device, c.live.data(), c.live.size()), VMSTASH_INVALID_ARGUMENT)
        << c.says;
    EXPECT_THAT(vmstash_last_error(), HasSubstr(c.says));
    EXPECT_TRUE(StateIs(0, "pld", "active") && StateIs(1, "pld", "active")) << "paused by: " << c.says;
  }
  // Well-formed entries pause (one device, then every device), bytes kept.
  std::memset(p[1], 0x5a, 4096);
  const vmstash_live_ranges one = entry(1);
  ASSERT_EQ(vmstash_pause_live_devices("pld", 1, &one, 1), VMSTASH_OK) << vmstash_last_error();
  ASSERT_EQ(vmstash_resume("pld", -1), VMSTASH_OK) << vmstash_last_error();
  EXPECT_EQ(static_cast<unsigned char*>(p[1])[4095], 0x5a);
  const vmstash_live_ranges both[2] = {entry(1), entry(0)};
  ASSERT_EQ(vmstash_pause_live_devices("pld", -1, both, 2), VMSTASH_OK) << vmstash_last_error();
  ASSERT_EQ(vmstash_resume("pld", -1), VMSTASH_OK) << vmstash_last_error();
  for (int d = 0; d < 2; ++d) vmstash_free(p[d], 0, d, nullptr);
  ASSERT_EQ(vmstash_shutdown(), VMSTASH_OK);
}

// Issue 29 item 5: the one-call pause over every device refuses NULL pointers with
// nonzero counts and entries of other tags, as it refuses bad devices: INVALID_ARGUMENT,
// nothing paused on any device (a well-formed entry for device 0 comes first each time).
TEST(CAbiHardeningTest, PauseLiveDevicesRefusesNullArraysAndOtherTagsPausingNothing) {
  ASSERT_EQ(vmstash_init("driver:sim,sim_devices:2,sim_capacity:1G,control:0,auto_prepare:0"), VMSTASH_OK);
  ASSERT_EQ(vmstash_create_tag("pln", "backup"), VMSTASH_OK);
  ASSERT_EQ(vmstash_create_tag("pln_other", "backup"), VMSTASH_OK);
  void* p[2] = {MallocIn("pln", 4096, 0), MallocIn("pln", 4096, 1)};
  ASSERT_TRUE(p[0] != nullptr && p[1] != nullptr);
  const uint64_t start[2] = {reinterpret_cast<uint64_t>(p[0]), reinterpret_cast<uint64_t>(p[1])};
  const uint64_t size = 4096;
  const vmstash_live_ranges good = {"pln", 0, &start[0], &size, 1};
  struct Case {
    const char* tag;
    std::vector<vmstash_live_ranges> live;
    bool null_live;
    const char* says;
  };
  const Case cases[] = {
      {"pln", {}, true, "NULL ranges with n_live > 0"},
      {nullptr, {good}, false, "a NULL tag"},
      {"pln", {good, {"pln", 1, nullptr, &size, 1}}, false, "NULL arrays and n > 0"},
      {"pln", {good, {"pln", 1, &start[1], nullptr, 1}}, false, "NULL arrays and n > 0"},
      {"pln", {good, {nullptr, 1, nullptr, nullptr, 2}}, false, "NULL arrays and n > 0"},
      {"pln", {good, {"pln_other", 1, &start[1], &size, 1}}, false, "name tag 'pln_other'"},
  };
  for (const Case& c : cases) {
    const size_t n = c.null_live ? 2 : c.live.size();
    EXPECT_EQ(vmstash_pause_live_devices(c.tag, -1, c.null_live ? nullptr : c.live.data(), n),
              VMSTASH_INVALID_ARGUMENT)
        << c.says;
    EXPECT_EQ(vmstash_last_error_code(), VMSTASH_INVALID_ARGUMENT) << c.says;
    EXPECT_THAT(vmstash_last_error(), HasSubstr(c.says));
    EXPECT_TRUE(StateIs(0, "pln", "active") && StateIs(1, "pln", "active")) << "paused by: " << c.says;
  }
  // NULL arrays with n == 0 are an empty hint: the device keeps nothing, and pauses.
  const vmstash_live_ranges empty[2] = {{"pln", 0, nullptr, nullptr, 0}, {nullptr, 1, nullptr, nullptr, 0}};
  ASSERT_EQ(vmstash_pause_live_devices("pln", -1, empty, 2), VMSTASH_OK) << vmstash_last_error();
  EXPECT_TRUE(StateIs(0, "pln", "paused") && StateIs(1, "pln", "paused"));
  ASSERT_EQ(vmstash_resume("pln", -1), VMSTASH_OK) << vmstash_last_error();
  for (int d = 0; d < 2; ++d) vmstash_free(p[d], 0, d, nullptr);
  ASSERT_EQ(vmstash_shutdown(), VMSTASH_OK);
}

}  // namespace
