// The driver conformance suite on SimDriver (see driver_conformance.h).
#include <memory>

#include "vmm/driver_conformance.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

absl::StatusOr<std::unique_ptr<Driver>> MakeSim() {
  SimDriverOptions options;
  options.capacity_bytes = std::size_t{4} << 30;
  return std::unique_ptr<Driver>(new SimDriver(options));
}

absl::StatusOr<std::unique_ptr<Driver>> MakeSmallGranularitySim() {
  SimDriverOptions options;
  options.capacity_bytes = std::size_t{1} << 30;
  options.granularity_bytes = 64 << 10;
  options.devices = 2;
  return std::unique_ptr<Driver>(new SimDriver(options));
}

INSTANTIATE_TEST_SUITE_P(Sim, DriverConformanceTest,
                         ::testing::Values(DriverFactory{"sim", MakeSim, true},
                                           DriverFactory{"sim_64k_2dev", MakeSmallGranularitySim, true}),
                         [](const ::testing::TestParamInfo<DriverFactory>& info) { return info.param.name; });

}  // namespace
}  // namespace vmstash
