#include "vmm/pinned_pieces.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kPiece = PinnedPieces::kPieceBytes;

// A sim device range of `size` bytes, mapped with access, filled with a byte pattern.
class PinnedPiecesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    size_ = 2 * kPiece + 8 * kMiB;
    va_ = sim_.ReserveAddress(0, size_, 0).value();
    chunk_ = sim_.CreateChunk(0, size_, {}).value();
    ASSERT_TRUE(sim_.Map(va_, size_, chunk_).ok());
    ASSERT_TRUE(sim_.SetAccess(va_, size_, 0).ok());
    stream_ = sim_.CreateStream(0).value();
    pattern_.resize(size_);
    for (std::size_t i = 0; i < size_; ++i) pattern_[i] = static_cast<char>((i * 131 + i / 4096) & 0xff);
    ASSERT_TRUE(sim_.CopyToDeviceAsync(0, va_, pattern_.data(), size_, stream_).ok());
  }
  void TearDown() override {
    ASSERT_TRUE(sim_.SynchronizeStream(0, stream_).ok());
    ASSERT_TRUE(sim_.DestroyStream(0, stream_).ok());
    ASSERT_TRUE(sim_.Unmap(0, va_, size_).ok());
    ASSERT_TRUE(sim_.ReleaseChunk(chunk_).ok());
    ASSERT_TRUE(sim_.FreeAddress(0, va_, size_).ok());
    EXPECT_TRUE(sim_.CheckNoLeaks().ok()) << sim_.CheckNoLeaks();
  }
  // The device's bytes [offset, offset + n).
  std::vector<char> Device(std::size_t offset, std::size_t n) {
    std::vector<char> out(n);
    EXPECT_TRUE(sim_.CopyToHostAsync(0, out.data(), va_ + offset, n, stream_).ok());
    return out;
  }
  void ZeroDevice() {
    std::vector<char> zeros(size_, 0);
    ASSERT_TRUE(sim_.CopyToDeviceAsync(0, va_, zeros.data(), size_, stream_).ok());
  }
  std::size_t Registered() const {
    const DriverCounters c = sim_.Counters();
    return c.Calls(DriverOp::kHostRegister) - c.Calls(DriverOp::kHostUnregister);
  }

  SimDriver sim_;
  std::size_t size_ = 0;
  DevicePtr va_ = 0;
  ChunkHandle chunk_ = 0;
  Stream stream_ = nullptr;
  std::vector<char> pattern_;
};

TEST_F(PinnedPiecesTest, CopiesSplitAtPieceBoundsAndRoundTrip) {
  PinnedPieces p(&sim_, 0, 4);
  ASSERT_TRUE(p.Reserve(size_).ok());
  EXPECT_EQ(p.piece_count(), 3u);
  EXPECT_EQ(p.pinned_bytes(), 0u);
  // 80 MiB from 40 MiB: pieces 0 and 1, each registered on its own.
  const std::size_t at = 40 * kMiB, n = 80 * kMiB;
  ASSERT_TRUE(p.CopyIn(at, va_ + at, n, stream_).ok()) << p.CopyIn(at, va_ + at, n, stream_);
  EXPECT_EQ(p.pinned_bytes(), 2 * kPiece);
  EXPECT_EQ(Registered(), 2u);
  EXPECT_EQ(std::memcmp(p.data() + at, pattern_.data() + at, n), 0);
  // One driver copy across the two registrations is what the CUDA driver refuses.
  EXPECT_EQ(sim_.CopyToDeviceAsync(0, va_, p.data() + at, n, stream_).code(), absl::StatusCode::kInvalidArgument);
  ZeroDevice();
  ASSERT_TRUE(p.CopyOut(va_ + at, at, n, stream_).ok());
  EXPECT_EQ(std::memcmp(Device(at, n).data(), pattern_.data() + at, n), 0);
  // The last, shorter piece.
  ASSERT_TRUE(p.CopyIn(2 * kPiece, va_ + 2 * kPiece, 8 * kMiB, stream_).ok());
  EXPECT_EQ(p.pinned_bytes(), p.capacity_bytes());
  EXPECT_EQ(p.pinned_prefix_bytes(), p.capacity_bytes());
  ASSERT_TRUE(p.Release().ok());
  EXPECT_EQ(Registered(), 0u);
}

