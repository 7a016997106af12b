// SimDriver specifics; the behaviour shared with CudaDriver is in the conformance suite.
#include "vmm/sim_driver.h"

#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <functional>

#include "gtest/gtest.h"
#include "base/status_macros.h"

namespace vmstash {
namespace {

constexpr std::size_t kG = 2 << 20;

SimDriverOptions Small() {
  SimDriverOptions options;
  options.capacity_bytes = 8 * kG;
  return options;
}

TEST(SimDriverTest, CapacityIsEnforcedAndReturned) {
  SimDriver sim(Small());
  absl::StatusOr<ChunkHandle> a = sim.CreateChunk(0, 6 * kG, {});
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(sim.UsedBytes(0), 6 * kG);
  absl::StatusOr<ChunkHandle> b = sim.CreateChunk(0, 4 * kG, {});
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("out of memory"), absl::string_view::npos);
  EXPECT_EQ(sim.MemoryInfo(0)->free_bytes, 2 * kG);
  ASSERT_TRUE(sim.ReleaseChunk(*a).ok());
  EXPECT_EQ(sim.UsedBytes(0), 0u);
  EXPECT_TRUE(sim.CheckNoLeaks().ok());
}

TEST(SimDriverTest, ReleasedButMappedChunkCountsUntilUnmapped) {
  SimDriver sim(Small());
  DevicePtr va = sim.ReserveAddress(0, 2 * kG, 0).value();
  ChunkHandle c = sim.CreateChunk(0, 2 * kG, {}).value();
  ASSERT_TRUE(sim.Map(va, 2 * kG, c).ok());
  ASSERT_TRUE(sim.ReleaseChunk(c).ok());
  EXPECT_EQ(sim.UsedBytes(0), 2 * kG);
  ASSERT_TRUE(sim.Unmap(0, va, 2 * kG).ok());
  EXPECT_EQ(sim.UsedBytes(0), 0u);
  ASSERT_TRUE(sim.FreeAddress(0, va, 2 * kG).ok());
  EXPECT_TRUE(sim.CheckNoLeaks().ok());
}

TEST(SimDriverTest, MemoryIsRealAndNeedsAccess) {
  SimDriver sim(Small());
  DevicePtr va = sim.ReserveAddress(0, kG, 0).value();
  ChunkHandle c = sim.CreateChunk(0, kG, {}).value();
  ASSERT_TRUE(sim.Map(va, kG, c).ok());
  char byte = 0;
  absl::Status s = sim.CopyToHostAsync(0, &byte, va, 1, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "no access granted yet";
  ASSERT_TRUE(sim.SetAccess(va, kG, 0).ok());
  std::memset(reinterpret_cast<void*>(va), 42, 16);  // the device pointer is a host address
  ASSERT_TRUE(sim.CopyToHostAsync(0, &byte, va + 15, 1, nullptr).ok());
  EXPECT_EQ(byte, 42);
  EXPECT_EQ(sim.CopyToHostAsync(0, &byte, va + kG - 1, 2, nullptr).code(), absl::StatusCode::kInvalidArgument)
      << "copy running past the mapping";
  ASSERT_TRUE(sim.Unmap(0, va, kG).ok());
  ASSERT_TRUE(sim.ReleaseChunk(c).ok());
  ASSERT_TRUE(sim.FreeAddress(0, va, kG).ok());
}

// `fd` sent over a Unix socket (SCM_RIGHTS), as processes pass an exported chunk.
bool SendFd(int socket, int fd) {
  char byte = 'x';
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  return ::sendmsg(socket, &msg, 0) == 1;
}

int ReceiveFd(int socket) {
  char byte = 0;
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  if (::recvmsg(socket, &msg, 0) != 1) return -1;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  if (c == nullptr || c->cmsg_type != SCM_RIGHTS) return -1;
  int fd = -1;
  std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
  return fd;
}

// The exporter of the cross-process case, in the forked child: its own driver, a chunk
// written and exported, kept until the importer says it has read it. Exits, never returns
// (a child must not run the rest of the test binary): 0 when all went well.
[[noreturn]] void ExportInChild(int socket) {
  SimDriver sim(Small());
  ChunkOptions shareable;
  shareable.shareable_fd = true;
  absl::StatusOr<DevicePtr> va = sim.ReserveAddress(0, 2 * kG, 0);
  absl::StatusOr<ChunkHandle> c = sim.CreateChunk(0, 2 * kG, shareable);
  if (!va.ok() || !c.ok() || !sim.Map(*va, 2 * kG, *c).ok() || !sim.SetAccess(*va, 2 * kG, 0).ok()) ::_exit(2);
  std::memset(reinterpret_cast<void*>(*va), 0x6b, 2 * kG);
  absl::StatusOr<int> fd = sim.ExportChunkFd(*c);
  char done = 0;
  if (!fd.ok() || !SendFd(socket, *fd) || ::read(socket, &done, 1) != 1) ::_exit(3);
  ::close(*fd);
  if (!sim.Unmap(0, *va, 2 * kG).ok() || !sim.ReleaseChunk(*c).ok() || !sim.FreeAddress(0, *va, 2 * kG).ok()) {
    ::_exit(4);
  }
  ::_exit(sim.CheckNoLeaks().ok() ? 0 : 5);
}

TEST(SimDriverTest, AChunkImportedFromAnotherProcessIsItsMemoryAndTakesNoCapacityHere) {
  int sockets[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sockets), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(sockets[0]);
    ExportInChild(sockets[1]);
  }
  ::close(sockets[1]);
  // Whatever happens below, the child is told to finish and is waited for.
  int status = -1;
  auto finish_child = [&] {
    if (sockets[0] >= 0) {
      (void)!::write(sockets[0], "d", 1);
      ::close(sockets[0]);
      sockets[0] = -1;
    }
    if (status == -1) ::waitpid(child, &status, 0);
  };
  struct Finally {
    std::function<void()> f;
    ~Finally() { f(); }
  } finally{finish_child};
  const int fd = ReceiveFd(sockets[0]);
  ASSERT_GE(fd, 0);
  SimDriver sim(Small());
  absl::StatusOr<ChunkHandle> imported = sim.ImportChunkFd(0, fd, 2 * kG);
  ::close(fd);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(sim.UsedBytes(0), 0u) << "the exporter's memory";
  EXPECT_EQ(sim.ImportChunkFd(0, sockets[0], 2 * kG).status().code(), absl::StatusCode::kInvalidArgument)
      << "a socket is no exported chunk";
  DevicePtr va = sim.ReserveAddress(0, 2 * kG, 0).value();
  EXPECT_TRUE(sim.Map(va, 2 * kG, *imported).ok());
  EXPECT_TRUE(sim.SetAccess(va, 2 * kG, 0).ok());
  char bytes[2] = {};
  EXPECT_TRUE(sim.CopyToHostAsync(0, &bytes[0], va, 1, nullptr).ok());
  EXPECT_TRUE(sim.CopyToHostAsync(0, &bytes[1], va + 2 * kG - 1, 1, nullptr).ok());
  EXPECT_EQ(bytes[0], 0x6b);
  EXPECT_EQ(bytes[1], 0x6b);
  finish_child();  // the exporter releases its handle and exits
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the exporter's exit status " << status;
  // The bytes live on in the import.
  EXPECT_TRUE(sim.CopyToHostAsync(0, &bytes[0], va + kG, 1, nullptr).ok());
  EXPECT_EQ(bytes[0], 0x6b);
  EXPECT_TRUE(sim.SynchronizeStream(0, nullptr).ok());
  EXPECT_TRUE(sim.Unmap(0, va, 2 * kG).ok());
  EXPECT_TRUE(sim.ReleaseChunk(*imported).ok());
  EXPECT_TRUE(sim.FreeAddress(0, va, 2 * kG).ok());
  EXPECT_EQ(sim.UsedBytes(0), 0u);
  EXPECT_TRUE(sim.CheckNoLeaks().ok()) << sim.CheckNoLeaks();
}

TEST(SimDriverTest, AChunkImportedBackKeepsItsCapacityUntilEveryHandleGoes) {
  SimDriver sim(Small());
  ChunkOptions shareable;
  shareable.shareable_fd = true;
  ChunkHandle exported = sim.CreateChunk(0, 2 * kG, shareable).value();
  const int fd = sim.ExportChunkFd(exported).value();
  EXPECT_EQ(sim.ImportChunkFd(0, fd, 4 * kG).status().code(), absl::StatusCode::kInvalidArgument)
      << "more than was exported";
  ChunkHandle imported = sim.ImportChunkFd(0, fd, 2 * kG).value();
  ::close(fd);
  EXPECT_EQ(sim.UsedBytes(0), 2 * kG) << "one memory, counted once";
  ASSERT_TRUE(sim.ReleaseChunk(exported).ok());
  EXPECT_EQ(sim.UsedBytes(0), 2 * kG) << "the import still holds it";
  EXPECT_EQ(sim.CreateChunk(0, 8 * kG, {}).status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(sim.ReleaseChunk(imported).ok());
  EXPECT_EQ(sim.UsedBytes(0), 0u);
  // A descriptor of a file that is not shared memory is refused.
  char path[] = "/tmp/vmstash-sim-import-XXXXXX";
  const int file = ::mkstemp(path);
  ASSERT_GE(file, 0);
  ::unlink(path);
  ASSERT_EQ(::ftruncate(file, 2 * kG), 0);
  EXPECT_EQ(sim.ImportChunkFd(0, file, 2 * kG).status().code(), absl::StatusCode::kInvalidArgument);
  ::close(file);
  EXPECT_TRUE(sim.CheckNoLeaks().ok());
}

TEST(SimDriverTest, UnmapOfMemoryWithUnsynchronizedCopiesIsReported) {
  SimDriver sim(Small());
  Stream stream = sim.CreateStream(0).value();
  Event event = sim.CreateEvent(0, false).value();
  auto map = [&](DevicePtr* va, ChunkHandle* c) {
    *va = sim.ReserveAddress(0, kG, 0).value();
    *c = sim.CreateChunk(0, kG, {}).value();
    ASSERT_TRUE(sim.Map(*va, kG, *c).ok());
    ASSERT_TRUE(sim.SetAccess(*va, kG, 0).ok());
  };
  auto unmap = [&](DevicePtr va, ChunkHandle c) {
    ASSERT_TRUE(sim.Unmap(0, va, kG).ok());
    ASSERT_TRUE(sim.ReleaseChunk(c).ok());
    ASSERT_TRUE(sim.FreeAddress(0, va, kG).ok());
  };
  char host[64] = {};
  DevicePtr a, b;
  ChunkHandle ca, cb;
  map(&a, &ca);
  map(&b, &cb);
  // Synchronized through an event recorded after the copy: fine. A copy queued after the
  // event is still in flight.
  ASSERT_TRUE(sim.CopyToHostAsync(0, host, a, 64, stream).ok());
  ASSERT_TRUE(sim.RecordEvent(0, event, stream).ok());
  ASSERT_TRUE(sim.CopyToDeviceAsync(0, b, host, 64, stream).ok());
  ASSERT_TRUE(sim.SynchronizeEvent(0, event).ok());
  unmap(a, ca);
  EXPECT_TRUE(sim.CheckOrdering().ok()) << sim.CheckOrdering();
  unmap(b, cb);  // its copy was queued after the event: nothing waited for it
  absl::Status s = sim.CheckOrdering();
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("in flight"), absl::string_view::npos) << s;
  ASSERT_TRUE(sim.DestroyEvent(0, event).ok());
  ASSERT_TRUE(sim.DestroyStream(0, stream).ok());
}

TEST(SimDriverTest, InjectsTheNthCallFailureBeforeAnyChange) {
  SimDriverOptions options = Small();
  options.faults = {FaultRule{DriverOp::kCreateChunk, 2, 2, absl::StatusCode::kResourceExhausted}};
  SimDriver sim(options);
  ChunkHandle first = sim.CreateChunk(0, kG, {}).value();
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<ChunkHandle> failed = sim.CreateChunk(0, kG, {});
    EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(failed.status().message().find("injected failure of create_chunk"), absl::string_view::npos);
  }
  EXPECT_EQ(sim.UsedBytes(0), kG);
  ChunkHandle fourth = sim.CreateChunk(0, kG, {}).value();
  DriverCounters counters = sim.Counters();
  EXPECT_EQ(counters.Calls(DriverOp::kCreateChunk), 4u);
  EXPECT_EQ(counters.failed_calls, 2u);
  EXPECT_EQ(counters.chunk_bytes_created, 2 * kG);
  // Rules added at run time count from when they are added.
  sim.InjectFault(FaultRule{DriverOp::kReleaseChunk, 1, 1, absl::StatusCode::kInternal});
  EXPECT_EQ(sim.ReleaseChunk(first).code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(sim.ReleaseChunk(first).ok());
  sim.ClearFaults();
  EXPECT_TRUE(sim.ReleaseChunk(fourth).ok());
  EXPECT_TRUE(sim.CheckNoLeaks().ok());
}

TEST(SimDriverTest, LeakCheckNamesWhatIsAlive) {
  SimDriver sim(Small());
  DevicePtr va = sim.ReserveAddress(0, kG, 0).value();
  Stream s = sim.CreateStream(0).value();
  absl::Status leaks = sim.CheckNoLeaks();
  EXPECT_EQ(leaks.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(leaks.message().find("1 reservation(s)"), absl::string_view::npos) << leaks;
  EXPECT_NE(leaks.message().find("1 stream(s)"), absl::string_view::npos) << leaks;
  ASSERT_TRUE(sim.DestroyStream(0, s).ok());
  ASSERT_TRUE(sim.FreeAddress(0, va, kG).ok());
  EXPECT_TRUE(sim.CheckNoLeaks().ok());
}

TEST(SimDriverTest, EachDeviceHasItsOwnCapacity) {
  SimDriverOptions options = Small();
  options.devices = 2;
  SimDriver sim(options);
  ChunkHandle a = sim.CreateChunk(0, 8 * kG, {}).value();
  ChunkHandle b = sim.CreateChunk(1, 8 * kG, {}).value();
  EXPECT_EQ(sim.CreateChunk(1, kG, {}).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(sim.CreateChunk(2, kG, {}).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(sim.ReleaseChunk(a).ok());
  ASSERT_TRUE(sim.ReleaseChunk(b).ok());
}

TEST(SimDriverTest, OptionsFromConf) {
  VmmOptions options;
  options.sim_devices = 3;
  options.sim_granularity_bytes = 64 << 10;
  options.sim_faults = {FaultRule{DriverOp::kMap, 1, 1, absl::StatusCode::kInternal}};
  SimDriverOptions sim = SimDriverOptions::FromOptions(options);
  EXPECT_EQ(sim.devices, 3);
  EXPECT_EQ(sim.granularity_bytes, 64u << 10);
  EXPECT_EQ(sim.faults.size(), 1u);
}

}  // namespace
}  // namespace vmstash

namespace vmstash {
namespace {

TEST(SimDriverHoldTest, EventOnHeldStreamStaysPendingUntilReleaseOrWait) {
  SimDriver sim;
  absl::StatusOr<Stream> s = sim.CreateStream(0);
  ASSERT_TRUE(s.ok());
  absl::StatusOr<Event> e = sim.CreateEvent(0, false);
  ASSERT_TRUE(e.ok());
  sim.HoldStream(0, *s);
  ASSERT_TRUE(sim.RecordEvent(0, *e, *s).ok());
  EXPECT_EQ(*sim.QueryEvent(0, *e), false);
  // An event on another stream is not held.
  absl::StatusOr<Event> other = sim.CreateEvent(0, false);
  ASSERT_TRUE(sim.RecordEvent(0, *other, nullptr).ok());
  EXPECT_EQ(*sim.QueryEvent(0, *other), true);
  sim.ReleaseStream(0, *s);
  EXPECT_EQ(*sim.QueryEvent(0, *e), true);
  // A new hold does not make the old record pending again.
  sim.HoldStream(0, *s);
  EXPECT_EQ(*sim.QueryEvent(0, *e), true);
  ASSERT_TRUE(sim.RecordEvent(0, *e, *s).ok());
  EXPECT_EQ(*sim.QueryEvent(0, *e), false);
  // Waiting ends the hold.
  ASSERT_TRUE(sim.SynchronizeEvent(0, *e).ok());
  EXPECT_EQ(*sim.QueryEvent(0, *e), true);
  sim.HoldStream(0, nullptr);
  ASSERT_TRUE(sim.RecordEvent(0, *e, nullptr).ok());
  EXPECT_EQ(*sim.QueryEvent(0, *e), false);
  ASSERT_TRUE(sim.SynchronizeDevice(0).ok());
  EXPECT_EQ(*sim.QueryEvent(0, *e), true);
  ASSERT_TRUE(sim.DestroyEvent(0, *e).ok());
  ASSERT_TRUE(sim.DestroyEvent(0, *other).ok());
  ASSERT_TRUE(sim.DestroyStream(0, *s).ok());
  EXPECT_TRUE(sim.CheckNoLeaks().ok());
}

}  // namespace
}  // namespace vmstash
