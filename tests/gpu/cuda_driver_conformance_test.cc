// The driver conformance suite (vmm/driver_conformance.h) on CudaDriver, plus kernel
// access to VMM memory across a pause/resume at the same address. Label/tag `gpu`.
// With VMSTASH_TEST_REQUIRE_GPU=1 (the GPU run sets it) a missing GPU is a failure;
// otherwise these cases skip on machines without one (tests/gpu/cuda_factory.h).
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "tests/gpu/cuda_factory.h"
#include "tests/gpu/pattern_kernels.h"
#include "vmm/chunk.h"
#include "vmm/driver_conformance.h"
#include "vmm/mapping.h"
#include "vmm/pinned_host_buffer.h"
#include "vmm/reservation.h"

namespace vmstash {
namespace {

INSTANTIATE_TEST_SUITE_P(Cuda, DriverConformanceTest, ::testing::Values(testing::CudaDriverFactory()),
                         testing::FactoryName);

class CudaKernelAccessTest : public DriverConformanceTest {};

TEST_P(CudaKernelAccessTest, KernelsSeeRestoredBytesAtTheSameAddress) {
  const std::size_t g = granularity();
  const std::size_t size = 8 * g;
  const std::size_t words = size / 8;
  Driver& d = driver();
  Reservation r = Reservation::Create(&d, 0, size + g).value();
  const DevicePtr va = r.address();
  const DevicePtr counter = va + size;  // a last granule for the mismatch counter
  std::vector<Chunk> chunks;
  for (int i = 0; i < 4; ++i) chunks.push_back(Chunk::Create(&d, 0, 2 * g).value());
  Chunk counter_chunk = Chunk::Create(&d, 0, g).value();
  Mapping data = Mapping::Create(&d, 0, va, chunks).value();
  Mapping counter_map = Mapping::Create(&d, 0, counter, absl::MakeConstSpan(&counter_chunk, 1)).value();
  Stream s = d.CreateStream(0).value();

  int err = testing::LaunchFillPattern(s, va, words, 42);
  ASSERT_EQ(err, 0) << testing::ErrorName(err);
  PinnedHostBuffer backup = PinnedHostBuffer::Allocate(&d, 0, size).value();
  ASSERT_TRUE(d.CopyToHostAsync(0, backup.data(), va, size, s).ok());
  ASSERT_TRUE(d.SynchronizeStream(0, s).ok());
  EXPECT_EQ(static_cast<std::uint64_t*>(backup.data())[words - 1], testing::PatternValue(42, words - 1));

  ASSERT_TRUE(data.Unmap().ok());
  chunks.clear();
  std::vector<Chunk> fresh;
  fresh.push_back(Chunk::Create(&d, 0, size).value());
  Mapping resumed = Mapping::Create(&d, 0, va, fresh).value();
  ASSERT_TRUE(d.CopyToDeviceAsync(0, va, backup.data(), size, s).ok());
  ASSERT_TRUE(d.MemsetAsync(0, counter, 0, 8, s).ok());
  err = testing::LaunchCountMismatches(s, va, words, 42, counter);
  ASSERT_EQ(err, 0) << testing::ErrorName(err);
  std::uint64_t mismatches = ~0ull;
  ASSERT_TRUE(d.CopyToHostAsync(0, &mismatches, counter, 8, s).ok());
  ASSERT_TRUE(d.SynchronizeStream(0, s).ok());
  EXPECT_EQ(mismatches, 0u);
  // And a kernel checking for another seed does see differences: the check can fail.
  ASSERT_TRUE(d.MemsetAsync(0, counter, 0, 8, s).ok());
  ASSERT_EQ(testing::LaunchCountMismatches(s, va, words, 43, counter), 0);
  ASSERT_TRUE(d.CopyToHostAsync(0, &mismatches, counter, 8, s).ok());
  ASSERT_TRUE(d.SynchronizeStream(0, s).ok());
  EXPECT_EQ(mismatches, words);
  ASSERT_TRUE(d.DestroyStream(0, s).ok());
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaKernelAccessTest, ::testing::Values(testing::CudaDriverFactory()),
                         testing::FactoryName);

}  // namespace
}  // namespace vmstash
