#include "vmm/chunk.h"

#include <unistd.h>

#include "gtest/gtest.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

constexpr std::size_t kG = 2 << 20;

TEST(ChunkTest, ReleasesOnDestruction) {
  SimDriver sim;
  {
    Chunk c = Chunk::Create(&sim, 0, 4 * kG).value();
    EXPECT_EQ(sim.UsedBytes(0), 4 * kG);
    EXPECT_EQ(c.size_bytes(), 4 * kG);
    Chunk moved = std::move(c);
    EXPECT_FALSE(c.valid());  // NOLINT(bugprone-use-after-move): moved-from is empty by contract
  }
  EXPECT_EQ(sim.UsedBytes(0), 0u);
  EXPECT_TRUE(sim.CheckNoLeaks().ok());
}

TEST(ChunkTest, FailedReleaseKeepsOwnershipAndDestructorRetries) {
  SimDriver sim;
  {
    Chunk c = Chunk::Create(&sim, 0, kG).value();
    sim.InjectFault(FaultRule{DriverOp::kReleaseChunk, 1, 1, absl::StatusCode::kInternal});
    EXPECT_EQ(c.Release().code(), absl::StatusCode::kInternal);
    EXPECT_TRUE(c.valid());
  }
  EXPECT_TRUE(sim.CheckNoLeaks().ok());
}

TEST(ChunkTest, ExportsShareableChunks) {
  SimDriver sim;
  Chunk c = Chunk::Create(&sim, 0, kG, ChunkOptions{true, false}).value();
  absl::StatusOr<int> fd = c.ExportFd();
  ASSERT_TRUE(fd.ok()) << fd.status();
  EXPECT_EQ(::lseek(*fd, 0, SEEK_END), static_cast<off_t>(kG)) << "the fd is the chunk's memory";
  ::close(*fd);
  Chunk empty;
  EXPECT_EQ(empty.ExportFd().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Chunk::Create(&sim, 0, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace vmstash
