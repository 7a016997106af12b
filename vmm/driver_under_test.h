// DriverFactory: how a suite held against every Driver makes its driver under test. The
// parameter of the driver conformance suite (driver_conformance.h) and of the allocator's
// suites over a driver (allocator/testing.h, allocator/allocator_conformance.h), each
// instantiated for SimDriver in CI and for CudaDriver in tests/gpu (label/tag `gpu`).
//
// Test-only, header-only. Thread-safety: a value; `make` is called by one test at a time.
#ifndef VMSTASH_VMM_DRIVER_UNDER_TEST_H_
#define VMSTASH_VMM_DRIVER_UNDER_TEST_H_

#include <functional>
#include <memory>
#include <ostream>
#include <string>

#include "absl/status/statusor.h"
#include "vmm/driver.h"

namespace vmstash {

struct DriverFactory {
  std::string name;
  std::function<absl::StatusOr<std::unique_ptr<Driver>>()> make;
  // When false, a driver that cannot be created (Unavailable: no GPU here) skips the
  // case; when true, that is a failure (the GPU run sets it).
  bool required = true;
};

inline std::ostream& operator<<(std::ostream& os, const DriverFactory& f) { return os << f.name; }

}  // namespace vmstash

#endif  // VMSTASH_VMM_DRIVER_UNDER_TEST_H_
