// The caching allocator on a real GPU (label gpu): memory is usable by the device, data
// written through one tag survives other tags' churn, cross-stream reuse waits for the
// other stream, EmptyCache gives memory back to the device, and nothing leaks.
// With VMSTASH_TEST_REQUIRE_GPU=1 a missing GPU fails; otherwise the tests skip.
#include <cstdlib>
#include <cstring>
#include <vector>

#include "allocator/caching_allocator.h"
#include "gtest/gtest.h"
#include "vmm/cuda_driver.h"

namespace vmstash {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

class CachingAllocatorGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<CudaDriver>> d = CudaDriver::Create();
    if (!d.ok() || *(*d)->DeviceCount() == 0) {
      const char* req = std::getenv("VMSTASH_TEST_REQUIRE_GPU");
      if (req != nullptr && std::strcmp(req, "1") == 0) FAIL() << "no GPU: " << (d.ok() ? "0 devices" : d.status().ToString());
      GTEST_SKIP() << "no GPU";
    }
    driver_ = *std::move(d);
    AllocatorOptions options;
    options.validate_each_op = true;
    alloc_ = *CachingAllocator::Create(driver_.get(), 0, options);
  }
  void TearDown() override {
    if (driver_ == nullptr) return;
    alloc_.reset();
    absl::Status leaks = driver_->CheckNoLeaks();
    EXPECT_TRUE(leaks.ok()) << leaks;
  }
  std::unique_ptr<CudaDriver> driver_;
  std::unique_ptr<CachingAllocator> alloc_;
};

TEST_F(CachingAllocatorGpuTest, BlocksAreUsableAndKeepTheirBytesAcrossChurn) {
  TagId kv = *InternTag("kv_cache");
  std::vector<std::pair<DevicePtr, std::size_t>> blocks;
  for (std::size_t size : {std::size_t{512}, std::size_t{4096}, kMiB, 3 * kMiB, 100 * kMiB}) {
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(size, nullptr, kv);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(driver_->MemsetAsync(0, *p, static_cast<std::uint8_t>(size % 251), size, nullptr).ok());
    blocks.emplace_back(*p, size);
  }
  // Churn in another tag.
  for (int i = 0; i < 200; ++i) {
    absl::StatusOr<DevicePtr> q = alloc_->Allocate((i % 7 + 1) * 3 * kMiB, nullptr, kDefaultTag);
    ASSERT_TRUE(q.ok());
    ASSERT_TRUE(driver_->MemsetAsync(0, *q, 0xff, (i % 7 + 1) * 3 * kMiB, nullptr).ok());
    ASSERT_TRUE(alloc_->Free(*q).ok());
  }
  for (auto [p, size] : blocks) {
    std::vector<std::uint8_t> host(size);
    ASSERT_TRUE(driver_->CopyToHostAsync(0, host.data(), p, size, nullptr).ok());
    ASSERT_TRUE(driver_->SynchronizeStream(0, nullptr).ok());
    for (std::size_t i = 0; i < size; i += 509) ASSERT_EQ(host[i], size % 251) << size;
    ASSERT_TRUE(alloc_->Free(p).ok());
  }
}

TEST_F(CachingAllocatorGpuTest, EmptyCacheReturnsMemoryToTheDevice) {
  absl::StatusOr<DeviceMemoryInfo> before = driver_->MemoryInfo(0);
  DevicePtr p = *alloc_->Allocate(std::size_t{4} << 30, nullptr);
  absl::StatusOr<DeviceMemoryInfo> during = driver_->MemoryInfo(0);
  ASSERT_TRUE(alloc_->Free(p).ok());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  absl::StatusOr<DeviceMemoryInfo> after = driver_->MemoryInfo(0);
  EXPECT_LE(during->free_bytes + (std::size_t{4} << 30), before->free_bytes + 64 * kMiB);
  EXPECT_GE(after->free_bytes + 64 * kMiB, before->free_bytes);
  EXPECT_EQ(alloc_->Stats().total.reserved_bytes.current, 0);
}

TEST_F(CachingAllocatorGpuTest, CrossStreamReuseAndRecordStreamOnRealStreams) {
  Stream s1 = *driver_->CreateStream(0), s2 = *driver_->CreateStream(0);
  DevicePtr p = *alloc_->Allocate(8 * kMiB, s1);
  ASSERT_TRUE(alloc_->RecordStream(p, s2).ok());
  ASSERT_TRUE(driver_->MemsetAsync(0, p, 1, 8 * kMiB, s2).ok());
  ASSERT_TRUE(alloc_->Free(p).ok());
  ASSERT_TRUE(driver_->SynchronizeDevice(0).ok());
  for (int i = 0; i < 100; ++i) {
    DevicePtr q = *alloc_->Allocate(8 * kMiB, i % 2 ? s1 : s2);
    ASSERT_TRUE(driver_->MemsetAsync(0, q, 2, 8 * kMiB, i % 2 ? s1 : s2).ok());
    ASSERT_TRUE(alloc_->Free(q).ok());
  }
  ASSERT_TRUE(alloc_->Validate().ok());
  ASSERT_TRUE(alloc_->EmptyCache().ok());
  alloc_.reset();  // before the streams go
  ASSERT_TRUE(driver_->DestroyStream(0, s1).ok());
  ASSERT_TRUE(driver_->DestroyStream(0, s2).ok());
}

}  // namespace
}  // namespace vmstash
