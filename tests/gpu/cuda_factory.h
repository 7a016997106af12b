// CudaDriver as the driver under test (vmm/driver_under_test.h) of the suites and fixtures
// instantiated for the GPU here (label/tag `gpu`): required, so a missing GPU is a failure,
// when VMSTASH_TEST_REQUIRE_GPU=1 (the GPU run sets it); otherwise the cases skip on
// machines without one.
//
//   INSTANTIATE_TEST_SUITE_P(Cuda, SomeTest, ::testing::Values(testing::CudaDriverFactory()),
//                            testing::FactoryName);
//
// Test-only, header-only. Thread-safety: pure functions (getenv at instantiation).
#ifndef VMSTASH_TESTS_GPU_CUDA_FACTORY_H_
#define VMSTASH_TESTS_GPU_CUDA_FACTORY_H_

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "vmm/cuda_driver.h"
#include "vmm/driver_under_test.h"

namespace vmstash::testing {

inline bool GpuRequired() {
  const char* v = std::getenv("VMSTASH_TEST_REQUIRE_GPU");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

inline absl::StatusOr<std::unique_ptr<Driver>> MakeCudaDriver() {
  absl::StatusOr<std::unique_ptr<CudaDriver>> d = CudaDriver::Create();
  if (!d.ok()) return d.status();
  return std::unique_ptr<Driver>(std::move(d).value());
}

inline DriverFactory CudaDriverFactory() { return DriverFactory{"cuda", MakeCudaDriver, GpuRequired()}; }

// The instantiated tests' name suffix: the factory's name ("cuda").
inline std::string FactoryName(const ::testing::TestParamInfo<DriverFactory>& info) { return info.param.name; }

}  // namespace vmstash::testing

#endif  // VMSTASH_TESTS_GPU_CUDA_FACTORY_H_
