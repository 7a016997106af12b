// The node daemon and its clients (daemon.h, client.h, wire.h), in real processes: the
// daemon in a child process, clients in this one and in children that exit or are
// killed holding leases; the daemon killed under its clients; the protocol's refusals.
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "node/client.h"
#include "node/daemon.h"
#include "control/runtime_dir.h"
#include "node/testing.h"
#include "node/wire.h"

namespace vmstash::node {
namespace {

using ::testing::HasSubstr;
constexpr std::size_t kUnit = HostPoolLedger::kUnitBytes;

// Polls the pool until `pred(stats)` or 5 s.
template <typename Pred>
bool Eventually(NodeClient* client, Pred pred) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < deadline) {
    absl::StatusOr<PoolStats> s = client->Stats();
    if (s.ok() && pred(*s)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

ClientOptions In(const std::string& dir) {
  ClientOptions o;
  o.dir = dir;
  return o;
}

TEST(NodeDaemonTest, ClientsShareOnePoolAndLeaseDisjointParts) {
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  absl::StatusOr<std::unique_ptr<NodeClient>> a = NodeClient::Connect(In(dir));
  absl::StatusOr<std::unique_ptr<NodeClient>> b = NodeClient::Connect(In(dir));
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_NE((*a)->id(), (*b)->id());
  EXPECT_EQ((*a)->pool_bytes(), 16 * kUnit);
  absl::StatusOr<HostLease> la = (*a)->Lease(3 * kUnit, "kv");
  absl::StatusOr<HostLease> lb = (*b)->Lease(kUnit + 1, "weights");
  ASSERT_TRUE(la.ok()) << la.status();
  ASSERT_TRUE(lb.ok()) << lb.status();
  EXPECT_EQ(lb->bytes, 2 * kUnit);
  EXPECT_TRUE(la->offset + la->bytes <= lb->offset || lb->offset + lb->bytes <= la->offset) << "disjoint";
  // One pool: bytes A writes into its lease are the bytes B's mapping shows there.
  std::memset(la->data, 0x5a, la->bytes);
  EXPECT_EQ((*b)->pool_data()[la->offset + la->bytes - 1], 0x5a);
  absl::StatusOr<PoolStats> s = (*a)->Stats();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->leased_bytes, 5 * kUnit);
  EXPECT_EQ(s->clients, 2u);
  // Only the holder gives a lease back.
  EXPECT_EQ((*a)->Give(*lb).code(), absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE((*b)->Give(*lb).ok());
  EXPECT_EQ((*b)->Give(*lb).code(), absl::StatusCode::kNotFound);
  // A pool too small for a lease says so; nothing changes.
  absl::StatusOr<HostLease> big = (*b)->Lease(14 * kUnit, "big");
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(big.status().message(), HasSubstr("no free run"));
  // A client that closes its connection gives back what it held.
  a->reset();
  EXPECT_TRUE(Eventually(b->get(), [](const PoolStats& p) { return p.leased_bytes == 0 && p.peak_bytes == 5 * kUnit; }));
}

TEST(NodeDaemonTest, AKilledClientsLeasesComeBackAndTheOthersKeepTheirs) {
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  absl::StatusOr<std::unique_ptr<NodeClient>> me = NodeClient::Connect(In(dir));
  ASSERT_TRUE(me.ok()) << me.status();
  absl::StatusOr<HostLease> mine = (*me)->Lease(2 * kUnit, "mine");
  ASSERT_TRUE(mine.ok());
  std::memset(mine->data, 0x11, mine->bytes);
  int leased[2];
  ASSERT_EQ(::pipe(leased), 0);
  const pid_t child = ::fork();
  if (child == 0) {  // this process has no thread: the child may allocate
    absl::StatusOr<std::unique_ptr<NodeClient>> c = NodeClient::Connect(In(dir));
    const bool ok = c.ok() && (*c)->Lease(8 * kUnit, "rollout").ok() && (*c)->Lease(kUnit, "graph").ok();
    const char b = ok ? 1 : 0;
    (void)!::write(leased[1], &b, 1);
    for (;;) ::pause();  // until killed, holding its leases
  }
  char b = 0;
  ASSERT_EQ(::read(leased[0], &b, 1), 1);
  ASSERT_EQ(b, 1);
  EXPECT_TRUE(Eventually(me->get(), [](const PoolStats& p) { return p.leased_bytes == 11 * kUnit; }));
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  EXPECT_TRUE(Eventually(me->get(), [](const PoolStats& p) { return p.leased_bytes == 2 * kUnit && p.clients == 1; }));
  EXPECT_EQ(mine->data[mine->bytes - 1], 0x11) << "the survivor's bytes are untouched";
  // What the dead one held can be leased again.
  EXPECT_TRUE((*me)->Lease(13 * kUnit, "after").ok());
}

TEST(NodeDaemonTest, WhenTheDaemonDiesClientsKeepTheirBytesAndNewLeasesFailClearly) {
  const std::string dir = PrivateDir();
  auto daemon = std::make_unique<DaemonProcess>(dir);
  ASSERT_TRUE(daemon->started());
  absl::StatusOr<std::unique_ptr<NodeClient>> c = NodeClient::Connect(In(dir));
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<HostLease> l = (*c)->Lease(kUnit, "kv");
  ASSERT_TRUE(l.ok());
  std::memset(l->data, 0x7e, l->bytes);
  daemon->Kill();
  EXPECT_EQ(l->data[123], 0x7e) << "the mapping outlives the daemon";
  absl::StatusOr<HostLease> next = (*c)->Lease(kUnit, "kv2");
  EXPECT_EQ(next.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(next.status().message(), HasSubstr("the node daemon is gone"));
  EXPECT_EQ((*c)->Give(*l).code(), absl::StatusCode::kUnavailable);
  // A daemon started again replaces the dead one's socket; a new connection works.
  daemon = std::make_unique<DaemonProcess>(dir);
  ASSERT_TRUE(daemon->started());
  absl::StatusOr<std::unique_ptr<NodeClient>> again = NodeClient::Connect(In(dir));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE((*again)->Lease(kUnit, "kv").ok());
}

TEST(NodeDaemonTest, OneDaemonPerDirectoryAndOnlyAPrivateOne) {
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  DaemonOptions options;
  options.dir = dir;
  options.capacity_bytes = 4 * kUnit;
  absl::StatusOr<std::unique_ptr<NodeDaemon>> second = NodeDaemon::Start(options);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists);
  options.capacity_bytes = kUnit - 1;
  EXPECT_EQ(NodeDaemon::Start(options).status().code(), absl::StatusCode::kInvalidArgument);
  const std::string open_dir = PrivateDir();
  ASSERT_EQ(::chmod(open_dir.c_str(), 0755), 0);
  options.dir = open_dir;
  options.capacity_bytes = 4 * kUnit;
  EXPECT_EQ(NodeDaemon::Start(options).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(NodeClient::Connect(In(open_dir)).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(NodeClient::Connect(In(PrivateDir())).status().code(), absl::StatusCode::kUnavailable);
}

// A raw connection to the daemon of `dir` (for what NodeClient never sends).
int RawConnect(const std::string& dir) {
  absl::StatusOr<int> fd = Connect(SocketPath(dir));
  return fd.ok() ? *fd : -1;
}

absl::Status Ask(int fd, const std::string& message, int pass_fd = -1) {
  if (absl::Status s = Send(fd, message, pass_fd); !s.ok()) return s;
  absl::StatusOr<Received> r = Receive(fd, 5000);
  if (!r.ok()) return r.status();
  if (r->fd >= 0) ::close(r->fd);
  return ParseReply(r->message).status();
}

// A raw client that said hello and holds one lease of a unit: its connection, or -1.
int RawClientWithALease(const std::string& dir) {
  const int raw = RawConnect(dir);
  if (raw < 0) return -1;
  if (!Ask(raw, R"({"v":3,"op":"hello","pid":1})").ok() || !Ask(raw, R"({"v":3,"op":"lease","bytes":1,"tag":"x"})").ok()) {
    ::close(raw);
    return -1;
  }
  return raw;
}

// Raw packets: the protocol's refusals, each answered, the daemon serving on.
TEST(NodeDaemonTest, BadRequestsAreAnsweredWithErrorsAndTheDaemonServesOn) {
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  const int fd = RawConnect(dir);
  ASSERT_GE(fd, 0);
  auto ask = [&](const std::string& message) { return Ask(fd, message); };
  EXPECT_THAT(ask(R"({"v":3,"op":"stats"})").message(), HasSubstr("say hello first"));
  EXPECT_EQ(ask("not json").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ask(R"({"v":3,"op":"stats"})").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ask(R"({"v":3,"op":"steal"})").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ask(R"({"v":3,"op":"hello","pid":-4})").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ask(R"({"v":3,"op":"hello","pid":1})").ok());
  EXPECT_THAT(ask(R"({"v":3,"op":"hello","pid":1})").message(), HasSubstr("hello was said already"));
  EXPECT_EQ(ask(R"({"v":3,"op":"lease","bytes":0,"tag":"x"})").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ask(R"({"v":3,"op":"lease","bytes":1.5,"tag":"x"})").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ask(R"({"v":3,"op":"lease","bytes":1,"tag":"x","extra":1})").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ask(R"({"v":3,"op":"give","offset":4096})").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(ask(R"({"v":3,"op":"lease","bytes":1,"tag":"x"})").ok());
  ::close(fd);
  absl::StatusOr<std::unique_ptr<NodeClient>> c = NodeClient::Connect(In(dir));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(Eventually(c->get(), [](const PoolStats& p) { return p.leased_bytes == 0; }));
}

// Threads of several clients leasing and giving at once (run under TSAN and ASAN by
// scripts/run_tests.sh): every lease is disjoint from the others held at the same time,
// and the pool ends empty.
TEST(NodeDaemonTest, ConcurrentClientsNeverShareBytes) {
  const std::string dir = PrivateDir();
  DaemonOptions options;
  options.dir = dir;
  options.capacity_bytes = 64 * kUnit;
  absl::StatusOr<std::unique_ptr<NodeDaemon>> daemon = NodeDaemon::Start(options);  // in-process: TSAN sees it
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  std::vector<std::unique_ptr<NodeClient>> clients;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<std::unique_ptr<NodeClient>> c = NodeClient::Connect(In(dir));
    ASSERT_TRUE(c.ok()) << c.status();
    clients.push_back(std::move(*c));
  }
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      NodeClient* c = clients[t % clients.size()].get();
      const char mark = static_cast<char>(t + 1);
      for (int i = 0; i < 100; ++i) {
        absl::StatusOr<HostLease> l = c->Lease(kUnit * (1 + (i + t) % 3), "t");
        if (!l.ok()) {
          if (!absl::IsResourceExhausted(l.status())) errors.fetch_add(1);
          continue;
        }
        std::memset(l->data, mark, l->bytes);
        std::this_thread::yield();
        for (std::size_t k = 0; k < l->bytes; k += 4096) {
          if (l->data[k] != mark) errors.fetch_add(1);  // someone else wrote into our lease
        }
        if (!c->Give(*l).ok()) errors.fetch_add(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ((*daemon)->stats().leased_bytes, 0u);
  clients.clear();
  (*daemon)->Stop();
  EXPECT_EQ((*daemon)->connected(), 0u);
}


TEST(NodeDaemonTest, AClientThatDoesNotReadItsRepliesIsDroppedAndTheOthersAreServed) {
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  const int raw = RawClientWithALease(dir);
  ASSERT_GE(raw, 0);
  // Requests without reading a reply, until the daemon drops the connection.
  bool dropped = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!dropped && std::chrono::steady_clock::now() < deadline) {
    if (::send(raw, R"({"v":3,"op":"stats"})", 20, MSG_NOSIGNAL | MSG_DONTWAIT) >= 0) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } else {
      dropped = true;  // EPIPE / ECONNRESET: the daemon let go of it
    }
  }
  EXPECT_TRUE(dropped) << "the daemon kept serving a client that reads no reply";
  absl::StatusOr<std::unique_ptr<NodeClient>> c = NodeClient::Connect(In(dir));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(Eventually(c->get(), [](const PoolStats& p) { return p.leased_bytes == 0; }))
      << "the dropped client's lease went back";
  ::close(raw);
  daemon.Stop();  // returns: the serving thread was never held up
}

TEST(NodeDaemonTest, DescriptorsAndEmptyPacketsFromAClientAreRefusedAndNothingLeaks) {
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  const int raw = RawClientWithALease(dir);
  ASSERT_GE(raw, 0);
  const int before = OpenFds(daemon.pid());
  for (int i = 0; i < 50; ++i) {
    // Two descriptors on one packet.
    int fds[2] = {::open("/dev/null", O_RDONLY), ::open("/dev/null", O_RDONLY)};
    const std::string m = R"({"v":3,"op":"stats"})";
    iovec iov{const_cast<char*>(m.data()), m.size()};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(fds))];
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(fds));
    std::memcpy(CMSG_DATA(cm), fds, sizeof(fds));
    ASSERT_GE(::sendmsg(raw, &msg, MSG_NOSIGNAL), 0);
    ::close(fds[0]);
    ::close(fds[1]);
    absl::StatusOr<Received> r = Receive(raw, 5000);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_THAT(ParseReply(r->message).status().message(), HasSubstr("only an offer passes descriptors"));
  }
  EXPECT_LE(OpenFds(daemon.pid()), before + 1) << "every descriptor sent was closed";
  // An empty packet is a bad request, not a closed connection: the lease stays.
  ASSERT_EQ(::send(raw, "", 0, MSG_NOSIGNAL), 0);
  absl::StatusOr<Received> r = Receive(raw, 5000);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(ParseReply(r->message).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::unique_ptr<NodeClient>> c = NodeClient::Connect(In(dir));
  ASSERT_TRUE(c.ok());
  absl::StatusOr<PoolStats> s = (*c)->Stats();
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->leased_bytes, kUnit);
  ::close(raw);
}

TEST(NodeDaemonTest, ThePoolCannotBeShrunkUnderItsClients) {
  absl::StatusOr<std::unique_ptr<SharedHostMemory>> m = SharedHostMemory::Create(4 * kUnit);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_NE(::ftruncate((*m)->fd(), 0), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(::ftruncate((*m)->fd(), 8 * kUnit), 0);
}

TEST(NodeDaemonTest, OnlyOneOfDaemonsStartedAtOnceServes) {
  for (int round = 0; round < 20; ++round) {
    const std::string dir = PrivateDir();
    std::atomic<int> started{0}, refused{0};
    std::vector<std::unique_ptr<NodeDaemon>> kept(4);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        DaemonOptions options;
        options.dir = dir;
        options.capacity_bytes = 4 * kUnit;
        absl::StatusOr<std::unique_ptr<NodeDaemon>> d = NodeDaemon::Start(options);
        if (d.ok()) {
          started.fetch_add(1);
          kept[t] = std::move(*d);
        } else if (absl::IsAlreadyExists(d.status())) {
          refused.fetch_add(1);
        }
      });
    }
    for (std::thread& t : threads) t.join();
    ASSERT_EQ(started.load(), 1) << "round " << round;
    ASSERT_EQ(refused.load(), 3);
  }
}

