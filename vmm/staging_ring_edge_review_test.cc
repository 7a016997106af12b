// Review of StagingRing (Note [Staging Ring]) and HostCopyPool at their edges: empty,
// unaligned and larger-than-the-ring copies, copies ending at the destination's last byte,
// directions and streams interleaved on reused slots (the sim's ordering checker), Free()
// refused and retried, and the shared pool in a forked child.
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "vmm/host_copy_pool.h"
#include "vmm/sim_driver.h"
#include "vmm/staging_ring.h"

namespace vmstash {
namespace {

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kSlot = 64 * kKiB;
constexpr int kSlots = 3;

std::vector<char> Pattern(std::size_t n, int seed) {
  std::vector<char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<char>((i * 131 + i / 4096 + seed * 7) & 0xff);
  return v;
}

class StagingRingReviewTest : public ::testing::Test {
 protected:
  void SetUp() override {
    va_ = sim_.ReserveAddress(0, size_, 0).value();
    chunk_ = sim_.CreateChunk(0, size_, {}).value();
    ASSERT_TRUE(sim_.Map(va_, size_, chunk_).ok());
    ASSERT_TRUE(sim_.SetAccess(va_, size_, 0).ok());
    a_ = sim_.CreateStream(0).value();
    b_ = sim_.CreateStream(0).value();
    pattern_ = Pattern(size_, 1);
    ASSERT_TRUE(sim_.CopyToDeviceAsync(0, va_, pattern_.data(), size_, a_).ok());
    ASSERT_TRUE(sim_.SynchronizeDevice(0).ok());
  }
  void TearDown() override {
    ASSERT_TRUE(sim_.SynchronizeDevice(0).ok());
    EXPECT_TRUE(sim_.CheckOrdering().ok()) << sim_.CheckOrdering();
    ASSERT_TRUE(sim_.DestroyStream(0, a_).ok());
    ASSERT_TRUE(sim_.DestroyStream(0, b_).ok());
    ASSERT_TRUE(sim_.Unmap(0, va_, size_).ok());
    ASSERT_TRUE(sim_.ReleaseChunk(chunk_).ok());
    ASSERT_TRUE(sim_.FreeAddress(0, va_, size_).ok());
    EXPECT_TRUE(sim_.CheckNoLeaks().ok()) << sim_.CheckNoLeaks();
  }
  std::vector<char> Device() {
    std::vector<char> out(size_);
    EXPECT_TRUE(sim_.CopyToHostAsync(0, out.data(), va_, size_, a_).ok());
    EXPECT_TRUE(sim_.SynchronizeStream(0, a_).ok());
    return out;
  }

