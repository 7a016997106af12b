// Note [Node Leases] (runtime/node_leases.h): a process's side of the node pool against a
// real daemon (node/daemon.h, in this process) on the simulated driver: connecting, leases
// registered once per segment, the lease given back, a registration refused, the daemon
// stopped under held leases and started again, and threads taking and giving at once.
#include "runtime/node_leases.h"

#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "control/runtime_dir.h"
#include "gtest/gtest.h"
#include "node/daemon.h"
#include "node/wire.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

class NodeLeasesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/vmstash-node-leases-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    sim_ = std::make_unique<SimDriver>(SimDriverOptions{1, 256 * kMiB, 2 * kMiB, {}});
    leases_ = std::make_unique<NodeLeases>(sim_.get(), node::NodeOptions{true, 0, false, dir_});
  }
  void TearDown() override {
    leases_.reset();
    daemon_.reset();
    EXPECT_TRUE(sim_->CheckNoLeaks().ok()) << sim_->CheckNoLeaks();
    ::unlink((dir_ + "/vmstashd.lock").c_str());
    ::rmdir(dir_.c_str());
  }
  void StartDaemon(std::size_t bytes = 256 * kMiB) {
    node::DaemonOptions options;
    options.dir = dir_;
    options.capacity_bytes = bytes;
    absl::StatusOr<std::unique_ptr<node::NodeDaemon>> d = node::NodeDaemon::Start(options);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
  }

  std::string dir_;
  std::unique_ptr<SimDriver> sim_;
  std::unique_ptr<node::NodeDaemon> daemon_;
  std::unique_ptr<NodeLeases> leases_;
};

TEST_F(NodeLeasesTest, WithoutADaemonItIsNotEnabledAndSaysWhy) {
  absl::Status s = leases_->Connect(/*start=*/false);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_FALSE(leases_->Enabled());
  EXPECT_EQ(leases_->Stats().status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(NodeLeasesTest, ALeaseIsRegisteredOnceAndGoesBack) {
  StartDaemon();
  ASSERT_TRUE(leases_->Connect(false).ok());
  EXPECT_TRUE(leases_->Enabled());
  absl::StatusOr<HostLease> a = leases_->Take(0, 100 * kMiB, "tag 'a' on device 0");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_GE(a->bytes, 100 * kMiB);
  EXPECT_EQ(a->segment_bytes, NodeLeases::kSegmentBytes);
  EXPECT_TRUE(sim_->HostPageLocked(a->data));
  EXPECT_TRUE(sim_->HostPageLocked(a->data + a->bytes - 1));
  std::memset(a->data, 0x5a, a->bytes);  // the pool's pages are ours to write
  EXPECT_EQ(daemon_->stats().leased_bytes, a->bytes);
  const auto registrations = sim_->Counters().Calls(DriverOp::kHostRegister);
  leases_->Give(*a);
  EXPECT_EQ(daemon_->stats().leased_bytes, 0u);
  // The same pages again: nothing registered anew.
  absl::StatusOr<HostLease> b = leases_->Take(0, 100 * kMiB, "tag 'b' on device 0");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(sim_->Counters().Calls(DriverOp::kHostRegister), registrations);
  absl::StatusOr<NodeLeases::Report> r = leases_->Stats();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->leases, 1u);
  EXPECT_EQ(r->pool.capacity_bytes, 256 * kMiB);
  EXPECT_EQ(r->registered_bytes, 128 * kMiB);
  leases_->Give(*b);
}

TEST_F(NodeLeasesTest, ARefusedRegistrationGivesTheLeaseBack) {
  StartDaemon();
  ASSERT_TRUE(leases_->Connect(false).ok());
  sim_->InjectFault(FaultRule{DriverOp::kHostRegister, 1, 1, absl::StatusCode::kResourceExhausted});
  absl::StatusOr<HostLease> a = leases_->Take(0, 8 * kMiB, "x");
  EXPECT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted) << a.status();
  EXPECT_NE(a.status().message().find("registering the node pool"), std::string::npos) << a.status();
  EXPECT_EQ(daemon_->stats().leased_bytes, 0u);
  sim_->ClearFaults();
  absl::StatusOr<HostLease> b = leases_->Take(0, 8 * kMiB, "x");
  ASSERT_TRUE(b.ok()) << b.status();
  leases_->Give(*b);
}