TEST(NodeDaemonTest, OverMaxClientsAConnectionIsRefusedWithTheReason) {
  const std::string dir = PrivateDir();
  DaemonOptions options;
  options.dir = dir;
  options.capacity_bytes = 4 * kUnit;
  options.max_clients = 1;
  absl::StatusOr<std::unique_ptr<NodeDaemon>> daemon = NodeDaemon::Start(options);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  absl::StatusOr<std::unique_ptr<NodeClient>> first = NodeClient::Connect(In(dir));
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::unique_ptr<NodeClient>> second = NodeClient::Connect(In(dir));
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted) << second.status();
  first->reset();
  (*daemon)->Stop();
}

// A daemon answering late (a fake one, here): the late reply must not answer the next
// request; the connection takes no more requests and keeps what was leased.
TEST(NodeDaemonTest, AReplyTooLateLeavesTheConnectionClosedToRequestsNotOutOfStep) {
  const std::string dir = PrivateDir();
  const int listener = ListenAsDaemon(dir, 1);
  ASSERT_GE(listener, 0);
  absl::StatusOr<std::unique_ptr<SharedHostMemory>> pool = SharedHostMemory::Create(4 * kUnit);
  ASSERT_TRUE(pool.ok());
  std::thread fake([&] {
    const int c = ::accept(listener, nullptr, nullptr);
    (void)Receive(c, 5000);  // hello
    (void)Send(c, absl::StrCat(R"({"v":3,"ok":true,"client":1,"capacity":)", 4 * kUnit, "}"), (*pool)->fd());
    (void)Receive(c, 5000);  // the first lease: answered late
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    (void)Send(c, absl::StrCat(R"({"v":3,"ok":true,"offset":0,"bytes":)", kUnit, "}"));
    absl::StatusOr<Received> more = Receive(c, 1000);  // nothing more may come
    (void)Send(c, absl::StrCat(R"({"v":3,"ok":true,"offset":)", 2 * kUnit, R"(,"bytes":)", kUnit, "}"));
    ::close(c);
    EXPECT_FALSE(more.ok()) << "a request after the late reply";
  });
  ClientOptions o = In(dir);
  o.timeout_ms = 100;
  absl::StatusOr<std::unique_ptr<NodeClient>> c = NodeClient::Connect(o);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<HostLease> first = (*c)->Lease(kUnit, "a");
  EXPECT_EQ(first.status().code(), absl::StatusCode::kUnavailable);
  absl::StatusOr<HostLease> second = (*c)->Lease(kUnit, "b");
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(), HasSubstr("takes no more requests"));
  fake.join();
  ::close(listener);
}

