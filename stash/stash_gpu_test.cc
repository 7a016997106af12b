// The paged stash kernels on a GPU (label gpu), checked against the CPU reference model
// (page_model.h), scenario by scenario: T1 round trips {0, 1, P-1, P, P+1, max}
// released out of order; T2 sticky overflow and reset; T3 host spill; T4 one captured
// graph replayed with several device counts, an overflow, then a clean replay; T5 zero
// tail; T6 pause/resume of an idle arena (memory released, graph replays after resume;
// refused while pages are live); T7 an arena above 4 GiB; T9 discard.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "allocator/caching_allocator.h"
#include "gtest/gtest.h"
#include "stash/arena.h"
#include "stash/page_model.h"
#include "vmm/cuda_driver.h"

namespace vmstash::stash {
namespace {

constexpr std::uint64_t kRowBytes = 7168 * 2;  // a bf16 row of hidden size 7168
constexpr std::uint32_t kP = 64;

class StashGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<CudaDriver>> d = CudaDriver::Create();
    if (!d.ok() || *(*d)->DeviceCount() == 0) {
      const char* req = std::getenv("VMSTASH_TEST_REQUIRE_GPU");
      if (req != nullptr && std::strcmp(req, "1") == 0) FAIL() << "no GPU";
      GTEST_SKIP() << "no GPU";
    }
    driver_ = *std::move(d);
    AllocatorOptions options;
    options.auto_prepare = false;
    alloc_ = *CachingAllocator::Create(driver_.get(), 0, options);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  Stream S() const { return reinterpret_cast<Stream>(stream_); }
  // Device buffers outside the arena's tag.
  void* Buffer(std::uint64_t bytes) {
    return reinterpret_cast<void*>(*alloc_->Allocate(bytes, S(), kDefaultTag));
  }
  std::vector<std::uint8_t> Pattern(std::uint64_t rows, int seed) {
    std::vector<std::uint8_t> v(rows * kRowBytes);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::uint8_t>((i * 131 + seed * 17) >> 3);
    return v;
  }
  std::vector<std::uint32_t> FreeList(StashArena& a, int tier) {
    StashState s{};
    cudaStreamSynchronize(stream_);
    cudaMemcpy(&s, a.state(), sizeof(s), cudaMemcpyDeviceToHost);
    std::vector<std::uint32_t> all(s.tier[tier].cap);
    cudaMemcpy(all.data(), s.tier[tier].free_list, all.size() * 4, cudaMemcpyDefault);
    std::vector<std::uint32_t> out;
    for (std::uint64_t c = s.tier[tier].head; c < s.tier[tier].tail; ++c) out.push_back(all[c % s.tier[tier].cap]);
    return out;
  }
  void ExpectBalanced(StashArena& a, int tier, std::uint64_t cap) {
    std::vector<std::uint32_t> free = FreeList(a, tier);
    ASSERT_EQ(free.size(), cap);
    std::sort(free.begin(), free.end());
    std::vector<std::uint32_t> all(cap);
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(free, all);
  }