TEST_F(PinnedPiecesTest, UnpinKeepsTheBytesAndHandBackLosesThem) {
  PinnedPieces p(&sim_, 0);
  ASSERT_TRUE(p.Reserve(size_).ok());
  ASSERT_TRUE(p.CopyIn(0, va_, size_, stream_).ok());
  ZeroDevice();
  ASSERT_TRUE(p.CopyOut(va_, 0, kPiece + kMiB, stream_).ok());  // reads pieces 0 and 1
  ASSERT_TRUE(p.Unpin().ok());
  EXPECT_EQ(p.resident_bytes(), p.capacity_bytes());
  EXPECT_EQ(p.pinned_bytes(), 0u);
  EXPECT_EQ(Registered(), 0u);
  // A retry of the reads (a resume that failed after unpinning): pinned again, same bytes.
  ASSERT_TRUE(p.CopyOut(va_, 0, size_, stream_).ok());
  EXPECT_EQ(std::memcmp(Device(0, size_).data(), pattern_.data(), size_), 0);
  ASSERT_TRUE(p.HandBack(/*lazily=*/true).ok());
  EXPECT_EQ(Registered(), 0u);
  absl::Status read = p.CopyOut(va_, 0, kMiB, stream_);
  EXPECT_EQ(read.code(), absl::StatusCode::kInternal);
  EXPECT_NE(read.message().find("handed back"), std::string::npos) << read;
  // The next pause warms and pins it again: same address range, new bytes.
  char* const before = p.data();
  ASSERT_TRUE(p.Warm(size_).ok());
  EXPECT_EQ(Registered(), 0u);
  ASSERT_TRUE(p.CopyIn(0, va_, size_, stream_).ok());
  EXPECT_EQ(p.data(), before);
  EXPECT_EQ(std::memcmp(p.data(), pattern_.data(), size_), 0);
  ASSERT_TRUE(p.HandBack(/*lazily=*/false).ok());
}

// A pause into an arena pinned only in part: the copies into the pinned piece warm
// nothing (the copy engine starts at once); the first copy into a cold piece warms it and
// the cold pieces after it, within the bytes the owner named, and no further.
TEST_F(PinnedPiecesTest, ACopyWarmsAheadOnlyWithinTheNamedEnd) {
  PinnedPieces p(&sim_, 0, 4);
  ASSERT_TRUE(p.Reserve(size_).ok());
  ASSERT_TRUE(p.Pin(0, kPiece).ok());  // a preparation cut short after piece 0
  p.WarmAheadWithin(2 * kPiece);       // the pause's layout: pieces 0 and 1
  (void)p.TakeTiming();
  ASSERT_TRUE(p.CopyIn(0, va_, kPiece, stream_).ok());
  EXPECT_EQ(p.resident_bytes(), kPiece);
  EXPECT_EQ(p.TakeTiming().warm_ms, 0.0);
  ASSERT_TRUE(p.CopyIn(kPiece, va_ + kPiece, kMiB, stream_).ok());
  EXPECT_EQ(p.resident_bytes(), 2 * kPiece);  // piece 1 only: piece 2 lies past the end
  EXPECT_EQ(p.pinned_bytes(), 2 * kPiece);
  // Named up to the end, a copy into piece 1 (warm already) leaves piece 2 cold; one into
  // piece 2 warms and pins it.
  p.WarmAheadWithin(p.capacity_bytes());
  ASSERT_TRUE(p.CopyIn(kPiece + kMiB, va_ + kPiece + kMiB, kPiece - kMiB, stream_).ok());
  EXPECT_EQ(p.resident_bytes(), 2 * kPiece);
  ASSERT_TRUE(p.CopyIn(2 * kPiece, va_ + 2 * kPiece, size_ - 2 * kPiece, stream_).ok());
  EXPECT_EQ(p.resident_bytes(), p.capacity_bytes());
  EXPECT_EQ(std::memcmp(p.data(), pattern_.data(), size_), 0);
  // A hand-back forgets the end: the next copy warms only the piece it needs.
  ASSERT_TRUE(p.HandBack(/*lazily=*/true).ok());
  ASSERT_TRUE(p.CopyIn(0, va_, kMiB, stream_).ok());
  EXPECT_EQ(p.resident_bytes(), kPiece);
  // Named again: one copy into piece 0 warms all three.
  ASSERT_TRUE(p.HandBack(/*lazily=*/true).ok());
  p.WarmAheadWithin(p.capacity_bytes());
  ASSERT_TRUE(p.CopyIn(0, va_, size_, stream_).ok());
  EXPECT_EQ(p.resident_bytes(), p.capacity_bytes());
  EXPECT_EQ(Registered(), 3u);
  EXPECT_EQ(std::memcmp(p.data(), pattern_.data(), size_), 0);
  ASSERT_TRUE(p.Release().ok());
  EXPECT_EQ(Registered(), 0u);
}