TEST(NodeDaemonTest, AForkedChildCannotUseItsParentsConnection) {
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  absl::StatusOr<std::unique_ptr<NodeClient>> c = NodeClient::Connect(In(dir));
  ASSERT_TRUE(c.ok());
  int result[2];
  ASSERT_EQ(::pipe(result), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    const char code = static_cast<char>((*c)->Stats().status().code());
    (void)!::write(result[1], &code, 1);
    ::_exit(0);
  }
  char code = 0;
  ASSERT_EQ(::read(result[0], &code, 1), 1);
  ::waitpid(child, nullptr, 0);
  EXPECT_EQ(static_cast<absl::StatusCode>(code), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE((*c)->Stats().ok()) << "the parent's connection is in step";
}

// A daemon of another release (here: version 1, before take named its gaps) answers with
// its own version: the client says so and how to replace it, whatever the reply said.
TEST(NodeWireTest, AReplyOfAnotherVersionSaysHowToReplaceItsDaemon) {
  for (const char* reply : {R"({"v":1,"ok":false,"code":"FAILED_PRECONDITION","message":"node protocol: version 2, )"
                            R"(this daemon speaks version 1"})",
                            R"({"v":1,"ok":true,"client":1,"capacity":4096})", R"({"ok":true})"}) {
    const absl::Status s = ParseReply(reply).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << reply;
    EXPECT_TRUE(IsOtherVersion(s)) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(absl::StrCat("this library version ", kWireVersion))) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("vmstash daemon stop")) << s;
  }
  EXPECT_THAT(std::string(ParseReply(R"({"ok":true})").status().message()), HasSubstr("without a version"));
  EXPECT_TRUE(ParseReply(R"({"v":3,"ok":true})").ok());
  // The daemon's own refusal of a request's version is not another version's reply.
  EXPECT_FALSE(IsOtherVersion(ParseReply(R"({"v":3,"ok":false,"code":"FAILED_PRECONDITION","message":"node )"
                                         R"(protocol: version 1, this daemon speaks version 2"})").status()));
}

TEST(NodeDaemonTest, ADaemonObjectInAForkedChildIsLeftToItsParent) {
  const std::string dir = PrivateDir();
  DaemonOptions options;
  options.dir = dir;
  options.capacity_bytes = 4 * kUnit;
  absl::StatusOr<std::unique_ptr<NodeDaemon>> daemon = NodeDaemon::Start(options);
  ASSERT_TRUE(daemon.ok());
  const pid_t child = ::fork();
  if (child == 0) {
    daemon->reset();  // neither aborts nor stops the parent's daemon
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  absl::StatusOr<std::unique_ptr<NodeClient>> c = NodeClient::Connect(In(dir));
  EXPECT_TRUE(c.ok()) << c.status();
  c->reset();
  (*daemon)->Stop();
}

}  // namespace
}  // namespace vmstash::node