  SimDriver sim_;
  HostCopyPool pool_{4};
  std::size_t size_ = 2 * std::size_t{1} << 20;  // 32 slots' worth: wraps the ring ~10 times
  DevicePtr va_ = 0;
  ChunkHandle chunk_ = 0;
  Stream a_ = nullptr, b_ = nullptr;
  std::vector<char> pattern_;
};

// Zero-size copies queue nothing and make no ring; Finish and Abandon of a ring never
// used are no-ops; a copy of the whole range (larger than the ring) and one ending at the
// destination's last byte (a guard page after it) arrive whole.
TEST_F(StagingRingReviewTest, EmptyHugeAndEndOfBufferCopies) {
  StagingRing ring(&sim_, 0, &pool_, kSlot, kSlots);
  const DriverCounters before = sim_.Counters();
  ASSERT_TRUE(ring.ToHost(nullptr, va_, 0, a_).ok());
  ASSERT_TRUE(ring.ToDevice(va_, nullptr, 0, a_).ok());
  ASSERT_TRUE(ring.Finish().ok());
  ring.Abandon();
  EXPECT_EQ(ring.held_bytes(), 0u);
  EXPECT_EQ(sim_.Counters().Calls(DriverOp::kHostAlloc), before.Calls(DriverOp::kHostAlloc));

  // The destination ends exactly at a PROT_NONE page: any byte past it faults.
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::size_t span = (size_ + page - 1) / page * page + page;
  char* map = static_cast<char*>(mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(map, MAP_FAILED);
  ASSERT_EQ(mprotect(map + span - page, page, PROT_NONE), 0);
  const std::size_t odd = size_ - 3;  // unaligned size and start
  char* dst = map + span - page - odd;
  ASSERT_TRUE(ring.ToHost(dst, va_ + 3, odd, a_).ok());
  ASSERT_TRUE(sim_.SynchronizeStream(0, a_).ok());
  ASSERT_TRUE(ring.Finish().ok());
  EXPECT_EQ(std::memcmp(dst, pattern_.data() + 3, odd), 0);
  // Back: the last byte of the device range from the last byte of the buffer.
  std::vector<char> zeros(size_, 0);
  ASSERT_TRUE(sim_.CopyToDeviceAsync(0, va_, zeros.data(), size_, a_).ok());
  ASSERT_TRUE(ring.ToDevice(va_ + 3, dst, odd, a_).ok());
  ASSERT_TRUE(ring.ToDevice(va_, pattern_.data(), 3, a_).ok());
  EXPECT_EQ(Device(), pattern_);
  munmap(map, span);
}

// Directions and streams interleaved, small pieces: ToDevice on A, ToHost on B, reusing
// the same few slots many times over; the slot bytes never get mixed up, and the sim's
// ordering checker is clean.
TEST_F(StagingRingReviewTest, InterleavedDirectionsAndStreamsReuseSlotsSafely) {
  StagingRing ring(&sim_, 0, &pool_, kSlot, kSlots);
  const std::vector<char> other = Pattern(size_, 9);
  std::vector<char> host(size_, 0);
  const std::size_t half = size_ / 2;
  // First half of the device gets `other` through the ring on A while the second half
  // (still pattern_) goes to host through the ring on B, piece by piece.
  const std::size_t piece = 40 * kKiB + 7;
  for (std::size_t at = 0; at < half; at += piece) {
    const std::size_t n = std::min(piece, half - at);
    ASSERT_TRUE(ring.ToDevice(va_ + at, other.data() + at, n, a_).ok());
    ASSERT_TRUE(ring.ToHost(host.data() + half + at, va_ + half + at, n, b_).ok());
  }
  ASSERT_TRUE(sim_.SynchronizeStream(0, a_).ok());
  ASSERT_TRUE(sim_.SynchronizeStream(0, b_).ok());
  ASSERT_TRUE(ring.Finish().ok());
  EXPECT_FALSE(ring.has_pending());
  EXPECT_EQ(std::memcmp(host.data() + half, pattern_.data() + half, half), 0);
  std::vector<char> device = Device();
  EXPECT_EQ(std::memcmp(device.data(), other.data(), half), 0);
  EXPECT_EQ(std::memcmp(device.data() + half, pattern_.data() + half, half), 0);
}

// Held streams: ToHost slots on a held stream are waited for before reuse, and a
// ToDevice on another stream that takes a slot a held ToHost copy still writes waits too.
TEST_F(StagingRingReviewTest, HeldStreamsAreWaitedForBeforeASlotChangesHands) {
  StagingRing ring(&sim_, 0, &pool_, kSlot, kSlots);
  std::vector<char> host(size_, 0);
  sim_.HoldStream(0, a_);
  ASSERT_TRUE(ring.ToHost(host.data(), va_, kSlot * kSlots, a_).ok());
  EXPECT_TRUE(sim_.StreamHeld(0, a_));
  const std::vector<char> other = Pattern(kSlot, 5);
  ASSERT_TRUE(ring.ToDevice(va_ + size_ - kSlot, other.data(), kSlot, b_).ok());  // takes slot 0 again
  EXPECT_FALSE(sim_.StreamHeld(0, a_)) << "a slot changed hands while the held copy into it was pending";
  ASSERT_TRUE(sim_.SynchronizeDevice(0).ok());
  ASSERT_TRUE(ring.Finish().ok());
  EXPECT_EQ(std::memcmp(host.data(), pattern_.data(), kSlot * kSlots), 0);
}

// Free() refused by the driver: the ring keeps its memory and stays usable; a second
// Free gives everything back (CheckNoLeaks at TearDown), and Ready makes it again.
TEST_F(StagingRingReviewTest, ARefusedFreeKeepsAUsableRingAndARetryFreesIt) {
  StagingRing ring(&sim_, 0, &pool_, kSlot, kSlots);
  std::vector<char> host(size_, 0);
  ASSERT_TRUE(ring.ToHost(host.data(), va_, size_, a_).ok());
  ASSERT_TRUE(ring.Finish().ok());
  const std::size_t held = ring.held_bytes();
  sim_.InjectFault(FaultRule{DriverOp::kHostFree, 1, 1, absl::StatusCode::kInternal});
  EXPECT_FALSE(ring.Free().ok());
  sim_.ClearFaults();
  EXPECT_EQ(ring.held_bytes(), held);
  std::vector<char> again(size_, 0);
  ASSERT_TRUE(ring.ToHost(again.data(), va_, size_, b_).ok());
  ASSERT_TRUE(ring.Finish().ok());
  EXPECT_EQ(again, pattern_);
  ASSERT_TRUE(ring.Free().ok());
  EXPECT_EQ(ring.held_bytes(), 0u);
  ASSERT_TRUE(ring.Free().ok()) << "a second Free is a no-op";
  ASSERT_TRUE(ring.Ready().ok());
  EXPECT_EQ(ring.held_bytes(), held);
}

// Free() waits for the device to be done with every slot, the open ToHost slot included
// (its event is otherwise recorded only when the slot is closed or at Finish): here on a
// held stream, whose hold only a wait ends. (Found in review against the first Free(),
// which waited only for recorded slots; the current Free records the open slot's event.)
TEST_F(StagingRingReviewTest, FreeWaitsForCopiesIntoTheOpenSlot) {
  StagingRing ring(&sim_, 0, &pool_, kSlot, kSlots);
  std::vector<char> host(kSlot, 0);
  sim_.HoldStream(0, a_);
  ASSERT_TRUE(ring.ToHost(host.data(), va_, kSlot / 2, a_).ok());  // the open slot, no event yet
  ASSERT_TRUE(ring.Free().ok());
  EXPECT_FALSE(sim_.StreamHeld(0, a_)) << "the pinned slots were freed while a copy into them was pending";
  // The same with the event refused: the stream is waited for instead.
  sim_.HoldStream(0, b_);
  ASSERT_TRUE(ring.ToHost(host.data(), va_, kSlot / 2, b_).ok());
  sim_.InjectFault(FaultRule{DriverOp::kRecordEvent, 1, 1, absl::StatusCode::kInternal});
  ASSERT_TRUE(ring.Free().ok());
  sim_.ClearFaults();
  EXPECT_FALSE(sim_.StreamHeld(0, b_));
}

// The shared pool in a forked child: a new pool with live threads, large copies work.
TEST(HostCopyPoolReviewTest, SharedPoolWorksInAForkedChild) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "TSAN cannot start threads in the child of a multi-threaded fork";
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
  GTEST_SKIP() << "TSAN cannot start threads in the child of a multi-threaded fork";
#endif
#endif
  const std::vector<char> src = Pattern(8 << 20, 3);
  {
    std::vector<char> dst(src.size(), 0);
    HostCopyPool::Shared().Copy({{dst.data(), src.data(), src.size()}});  // threads made in the parent
    ASSERT_EQ(dst, src);
  }
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    std::vector<char> dst(src.size(), 0);
    HostCopyPool::Shared().Copy({{dst.data(), src.data(), src.size()}});
    _exit(dst == src ? 0 : 1);
  }
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (waitpid(child, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(child, SIGKILL);
      waitpid(child, &status, 0);
      FAIL() << "the child's copy hung";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// Many threads copying through one pool at once, spans of every size (TSAN).
TEST(HostCopyPoolReviewTest, ConcurrentCopiersOfMixedSizes) {
  HostCopyPool pool(7);
  auto run = [&pool](int seed) {
    for (int round = 0; round < 12; ++round) {
      const std::size_t n = (std::size_t{1} << 20) + 1 + static_cast<std::size_t>(round) * 65537;
      const std::vector<char> src = Pattern(n, seed + round);
      std::vector<char> dst(n, 0);
      pool.Copy({{dst.data(), src.data(), 1}, {dst.data() + 1, src.data() + 1, n - 1}});
      ASSERT_EQ(dst, src);
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back(run, t);
  for (std::thread& t : threads) t.join();
}

}  // namespace
}  // namespace vmstash
