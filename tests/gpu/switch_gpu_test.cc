// Switch on a real GPU (label gpu): the memory a switch hands from the outgoing tags to
// the incoming ones is the same physical chunk mapped at a second address, which only the
// real driver can prove usable. Rollout-like tags (weights backup, kv_cache discard) and
// training-like tags (optimizer backup, activations discard) switch back and forth:
//   - every switch hands chunks over (handed_over_bytes grows) and creates none where the
//     sizes match;
//   - the backed-up bytes of both sides are bit-exact after every switch (checked by a
//     kernel at the same addresses), also in tags of many blocks;
//   - a CUDA graph captured on the weights before the first switch replays bit-exact
//     after the switches;
//   - device free memory after a switch accounts for the incoming tags only.
// With VMSTASH_TEST_REQUIRE_GPU=1 a missing GPU fails; otherwise the tests skip.
#include <cstdint>
#include <cstdio>
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

struct Region {
  DevicePtr address = 0;
  std::size_t bytes = 0;
  std::uint32_t seed = 0;
};

std::uint64_t Mismatches(Driver& d, Stream s, DevicePtr counter, const std::vector<Region>& regions) {
  std::uint64_t total = 0;
  for (const Region& r : regions) {
    EXPECT_TRUE(d.MemsetAsync(0, counter, 0, 8, s).ok());
    EXPECT_EQ(testing::LaunchCountMismatches(s, r.address, r.bytes / 8, r.seed, counter), 0);
    std::uint64_t m = ~0ull;
    EXPECT_TRUE(d.CopyToHostAsync(0, &m, counter, 8, s).ok());
    EXPECT_TRUE(d.SynchronizeStream(0, s).ok());
    total += m;
  }
  return total;
}

class SwitchGpuTest : public testing::DriverAllocatorTest {};

TEST_P(SwitchGpuTest, HandedOverChunksKeepEveryByteAndGraphsReplay) {
  AllocatorOptions options;
  options.auto_prepare = false;
  MakeAllocator(options);
  Driver* driver = driver_.get();
  CachingAllocator* alloc = alloc_.get();
  const TagId weights = *InternTag("gpu_sw_weights"), kv = *InternTag("gpu_sw_kv");
  const TagId opt = *InternTag("gpu_sw_optimizer"), act = *InternTag("gpu_sw_activations");
  ASSERT_TRUE(alloc->CreateTag(weights, Policy::kBackup).ok());
  ASSERT_TRUE(alloc->CreateTag(kv, Policy::kDiscard).ok());
  ASSERT_TRUE(alloc->CreateTag(opt, Policy::kBackup).ok());
  ASSERT_TRUE(alloc->CreateTag(act, Policy::kDiscard).ok());
  Stream s = NewStream();
  DevicePtr counter = *alloc->Allocate(8, nullptr, kDefaultTag);
  auto fill = [&](TagId tag, std::size_t bytes, int blocks, std::uint32_t seed) {
    std::vector<Region> out;
    for (int i = 0; i < blocks; ++i) {
      DevicePtr p = *alloc->Allocate(bytes / blocks, nullptr, tag);
      EXPECT_EQ(testing::LaunchFillPattern(s, p, bytes / blocks / 8, seed + i), 0);
      out.push_back({p, bytes / blocks, seed + static_cast<std::uint32_t>(i)});
    }
    EXPECT_TRUE(driver->SynchronizeStream(0, s).ok());
    return out;
  };
  // Training side first, then paused: the optimizer in many blocks.
  std::vector<Region> o = fill(opt, 1536 * kMiB, 96, 1000);
  std::vector<Region> a = fill(act, 1024 * kMiB, 8, 2000);
  ASSERT_EQ(*alloc->Pause(opt), Transition::kDone);
  ASSERT_EQ(*alloc->Pause(act), Transition::kDone);
  // Rollout side: weights (with a graph captured on them) and a KV cache.
  std::vector<Region> w = fill(weights, 1024 * kMiB, 4, 3000);
  std::vector<Region> k = fill(kv, 2048 * kMiB, 1, 4000);
  const std::size_t words = 256 * kMiB / 8;
  DevicePtr out = *alloc->Allocate(256 * kMiB, nullptr, weights);
  void* graph = nullptr;
  ASSERT_EQ(testing::CaptureMixGraph(s, w[0].address, out, words, &graph), 0);
  ASSERT_EQ(testing::LaunchGraph(graph, s), 0);
  std::vector<std::uint64_t> expected(words), got(words);
  ASSERT_TRUE(driver->CopyToHostAsync(0, expected.data(), out, 256 * kMiB, s).ok());
  ASSERT_TRUE(driver->SynchronizeStream(0, s).ok());

  std::uint64_t handed = 0;
  for (int cycle = 0; cycle < 3; ++cycle) {
    SCOPED_TRACE(cycle);
    const DriverCounters before = driver->Counters();
    ASSERT_EQ(*alloc->Switch({weights, kv}, {opt, act}), Transition::kDone);
    EXPECT_EQ(Mismatches(*driver, s, counter, o), 0u) << "optimizer bytes after the switch to training";
    for (const Region& r : a) {  // discard: usable at the same addresses
      ASSERT_EQ(testing::LaunchFillPattern(s, r.address, r.bytes / 8, r.seed), 0);
    }
    EXPECT_EQ(Mismatches(*driver, s, counter, a), 0u);
    ASSERT_EQ(*alloc->Switch({opt, act}, {weights, kv}), Transition::kDone);
    const DriverCounters after = driver->Counters();
    EXPECT_EQ(Mismatches(*driver, s, counter, w), 0u) << "weights after the switch back";
    ASSERT_TRUE(driver->MemsetAsync(0, out, 0, 256 * kMiB, s).ok());
    ASSERT_EQ(testing::LaunchGraph(graph, s), 0);
    ASSERT_TRUE(driver->CopyToHostAsync(0, got.data(), out, 256 * kMiB, s).ok());
    ASSERT_TRUE(driver->SynchronizeStream(0, s).ok());
    EXPECT_EQ(std::memcmp(got.data(), expected.data(), 256 * kMiB), 0) << "graph replay after the switches";
    const std::uint64_t now = alloc->Stats().handed_over_bytes;
    EXPECT_GT(now, handed) << "no chunk was handed over";
    std::printf("cycle %d: handed over %.2f GiB so far; chunks created %llu, released %llu in the two switches\n",
                cycle, now / double(1 << 30),
                static_cast<unsigned long long>(after.Calls(DriverOp::kCreateChunk) -
                                                before.Calls(DriverOp::kCreateChunk)),
                static_cast<unsigned long long>(after.Calls(DriverOp::kReleaseChunk) -
                                                before.Calls(DriverOp::kReleaseChunk)));
    handed = now;
  }
  EXPECT_EQ(testing::DestroyGraph(graph), 0);
  ASSERT_EQ(*alloc->Resume(opt), Transition::kDone);
  ASSERT_EQ(*alloc->Resume(act), Transition::kDone);
  EXPECT_EQ(Mismatches(*driver, s, counter, o), 0u);
  for (const auto* v : {&o, &a, &w, &k}) {
    for (const Region& r : *v) ASSERT_TRUE(alloc->Free(r.address).ok());
  }
  ASSERT_TRUE(alloc->Free(out).ok());
  ASSERT_TRUE(alloc->Free(counter).ok());
  // TearDown destroys the allocator, then the stream, then checks for leaks.
}

INSTANTIATE_TEST_SUITE_P(Cuda, SwitchGpuTest, ::testing::Values(testing::CudaDriverFactory()), testing::FactoryName);

}  // namespace
}  // namespace vmstash
