// Pause/resume on a real GPU (label gpu): a CUDA graph captured on buffers of a `backup`
// tag replays bit-exact after pause + resume, at the same addresses, and the restored
// output equals what it was before the pause (checked by a kernel too). What a pause gives
// back to the device, its use by others meanwhile, and the bytes of a backup tag read
// back by copies are the allocator conformance suite's, held on the simulator as well
// (allocator/allocator_conformance.h, tests/gpu/cuda_allocator_conformance_test.cc).
// With VMSTASH_TEST_REQUIRE_GPU=1 a missing GPU fails; otherwise the tests skip.
#include <cstdint>
#include <cstring>
#include <vector>

#include "allocator/testing.h"
#include "gtest/gtest.h"
#include "tests/gpu/cuda_factory.h"
#include "tests/gpu/graph_kernels.h"
#include "tests/gpu/pattern_kernels.h"

namespace vmstash {
namespace {

using Transition = CachingAllocator::Transition;

class PauseResumeGpuTest : public testing::DriverAllocatorTest {};

TEST_P(PauseResumeGpuTest, CapturedGraphReplaysBitExactAfterPauseAndResume) {
  MakeAllocator(AllocatorOptions{});
  Driver* driver = driver_.get();
  TagId weights = *InternTag("weights");
  ASSERT_TRUE(alloc_->CreateTag(weights, Policy::kBackup).ok());
  const std::size_t bytes = 512 * kMiB, words = bytes / 8;
  DevicePtr in = *alloc_->Allocate(bytes, nullptr, weights);
  DevicePtr out = *alloc_->Allocate(bytes, nullptr, weights);
  DevicePtr counter = *alloc_->Allocate(8, nullptr, kDefaultTag);
  Stream stream = NewStream();
  ASSERT_EQ(testing::LaunchFillPattern(stream, in, words, 77), 0);
  ASSERT_TRUE(driver->SynchronizeStream(0, stream).ok());
  void* graph = nullptr;
  ASSERT_EQ(testing::CaptureMixGraph(stream, in, out, words, &graph), 0);
  ASSERT_EQ(testing::LaunchGraph(graph, stream), 0);
  std::vector<std::uint64_t> expected(words);
  ASSERT_TRUE(driver->CopyToHostAsync(0, expected.data(), out, bytes, stream).ok());
  ASSERT_TRUE(driver->SynchronizeStream(0, stream).ok());
  for (std::size_t i = 0; i < words; i += 4099) ASSERT_EQ(expected[i], testing::MixValue(testing::PatternValue(77, i)));

  ASSERT_EQ(*alloc_->Pause(weights), Transition::kDone);
  ASSERT_EQ(*alloc_->Resume(weights), Transition::kDone);
  // Restored output equals the pre-pause output, bit for bit.
  std::vector<std::uint64_t> restored(words);
  ASSERT_TRUE(driver->CopyToHostAsync(0, restored.data(), out, bytes, stream).ok());
  ASSERT_TRUE(driver->SynchronizeStream(0, stream).ok());
  EXPECT_EQ(std::memcmp(restored.data(), expected.data(), bytes), 0);
  // The graph captured before the pause replays on the same addresses.
  ASSERT_TRUE(driver->MemsetAsync(0, out, 0, bytes, stream).ok());
  ASSERT_EQ(testing::LaunchGraph(graph, stream), 0);
  ASSERT_TRUE(driver->CopyToHostAsync(0, restored.data(), out, bytes, stream).ok());
  ASSERT_TRUE(driver->SynchronizeStream(0, stream).ok());
  EXPECT_EQ(std::memcmp(restored.data(), expected.data(), bytes), 0);
  ASSERT_TRUE(driver->MemsetAsync(0, counter, 0, 8, stream).ok());
  ASSERT_EQ(testing::LaunchCountMismatches(stream, in, words, 77, counter), 0);
  std::uint64_t mismatches = 1;
  ASSERT_TRUE(driver->CopyToHostAsync(0, &mismatches, counter, 8, stream).ok());
  ASSERT_TRUE(driver->SynchronizeStream(0, stream).ok());
  EXPECT_EQ(mismatches, 0u);

  EXPECT_EQ(testing::DestroyGraph(graph), 0);
  for (DevicePtr p : {in, out, counter}) ASSERT_TRUE(alloc_->Free(p).ok());
  // TearDown destroys the allocator, then the stream, then checks for leaks.
}

INSTANTIATE_TEST_SUITE_P(Cuda, PauseResumeGpuTest, ::testing::Values(testing::CudaDriverFactory()),
                         testing::FactoryName);

}  // namespace
}  // namespace vmstash
