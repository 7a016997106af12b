#include "vmm/staging_ring.h"

#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "vmm/host_copy_pool.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kSlot = 64 * kKiB;  // small slots: the ring wraps many times
constexpr int kSlots = 3;

std::vector<char> Pattern(std::size_t n, int seed) {
  std::vector<char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<char>((i * 131 + i / 4096 + seed * 7) & 0xff);
  return v;
}

// A sim device range of size_ bytes holding a pattern, and a pool of 4 threads.
class StagingRingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    va_ = sim_.ReserveAddress(0, size_, 0).value();
    chunk_ = sim_.CreateChunk(0, size_, {}).value();
    ASSERT_TRUE(sim_.Map(va_, size_, chunk_).ok());
    ASSERT_TRUE(sim_.SetAccess(va_, size_, 0).ok());
    stream_ = sim_.CreateStream(0).value();
    other_ = sim_.CreateStream(0).value();
    pattern_ = Pattern(size_, 1);
    ASSERT_TRUE(sim_.CopyToDeviceAsync(0, va_, pattern_.data(), size_, stream_).ok());
  }
  void TearDown() override {
    ASSERT_TRUE(sim_.SynchronizeDevice(0).ok());
    ASSERT_TRUE(sim_.DestroyStream(0, stream_).ok());
    ASSERT_TRUE(sim_.DestroyStream(0, other_).ok());
    ASSERT_TRUE(sim_.Unmap(0, va_, size_).ok());
    ASSERT_TRUE(sim_.ReleaseChunk(chunk_).ok());
    ASSERT_TRUE(sim_.FreeAddress(0, va_, size_).ok());
    EXPECT_TRUE(sim_.CheckNoLeaks().ok()) << sim_.CheckNoLeaks();
  }
  std::vector<char> Device() {
    std::vector<char> out(size_);
    EXPECT_TRUE(sim_.CopyToHostAsync(0, out.data(), va_, size_, stream_).ok());
    return out;
  }
  void ZeroDevice() {
    std::vector<char> zeros(size_, 0);
    ASSERT_TRUE(sim_.CopyToDeviceAsync(0, va_, zeros.data(), size_, stream_).ok());
  }
  // The sizes of the copies a pause makes: small blocks, blocks larger than a slot, and
  // blocks that start mid-slot; they add up to size_.
  std::vector<std::size_t> Cuts() const {
    std::vector<std::size_t> cuts;
    const std::size_t sizes[] = {512, 4 * kKiB, 100 * kKiB, 3 * kKiB, kSlot, 3 * kSlot + 17, 1};
    std::size_t done = 0;
    for (int i = 0; done < size_; ++i) {
      cuts.push_back(std::min(sizes[i % 7], size_ - done));
      done += cuts.back();
    }
    return cuts;
  }

  SimDriver sim_;
  HostCopyPool pool_{4};
  std::size_t size_ = 2 * std::size_t{1} << 20;
  DevicePtr va_ = 0;
  ChunkHandle chunk_ = 0;
  Stream stream_ = nullptr;
  Stream other_ = nullptr;
  std::vector<char> pattern_;
};

TEST_F(StagingRingTest, CopiesOfEverySizeRoundTripThroughAFewSlots) {
  StagingRing ring(&sim_, 0, &pool_, kSlot, kSlots);
  EXPECT_EQ(ring.held_bytes(), 0u);
  std::vector<char> host(size_, 0);
  std::size_t at = 0;
  for (std::size_t n : Cuts()) {
    ASSERT_TRUE(ring.ToHost(host.data() + at, va_ + at, n, stream_).ok());
    at += n;
  }
  EXPECT_EQ(ring.held_bytes(), kSlot * kSlots);
  // The last slot's bytes are still in the ring: they arrive at Finish().
  EXPECT_TRUE(ring.has_pending());
  ASSERT_TRUE(sim_.SynchronizeStream(0, stream_).ok());
  ASSERT_TRUE(ring.Finish().ok());
  EXPECT_FALSE(ring.has_pending());
  ASSERT_EQ(std::memcmp(host.data(), pattern_.data(), size_), 0);

  ZeroDevice();
  at = 0;
  for (std::size_t n : Cuts()) {
    ASSERT_TRUE(ring.ToDevice(va_ + at, host.data() + at, n, stream_).ok());
    at += n;
  }
  ASSERT_TRUE(sim_.SynchronizeStream(0, stream_).ok());
  EXPECT_EQ(Device(), pattern_);
  // Both directions again on the same ring, the second on another stream.
  std::vector<char> again(size_, 0);
  ASSERT_TRUE(ring.ToHost(again.data(), va_, size_, other_).ok());
  ASSERT_TRUE(ring.Finish().ok());
  EXPECT_EQ(again, pattern_);
}

