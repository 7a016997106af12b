// The driver conformance suite: one set of gtest cases that every Driver must pass.
//
// Instantiated for SimDriver in vmm/sim_driver_conformance_test.cc (CI) and for CudaDriver
// in tests/gpu/cuda_driver_conformance_test.cc (label/tag `gpu`), so the simulator is held
// to what the hardware does. Each case runs on a fresh driver and ends with its leak check.
// The parameter, DriverFactory, is vmm/driver_under_test.h.
//
//   INSTANTIATE_TEST_SUITE_P(Sim, DriverConformanceTest,
//                            ::testing::Values(DriverFactory{"sim", MakeSim, false}));
#ifndef VMSTASH_VMM_DRIVER_CONFORMANCE_H_
#define VMSTASH_VMM_DRIVER_CONFORMANCE_H_

#include <cstddef>
#include <memory>

#include "gtest/gtest.h"
#include "vmm/driver.h"
#include "vmm/driver_under_test.h"

namespace vmstash {

class DriverConformanceTest : public ::testing::TestWithParam<DriverFactory> {
 protected:
  void SetUp() override;
  void TearDown() override;

  Driver& driver() { return *driver_; }
  std::size_t granularity() const { return granularity_; }

  std::unique_ptr<Driver> driver_;
  std::size_t granularity_ = 0;
};

}  // namespace vmstash

#endif  // VMSTASH_VMM_DRIVER_CONFORMANCE_H_