TEST_F(NodeLeasesTest, APoolTooSmallRefusesAndTheReportCountsIt) {
  StartDaemon(16 * kMiB);
  ASSERT_TRUE(leases_->Connect(false).ok());
  absl::StatusOr<HostLease> big = leases_->Take(0, 32 * kMiB, "more than the pool");
  EXPECT_EQ(big.status().code(), absl::StatusCode::kInvalidArgument) << big.status();
  absl::StatusOr<HostLease> a = leases_->Take(0, 12 * kMiB, "first");
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<HostLease> b = leases_->Take(0, 8 * kMiB, "no room left");
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted) << b.status();
  absl::StatusOr<NodeLeases::Report> r = leases_->Stats();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->fallbacks, 2u);
  EXPECT_EQ(r->pool.refused, 2u);  // both, as the daemon counts
  leases_->Give(*a);
}

TEST_F(NodeLeasesTest, TheDaemonStoppedUnderHeldLeasesLosesNothingAndAReconnectServes) {
  StartDaemon();
  ASSERT_TRUE(leases_->Connect(false).ok());
  absl::StatusOr<HostLease> held = leases_->Take(0, 8 * kMiB, "paused");
  ASSERT_TRUE(held.ok());
  std::memset(held->data, 0x33, held->bytes);
  daemon_.reset();  // stopped: its socket gone
  absl::StatusOr<HostLease> refused = leases_->Take(0, 8 * kMiB, "another");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_TRUE(leases_->Enabled()) << "a fallback, not a disable";
  // The held bytes are still there, and still registered.
  EXPECT_EQ(static_cast<unsigned char>(held->data[held->bytes - 1]), 0x33);
  EXPECT_TRUE(sim_->HostPageLocked(held->data));
  StartDaemon();
  ASSERT_TRUE(leases_->Connect(false).ok()) << "a connect does not wait for the retry time";
  absl::StatusOr<HostLease> fresh = leases_->Take(0, 8 * kMiB, "after");
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_NE(fresh->segment_base, held->segment_base) << "the new daemon's pool, mapped anew";
  leases_->Give(*held);  // the old connection retires: its registrations go
  EXPECT_FALSE(sim_->HostPageLocked(held->data));
  leases_->Give(*fresh);
  EXPECT_EQ(daemon_->stats().leased_bytes, 0u);
}

TEST_F(NodeLeasesTest, ADaemonThatNeverAnswersCostsOneTimeoutThenNothing) {
  // A listener that never accepts, as a stopped daemon: a connection waits in its queue
  // (hello times out), then the queue is full (connect refused at once).
  const int listener = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  ASSERT_GE(listener, 0);
  sockaddr_un addr = control::UnixAddress(node::SocketPath(dir_));
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(listener, 0), 0);
  const auto start = std::chrono::steady_clock::now();
  absl::Status s = leases_->Connect(false);
  EXPECT_FALSE(s.ok());
  for (int i = 0; i < 4; ++i) {  // each within the retry time: no request at all
    absl::StatusOr<HostLease> l = leases_->Take(0, 2 * kMiB, "x");
    EXPECT_EQ(l.status().code(), absl::StatusCode::kUnavailable) << l.status();
  }
  for (int i = 0; i < 4; ++i) {  // connects tried at once: the queue is full, refused at once
    EXPECT_FALSE(leases_->Connect(false).ok());
  }
  // One hello timeout (2 s) and no more; a generous bound, not a timing test.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4 * NodeLeases::kRequestTimeoutMs / 1000));
  ::close(listener);
  ::unlink(node::SocketPath(dir_).c_str());
}

