#include "vmm/driver_conformance.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "vmm/chunk.h"
#include "vmm/mapping.h"
#include "vmm/pinned_host_buffer.h"
#include "vmm/reservation.h"

namespace vmstash {
namespace {

using ::testing::HasSubstr;

constexpr int kDevice = 0;

#define ASSERT_OK(expr)                            \
  do {                                             \
    absl::Status s_ = (expr);                      \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_;   \
  } while (0)

template <typename T>
T Take(absl::StatusOr<T> v) {
  EXPECT_TRUE(v.ok()) << v.status();
  return std::move(v).value();
}

void FillPattern(void* dst, std::size_t n, std::uint32_t seed) {
  auto* p = static_cast<std::uint32_t*>(dst);
  for (std::size_t i = 0; i < n / 4; ++i) p[i] = seed * 2654435761u + static_cast<std::uint32_t>(i);
}

bool HasPattern(const void* src, std::size_t n, std::uint32_t seed) {
  const auto* p = static_cast<const std::uint32_t*>(src);
  for (std::size_t i = 0; i < n / 4; ++i) {
    if (p[i] != seed * 2654435761u + static_cast<std::uint32_t>(i)) return false;
  }
  return true;
}

bool AllBytes(const void* src, std::size_t n, std::uint8_t value) {
  const auto* p = static_cast<const std::uint8_t*>(src);
  for (std::size_t i = 0; i < n; ++i) {
    if (p[i] != value) return false;
  }
  return true;
}

}  // namespace

void DriverConformanceTest::SetUp() {
  absl::StatusOr<std::unique_ptr<Driver>> made = GetParam().make();
  if (!made.ok()) {
    if (!GetParam().required && made.status().code() == absl::StatusCode::kUnavailable) {
      GTEST_SKIP() << GetParam().name << " driver unavailable here: " << made.status();
    }
    FAIL() << "cannot create the " << GetParam().name << " driver: " << made.status();
  }
  driver_ = std::move(made).value();
  absl::StatusOr<int> count = driver_->DeviceCount();
  ASSERT_TRUE(count.ok()) << count.status();
  if (*count == 0 && !GetParam().required) GTEST_SKIP() << "no device";
  ASSERT_GT(*count, 0);
  absl::StatusOr<std::size_t> g = driver_->Granularity(kDevice, GranularityKind::kMinimum, {});
  ASSERT_TRUE(g.ok()) << g.status();
  granularity_ = *g;
}

void DriverConformanceTest::TearDown() {
  if (driver_ == nullptr) return;
  EXPECT_TRUE(driver_->CheckNoLeaks().ok()) << driver_->CheckNoLeaks();
  driver_.reset();
}

TEST_P(DriverConformanceTest, GranularityIsAPowerOfTwoAndHonoured) {
  const std::size_t g = granularity();
  EXPECT_GT(g, 0u);
  EXPECT_EQ(g & (g - 1), 0u);
  std::size_t recommended = Take(driver().Granularity(kDevice, GranularityKind::kRecommended, {}));
  EXPECT_EQ(recommended % g, 0u);
  // A reservation honours the alignment asked for.
  Reservation r = Take(Reservation::Create(&driver(), kDevice, 4 * g, 8 * g));
  EXPECT_EQ(r.address() % (8 * g), 0u);
  EXPECT_TRUE(r.Free().ok());
}

TEST_P(DriverConformanceTest, MemoryInfoIsConsistent) {
  DeviceMemoryInfo info = Take(driver().MemoryInfo(kDevice));
  EXPECT_GT(info.total_bytes, 0u);
  EXPECT_LE(info.free_bytes, info.total_bytes);
  const std::size_t size = 16 * granularity();
  Chunk chunk = Take(Chunk::Create(&driver(), kDevice, size));
  DeviceMemoryInfo after = Take(driver().MemoryInfo(kDevice));
  EXPECT_GE(info.free_bytes - after.free_bytes, size) << "creating a chunk must consume device memory";
}

TEST_P(DriverConformanceTest, DeviceUuidIsStableAndPerDevice) {
  const std::string uuid = Take(driver().DeviceUuid(kDevice));
  EXPECT_FALSE(uuid.empty());
  EXPECT_EQ(Take(driver().DeviceUuid(kDevice)), uuid);
  const int count = Take(driver().DeviceCount());
  if (count > 1) EXPECT_NE(Take(driver().DeviceUuid(1)), uuid);
  EXPECT_EQ(driver().DeviceUuid(count).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver().DeviceUuid(-1).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_P(DriverConformanceTest, BadSizesAreInvalidArgumentNamingTheValue) {
  const std::size_t g = granularity();
  absl::StatusOr<DevicePtr> va = driver().ReserveAddress(kDevice, 0, 0);
  EXPECT_EQ(va.status().code(), absl::StatusCode::kInvalidArgument);
  va = driver().ReserveAddress(kDevice, g + 4096, 0);
  EXPECT_EQ(va.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(va.status().message()), HasSubstr(std::to_string(g + 4096)));
  va = driver().ReserveAddress(kDevice, g, 3 * g);
  EXPECT_EQ(va.status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<ChunkHandle> chunk = driver().CreateChunk(kDevice, 0, {});
  EXPECT_EQ(chunk.status().code(), absl::StatusCode::kInvalidArgument);
  chunk = driver().CreateChunk(kDevice, g / 2, {});
  EXPECT_EQ(chunk.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(chunk.status().message()), HasSubstr(std::to_string(g / 2)));
  chunk = driver().CreateChunk(-1, g, {});
  EXPECT_EQ(chunk.status().code(), absl::StatusCode::kInvalidArgument);
  int count = Take(driver().DeviceCount());
  chunk = driver().CreateChunk(count, g, {});
  EXPECT_EQ(chunk.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(chunk.status().message()), HasSubstr(std::to_string(count)));
  EXPECT_EQ(driver().HostAlloc(kDevice, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_P(DriverConformanceTest, UnknownHandlesAreInvalidArgument) {
  EXPECT_EQ(driver().ReleaseChunk(0xdead0000).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver().ExportChunkFd(0xdead0000).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver().FreeAddress(kDevice, 0xdead0000, granularity()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver().Unmap(kDevice, 0xdead0000, granularity()).code(), absl::StatusCode::kInvalidArgument);
  int stack_value = 0;
  EXPECT_EQ(driver().HostFree(kDevice, &stack_value).code(), absl::StatusCode::kInvalidArgument);
  Chunk chunk = Take(Chunk::Create(&driver(), kDevice, granularity()));
  ChunkHandle handle = chunk.handle();
  ASSERT_OK(chunk.Release());
  EXPECT_EQ(driver().ReleaseChunk(handle).code(), absl::StatusCode::kInvalidArgument) << "double release";
}

TEST_P(DriverConformanceTest, MapTakesWholeChunksInsideAReservationOnly) {
  const std::size_t g = granularity();
  Reservation r = Take(Reservation::Create(&driver(), kDevice, 8 * g));
  Chunk chunk = Take(Chunk::Create(&driver(), kDevice, 2 * g));
  // A partial chunk is rejected.
  absl::Status s = driver().Map(r.address(), g, chunk.handle());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // Misaligned address.
  s = driver().Map(r.address() + g / 2, 2 * g, chunk.handle());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // Running past the end of the reservation.
  s = driver().Map(r.address() + 7 * g, 2 * g, chunk.handle());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // Unknown chunk.
  s = driver().Map(r.address(), 2 * g, 0xdead0000);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // Overlap with an existing mapping.
  ASSERT_OK(driver().Map(r.address(), 2 * g, chunk.handle()));
  Chunk other = Take(Chunk::Create(&driver(), kDevice, 2 * g));
  s = driver().Map(r.address() + g, 2 * g, other.handle());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  // Unmap must name exactly one mapping.
  EXPECT_EQ(driver().Unmap(kDevice, r.address(), g).code(), absl::StatusCode::kInvalidArgument);
  // A reservation with a mapping inside cannot be freed.
  EXPECT_EQ(r.Free().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_OK(driver().Unmap(kDevice, r.address(), 2 * g));
}

TEST_P(DriverConformanceTest, AnImportedChunkIsTheSamePhysicalMemory) {
  ChunkOptions shareable;
  shareable.shareable_fd = true;
  const std::size_t size = Take(driver().Granularity(kDevice, GranularityKind::kMinimum, shareable));
  ChunkHandle exported = Take(driver().CreateChunk(kDevice, size, shareable));
  const int fd = Take(driver().ExportChunkFd(exported));
  ChunkHandle imported = Take(driver().ImportChunkFd(kDevice, fd, size));
  ::close(fd);  // the import holds its own reference
  EXPECT_NE(imported, exported);
  Reservation a = Take(Reservation::Create(&driver(), kDevice, size));
  Reservation b = Take(Reservation::Create(&driver(), kDevice, size));
  ASSERT_OK(driver().Map(a.address(), size, exported));
  ASSERT_OK(driver().Map(b.address(), size, imported));
  ASSERT_OK(driver().SetAccess(a.address(), size, kDevice));
  ASSERT_OK(driver().SetAccess(b.address(), size, kDevice));
  PinnedHostBuffer host = Take(PinnedHostBuffer::Allocate(&driver(), kDevice, size));
  Stream stream = Take(driver().CreateStream(kDevice));
  FillPattern(host.data(), size, 41);
  ASSERT_OK(driver().CopyToDeviceAsync(kDevice, a.address(), host.data(), size, stream));
  ASSERT_OK(driver().SynchronizeStream(kDevice, stream));
  std::memset(host.data(), 0, size);
  ASSERT_OK(driver().CopyToHostAsync(kDevice, host.data(), b.address(), size, stream));
  ASSERT_OK(driver().SynchronizeStream(kDevice, stream));
  EXPECT_TRUE(HasPattern(host.data(), size, 41)) << "written through one handle, read through the other";
  // The exporter's handle released: the imported one keeps the memory.
  ASSERT_OK(driver().Unmap(kDevice, a.address(), size));
  ASSERT_OK(driver().ReleaseChunk(exported));
  std::memset(host.data(), 0, size);
  ASSERT_OK(driver().CopyToHostAsync(kDevice, host.data(), b.address(), size, stream));
  ASSERT_OK(driver().SynchronizeStream(kDevice, stream));
  EXPECT_TRUE(HasPattern(host.data(), size, 41));
  // The imported chunk exports again (passed on to a third holder), with the exporter gone.
  const int again_fd = Take(driver().ExportChunkFd(imported));
  ChunkHandle again = Take(driver().ImportChunkFd(kDevice, again_fd, size));
  ::close(again_fd);
  ASSERT_OK(driver().Unmap(kDevice, b.address(), size));
  ASSERT_OK(driver().ReleaseChunk(imported));
  ASSERT_OK(driver().Map(b.address(), size, again));
  ASSERT_OK(driver().SetAccess(b.address(), size, kDevice));
  std::memset(host.data(), 0, size);
  ASSERT_OK(driver().CopyToHostAsync(kDevice, host.data(), b.address(), size, stream));
  ASSERT_OK(driver().SynchronizeStream(kDevice, stream));
  EXPECT_TRUE(HasPattern(host.data(), size, 41)) << "the same memory, through a descriptor passed on";
  ASSERT_OK(driver().Unmap(kDevice, b.address(), size));
  ASSERT_OK(driver().ReleaseChunk(again));
  ASSERT_OK(driver().DestroyStream(kDevice, stream));
}

TEST_P(DriverConformanceTest, ImportRefusesBadArguments) {
  ChunkOptions shareable;
  shareable.shareable_fd = true;
  const std::size_t size = Take(driver().Granularity(kDevice, GranularityKind::kMinimum, shareable));
  EXPECT_EQ(driver().ImportChunkFd(kDevice, -1, size).status().code(), absl::StatusCode::kInvalidArgument);
  ChunkHandle exported = Take(driver().CreateChunk(kDevice, size, shareable));
  const int fd = Take(driver().ExportChunkFd(exported));
  EXPECT_EQ(driver().ImportChunkFd(kDevice, fd, size / 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver().ImportChunkFd(kDevice, fd, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver().ImportChunkFd(-1, fd, size).status().code(), absl::StatusCode::kInvalidArgument);
  // One descriptor imported twice: two handles, each released on its own.
  ChunkHandle first = Take(driver().ImportChunkFd(kDevice, fd, size));
  ChunkHandle second = Take(driver().ImportChunkFd(kDevice, fd, size));
  EXPECT_NE(first, second);
  ASSERT_OK(driver().ReleaseChunk(first));
  ASSERT_OK(driver().ReleaseChunk(second));
  ::close(fd);
  ASSERT_OK(driver().ReleaseChunk(exported));
}

TEST_P(DriverConformanceTest, RemapAtTheSameAddressFollowsThePhysicalChunk) {
  const std::size_t g = granularity();
  const std::size_t size = 4 * g;
  Reservation home = Take(Reservation::Create(&driver(), kDevice, size));
  Reservation scratch = Take(Reservation::Create(&driver(), kDevice, size));
  const DevicePtr va = home.address();
  PinnedHostBuffer host = Take(PinnedHostBuffer::Allocate(&driver(), kDevice, size));
  Stream stream = Take(driver().CreateStream(kDevice));

  Chunk first = Take(Chunk::Create(&driver(), kDevice, size));
  {
    Mapping m = Take(Mapping::Create(&driver(), kDevice, va, absl::MakeConstSpan(&first, 1)));
    FillPattern(host.data(), size, 7);
    ASSERT_OK(driver().CopyToDeviceAsync(kDevice, va, host.data(), size, stream));
    // Pinned copies are truly asynchronous: the source must not change until they finish.
    ASSERT_OK(driver().SynchronizeStream(kDevice, stream));
    std::memset(host.data(), 0, size);
    ASSERT_OK(driver().CopyToHostAsync(kDevice, host.data(), va, size, stream));
    ASSERT_OK(driver().SynchronizeStream(kDevice, stream));
    ASSERT_TRUE(HasPattern(host.data(), size, 7));
    ASSERT_OK(m.Unmap());
  }
  // A fresh chunk, zeroed elsewhere, then mapped at the same VA: the old bytes are gone.
  Chunk second = Take(Chunk::Create(&driver(), kDevice, size));
  {
    Mapping m = Take(Mapping::Create(&driver(), kDevice, scratch.address(), absl::MakeConstSpan(&second, 1)));
    ASSERT_OK(driver().MemsetAsync(kDevice, scratch.address(), 0, size, stream));
    ASSERT_OK(driver().SynchronizeStream(kDevice, stream));
  }
  {
    Mapping m = Take(Mapping::Create(&driver(), kDevice, va, absl::MakeConstSpan(&second, 1)));
    EXPECT_EQ(m.address(), va);
    ASSERT_OK(driver().CopyToHostAsync(kDevice, host.data(), va, size, stream));
    ASSERT_OK(driver().SynchronizeStream(kDevice, stream));
    EXPECT_TRUE(AllBytes(host.data(), size, 0)) << "data written before unmap must not survive a fresh chunk";
  }
  // The first chunk still holds its bytes, wherever it is mapped.
  {
    Mapping m = Take(Mapping::Create(&driver(), kDevice, scratch.address(), absl::MakeConstSpan(&first, 1)));
    ASSERT_OK(driver().CopyToHostAsync(kDevice, host.data(), scratch.address(), size, stream));
    ASSERT_OK(driver().SynchronizeStream(kDevice, stream));
    EXPECT_TRUE(HasPattern(host.data(), size, 7));
  }
  ASSERT_OK(driver().DestroyStream(kDevice, stream));
}

TEST_P(DriverConformanceTest, DataRestoredFromAPinnedBufferAtTheSameAddress) {
  const std::size_t g = granularity();
  const std::size_t size = 6 * g;
  Reservation r = Take(Reservation::Create(&driver(), kDevice, 2 * size));
  const DevicePtr va = r.address() + 2 * g;  // not at the reservation's start
  PinnedHostBuffer backup = Take(PinnedHostBuffer::Allocate(&driver(), kDevice, size));
  PinnedHostBuffer check = Take(PinnedHostBuffer::Allocate(&driver(), kDevice, size));
  Stream stream = Take(driver().CreateStream(kDevice));

  std::vector<Chunk> chunks;
  for (int i = 0; i < 3; ++i) chunks.push_back(Take(Chunk::Create(&driver(), kDevice, 2 * g)));
  Mapping m = Take(Mapping::Create(&driver(), kDevice, va, chunks));
  ASSERT_EQ(m.pieces().size(), 3u);
  FillPattern(check.data(), size, 11);
  // One copy spanning all three chunks.
  ASSERT_OK(driver().CopyToDeviceAsync(kDevice, va, check.data(), size, stream));
  // "Pause": back up, unmap, release.
  ASSERT_OK(driver().CopyToHostAsync(kDevice, backup.data(), va, size, stream));
  ASSERT_OK(driver().SynchronizeStream(kDevice, stream));
  ASSERT_OK(m.Unmap());
  chunks.clear();
  // "Resume" in one chunk (re-chunking is allowed), restore, verify.
  std::vector<Chunk> fresh;
  fresh.push_back(Take(Chunk::Create(&driver(), kDevice, size)));
  Mapping again = Take(Mapping::Create(&driver(), kDevice, va, fresh));
  EXPECT_EQ(again.address(), va);
  ASSERT_OK(driver().CopyToDeviceAsync(kDevice, va, backup.data(), size, stream));
  std::memset(check.data(), 0, size);
  ASSERT_OK(driver().CopyToHostAsync(kDevice, check.data(), va, size, stream));
  ASSERT_OK(driver().SynchronizeStream(kDevice, stream));
  EXPECT_TRUE(HasPattern(check.data(), size, 11));
  ASSERT_OK(again.Unmap());
  ASSERT_OK(driver().DestroyStream(kDevice, stream));
}

TEST_P(DriverConformanceTest, ReleasedChunkLivesUntilItsLastUnmap) {
  const std::size_t g = granularity();
  Reservation r = Take(Reservation::Create(&driver(), kDevice, 2 * g));
  PinnedHostBuffer host = Take(PinnedHostBuffer::Allocate(&driver(), kDevice, 2 * g));
  Chunk chunk = Take(Chunk::Create(&driver(), kDevice, 2 * g));
  Mapping m = Take(Mapping::Create(&driver(), kDevice, r.address(), absl::MakeConstSpan(&chunk, 1)));
  FillPattern(host.data(), 2 * g, 3);
  ASSERT_OK(driver().CopyToDeviceAsync(kDevice, r.address(), host.data(), 2 * g, nullptr));
  ASSERT_OK(driver().SynchronizeStream(kDevice, nullptr));
  ASSERT_OK(chunk.Release());
  std::memset(host.data(), 0, 2 * g);
  ASSERT_OK(driver().CopyToHostAsync(kDevice, host.data(), r.address(), 2 * g, nullptr));
  ASSERT_OK(driver().SynchronizeStream(kDevice, nullptr));
  EXPECT_TRUE(HasPattern(host.data(), 2 * g, 3));
  ASSERT_OK(m.Unmap());
}

TEST_P(DriverConformanceTest, OutOfMemoryIsResourceExhausted) {
  const std::size_t g = granularity();
  DeviceMemoryInfo info = Take(driver().MemoryInfo(kDevice));
  const std::size_t too_big = (info.total_bytes / g + 1) * g;
  absl::StatusOr<ChunkHandle> chunk = driver().CreateChunk(kDevice, too_big, {});
  EXPECT_EQ(chunk.status().code(), absl::StatusCode::kResourceExhausted) << chunk.status();
  // The failed call left nothing behind, and the device still works.
  Chunk ok = Take(Chunk::Create(&driver(), kDevice, g));
  EXPECT_TRUE(ok.valid());
}

TEST_P(DriverConformanceTest, ShareableChunksExportAFileDescriptor) {
  const std::size_t g = Take(driver().Granularity(kDevice, GranularityKind::kMinimum, {true, false}));
  Chunk shareable = Take(Chunk::Create(&driver(), kDevice, g, ChunkOptions{true, false}));
  int fd = Take(shareable.ExportFd());
  EXPECT_GE(fd, 0);
  if (fd >= 0) ::close(fd);
  Chunk plain = Take(Chunk::Create(&driver(), kDevice, granularity()));
  EXPECT_EQ(plain.ExportFd().status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_P(DriverConformanceTest, RdmaChunksAreCreatedOrUnimplemented) {
  absl::StatusOr<ChunkHandle> chunk = driver().CreateChunk(kDevice, granularity(), ChunkOptions{false, true});
  if (chunk.ok()) {
    ASSERT_OK(driver().ReleaseChunk(*chunk));
  } else {
    EXPECT_EQ(chunk.status().code(), absl::StatusCode::kUnimplemented) << chunk.status();
  }
}

TEST_P(DriverConformanceTest, StreamsAndEventsOrderWork) {
  const std::size_t g = granularity();
  Reservation r = Take(Reservation::Create(&driver(), kDevice, 2 * g));
  Chunk chunk = Take(Chunk::Create(&driver(), kDevice, 2 * g));
  Mapping m = Take(Mapping::Create(&driver(), kDevice, r.address(), absl::MakeConstSpan(&chunk, 1)));
  PinnedHostBuffer host = Take(PinnedHostBuffer::Allocate(&driver(), kDevice, 2 * g));
  Stream a = Take(driver().CreateStream(kDevice));
  Stream b = Take(driver().CreateStream(kDevice));
  Event start = Take(driver().CreateEvent(kDevice, true));
  Event end = Take(driver().CreateEvent(kDevice, true));
  ASSERT_OK(driver().RecordEvent(kDevice, start, a));
  ASSERT_OK(driver().MemsetAsync(kDevice, r.address(), 0x5a, 2 * g, a));
  ASSERT_OK(driver().RecordEvent(kDevice, end, a));
  // b waits for a's memset, then reads.
  ASSERT_OK(driver().StreamWaitEvent(kDevice, b, end));
  ASSERT_OK(driver().CopyToHostAsync(kDevice, host.data(), r.address(), 2 * g, b));
  ASSERT_OK(driver().SynchronizeStream(kDevice, b));
  EXPECT_TRUE(AllBytes(host.data(), 2 * g, 0x5a));
  ASSERT_OK(driver().SynchronizeEvent(kDevice, end));
  EXPECT_TRUE(Take(driver().QueryEvent(kDevice, end)));
  EXPECT_GE(Take(driver().ElapsedMs(kDevice, start, end)), 0.0f);
  ASSERT_OK(driver().SynchronizeDevice(kDevice));
  ASSERT_OK(driver().DestroyEvent(kDevice, start));
  ASSERT_OK(driver().DestroyEvent(kDevice, end));
  ASSERT_OK(driver().DestroyStream(kDevice, a));
  ASSERT_OK(driver().DestroyStream(kDevice, b));
}

namespace {

// Interprocess events cross to another process: this test binary again (fork + exec,
// the only way to a fresh CUDA context: a forked child cannot use CUDA), filtered to
// OpensAnEventOfAnotherProcess of the same driver, with the handle in its environment.
constexpr char kIpcHandleEnv[] = "VMSTASH_CONFORMANCE_IPC_EVENT";  // the handle, in hex
constexpr char kIpcReportEnv[] = "VMSTASH_CONFORMANCE_IPC_REPORT_FD";  // "ok" goes there when it passed

std::string ToHex(const std::string& bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += kDigits[c >> 4];
    out += kDigits[c & 15];
  }
  return out;
}

std::string FromHex(absl::string_view hex) {
  auto value = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  std::string out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2) out += static_cast<char>(value(hex[i]) * 16 + value(hex[i + 1]));
  return out;
}

// Runs OpensAnEventOfAnotherProcess of this instantiation in another process with `handle`;
// OK when it passed there.
absl::Status PassesInAnotherProcess(const std::string& handle) {
  const ::testing::TestInfo* me = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string name = me->name();  // "Case/param"
  const std::size_t slash = name.find('/');
  const std::string filter = std::string("--gtest_filter=") + me->test_suite_name() +
                             ".OpensAnEventOfAnotherProcess" + (slash == std::string::npos ? "" : name.substr(slash));
  char exe[4096] = {};
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n <= 0) return absl::InternalError("readlink(/proc/self/exe) failed");
  int report[2];
  if (::pipe(report) != 0) return absl::InternalError("pipe failed");
  ::fcntl(report[0], F_SETFD, FD_CLOEXEC);  // the write end stays open across exec
  // A new process image (posix_spawn): a forked copy of this one could not use CUDA.
  std::vector<std::string> env = {std::string(kIpcHandleEnv) + "=" + ToHex(handle),
                                  std::string(kIpcReportEnv) + "=" + std::to_string(report[1])};
  for (char** e = environ; *e != nullptr; ++e) {
    const absl::string_view var(*e);
    // Not the runner's sharding and report files: the child is no part of this run.
    if (var.substr(0, 6) == "GTEST_" || var.substr(0, 16) == "XML_OUTPUT_FILE=" ||
        var.substr(0, 24) == "TEST_PREMATURE_EXIT_FILE" || var.substr(0, 22) == "TEST_SHARD_STATUS_FILE") {
      continue;
    }
    env.emplace_back(var);
  }
  std::vector<char*> envp;
  for (std::string& v : env) envp.push_back(&v[0]);
  envp.push_back(nullptr);
  std::string arg0 = exe;
  std::string arg1 = filter;
  char* argv[] = {&arg0[0], &arg1[0], nullptr};
  pid_t child = -1;
  const int spawned = ::posix_spawn(&child, exe, nullptr, nullptr, argv, envp.data());
  ::close(report[1]);
  std::string said;
  char buf[16];
  for (ssize_t got; (got = ::read(report[0], buf, sizeof(buf))) > 0;) said.append(buf, static_cast<std::size_t>(got));
  ::close(report[0]);
  if (spawned != 0) return absl::InternalError(absl::StrCat("posix_spawn failed: ", std::strerror(spawned)));
  int status = -1;
  ::waitpid(child, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || said != "ok") {
    return absl::InternalError(absl::StrCat(filter, " in another process: exit status ", status, ", reported '",
                                            said, "'"));
  }
  return absl::OkStatus();
}

}  // namespace

TEST_P(DriverConformanceTest, InterprocessEventsOrderWorkAcrossProcesses) {
  const std::size_t g = granularity();
  const DriverCounters before = driver().Counters();
  Reservation r = Take(Reservation::Create(&driver(), kDevice, 2 * g));
  Chunk chunk = Take(Chunk::Create(&driver(), kDevice, 2 * g));
  Mapping m = Take(Mapping::Create(&driver(), kDevice, r.address(), absl::MakeConstSpan(&chunk, 1)));
  PinnedHostBuffer host = Take(PinnedHostBuffer::Allocate(&driver(), kDevice, 2 * g));
  Stream a = Take(driver().CreateStream(kDevice));
  Stream b = Take(driver().CreateStream(kDevice));
  Event exported = Take(driver().CreateIpcEvent(kDevice));
  const std::string handle = Take(driver().ExportIpcEvent(kDevice, exported));
  EXPECT_EQ(handle.size(), kIpcEventHandleBytes);
  ASSERT_OK(driver().MemsetAsync(kDevice, r.address(), 0x3c, 2 * g, a));
  ASSERT_OK(driver().RecordEvent(kDevice, exported, a));
  // The handle crosses after the record; another process waits for it.
  ASSERT_OK(PassesInAnotherProcess(handle));
  // Here it is an event as any other: b waits for a's memset, then reads.
  ASSERT_OK(driver().StreamWaitEvent(kDevice, b, exported));
  ASSERT_OK(driver().CopyToHostAsync(kDevice, host.data(), r.address(), 2 * g, b));
  ASSERT_OK(driver().SynchronizeStream(kDevice, b));
  EXPECT_TRUE(AllBytes(host.data(), 2 * g, 0x3c));
  ASSERT_OK(driver().SynchronizeEvent(kDevice, exported));
  EXPECT_TRUE(Take(driver().QueryEvent(kDevice, exported)));
  // Interprocess events keep no time.
  EXPECT_EQ(driver().ElapsedMs(kDevice, exported, exported).status().code(), absl::StatusCode::kInvalidArgument);
  // Not in the process that exported it (CUDA: CUDA_ERROR_INVALID_CONTEXT).
  absl::StatusOr<Event> here = driver().OpenIpcEvent(kDevice, handle);
  EXPECT_EQ(here.status().code(), absl::StatusCode::kFailedPrecondition) << here.status();
  if (here.ok()) ASSERT_OK(driver().DestroyEvent(kDevice, *here));
  // Malformed handles.
  EXPECT_EQ(driver().OpenIpcEvent(kDevice, handle.substr(0, kIpcEventHandleBytes - 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(driver().OpenIpcEvent(kDevice, handle + "x").status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<Event> empty = driver().OpenIpcEvent(kDevice, "");
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(empty.status().message()), HasSubstr(std::to_string(kIpcEventHandleBytes)));
  // Only an event made by CreateIpcEvent exports.
  Event plain = Take(driver().CreateEvent(kDevice, false));
  EXPECT_EQ(driver().ExportIpcEvent(kDevice, plain).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_OK(driver().DestroyEvent(kDevice, plain));
  ASSERT_OK(driver().DestroyEvent(kDevice, exported));
  EXPECT_EQ(driver().ExportIpcEvent(kDevice, exported).status().code(), absl::StatusCode::kInvalidArgument)
      << "destroyed";
  ASSERT_OK(driver().DestroyStream(kDevice, a));
  ASSERT_OK(driver().DestroyStream(kDevice, b));
  const DriverCounters after = driver().Counters();
  EXPECT_EQ(after.Calls(DriverOp::kCreateIpcEvent) - before.Calls(DriverOp::kCreateIpcEvent), 1u);
  EXPECT_EQ(after.Calls(DriverOp::kExportIpcEvent) - before.Calls(DriverOp::kExportIpcEvent), 3u);
  EXPECT_EQ(after.Calls(DriverOp::kOpenIpcEvent) - before.Calls(DriverOp::kOpenIpcEvent), 4u);
}

// The other process of InterprocessEventsOrderWorkAcrossProcesses; skipped anywhere else.
TEST_P(DriverConformanceTest, OpensAnEventOfAnotherProcess) {
  const char* hex = std::getenv(kIpcHandleEnv);
  const char* report = std::getenv(kIpcReportEnv);
  if (hex == nullptr || report == nullptr) {
    GTEST_SKIP() << "runs in the other process of InterprocessEventsOrderWorkAcrossProcesses";
  }
  Event opened = Take(driver().OpenIpcEvent(kDevice, FromHex(hex)));
  Stream stream = Take(driver().CreateStream(kDevice));
  ASSERT_OK(driver().StreamWaitEvent(kDevice, stream, opened));
  ASSERT_OK(driver().SynchronizeStream(kDevice, stream));
  ASSERT_OK(driver().SynchronizeEvent(kDevice, opened));
  EXPECT_TRUE(Take(driver().QueryEvent(kDevice, opened)));
  EXPECT_EQ(driver().ExportIpcEvent(kDevice, opened).status().code(), absl::StatusCode::kInvalidArgument)
      << "an opened event is not made by CreateIpcEvent";
  ASSERT_OK(driver().DestroyStream(kDevice, stream));
  ASSERT_OK(driver().DestroyEvent(kDevice, opened));
  ASSERT_OK(driver().CheckNoLeaks());
  if (!HasFailure()) EXPECT_EQ(::write(std::atoi(report), "ok", 2), 2);
}

TEST_P(DriverConformanceTest, RegisteredHostMemoryCopies) {
  const std::size_t g = granularity();
  const long page = ::sysconf(_SC_PAGESIZE);
  void* raw = std::aligned_alloc(static_cast<std::size_t>(page), g);
  ASSERT_NE(raw, nullptr);
  {
    PinnedHostBuffer registered = Take(PinnedHostBuffer::Register(&driver(), kDevice, raw, g));
    EXPECT_TRUE(registered.registered());
    EXPECT_EQ(driver().HostRegister(kDevice, raw, g).code(), absl::StatusCode::kFailedPrecondition)
        << "registering twice";
    Reservation r = Take(Reservation::Create(&driver(), kDevice, g));
    Chunk chunk = Take(Chunk::Create(&driver(), kDevice, g));
    Mapping m = Take(Mapping::Create(&driver(), kDevice, r.address(), absl::MakeConstSpan(&chunk, 1)));
    FillPattern(raw, g, 5);
    ASSERT_OK(driver().CopyToDeviceAsync(kDevice, r.address(), raw, g, nullptr));
    ASSERT_OK(driver().SynchronizeStream(kDevice, nullptr));
    std::memset(raw, 0, g);
    ASSERT_OK(driver().CopyToHostAsync(kDevice, raw, r.address(), g, nullptr));
    ASSERT_OK(driver().SynchronizeStream(kDevice, nullptr));
    EXPECT_TRUE(HasPattern(raw, g, 5));
  }
  std::free(raw);
}

}  // namespace vmstash