TEST_F(PinnedPiecesTest, PinAndWarmCoverWholePieces) {
  PinnedPieces p(&sim_, 0, 8);
  ASSERT_TRUE(p.Reserve(size_).ok());
  ASSERT_TRUE(p.Warm(p.capacity_bytes()).ok());
  EXPECT_EQ(Registered(), 0u);
  ASSERT_TRUE(p.Pin(kPiece - 1, 2).ok());  // the last byte of piece 0, the first of 1
  EXPECT_EQ(p.pinned_bytes(), 2 * kPiece);
  EXPECT_EQ(p.pinned_prefix_bytes(), 2 * kPiece);
  ASSERT_TRUE(p.Pin(0, p.capacity_bytes()).ok());
  EXPECT_EQ(Registered(), 3u);
  EXPECT_EQ(p.Pin(0, p.capacity_bytes() + 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p.CopyIn(p.capacity_bytes() - 4096, va_, 8192, stream_).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p.Warm(p.capacity_bytes() + 4096).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(PinnedPiecesTest, AStoppedWarmLeavesThePiecesItDidNotReachCold) {
  PinnedPieces p(&sim_, 0, 1);  // one thread: the units go in order
  ASSERT_TRUE(p.Reserve(size_).ok());
  // Stop asked before the first unit: nothing is touched.
  ASSERT_TRUE(p.Warm(p.capacity_bytes(), [] { return true; }).ok());
  EXPECT_EQ(p.resident_bytes(), 0u);
  // Stopped after the units of one piece and one unit of the next: both are warm (the
  // second partly resident, counted whole), the third cold.
  const std::size_t units_per_piece = kPiece / PinnedPieces::kWarmUnitBytes;
  std::size_t asked = 0;
  ASSERT_TRUE(p.Warm(p.capacity_bytes(), [&] { return ++asked > units_per_piece + 1; }).ok());
  EXPECT_EQ(p.resident_bytes(), 2 * kPiece);
  EXPECT_EQ(p.resident_bytes_with(p.capacity_bytes()), p.capacity_bytes());
  EXPECT_EQ(Registered(), 0u);
  // The rest warms and everything pins and round-trips as usual.
  ASSERT_TRUE(p.Warm(p.capacity_bytes(), [] { return false; }).ok());
  EXPECT_EQ(p.resident_bytes(), p.capacity_bytes());
  ASSERT_TRUE(p.CopyIn(0, va_, size_, stream_).ok());
  ASSERT_TRUE(sim_.SynchronizeStream(0, stream_).ok());
  ZeroDevice();
  ASSERT_TRUE(p.CopyOut(va_, 0, size_, stream_).ok());
  EXPECT_EQ(Device(0, size_), pattern_);
  EXPECT_EQ(p.pinned_bytes(), p.capacity_bytes());
}

// Pages of [p, p + n) resident in memory (mincore).
std::size_t ResidentPages(const char* p, std::size_t n) {
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> v((n + page - 1) / page);
  if (mincore(const_cast<char*>(p), n, v.data()) != 0) return ~std::size_t{0};
  std::size_t c = 0;
  for (unsigned char b : v) c += b & 1;
  return c;
}

// Eight threads stopped at varying points: every page faulted in lies in a piece counted
// resident, a hand-back leaves no page resident, and a later Warm completes the rest.
TEST_F(PinnedPiecesTest, AWarmStoppedAcrossThreadsCountsEveryPageItFaultedIn) {
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  for (int round = 0; round < 24; ++round) {
    SCOPED_TRACE(round);
    PinnedPieces p(&sim_, 0, 8);
    ASSERT_TRUE(p.Reserve(16 * kPiece).ok());
    std::atomic<int> asked{0};
    const int limit = 1 + round * 5;
    ASSERT_TRUE(p.Warm(p.capacity_bytes(), [&] { return asked.fetch_add(1) >= limit; }).ok());
    EXPECT_LE(ResidentPages(p.data(), p.capacity_bytes()) * page, p.resident_bytes());
    EXPECT_LT(p.resident_bytes(), p.capacity_bytes());
    ASSERT_TRUE(p.HandBack(/*lazily=*/false).ok());
    EXPECT_EQ(p.resident_bytes(), 0u);
    EXPECT_EQ(ResidentPages(p.data(), p.capacity_bytes()), 0u) << "pages left resident in cold pieces";
    ASSERT_TRUE(p.Warm(p.capacity_bytes()).ok());
    EXPECT_EQ(p.resident_bytes(), p.capacity_bytes());
  }
}

TEST_F(PinnedPiecesTest, FailedRegistrationKeepsWhatWasPinnedAndReleaseCleansUp) {
  PinnedPieces p(&sim_, 0);
  ASSERT_TRUE(p.Reserve(size_).ok());
  sim_.InjectFault(FaultRule{DriverOp::kHostRegister, 2, 1, absl::StatusCode::kResourceExhausted});
  EXPECT_EQ(p.CopyIn(0, va_, size_, stream_).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(p.pinned_bytes(), kPiece);  // piece 0; piece 1 refused; piece 2 not reached
  // A retry pins the rest.
  ASSERT_TRUE(p.CopyIn(0, va_, size_, stream_).ok());
  EXPECT_EQ(p.pinned_bytes(), p.capacity_bytes());
  ASSERT_TRUE(p.Release().ok());
}

TEST_F(PinnedPiecesTest, HandBackSomeGoesInStepsAndStopsAtAFailure) {
  PinnedPieces p(&sim_, 0);
  ASSERT_TRUE(p.Reserve(size_).ok());
  ASSERT_TRUE(p.CopyIn(0, va_, size_, stream_).ok());
  bool more = false;
  ASSERT_TRUE(p.HandBackSome(kPiece, /*lazily=*/true, &more).ok());
  EXPECT_TRUE(more);
  EXPECT_EQ(p.pinned_bytes(), p.capacity_bytes() - kPiece);
  EXPECT_EQ(p.resident_bytes(), p.capacity_bytes() - kPiece);
  // The second piece's unregistering fails: it and the third stay pinned, with their bytes.
  sim_.InjectFault(FaultRule{DriverOp::kHostUnregister, 1, 1, absl::StatusCode::kInternal});
  EXPECT_EQ(p.HandBackSome(kPiece, /*lazily=*/true, &more).code(), absl::StatusCode::kInternal);
  EXPECT_EQ(p.pinned_bytes(), p.capacity_bytes() - kPiece);
  ZeroDevice();
  ASSERT_TRUE(p.CopyOut(va_ + kPiece, kPiece, size_ - kPiece, stream_).ok());
  EXPECT_EQ(std::memcmp(Device(kPiece, size_ - kPiece).data(), pattern_.data() + kPiece, size_ - kPiece), 0);
  ASSERT_TRUE(p.HandBackSome(p.capacity_bytes(), /*lazily=*/true, &more).ok());
  EXPECT_FALSE(more);
  EXPECT_EQ(p.resident_bytes(), 0u);
  // Warm pieces are handed back too (no pinned budget needed).
  ASSERT_TRUE(p.Warm(kPiece).ok());
  EXPECT_EQ(p.resident_bytes(), kPiece);
  ASSERT_TRUE(p.HandBackSome(0, /*lazily=*/false, &more).ok());
  EXPECT_EQ(p.resident_bytes(), 0u);
}

TEST_F(PinnedPiecesTest, ReleaseFailureKeepsTheMemoryAndTheDestructorLogs) {
  {
    PinnedPieces p(&sim_, 0);
    ASSERT_TRUE(p.Reserve(size_).ok());
    ASSERT_TRUE(p.Pin(0, kPiece).ok());
    sim_.InjectFault(FaultRule{DriverOp::kHostUnregister, 1, 1, absl::StatusCode::kInternal});
    EXPECT_EQ(p.Release().code(), absl::StatusCode::kInternal);
    EXPECT_NE(p.data(), nullptr);
    EXPECT_EQ(p.pinned_bytes(), kPiece);
  }  // the destructor releases it (TearDown checks no registration is left)
}

TEST_F(PinnedPiecesTest, ReserveReplacesAndZeroIsEmpty) {
  PinnedPieces p(&sim_, 0);
  ASSERT_TRUE(p.Reserve(kMiB).ok());
  EXPECT_EQ(p.capacity_bytes(), 2 * kMiB);  // 2 MiB units
  ASSERT_TRUE(p.Pin(0, kMiB).ok());
  ASSERT_TRUE(p.Reserve(size_).ok());
  EXPECT_EQ(Registered(), 0u);
  EXPECT_EQ(p.pinned_bytes(), 0u);
  ASSERT_TRUE(p.Reserve(0).ok());
  EXPECT_EQ(p.data(), nullptr);
  EXPECT_EQ(p.capacity_bytes(), 0u);
}

}  // namespace
}  // namespace vmstash