TEST_F(NodeLeasesTest, AConnectionFoundBrokenByStatsIsRetiredAtTheNextConnect) {
  StartDaemon();
  ASSERT_TRUE(leases_->Connect(false).ok());
  absl::StatusOr<HostLease> a = leases_->Take(0, 2 * kMiB, "x");
  ASSERT_TRUE(a.ok());
  char* old = a->data;
  leases_->Give(*a);
  daemon_.reset();
  EXPECT_EQ(leases_->Stats().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(sim_->HostPageLocked(old)) << "the dead daemon's pool is unregistered once nothing of it is held";
  StartDaemon();
  ASSERT_TRUE(leases_->Connect(false).ok());
  absl::StatusOr<HostLease> b = leases_->Take(0, 2 * kMiB, "y");
  ASSERT_TRUE(b.ok()) << b.status();
  leases_->Give(*b);
}

TEST_F(NodeLeasesTest, NodePinPinsThePoolAheadInTheBackground) {
  StartDaemon();
  leases_ = std::make_unique<NodeLeases>(sim_.get(), node::NodeOptions{true, 0, false, dir_});
  ASSERT_TRUE(leases_->Connect(false).ok());
  leases_->PrepareAhead(0);  // without node_pin: nothing
  EXPECT_FALSE(leases_->Stats()->pinning);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(leases_->Stats()->registered_bytes, 0u);
  leases_ = std::make_unique<NodeLeases>(sim_.get(), node::NodeOptions{true, 0, true, dir_});
  ASSERT_TRUE(leases_->Connect(false).ok());
  leases_->PrepareAhead(0);
  leases_->PrepareAhead(0);  // once
  for (int i = 0; i < 2000 && leases_->Stats()->pinning; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  absl::StatusOr<NodeLeases::Report> r = leases_->Stats();
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->pinning);
  EXPECT_EQ(r->registered_bytes, 256 * kMiB);
  const auto registrations = sim_->Counters().Calls(DriverOp::kHostRegister);
  absl::StatusOr<HostLease> a = leases_->Take(0, 100 * kMiB, "a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(sim_->Counters().Calls(DriverOp::kHostRegister), registrations) << "pinned ahead: nothing to register";
  leases_->Give(*a);
}

TEST_F(NodeLeasesTest, TeardownWhilePinningAheadJoinsAndLeavesNothingRegistered) {
  StartDaemon(256 * kMiB);
  leases_ = std::make_unique<NodeLeases>(sim_.get(), node::NodeOptions{true, 0, true, dir_});
  ASSERT_TRUE(leases_->Connect(false).ok());
  leases_->PrepareAhead(0);
  absl::StatusOr<HostLease> a = leases_->Take(0, 8 * kMiB, "racing the pinner");
  ASSERT_TRUE(a.ok()) << a.status();
  leases_->Give(*a);
  leases_.reset();  // TearDown's leak check: every registration undone
}

TEST_F(NodeLeasesTest, NodePinPinsTheNewPoolAfterADaemonRestart) {
  StartDaemon();
  leases_ = std::make_unique<NodeLeases>(sim_.get(), node::NodeOptions{true, 0, true, dir_});
  ASSERT_TRUE(leases_->Connect(false).ok());
  auto wait_pinned = [&] {
    for (int i = 0; i < 2000 && leases_->Stats().ok() && leases_->Stats()->pinning; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  };
  leases_->PrepareAhead(0);
  wait_pinned();
  EXPECT_EQ(leases_->Stats()->registered_bytes, 256 * kMiB);
  daemon_.reset();
  EXPECT_FALSE(leases_->Stats().ok());
  StartDaemon();
  ASSERT_TRUE(leases_->Connect(false).ok());
  leases_->PrepareAhead(0);  // a preparation after the reconnect: the new pool is pinned too
  wait_pinned();
  EXPECT_EQ(leases_->Stats()->registered_bytes, 256 * kMiB) << "node_pin after the daemon came back";
}

TEST_F(NodeLeasesTest, StopPinningStopsItForGood) {
  StartDaemon();
  leases_ = std::make_unique<NodeLeases>(sim_.get(), node::NodeOptions{true, 0, true, dir_});
  ASSERT_TRUE(leases_->Connect(false).ok());
  leases_->PrepareAhead(0);
  leases_->StopPinning();  // at exit: joined, whatever it had done
  EXPECT_FALSE(leases_->Stats()->pinning);
  leases_->PrepareAhead(0);
  EXPECT_FALSE(leases_->Stats()->pinning) << "no pinning after a stop";
  absl::StatusOr<HostLease> a = leases_->Take(0, 8 * kMiB, "still leases");
  ASSERT_TRUE(a.ok()) << a.status();
  leases_->Give(*a);
}

TEST_F(NodeLeasesTest, ThreadsTakeAndGiveAtOnceAndNeverShareAByte) {
  StartDaemon();
  ASSERT_TRUE(leases_->Connect(false).ok());
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) {
        absl::StatusOr<HostLease> l = leases_->Take(0, (2 + (t + i) % 6) * kMiB, "t");
        if (!l.ok()) {
          if (!absl::IsResourceExhausted(l.status())) ++failures;
          continue;
        }
        std::memset(l->data, t + 1, l->bytes);
        for (std::size_t k = 0; k < l->bytes; k += 4096) {
          if (l->data[k] != static_cast<char>(t + 1)) ++failures;
        }
        leases_->Give(*l);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(daemon_->stats().leased_bytes, 0u);
}

}  // namespace
}  // namespace vmstash
