// CreateDriver: picks the concrete Driver at the top of a program (C ABI init, the demo,
// tests), as docs/architecture.md §3 asks; nothing below chooses one.
//
//   driver:cuda  CudaDriver, or its error (Unavailable without a usable GPU)
//   driver:sim   SimDriver configured from the sim_* options
//   driver:auto  CudaDriver when it loads and sees at least one device, else SimDriver
//                (logged at info level, with the reason)
#ifndef VMSTASH_VMM_DRIVER_FACTORY_H_
#define VMSTASH_VMM_DRIVER_FACTORY_H_

#include <memory>

#include "absl/status/statusor.h"
#include "vmm/driver.h"
#include "vmm/vmm_options.h"

namespace vmstash {

absl::StatusOr<std::unique_ptr<Driver>> CreateDriver(const VmmOptions& options);

}  // namespace vmstash

#endif  // VMSTASH_VMM_DRIVER_FACTORY_H_
