#include "vmm/mapping.h"

#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "vmm/reservation.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

constexpr std::size_t kG = 2 << 20;

std::vector<Chunk> MakeChunks(Driver* d, int n) {
  std::vector<Chunk> chunks;
  for (int i = 0; i < n; ++i) chunks.push_back(Chunk::Create(d, 0, (i + 1) * kG).value());
  return chunks;
}

TEST(MappingTest, MapsChunksBackToBackAndUnmapsOnDestruction) {
  SimDriver sim;
  Reservation r = Reservation::Create(&sim, 0, 16 * kG).value();
  std::vector<Chunk> chunks = MakeChunks(&sim, 3);
  {
    Mapping m = Mapping::Create(&sim, 0, r.address() + kG, chunks).value();
    ASSERT_EQ(m.pieces().size(), 3u);
    EXPECT_EQ(m.address(), r.address() + kG);
    EXPECT_EQ(m.size_bytes(), 6 * kG);
    EXPECT_EQ(m.pieces()[1].va, r.address() + 2 * kG);
    EXPECT_EQ(m.pieces()[2].va, r.address() + 4 * kG);
    for (const Mapping::Piece& p : m.pieces()) EXPECT_EQ(p.state, Mapping::PieceState::kAccessible);
    // The whole run is usable memory.
    std::memset(reinterpret_cast<void*>(m.address()), 7, m.size_bytes());
  }
  EXPECT_EQ(sim.Counters().Calls(DriverOp::kUnmap), 3u);
  chunks.clear();
  ASSERT_TRUE(r.Free().ok());
  EXPECT_TRUE(sim.CheckNoLeaks().ok());
}

// Fault injection at every driver call Mapping::Create makes: the error comes back with
// its code, and everything mapped so far is unmapped again.
TEST(MappingTest, CreateRollsBackExactlyAtEveryFailurePoint) {
  for (DriverOp op : {DriverOp::kMap, DriverOp::kSetAccess}) {
    for (int nth = 1; nth <= 4; ++nth) {
      SCOPED_TRACE(testing::Message() << DriverOpName(op) << "@" << nth);
      SimDriver sim;
      Reservation r = Reservation::Create(&sim, 0, 16 * kG).value();
      std::vector<Chunk> chunks = MakeChunks(&sim, 4);
      sim.InjectFault(FaultRule{op, nth, 1, absl::StatusCode::kResourceExhausted});
      absl::StatusOr<Mapping> m = Mapping::Create(&sim, 0, r.address(), chunks);
      EXPECT_EQ(m.status().code(), absl::StatusCode::kResourceExhausted);
      DriverCounters c = sim.Counters();
      const std::uint64_t successful_maps = c.Calls(DriverOp::kMap) - (op == DriverOp::kMap ? 1 : 0);
      EXPECT_EQ(c.Calls(DriverOp::kUnmap), successful_maps) << "every successful map undone";
      // The range is free again: a retry succeeds.
      sim.ClearFaults();
      absl::StatusOr<Mapping> retry = Mapping::Create(&sim, 0, r.address(), chunks);
      ASSERT_TRUE(retry.ok()) << retry.status();
      ASSERT_TRUE(retry->Unmap().ok());
      chunks.clear();
      ASSERT_TRUE(r.Free().ok());
      EXPECT_TRUE(sim.CheckNoLeaks().ok()) << sim.CheckNoLeaks();
    }
  }
}

TEST(MappingTest, FailedUnmapKeepsTheRestAndCanBeRetried) {
  SimDriver sim;
  Reservation r = Reservation::Create(&sim, 0, 16 * kG).value();
  std::vector<Chunk> chunks = MakeChunks(&sim, 3);
  Mapping m = Mapping::Create(&sim, 0, r.address(), chunks).value();
  sim.InjectFault(FaultRule{DriverOp::kUnmap, 2, 1, absl::StatusCode::kInternal});
  EXPECT_EQ(m.Unmap().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(m.pieces().size(), 2u) << "the last piece went; the failing one and the first stay";
  EXPECT_TRUE(m.mapped());
  ASSERT_TRUE(m.Unmap().ok());
  EXPECT_FALSE(m.mapped());
  EXPECT_EQ(sim.Counters().Calls(DriverOp::kUnmap), 4u);
  chunks.clear();
  ASSERT_TRUE(r.Free().ok());
  EXPECT_TRUE(sim.CheckNoLeaks().ok());
}

TEST(MappingTest, RejectsBadInput) {
  SimDriver sim;
  Reservation r = Reservation::Create(&sim, 0, 4 * kG).value();
  std::vector<Chunk> none;
  EXPECT_EQ(Mapping::Create(&sim, 0, r.address(), none).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<Chunk> too_many = MakeChunks(&sim, 3);  // 6 granules into 4
  EXPECT_EQ(Mapping::Create(&sim, 0, r.address(), too_many).status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<Chunk> empty(1);
  EXPECT_EQ(Mapping::Create(&sim, 0, r.address(), empty).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sim.Counters().Calls(DriverOp::kUnmap), 2u) << "the two that fit were rolled back";
}

}  // namespace
}  // namespace vmstash
