// Pause/resume on a real GPU (label gpu):
//   - a CUDA graph captured on buffers of a `backup` tag replays bit-exact after
//     pause + resume, and the restored output equals what it was before the pause;
//   - device free memory rises by >= 95% of the tag's reserved bytes during the pause,
//     and that memory is usable by others meanwhile.
// With VMSTASH_TEST_REQUIRE_GPU=1 a missing GPU fails; otherwise the tests skip.
#include <cstdlib>
#include <cstring>
#include <vector>

#include "allocator/caching_allocator.h"
#include "gtest/gtest.h"
#include "tests/gpu/graph_kernels.h"
#include "tests/gpu/pattern_kernels.h"
#include "vmm/cuda_driver.h"

namespace vmstash {
namespace {

using Transition = CachingAllocator::Transition;
constexpr std::size_t kMiB = std::size_t{1} << 20;

TEST(PauseResumeGpuTest, CapturedGraphReplaysBitExactAfterPauseAndResume) {
  absl::StatusOr<std::unique_ptr<CudaDriver>> d = CudaDriver::Create();
  if (!d.ok() || *(*d)->DeviceCount() == 0) {
    const char* req = std::getenv("VMSTASH_TEST_REQUIRE_GPU");
    if (req != nullptr && std::strcmp(req, "1") == 0) FAIL() << "no GPU";
    GTEST_SKIP() << "no GPU";
  }
  std::unique_ptr<CudaDriver> driver = *std::move(d);
  auto alloc = *CachingAllocator::Create(driver.get(), 0, AllocatorOptions{});
  TagId weights = *InternTag("weights"), kv = *InternTag("kv_cache");
  ASSERT_TRUE(alloc->CreateTag(weights, Policy::kBackup).ok());
  ASSERT_TRUE(alloc->CreateTag(kv, Policy::kDiscard).ok());
  const std::size_t bytes = 512 * kMiB, words = bytes / 8;
  DevicePtr in = *alloc->Allocate(bytes, nullptr, weights);
  DevicePtr out = *alloc->Allocate(bytes, nullptr, weights);
  DevicePtr cache = *alloc->Allocate(2048 * kMiB, nullptr, kv);
  DevicePtr counter = *alloc->Allocate(8, nullptr, kDefaultTag);
  Stream stream = *driver->CreateStream(0);
  ASSERT_EQ(testing::LaunchFillPattern(stream, in, words, 77), 0);
  ASSERT_TRUE(driver->SynchronizeStream(0, stream).ok());
  void* graph = nullptr;
  ASSERT_EQ(testing::CaptureMixGraph(stream, in, out, words, &graph), 0);
  ASSERT_EQ(testing::LaunchGraph(graph, stream), 0);
  std::vector<std::uint64_t> expected(words);
  ASSERT_TRUE(driver->CopyToHostAsync(0, expected.data(), out, bytes, stream).ok());
  ASSERT_TRUE(driver->SynchronizeStream(0, stream).ok());
  for (std::size_t i = 0; i < words; i += 4099) ASSERT_EQ(expected[i], testing::MixValue(testing::PatternValue(77, i)));

  std::int64_t reserved = 0;
  for (const TagStats& t : alloc->Stats().tags) reserved += t.name == "default" ? 0 : t.reserved_bytes.current;
  std::size_t free_before = driver->MemoryInfo(0)->free_bytes;
  ASSERT_EQ(*alloc->Pause(weights), Transition::kDone);
  ASSERT_EQ(*alloc->Pause(kv), Transition::kDone);
  std::size_t free_paused = driver->MemoryInfo(0)->free_bytes;
  std::printf("reserved by the tags %lld bytes; device free rose by %lld bytes during the pause\n",
              static_cast<long long>(reserved), static_cast<long long>(free_paused - free_before));
  EXPECT_GE(static_cast<double>(free_paused - free_before), 0.95 * static_cast<double>(reserved));
  // The released memory is usable by others meanwhile.
  DevicePtr other = *alloc->Allocate(free_paused - free_before - 64 * kMiB, nullptr, kDefaultTag);
  ASSERT_TRUE(driver->MemsetAsync(0, other, 0xee, 64 * kMiB, stream).ok());
  ASSERT_TRUE(driver->SynchronizeStream(0, stream).ok());
  ASSERT_TRUE(alloc->Free(other).ok());
  ASSERT_TRUE(alloc->EmptyCache(kDefaultTag).ok());

  ASSERT_EQ(*alloc->Resume(kv), Transition::kDone);
  ASSERT_EQ(*alloc->Resume(weights), Transition::kDone);
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
  for (DevicePtr p : {in, out, cache, counter}) ASSERT_TRUE(alloc->Free(p).ok());
  alloc.reset();
  ASSERT_TRUE(driver->DestroyStream(0, stream).ok());
  absl::Status leaks = driver->CheckNoLeaks();
  EXPECT_TRUE(leaks.ok()) << leaks;
}

}  // namespace
}  // namespace vmstash
