#include "vmm/driver_factory.h"

#include "gtest/gtest.h"

namespace vmstash {
namespace {

TEST(DriverFactoryTest, SimIsConfiguredFromOptions) {
  VmmOptions options;
  options.driver = DriverKind::kSim;
  options.sim_devices = 2;
  options.sim_capacity_bytes = 64u << 20;
  options.sim_granularity_bytes = 1u << 20;
  absl::StatusOr<std::unique_ptr<Driver>> driver = CreateDriver(options);
  ASSERT_TRUE(driver.ok()) << driver.status();
  EXPECT_EQ((*driver)->Name(), "sim");
  EXPECT_EQ((*driver)->DeviceCount().value(), 2);
  EXPECT_EQ((*driver)->Granularity(1, GranularityKind::kMinimum, {}).value(), 1u << 20);
  EXPECT_EQ((*driver)->MemoryInfo(0)->total_bytes, 64u << 20);
}

TEST(DriverFactoryTest, AutoAlwaysGivesADriver) {
  absl::StatusOr<std::unique_ptr<Driver>> driver = CreateDriver(VmmOptions{});
  ASSERT_TRUE(driver.ok()) << driver.status();
  EXPECT_GT((*driver)->DeviceCount().value(), 0);
}

TEST(DriverFactoryTest, CudaWithoutAGpuIsUnavailable) {
  VmmOptions options;
  options.driver = DriverKind::kCuda;
  absl::StatusOr<std::unique_ptr<Driver>> driver = CreateDriver(options);
  if (!driver.ok()) {
    EXPECT_EQ(driver.status().code(), absl::StatusCode::kUnavailable) << driver.status();
  } else {
    EXPECT_EQ((*driver)->Name(), "cuda");
  }
}

}  // namespace
}  // namespace vmstash