TEST_F(StagingRingTest, ASlotIsReusedOnlyAfterTheDeviceIsDoneWithIt) {
  StagingRing ring(&sim_, 0, &pool_, kSlot, kSlots);
  std::vector<char> host(size_, 0);
  // Held: events recorded on the stream stay pending until someone waits for them. The
  // ring fills every slot, then must wait (SynchronizeEvent ends the hold) before reuse.
  sim_.HoldStream(0, stream_);
  ASSERT_TRUE(ring.ToHost(host.data(), va_, kSlot * kSlots, stream_).ok());
  EXPECT_TRUE(sim_.StreamHeld(0, stream_));
  const std::uint64_t waits = sim_.Counters().Calls(DriverOp::kSynchronizeEvent);
  ASSERT_TRUE(ring.ToHost(host.data() + kSlot * kSlots, va_ + kSlot * kSlots, kSlot, stream_).ok());
  EXPECT_GT(sim_.Counters().Calls(DriverOp::kSynchronizeEvent), waits);
  EXPECT_FALSE(sim_.StreamHeld(0, stream_));
  ASSERT_TRUE(ring.Finish().ok());
  EXPECT_EQ(std::memcmp(host.data(), pattern_.data(), kSlot * (kSlots + 1)), 0);
}

TEST_F(StagingRingTest, EveryDriverFailureIsReturnedAndTheRingWorksAfterAbandon) {
  // A clean run counts the calls; then each call of each kind fails once in turn.
  const DriverCounters before = sim_.Counters();
  {
    StagingRing ring(&sim_, 0, &pool_, kSlot, kSlots);
    std::vector<char> host(size_);
    ASSERT_TRUE(ring.ToHost(host.data(), va_, size_, stream_).ok());
    ASSERT_TRUE(ring.Finish().ok());
    ASSERT_TRUE(ring.ToDevice(va_, host.data(), size_, stream_).ok());
  }
  DriverCounters clean = sim_.Counters();
  int failures = 0;
  for (DriverOp op : {DriverOp::kCreateEvent, DriverOp::kHostAlloc, DriverOp::kCopyToHost, DriverOp::kRecordEvent,
                      DriverOp::kSynchronizeEvent, DriverOp::kCopyToDevice}) {
    const std::uint64_t calls = clean.Calls(op) - before.Calls(op);
    for (std::uint64_t nth = 1; nth <= calls; ++nth) {
      SCOPED_TRACE(std::string(DriverOpName(op)) + "@" + std::to_string(nth));
      StagingRing ring(&sim_, 0, &pool_, kSlot, kSlots);
      sim_.InjectFault(FaultRule{op, static_cast<int>(nth), 1, absl::StatusCode::kInternal});
      std::vector<char> host(size_, 0);
      absl::Status s = ring.ToHost(host.data(), va_, size_, stream_);
      if (s.ok()) s = ring.Finish();
      if (s.ok()) s = ring.ToDevice(va_, host.data(), size_, stream_);
      sim_.ClearFaults();
      ASSERT_TRUE(sim_.SynchronizeDevice(0).ok());
      if (!s.ok()) {
        ++failures;
        EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
        ring.Abandon();
        EXPECT_FALSE(ring.has_pending());
      }
      // The same ring round-trips afterwards.
      ZeroDevice();
      std::vector<char> again(size_, 0);
      ASSERT_TRUE(ring.ToDevice(va_, pattern_.data(), size_, stream_).ok());
      ASSERT_TRUE(ring.ToHost(again.data(), va_, size_, stream_).ok());
      ASSERT_TRUE(ring.Finish().ok());
      ASSERT_EQ(again, pattern_);
    }
  }
  EXPECT_GT(failures, 10);
}

TEST_F(StagingRingTest, ARefusedRingNamesItselfAndLeavesNothing) {
  StagingRing ring(&sim_, 0, &pool_, kSlot, kSlots);
  sim_.InjectFault(FaultRule{DriverOp::kHostAlloc, 1, 1, absl::StatusCode::kResourceExhausted});
  std::vector<char> host(size_);
  absl::Status s = ring.ToHost(host.data(), va_, size_, stream_);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("staging ring"), absl::string_view::npos) << s;
  EXPECT_EQ(ring.held_bytes(), 0u);
  EXPECT_FALSE(ring.has_pending());
  const DriverCounters c = sim_.Counters();
  EXPECT_EQ(c.Calls(DriverOp::kCreateEvent), c.Calls(DriverOp::kDestroyEvent));
}

TEST(HostCopyPoolTest, ManySpansLargeAndSmallFromSeveralThreads) {
  HostCopyPool pool(5);
  auto run = [&pool](int seed) {
    for (int round = 0; round < 20; ++round) {
      const std::vector<char> src = Pattern((3 << 20) + 12345, seed + round);
      std::vector<char> dst(src.size(), 0);
      std::vector<HostCopyPool::Span> spans;
      std::size_t at = 0;
      for (std::size_t n : {std::size_t{1}, std::size_t{4095}, std::size_t{2} << 20, std::size_t{777}}) {
        spans.push_back({dst.data() + at, src.data() + at, n});
        at += n;
      }
      spans.push_back({dst.data() + at, src.data() + at, src.size() - at});
      pool.Copy(spans);
      ASSERT_EQ(dst, src);
      pool.Copy({});  // nothing to copy
    }
  };
  std::thread a(run, 1), b(run, 2);
  run(3);
  a.join();
  b.join();
}

}  // namespace
}  // namespace vmstash
