// SimDriver specifics; the behaviour shared with CudaDriver is in the conformance suite.
#include "vmm/sim_driver.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

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

// The shared-memory objects of this process's interprocess events (the simulator names
// them /vmstash-simev-<pid>-...).
int IpcObjectsOfThisProcess() {
  const std::string prefix = "vmstash-simev-" + std::to_string(::getpid()) + "-";
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return -1;
  int n = 0;
  while (const dirent* entry = ::readdir(dir)) {
    if (std::strncmp(entry->d_name, prefix.c_str(), prefix.size()) == 0) ++n;
  }
  ::closedir(dir);
  return n;
}

bool WriteAll(int fd, const void* data, std::size_t n) {
  return ::write(fd, data, n) == static_cast<ssize_t>(n);
}

bool ReadAll(int fd, void* data, std::size_t n) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t got = ::read(fd, p, n);
    if (got <= 0) return false;
    p += got;
    n -= static_cast<std::size_t>(got);
  }
  return true;
}

// The opener of the cross-process cases, in the forked child: reads a handle from `in`,
// opens it with its own driver, and runs `check` on it. Exits, never returns: 0 when all
// went well, else the number of the step that failed.
[[noreturn]] void OpenInChild(int in, const std::function<int(SimDriver&, Event)>& check) {
  std::string handle(kIpcEventHandleBytes, '\0');
  if (!ReadAll(in, &handle[0], handle.size())) ::_exit(10);
  SimDriver sim(Small());
  absl::StatusOr<Event> opened = sim.OpenIpcEvent(0, handle);
  if (!opened.ok()) ::_exit(11);
  const int failed = check(sim, *opened);
  if (failed != 0) ::_exit(failed);
  if (!sim.DestroyEvent(0, *opened).ok()) ::_exit(12);
  ::_exit(sim.CheckNoLeaks().ok() ? 0 : 13);
}

TEST(SimDriverIpcEventTest, AnotherProcessWaitsForARecordedEvent) {
  int to_child[2];
  ASSERT_EQ(::pipe2(to_child, O_CLOEXEC), 0);
  const pid_t child = ::fork();  // no other thread runs here
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(to_child[1]);
    OpenInChild(to_child[0], [](SimDriver& sim, Event opened) {
      absl::StatusOr<Stream> stream = sim.CreateStream(0);
      if (!stream.ok()) return 1;
      if (!sim.StreamWaitEvent(0, *stream, opened).ok()) return 2;
      absl::StatusOr<bool> done = sim.QueryEvent(0, opened);
      if (!done.ok() || !*done) return 3;
      if (!sim.SynchronizeEvent(0, opened).ok()) return 4;
      if (sim.RecordEvent(0, opened, *stream).code() != absl::StatusCode::kInvalidArgument) return 5;
      if (sim.ExportIpcEvent(0, opened).status().code() != absl::StatusCode::kInvalidArgument) return 6;
      return sim.DestroyStream(0, *stream).ok() ? 0 : 7;
    });
  }
  ::close(to_child[0]);
  SimDriver sim(Small());
  Event event = sim.CreateIpcEvent(0).value();
  const std::string handle = sim.ExportIpcEvent(0, event).value();
  ASSERT_TRUE(sim.RecordEvent(0, event, nullptr).ok());
  EXPECT_TRUE(WriteAll(to_child[1], handle.data(), handle.size()));
  ::close(to_child[1]);
  int status = -1;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the opener's exit status " << status;
  // The exporter's event is an event as any other here.
  EXPECT_TRUE(sim.QueryEvent(0, event).value());
  ASSERT_TRUE(sim.DestroyEvent(0, event).ok());
  EXPECT_EQ(IpcObjectsOfThisProcess(), 0);
  EXPECT_TRUE(sim.CheckNoLeaks().ok()) << sim.CheckNoLeaks();
}

