// Runs everywhere: without a GPU, CudaDriver must fail to load cleanly (Unavailable, no
// crash, no exit); with one, it must come up. Its behaviour on a GPU is the conformance
// suite's business (tests/gpu).
#include "vmm/cuda_driver.h"

#include "gtest/gtest.h"

namespace vmstash {
namespace {

TEST(CudaDriverTest, CreatesOrReportsUnavailable) {
  absl::StatusOr<std::unique_ptr<CudaDriver>> driver = CudaDriver::Create();
  if (!driver.ok()) {
    EXPECT_EQ(driver.status().code(), absl::StatusCode::kUnavailable) << driver.status();
    return;
  }
  EXPECT_EQ((*driver)->Name(), "cuda");
  EXPECT_GE((*driver)->driver_version(), 12000);
  absl::StatusOr<int> count = (*driver)->DeviceCount();
  ASSERT_TRUE(count.ok());
  EXPECT_EQ((*driver)->CreateChunk(*count, 2 << 20, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*driver)->CheckNoLeaks().ok());
}

}  // namespace
}  // namespace vmstash
