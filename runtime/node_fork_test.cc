// A fork racing the process runtime's Init and Shutdown with node:1 (runtime/process.h,
// Note [Fork]; node/client.h: a forked child closes its copy of the daemon's socket): the
// fork handlers of the runtime and of the node client take no lock in an order that could
// meet, so a thread forking (a data loader, multiprocessing) while another initializes or
// shuts vmstash down never hangs either.
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "node/daemon.h"
#include "runtime/process.h"

namespace vmstash {
namespace {

TEST(NodeForkTest, AForkDuringInitOrShutdownWithTheNodePoolNeverHangs) {
  char tmpl[] = "/tmp/vmstash-node-fork-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  ::setenv("VMSTASH_RUNTIME_DIR", tmpl, 1);
  node::DaemonOptions options;
  options.dir = tmpl;
  options.capacity_bytes = std::size_t{64} << 20;
  absl::StatusOr<std::unique_ptr<node::NodeDaemon>> daemon = node::NodeDaemon::Start(options);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  const char* conf = "driver:sim,control:0,node:1,node_capacity:64M";
  std::atomic<bool> stop{false};
  std::atomic<int> cycles{0}, forks{0};
  std::thread watchdog([&] {  // a hang fails the test with its figures, rather than timing it out
    for (int i = 0; i < 600 && !stop.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (!stop.load()) {
      std::fprintf(stderr, "hung: after %d init/shutdown cycles and %d forks\n", cycles.load(), forks.load());
      std::fflush(stderr);
      ::_exit(3);
    }
  });
  std::thread forker([&] {
    while (!stop.load()) {
      const pid_t p = ::fork();
      if (p == 0) ::_exit(0);
      if (p > 0) {
        ::waitpid(p, nullptr, 0);
        forks.fetch_add(1);
      }
    }
  });
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  bool ok = true;
  while (ok && std::chrono::steady_clock::now() < end) {
    ok = process::Init(conf).ok() && process::Shutdown().ok();
    cycles.fetch_add(1);
  }
  stop.store(true);
  forker.join();
  watchdog.join();
  EXPECT_TRUE(ok);
  EXPECT_GT(cycles.load(), 0);
  EXPECT_GT(forks.load(), 0);
  daemon->reset();
}

}  // namespace
}  // namespace vmstash