TEST(SimDriverIpcEventTest, AWaitBeforeAnyRecordFails) {
  int to_child[2];
  int to_parent[2];
  ASSERT_EQ(::pipe2(to_child, O_CLOEXEC), 0);
  ASSERT_EQ(::pipe2(to_parent, O_CLOEXEC), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(to_child[1]);
    ::close(to_parent[0]);
    OpenInChild(to_child[0], [&](SimDriver& sim, Event opened) {
      absl::StatusOr<Stream> stream = sim.CreateStream(0);
      if (!stream.ok()) return 1;
      absl::Status early = sim.StreamWaitEvent(0, *stream, opened);
      if (early.code() != absl::StatusCode::kFailedPrecondition) return 2;
      if (early.message().find("never recorded") == absl::string_view::npos) return 3;
      // Told so, the exporter records; now the wait orders.
      char byte = 'w';
      if (!WriteAll(to_parent[1], &byte, 1) || !ReadAll(to_child[0], &byte, 1)) return 4;
      if (!sim.StreamWaitEvent(0, *stream, opened).ok()) return 5;
      return sim.DestroyStream(0, *stream).ok() ? 0 : 6;
    });
  }
  ::close(to_child[0]);
  ::close(to_parent[1]);
  SimDriver sim(Small());
  Event event = sim.CreateIpcEvent(0).value();
  const std::string handle = sim.ExportIpcEvent(0, event).value();
  EXPECT_TRUE(WriteAll(to_child[1], handle.data(), handle.size())) << "sent before its record";
  char byte = 0;
  EXPECT_TRUE(ReadAll(to_parent[0], &byte, 1));
  EXPECT_TRUE(sim.RecordEvent(0, event, nullptr).ok());
  EXPECT_TRUE(WriteAll(to_child[1], "r", 1));
  ::close(to_child[1]);
  ::close(to_parent[0]);
  int status = -1;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the opener's exit status " << status;
  ASSERT_TRUE(sim.DestroyEvent(0, event).ok());
  EXPECT_TRUE(sim.CheckNoLeaks().ok()) << sim.CheckNoLeaks();
}

TEST(SimDriverIpcEventTest, HandlesOfDestroyedOrForeignEventsDoNotOpen) {
  SimDriver sim(Small());
  Event event = sim.CreateIpcEvent(0).value();
  const std::string handle = sim.ExportIpcEvent(0, event).value();
  EXPECT_EQ(IpcObjectsOfThisProcess(), 1);
  std::string bad = handle;
  bad[0] ^= 1;
  EXPECT_EQ(sim.OpenIpcEvent(0, bad).status().code(), absl::StatusCode::kInvalidArgument) << "bad magic";
  bad = handle;
  bad[kIpcEventHandleBytes - 1] = 'x';
  EXPECT_EQ(sim.OpenIpcEvent(0, bad).status().code(), absl::StatusCode::kInvalidArgument) << "no zero padding";
  bad = handle;
  bad[9] = 'x';  // the name's prefix
  EXPECT_EQ(sim.OpenIpcEvent(0, bad).status().code(), absl::StatusCode::kInvalidArgument) << "not our name";
  EXPECT_EQ(sim.OpenIpcEvent(1, handle).status().code(), absl::StatusCode::kInvalidArgument) << "no device 1";
  ASSERT_TRUE(sim.DestroyEvent(0, event).ok());
  EXPECT_EQ(IpcObjectsOfThisProcess(), 0) << "the exporter's DestroyEvent unlinks it";
  absl::StatusOr<Event> gone = sim.OpenIpcEvent(0, handle);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kInvalidArgument) << gone.status();
  EXPECT_NE(gone.status().message().find("destroyed"), absl::string_view::npos) << gone.status();
  // Not by the driver that exported it, as CUDA refuses it in the exporting process; another
  // driver of this process stands for another process. Opened events are counted and
  // destroyed like events; one outlives its exporter's.
  event = sim.CreateIpcEvent(0).value();
  const std::string again = sim.ExportIpcEvent(0, event).value();
  absl::StatusOr<Event> own = sim.OpenIpcEvent(0, again);
  EXPECT_EQ(own.status().code(), absl::StatusCode::kFailedPrecondition) << own.status();
  EXPECT_NE(own.status().message().find("CUDA_ERROR_INVALID_CONTEXT"), absl::string_view::npos) << own.status();
  SimDriver peer(Small());
  Event opened = peer.OpenIpcEvent(0, again).value();
  Event opened_twice = peer.OpenIpcEvent(0, again).value();
  EXPECT_NE(opened, opened_twice);
  absl::Status leaks = peer.CheckNoLeaks();
  EXPECT_NE(leaks.message().find("2 event(s)"), absl::string_view::npos) << leaks;
  Stream stream = peer.CreateStream(0).value();
  EXPECT_EQ(peer.StreamWaitEvent(0, stream, opened).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(sim.RecordEvent(0, event, nullptr).ok());
  EXPECT_TRUE(peer.StreamWaitEvent(0, stream, opened).ok()) << "recorded now";
  EXPECT_EQ(peer.RecordEvent(0, opened, stream).code(), absl::StatusCode::kInvalidArgument) << "the exporter's to record";
  EXPECT_EQ(peer.ElapsedMs(0, opened, opened).status().code(), absl::StatusCode::kInvalidArgument) << "no timing";
  ASSERT_TRUE(sim.DestroyEvent(0, event).ok());
  EXPECT_TRUE(peer.QueryEvent(0, opened).value());
  ASSERT_TRUE(peer.DestroyEvent(0, opened).ok());
  ASSERT_TRUE(peer.DestroyEvent(0, opened_twice).ok());
  ASSERT_TRUE(peer.DestroyStream(0, stream).ok());
  EXPECT_TRUE(peer.CheckNoLeaks().ok()) << peer.CheckNoLeaks();
  EXPECT_TRUE(sim.CheckNoLeaks().ok()) << sim.CheckNoLeaks();
  // A driver torn down with an interprocess event alive unlinks it too.
  {
    SimDriver other(Small());
    ASSERT_TRUE(other.CreateIpcEvent(0).ok());
    EXPECT_EQ(IpcObjectsOfThisProcess(), 1);
  }
  EXPECT_EQ(IpcObjectsOfThisProcess(), 0);
}

