// The allocator conformance suite: the CachingAllocator behaviours that must hold on
// every Driver, written once and held against the simulator and the hardware alike.
//
// Instantiated for SimDriver in allocator/sim_allocator_conformance_test.cc (CI, label
// cpu) and for CudaDriver in tests/gpu/cuda_allocator_conformance_test.cc (label/tag
// `gpu`; required there when VMSTASH_TEST_REQUIRE_GPU=1), as vmm/driver_conformance.h is
// for the driver itself. Each case runs on a fresh driver and allocator
// (DriverAllocatorTest, allocator/testing.h) and ends with the driver's leak check. Bytes
// are written and read through the driver (copies and memsets), never through host
// pointers, so the same case proves them on device memory.
//
// The cases: reuse and alignment of freed blocks, bytes kept across other tags' churn,
// EmptyCache giving memory back to the device, stream-ordered reuse with RecordStream,
// destruction with live blocks, out of memory as an error, pause/resume of a discard tag
// (memory released, same addresses usable) and of a backup tag (bytes kept), and the
// switch (backed-up bytes both ways at the same addresses, discard memory handed over
// zeroed or, without zeroing, as the very same physical memory). Sizes stay below a few
// GiB and nothing is timed, so they hold on any GPU of 16 GiB or more.
//
//   INSTANTIATE_TEST_SUITE_P(Sim, AllocatorConformanceTest,
//                            ::testing::Values(DriverFactory{"sim", MakeSim, true}));
#ifndef VMSTASH_ALLOCATOR_ALLOCATOR_CONFORMANCE_H_
#define VMSTASH_ALLOCATOR_ALLOCATOR_CONFORMANCE_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "allocator/testing.h"

namespace vmstash {

class AllocatorConformanceTest : public testing::DriverAllocatorTest {
 protected:
  // A block of a case, written with FillPattern(seed) (base/byte_pattern.h).
  struct Live {
    DevicePtr address = 0;
    std::size_t size = 0;
    std::uint8_t seed = 0;
  };

  // Allocates `sizes` in `tag`, each written with its own pattern (seed, seed + 1, ...).
  std::vector<Live> Fill(TagId tag, const std::vector<std::size_t>& sizes, std::uint8_t seed);
  // The bytes of `blocks` that lost their pattern, read back through the driver.
  std::size_t Wrong(const std::vector<Live>& blocks);
  void FreeAll(const std::vector<Live>& blocks);
  // `tag` interned and created with `policy` in the allocator.
  TagId Tag(const char* name, Policy policy);
  // Device free memory now (0, and a failure, when the driver cannot say).
  std::size_t FreeBytes();
  // What a pause gave back (`released_bytes`), less 64 MiB, allocated in the default tag,
  // written all over, freed and given back again: memory used by others meanwhile.
  void UseMeanwhile(std::int64_t released_bytes);
  // Calls of `op` made through the driver so far.
  std::uint64_t Calls(DriverOp op) const { return driver_->Counters().Calls(op); }
  // The options of the switch cases: small stages, pieces and copy groups, so a switch
  // of a few hundred MiB has several of each, and no background preparation.
  static AllocatorOptions SwitchOptions(bool zero);
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_ALLOCATOR_CONFORMANCE_H_
