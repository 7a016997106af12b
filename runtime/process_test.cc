// The process runtime: initialization, re-initialization, and Note [Shutdown] under
// concurrent calls (run under TSAN and ASAN by scripts/run_tests.sh).
#include "runtime/process.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "allocator/host_budget.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace vmstash::process {
namespace {

using ::testing::HasSubstr;

TEST(ProcessTest, InitIsIdempotentForTheSameOptionsOnly) {
  ASSERT_TRUE(Init("driver:sim,control:0").ok());
  EXPECT_TRUE(Initialized());
  EXPECT_TRUE(Init("driver:sim,control:0").ok());
  EXPECT_TRUE(Init(nullptr).ok());
  absl::Status other = Init("driver:sim,control:0,bypass:1");
  EXPECT_EQ(other.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(other.message()), HasSubstr("already initialized"));
  EXPECT_EQ(Init("driver:sim,nonsense:1").code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(Shutdown().ok());
  EXPECT_FALSE(Initialized());
  EXPECT_TRUE(Shutdown().ok()) << "a second shutdown is a no-op";
}

TEST(ProcessTest, InitSetsTheProcessHostMemoryCapFromHostMax) {
  ASSERT_TRUE(Init("driver:sim,control:0,host_max:512M").ok());
  EXPECT_EQ(HostBudget::Process().limit(), std::size_t{512} << 20);
  ASSERT_TRUE(Shutdown().ok());
  ASSERT_TRUE(Init("driver:sim,control:0").ok());
  EXPECT_EQ(HostBudget::Process().limit(), 0u) << "a conf without host_max has no cap";
  ASSERT_TRUE(Shutdown().ok());
}

TEST(ProcessTest, ShutdownWaitsForCallsInFlightAndRefusesLaterOnes) {
  for (int round = 0; round < 4; ++round) {
    ASSERT_TRUE(Init("driver:sim,sim_devices:2,sim_capacity:1G,control:0").ok());
    std::atomic<bool> go{true};
    std::atomic<int> refused{0}, served{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        while (go.load()) {
          Call call;
          absl::StatusOr<Runtime*> rt = call.runtime();
          if (!rt.ok()) {
            EXPECT_EQ(rt.status().code(), absl::StatusCode::kFailedPrecondition);
            ++refused;
            continue;
          }
          CachingAllocator* a = (*rt)->Allocator(t % 2).value();
          absl::StatusOr<DevicePtr> p = a->Allocate(std::size_t{1} << 20, Stream{});
          ASSERT_TRUE(p.ok()) << p.status();
          (void)(*rt)->StatsJson(Runtime::kAllDevices);
          ASSERT_TRUE(a->Free(*p).ok());
          ++served;
        }
      });
    }
    while (served.load() < 100) std::this_thread::yield();
    ASSERT_TRUE(Shutdown().ok());
    while (refused.load() < 4) std::this_thread::yield();
    go = false;
    for (auto& t : threads) t.join();
    // After the shutdown, calls are refused until Init: nothing re-initializes silently.
    Call after;
    absl::StatusOr<Runtime*> rt = after.runtime();
    EXPECT_EQ(rt.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(rt.status().message()), HasSubstr("vmstash_init"));
  }
  ASSERT_TRUE(Init("driver:sim,control:0").ok());
  ASSERT_TRUE(Shutdown().ok());
}

TEST(ProcessTest, AShutdownFromInsideACallFailsInsteadOfWaitingForItself) {
  ASSERT_TRUE(Init("driver:sim,control:0").ok());
  {
    Call call;
    absl::Status s = Shutdown();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(s.message()), HasSubstr("wait for itself"));
  }
  EXPECT_TRUE(Shutdown().ok());
}

TEST(ProcessTest, AShutdownWithDependentsAliveIsRefused) {
  ASSERT_TRUE(Init("driver:sim,control:0").ok());
  Runtime* rt = nullptr;
  {
    Call call;
    rt = call.runtime().value();
    rt->AddDependent(+1);
  }
  absl::Status s = Shutdown();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("stash arena"));
  EXPECT_TRUE(Initialized()) << "a refused shutdown leaves the runtime usable";
  {
    Call call;
    call.runtime().value()->AddDependent(-1);
  }
  EXPECT_TRUE(Shutdown().ok());
}

// Issue 28 (suspected): after fork() the parent's runtime may have locks held by threads
// the child does not have. The child is refused it with FailedPrecondition (Note [Fork]),
// never hangs, drops it with Shutdown() and may make its own. A thread allocates in the
// parent throughout; each child must end within the deadline (a hang fails the test).
TEST(ProcessTest, AForkedChildIsRefusedTheParentsRuntimeAndNeverHangs) {
  ASSERT_TRUE(Init("driver:sim,sim_capacity:1G,control:0,auto_prepare:0").ok());
  std::atomic<bool> go{true};
  std::atomic<long> served{0};
  std::thread worker([&] {
    while (go.load()) {
      Call call;
      absl::StatusOr<Runtime*> rt = call.runtime();
      ASSERT_TRUE(rt.ok()) << rt.status();
      CachingAllocator* a = (*rt)->Allocator(0).value();
      absl::StatusOr<DevicePtr> p = a->Allocate(std::size_t{1} << 20, Stream{});
      ASSERT_TRUE(p.ok()) << p.status();
      ASSERT_TRUE(a->Free(*p).ok());
      ++served;
    }
  });
  while (served.load() < 100) std::this_thread::yield();
  for (int i = 0; i < 50; ++i) {
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      int code = 0;
      {
        Call call;
        absl::StatusOr<Runtime*> rt = call.runtime();
        if (rt.ok() || rt.status().code() != absl::StatusCode::kFailedPrecondition ||
            std::string(rt.status().message()).find("fork()") == std::string::npos) {
          code = 2;
        }
      }
      if (code == 0 && Initialized()) code = 3;
      if (code == 0 && Init(nullptr).code() != absl::StatusCode::kFailedPrecondition) code = 4;
      if (code == 0 && !Shutdown().ok()) code = 5;  // abandons the copy, touches nothing
      if (code == 0 && !Init("driver:sim,sim_capacity:1G,control:0,auto_prepare:0").ok()) code = 6;
      if (code == 0) {
        Call call;
        absl::StatusOr<Runtime*> rt = call.runtime();
        absl::StatusOr<CachingAllocator*> a = rt.ok() ? (*rt)->Allocator(0) : rt.status();
        absl::StatusOr<DevicePtr> p = a.ok() ? (*a)->Allocate(4096, Stream{}) : a.status();
        if (!p.ok() || !(*a)->Free(*p).ok()) code = 7;
      }
      if (code == 0 && !Shutdown().ok()) code = 8;
      _exit(code);
    }
    int status = 0;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (waitpid(child, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        kill(child, SIGKILL);
        waitpid(child, &status, 0);
        ADD_FAILURE() << "fork " << i << ": the child hung";
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "fork " << i << ": child status " << status;
  }
  go = false;
  worker.join();
  EXPECT_TRUE(Initialized()) << "the parent's runtime is untouched by its children";
  ASSERT_TRUE(Shutdown().ok());
}

}  // namespace
}  // namespace vmstash::process