TEST(SimDriverIpcEventTest, InjectedFailuresOfEachOperationLeaveNothingBehind) {
  for (DriverOp op : {DriverOp::kCreateIpcEvent, DriverOp::kExportIpcEvent, DriverOp::kOpenIpcEvent}) {
    SCOPED_TRACE(DriverOpName(op));
    SimDriver sim(Small());  // the exporter
    SimDriver peer(Small());  // the opener, as another process
    SimDriver& faulty = op == DriverOp::kOpenIpcEvent ? peer : sim;
    faulty.InjectFault(FaultRule{op, 1, 1, absl::StatusCode::kInternal});
    // Each step is tried until it passes: the first call of `op` fails, the second works.
    absl::StatusOr<Event> event = sim.CreateIpcEvent(0);
    if (op == DriverOp::kCreateIpcEvent) {
      EXPECT_EQ(event.status().code(), absl::StatusCode::kInternal);
      EXPECT_TRUE(sim.CheckNoLeaks().ok()) << sim.CheckNoLeaks();
      EXPECT_EQ(IpcObjectsOfThisProcess(), 0);
      event = sim.CreateIpcEvent(0);
    }
    ASSERT_TRUE(event.ok()) << event.status();
    absl::StatusOr<std::string> handle = sim.ExportIpcEvent(0, *event);
    if (op == DriverOp::kExportIpcEvent) {
      EXPECT_EQ(handle.status().code(), absl::StatusCode::kInternal);
      handle = sim.ExportIpcEvent(0, *event);
    }
    ASSERT_TRUE(handle.ok()) << handle.status();
    absl::StatusOr<Event> opened = peer.OpenIpcEvent(0, *handle);
    if (op == DriverOp::kOpenIpcEvent) {
      EXPECT_EQ(opened.status().code(), absl::StatusCode::kInternal);
      EXPECT_TRUE(peer.CheckNoLeaks().ok()) << peer.CheckNoLeaks();
      opened = peer.OpenIpcEvent(0, *handle);
    }
    ASSERT_TRUE(opened.ok()) << opened.status();
    ASSERT_TRUE(peer.DestroyEvent(0, *opened).ok());
    ASSERT_TRUE(sim.DestroyEvent(0, *event).ok());
    EXPECT_TRUE(sim.CheckNoLeaks().ok()) << sim.CheckNoLeaks();
    EXPECT_TRUE(peer.CheckNoLeaks().ok()) << peer.CheckNoLeaks();
    EXPECT_EQ(IpcObjectsOfThisProcess(), 0);
    const DriverCounters counters = faulty.Counters();
    EXPECT_EQ(counters.failed_calls, 1u);
    EXPECT_EQ(counters.Calls(op), 2u);
  }
  // And through the configuration's names.
  absl::StatusOr<std::vector<FaultRule>> rules = ParseFaultRules("open_ipc_event@1=invalid_argument");
  ASSERT_TRUE(rules.ok()) << rules.status();
  EXPECT_EQ((*rules)[0].op, DriverOp::kOpenIpcEvent);
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
