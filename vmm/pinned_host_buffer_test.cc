#include "vmm/pinned_host_buffer.h"

#include <cstdlib>
#include <cstring>

#include "gtest/gtest.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

TEST(PinnedHostBufferTest, AllocatesAndFrees) {
  SimDriver sim;
  {
    PinnedHostBuffer b = PinnedHostBuffer::Allocate(&sim, 0, 1 << 20).value();
    ASSERT_NE(b.data(), nullptr);
    std::memset(b.data(), 1, b.size_bytes());
    EXPECT_FALSE(b.registered());
    PinnedHostBuffer moved = std::move(b);
    EXPECT_EQ(moved.size_bytes(), 1u << 20);
  }
  EXPECT_EQ(sim.Counters().Calls(DriverOp::kHostFree), 1u);
  EXPECT_TRUE(sim.CheckNoLeaks().ok());
}

TEST(PinnedHostBufferTest, RegistersWithoutTakingOwnership) {
  SimDriver sim;
  void* raw = std::aligned_alloc(4096, 1 << 16);
  {
    PinnedHostBuffer b = PinnedHostBuffer::Register(&sim, 0, raw, 1 << 16).value();
    EXPECT_TRUE(b.registered());
    EXPECT_EQ(b.data(), raw);
  }
  EXPECT_EQ(sim.Counters().Calls(DriverOp::kHostUnregister), 1u);
  EXPECT_TRUE(sim.CheckNoLeaks().ok());
  std::free(raw);  // still ours
}

TEST(PinnedHostBufferTest, FailuresAreReported) {
  SimDriver sim;
  sim.InjectFault(FaultRule{DriverOp::kHostAlloc, 1, 1, absl::StatusCode::kResourceExhausted});
  EXPECT_EQ(PinnedHostBuffer::Allocate(&sim, 0, 4096).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(PinnedHostBuffer::Allocate(&sim, 0, 0).status().code(), absl::StatusCode::kInvalidArgument);
  {
    PinnedHostBuffer b = PinnedHostBuffer::Allocate(&sim, 0, 4096).value();
    sim.InjectFault(FaultRule{DriverOp::kHostFree, 1, 1, absl::StatusCode::kInternal});
    EXPECT_EQ(b.Release().code(), absl::StatusCode::kInternal);
    EXPECT_TRUE(b.valid());
  }
  EXPECT_TRUE(sim.CheckNoLeaks().ok());
}

}  // namespace
}  // namespace vmstash
