// The allocator conformance suite (allocator_conformance.h) on SimDriver, in CI. The
// simulated device has the granularity of the GPUs the suite runs on there (2 MiB) and
// room for its largest case (EmptyCache's 4 GiB).
#include <memory>

#include "allocator/allocator_conformance.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

absl::StatusOr<std::unique_ptr<Driver>> MakeSim() {
  SimDriverOptions options;
  options.capacity_bytes = 8 * kGiB;
  options.granularity_bytes = 2 * kMiB;
  return std::unique_ptr<Driver>(new SimDriver(options));
}

INSTANTIATE_TEST_SUITE_P(Sim, AllocatorConformanceTest, ::testing::Values(DriverFactory{"sim", MakeSim, true}),
                         [](const ::testing::TestParamInfo<DriverFactory>& info) { return info.param.name; });

}  // namespace
}  // namespace vmstash
