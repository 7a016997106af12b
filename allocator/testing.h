// What the allocator's tests share: byte units, the options a test's allocator starts
// from, the order an allocator test ends in, and the two fixtures that build a driver and a
// CachingAllocator on its device 0 so a test does not build them by hand.
//
//   SimAllocatorTest     TEST_F fixture on a SimDriver (sim_, alloc_): the unit tests
//                        beside the code (allocator/, stash/).
//   DriverAllocatorTest  TEST_P fixture over a DriverFactory (vmm/driver_under_test.h;
//                        driver_, alloc_): the allocator conformance suite
//                        (allocator_conformance.h) and the GPU-only allocator tests of
//                        tests/gpu, each instantiated with the drivers it must hold on.
//
// Both end the same way (TearDownAllocator): the allocator is destroyed first (its fences
// and pending frees end with it), then the streams the test made with NewStream, then the
// driver's ledger must show nothing alive (Driver::CheckNoLeaks; the simulator's also
// reports unsynchronized work that an unmap overtook).
//
// Test-only. Thread-safety: a fixture belongs to its test's thread; the allocator it
// builds is as thread-safe as ever.
#ifndef VMSTASH_ALLOCATOR_TESTING_H_
#define VMSTASH_ALLOCATOR_TESTING_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "allocator/allocator_options.h"
#include "allocator/caching_allocator.h"
#include "allocator/stats.h"
#include "allocator/tag.h"
#include "gtest/gtest.h"
#include "vmm/driver.h"
#include "vmm/driver_under_test.h"
#include "vmm/sim_driver.h"

namespace vmstash {

// Byte units for tests' sizes.
inline constexpr std::size_t kKiB = std::size_t{1} << 10;
inline constexpr std::size_t kMiB = std::size_t{1} << 20;
inline constexpr std::size_t kGiB = std::size_t{1} << 30;

namespace testing {

// AllocatorOptions{} with validate_each_op on (every build type, NDEBUG ones included):
// the options a test's allocator starts from.
AllocatorOptions TestOptions();

// Ends an allocator test: destroys `alloc`, then `streams` (on device 0 of `driver`), then
// expects the driver's leak check to pass. Clears both.
void TearDownAllocator(Driver& driver, std::unique_ptr<CachingAllocator>& alloc, std::vector<Stream>& streams);

// `tag`'s statistics in `alloc` (a default TagStats, name empty, when it has no pool).
TagStats TagStatsOf(const CachingAllocator& alloc, TagId tag);

// FillPattern(seed) (base/byte_pattern.h) written into [ptr, ptr + n) through the driver:
// a host buffer copied in on the default stream, which is then synchronized.
absl::Status WritePattern(Driver& driver, DevicePtr ptr, std::size_t n, std::uint8_t seed);
// The bytes of [ptr, ptr + n) that differ from FillPattern(seed), read back through the
// driver (any device memory, not only the simulator's); a failed read is a test failure
// and counts every byte.
std::size_t WrongBytesOnDevice(Driver& driver, DevicePtr ptr, std::size_t n, std::uint8_t seed);

// A SimDriver and a CachingAllocator on its device 0. SetUp makes nothing: each test
// fixture calls MakeAllocator (from its SetUp or the test body).
class SimAllocatorTest : public ::testing::Test {
 protected:
  // TearDownAllocator, when a driver was made.
  void TearDown() override;

  // A fresh SimDriver of `sim_options` and an allocator on it; the earlier pair and its
  // streams, if any, are dropped without a leak check.
  void MakeAllocator(SimDriverOptions sim_options, AllocatorOptions options = TestOptions());
  // A stream of device 0, destroyed by TearDown after the allocator.
  Stream NewStream();

  std::unique_ptr<SimDriver> sim_;
  std::unique_ptr<CachingAllocator> alloc_;
  std::vector<Stream> streams_;
};

// The driver the parameter makes and a CachingAllocator on its device 0 with
// TestOptions(). A driver that cannot be made, or that sees no device, skips the case
// unless the factory says it is required (then it fails).
class DriverAllocatorTest : public ::testing::TestWithParam<DriverFactory> {
 protected:
  void SetUp() override;
  // TearDownAllocator, when a driver was made.
  void TearDown() override;

  // Replaces the allocator by one with `options`, on the same driver (the earlier one is
  // destroyed first).
  void MakeAllocator(AllocatorOptions options);
  // A stream of device 0, destroyed by TearDown after the allocator.
  Stream NewStream();
  // An allocation of `size_bytes` in `tag` on `stream`; a failure is a test failure, and 0.
  DevicePtr Alloc(std::size_t size_bytes, TagId tag = kDefaultTag, Stream stream = nullptr);

  std::unique_ptr<Driver> driver_;
  std::unique_ptr<CachingAllocator> alloc_;
  std::vector<Stream> streams_;
};

}  // namespace testing
}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_TESTING_H_