  std::unique_ptr<CudaDriver> driver_;
  std::unique_ptr<CachingAllocator> alloc_;
  cudaStream_t stream_ = nullptr;
};

TEST_F(StashGpuTest, RoundTripsSpillOverflowResetDiscardAgainstTheModel) {
  StashArenaSpec spec{kRowBytes, kP, "stash_t1"};
  auto arena = *StashArena::Create(driver_.get(), alloc_.get(), spec);
  ASSERT_TRUE(arena->Prepare(20, 16, S()).ok());
  ArenaSpec mspec;
  mspec.row_bytes = kRowBytes;
  mspec.page_rows = kP;
  mspec.capacity_pages[0] = 20;
  mspec.capacity_pages[1] = 16;
  PageModel model = *PageModel::Create(mspec);

  const std::uint64_t max_rows = 9 * kP + 5;
  // 0+1+1+1+2+10 pages leave 5 of the 20 device pages: the last (7 pages) spills to the host.
  const std::uint64_t counts[] = {0, 1, kP - 1, kP, kP + 1, max_rows, 7 * kP};
  const int n = 7;
  void* src = Buffer(max_rows * kRowBytes);
  void* dst = Buffer(max_rows * kRowBytes);
  std::int64_t* rows_dev = static_cast<std::int64_t*>(Buffer(8 * n));
  std::vector<StashHandleHeader*> handles;
  std::vector<Handle> mh(n);
  std::vector<std::vector<std::uint8_t>> data;
  for (int i = 0; i < n; ++i) {
    data.push_back(Pattern(max_rows, i));
    handles.push_back(*arena->NewHandle(max_rows));
    std::int64_t c = static_cast<std::int64_t>(counts[i]);
    ASSERT_EQ(cudaMemcpyAsync(rows_dev + i, &c, 8, cudaMemcpyHostToDevice, stream_), cudaSuccess);
    ASSERT_EQ(cudaMemcpyAsync(src, data[i].data(), data[i].size(), cudaMemcpyHostToDevice, stream_), cudaSuccess);
    ASSERT_TRUE(arena->Stash(S(), src, rows_dev + i, max_rows, handles[i]).ok());
    ASSERT_TRUE(model.Stash(data[i].data(), counts[i], max_rows, &mh[i]).ok());
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    StashHandleHeader h{};
    cudaMemcpy(&h, handles[i], sizeof(h), cudaMemcpyDeviceToHost);
    EXPECT_EQ(h.status, mh[i].status == HandleStatus::kDevice ? kHandleDevice : kHandleHost) << i;
    EXPECT_EQ(h.rows, counts[i]);
  }
  StashFlags flags = *arena->ReadFlags(S());
  EXPECT_EQ(flags.host_spill, 1u);
  EXPECT_EQ(flags.overflow, 0u);
  EXPECT_EQ(FreeList(*arena, 0), model.FreeList(0));
  EXPECT_EQ(FreeList(*arena, 1), model.FreeList(1));
  std::vector<std::uint8_t> out(max_rows * kRowBytes);
  for (int i : {3, 6, 0, 5, 1, 4}) {  // not LIFO; zero tail on every other one
    const bool zero = i % 2 == 0;
    ASSERT_TRUE(arena->Restore(S(), handles[i], dst, max_rows, zero).ok());
    ASSERT_EQ(cudaMemcpyAsync(out.data(), dst, out.size(), cudaMemcpyDeviceToHost, stream_), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    ASSERT_EQ(0, std::memcmp(out.data(), data[i].data(), counts[i] * kRowBytes)) << "count " << counts[i];
    if (zero) {
      for (std::uint64_t b = counts[i] * kRowBytes; b < out.size(); b += 4093) ASSERT_EQ(out[b], 0) << b;
    }
    ASSERT_TRUE(model.Restore(&mh[i], nullptr, max_rows, zero).ok());
  }
  ASSERT_TRUE(arena->Discard(S(), handles[2], max_rows).ok());  // T9
  ASSERT_TRUE(model.Discard(&mh[2]).ok());
  EXPECT_EQ(FreeList(*arena, 0), model.FreeList(0)) << "the same permutation as the model";
  ExpectBalanced(*arena, 0, 20);
  ExpectBalanced(*arena, 1, 16);

  // T2: overflow is sticky and writes nothing; reset clears it.
  std::int64_t big = 60 * kP, small = 1;
  StashHandleHeader* hb = *arena->NewHandle(60 * kP);  // a handle made for that many rows
  StashHandleHeader* hs = handles[1];
  ASSERT_EQ(cudaMemcpyAsync(rows_dev, &big, 8, cudaMemcpyHostToDevice, stream_), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(rows_dev + 1, &small, 8, cudaMemcpyHostToDevice, stream_), cudaSuccess);
  void* big_src = Buffer(60 * kP * kRowBytes);
  ASSERT_TRUE(arena->Stash(S(), big_src, rows_dev, 60 * kP, hb).ok());
  ASSERT_TRUE(arena->Stash(S(), src, rows_dev + 1, max_rows, hs).ok());
  flags = *arena->ReadFlags(S());
  EXPECT_EQ(flags.overflow, 1u);
  EXPECT_EQ(flags.last_failed_pages, 60u);
  EXPECT_EQ(FreeList(*arena, 0).size(), 20u) << "head unchanged";
  StashHandleHeader h{};
  cudaMemcpy(&h, hs, sizeof(h), cudaMemcpyDeviceToHost);
  EXPECT_EQ(h.status, kHandleOverflowed) << "a stash after an overflow is a no-op";
  ASSERT_TRUE(arena->Reset(S()).ok());
  flags = *arena->ReadFlags(S());
  EXPECT_EQ(flags.overflow, 0u);
  ExpectBalanced(*arena, 0, 20);
  for (StashHandleHeader* hh : handles) ASSERT_TRUE(arena->FreeHandle(hh).ok());
  ASSERT_TRUE(arena->FreeHandle(hb).ok());
  for (void* p : {src, dst, static_cast<void*>(rows_dev), big_src}) {
    ASSERT_TRUE(alloc_->Free(reinterpret_cast<DevicePtr>(p)).ok());
  }
}

TEST_F(StashGpuTest, OneCapturedGraphReplaysEveryCountAndSurvivesAPause) {
  StashArenaSpec spec{kRowBytes, kP, "stash_graph"};
  auto arena = *StashArena::Create(driver_.get(), alloc_.get(), spec);
  const std::uint64_t cap = 96, max_rows = 100 * kP;  // max needs 100 pages: more than the arena
  ASSERT_TRUE(arena->Prepare(cap, 0, S()).ok());
  void* src = Buffer(max_rows * kRowBytes);
  void* dst = Buffer(max_rows * kRowBytes);
  std::int64_t* rows_dev = static_cast<std::int64_t*>(Buffer(8));
  StashHandleHeader* h = *arena->NewHandle(max_rows);
  std::vector<std::uint8_t> data = Pattern(max_rows, 9);
  ASSERT_EQ(cudaMemcpyAsync(src, data.data(), data.size(), cudaMemcpyHostToDevice, stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal), cudaSuccess);
  ASSERT_TRUE(arena->Reset(S()).ok());
  ASSERT_TRUE(arena->Stash(S(), src, rows_dev, max_rows, h).ok());
  ASSERT_TRUE(arena->Restore(S(), h, dst, max_rows, /*zero_tail=*/true).ok());
  ASSERT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  std::vector<std::uint8_t> out(max_rows * kRowBytes);
  auto replay = [&](std::int64_t count, bool expect_overflow) {
    ASSERT_EQ(cudaMemcpyAsync(rows_dev, &count, 8, cudaMemcpyHostToDevice, stream_), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(dst, 0xab, max_rows * kRowBytes, stream_), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream_), cudaSuccess);
    StashFlags flags = *arena->ReadFlags(S());
    EXPECT_EQ(flags.overflow, expect_overflow ? 1u : 0u) << count;
    ASSERT_EQ(cudaMemcpy(out.data(), dst, out.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    const std::uint64_t live = expect_overflow ? 0 : static_cast<std::uint64_t>(count);
    ASSERT_EQ(0, std::memcmp(out.data(), data.data(), live * kRowBytes)) << count;
    for (std::uint64_t b = live * kRowBytes; b < out.size(); b += 4093) ASSERT_EQ(out[b], 0) << count << " @" << b;
  };
  for (std::int64_t c : {std::int64_t{1}, std::int64_t{4097}, std::int64_t{0}, std::int64_t{cap * kP},
                         std::int64_t{3333}}) {
    replay(c, false);
  }
  replay(static_cast<std::int64_t>(max_rows), true);  // more pages than the arena: overflow, zero-filled
  replay(77, false);                                   // the captured reset makes the next replay clean

  // T6: an idle arena pauses without backup (its memory is released) and the same graph
  // replays after resume; a pause while pages are live is refused.
  TagId tag = arena->tag();
  std::int64_t reserved = 0;
  for (const TagStats& t : alloc_->Stats().tags) reserved += t.name == "stash_graph" ? t.reserved_bytes.current : 0;
  const std::size_t free_before = driver_->MemoryInfo(0)->free_bytes;
  ASSERT_TRUE(alloc_->Pause(tag).ok());
  const std::size_t free_paused = driver_->MemoryInfo(0)->free_bytes;
  std::printf("stash arena paused: device free rose %zu bytes of the tag's %lld reserved\n", free_paused - free_before,
              static_cast<long long>(reserved));
  EXPECT_GE(static_cast<double>(free_paused - free_before), 0.95 * static_cast<double>(reserved));
  ASSERT_TRUE(alloc_->Resume(tag).ok());
  replay(5000, false);
  // Live pages: stash without restore, then try to pause.
  std::int64_t some = 3 * kP;
  ASSERT_EQ(cudaMemcpyAsync(rows_dev, &some, 8, cudaMemcpyHostToDevice, stream_), cudaSuccess);
  ASSERT_TRUE(arena->Stash(S(), src, rows_dev, max_rows, h).ok());
  absl::StatusOr<CachingAllocator::Transition> refused = alloc_->Pause(tag);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  ASSERT_TRUE(arena->Discard(S(), h, max_rows).ok());
  ASSERT_TRUE(alloc_->Pause(tag).ok());
  ASSERT_TRUE(alloc_->Resume(tag).ok());
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  ASSERT_TRUE(arena->FreeHandle(h).ok());
  for (void* p : {src, dst, static_cast<void*>(rows_dev)}) ASSERT_TRUE(alloc_->Free(reinterpret_cast<DevicePtr>(p)).ok());
}

// T7: an arena above 4 GiB. A first stash takes the low 4.3 GiB of pages; a second lands
// on pages whose byte offsets need 64 bits, and must round-trip exactly. A restore into a
// smaller buffer writes at most its max_rows rows.
TEST_F(StashGpuTest, ArenaAboveFourGiBRoundTripsAtHighOffsets) {
  constexpr std::uint64_t kPages = 5000;  // 5000 x 917504 B = 4.27 GiB
  constexpr std::uint64_t kLowPages = 4700;
  auto arena = *StashArena::Create(driver_.get(), alloc_.get(), StashArenaSpec{kRowBytes, kP, "stash_big"});
  ASSERT_TRUE(arena->Prepare(kPages, 0, S()).ok());
  ASSERT_GT(arena->device_bytes(), std::uint64_t{4} << 30);
  const std::uint64_t low_rows = kLowPages * kP, high_rows = 250 * kP + 17;
  void* low = Buffer(low_rows * kRowBytes);
  void* src = Buffer(high_rows * kRowBytes);
  void* dst = Buffer(high_rows * kRowBytes);
  auto* n = static_cast<std::int64_t*>(Buffer(16));
  std::vector<std::uint8_t> data = Pattern(high_rows, 7);
  ASSERT_EQ(cudaMemcpyAsync(src, data.data(), data.size(), cudaMemcpyHostToDevice, stream_), cudaSuccess);
  const std::int64_t counts[2] = {static_cast<std::int64_t>(low_rows), static_cast<std::int64_t>(high_rows)};
  ASSERT_EQ(cudaMemcpyAsync(n, counts, 16, cudaMemcpyHostToDevice, stream_), cudaSuccess);
  StashHandleHeader* h_low = *arena->NewHandle(low_rows);
  StashHandleHeader* h_high = *arena->NewHandle(high_rows);
  ASSERT_TRUE(arena->Stash(S(), low, n, low_rows, h_low).ok());
  ASSERT_TRUE(arena->Stash(S(), src, n + 1, high_rows, h_high).ok());
  std::vector<std::uint32_t> table(251);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(table.data(), h_high + 1, table.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(table[0], kLowPages);
  EXPECT_GT(std::uint64_t{table[250]} * kP * kRowBytes, std::uint64_t{4} << 30);  // offsets past 4 GiB
  ASSERT_EQ(cudaMemsetAsync(dst, 0xab, data.size(), stream_), cudaSuccess);
  ASSERT_TRUE(arena->Restore(S(), h_high, dst, high_rows, false).ok());
  std::vector<std::uint8_t> out(data.size());
  ASSERT_EQ(cudaMemcpyAsync(out.data(), dst, out.size(), cudaMemcpyDeviceToHost, stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(0, std::memcmp(out.data(), data.data(), data.size()));
  // A restore into a buffer of 100 rows writes 100 rows, no more; the pages all come back.
  ASSERT_TRUE(arena->Stash(S(), src, n + 1, high_rows, h_high).ok());
  ASSERT_EQ(cudaMemsetAsync(dst, 0xab, data.size(), stream_), cudaSuccess);
  ASSERT_TRUE(arena->Restore(S(), h_high, dst, 100, true).ok());
  ASSERT_EQ(cudaMemcpyAsync(out.data(), dst, out.size(), cudaMemcpyDeviceToHost, stream_), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  EXPECT_EQ(0, std::memcmp(out.data(), data.data(), 100 * kRowBytes));
  EXPECT_EQ(out[100 * kRowBytes], 0xab);
  ASSERT_TRUE(arena->Discard(S(), h_low, low_rows).ok());
  EXPECT_EQ(*arena->PagesInUse(S()), 0u);
  ExpectBalanced(*arena, 0, kPages);
  for (StashHandleHeader* h : {h_low, h_high}) ASSERT_TRUE(arena->FreeHandle(h).ok());
  for (void* p : {low, src, dst, static_cast<void*>(n)}) ASSERT_TRUE(alloc_->Free(reinterpret_cast<DevicePtr>(p)).ok());
}

}  // namespace
}  // namespace vmstash::stash
