#include "vmm/driver_factory.h"

#include "vmm/cuda_driver.h"
#include "base/log.h"
#include "vmm/sim_driver.h"

namespace vmstash {

absl::StatusOr<std::unique_ptr<Driver>> CreateDriver(const VmmOptions& options) {
  if (options.driver == DriverKind::kSim) {
    return std::unique_ptr<Driver>(new SimDriver(SimDriverOptions::FromOptions(options)));
  }
  absl::StatusOr<std::unique_ptr<CudaDriver>> cuda = CudaDriver::Create();
  if (options.driver == DriverKind::kCuda) {
    if (!cuda.ok()) return cuda.status();
    return std::unique_ptr<Driver>(std::move(cuda).value());
  }
  if (cuda.ok() && (*cuda)->DeviceCount().value_or(0) > 0) return std::unique_ptr<Driver>(std::move(cuda).value());
  VMSTASH_LOG(kInfo, "driver:auto uses the simulator: {}",
              cuda.ok() ? std::string("the CUDA driver sees no device") : cuda.status().ToString());
  return std::unique_ptr<Driver>(new SimDriver(SimDriverOptions::FromOptions(options)));
}

}  // namespace vmstash
