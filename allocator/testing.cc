// The allocator tests' shared fixtures and helpers (see testing.h).
#include "allocator/testing.h"

#include <utility>

#include "base/byte_pattern.h"

namespace vmstash::testing {

AllocatorOptions TestOptions() {
  AllocatorOptions options;
  options.validate_each_op = true;
  return options;
}

void TearDownAllocator(Driver& driver, std::unique_ptr<CachingAllocator>& alloc, std::vector<Stream>& streams) {
  alloc.reset();
  for (Stream s : streams) {
    absl::Status destroyed = driver.DestroyStream(0, s);
    EXPECT_TRUE(destroyed.ok()) << destroyed;
  }
  streams.clear();
  absl::Status leaks = driver.CheckNoLeaks();
  EXPECT_TRUE(leaks.ok()) << leaks;
}

TagStats TagStatsOf(const CachingAllocator& alloc, TagId tag) {
  for (TagStats& t : alloc.Stats().tags) {
    if (t.name == TagName(tag)) return std::move(t);
  }
  return TagStats{};
}

absl::Status WritePattern(Driver& driver, DevicePtr ptr, std::size_t n, std::uint8_t seed) {
  std::vector<std::uint8_t> host(n);
  FillPattern(host.data(), n, seed);
  absl::Status copied = driver.CopyToDeviceAsync(0, ptr, host.data(), n, nullptr);
  if (!copied.ok()) return copied;
  return driver.SynchronizeStream(0, nullptr);  // `host` must outlive the copy
}

std::size_t WrongBytesOnDevice(Driver& driver, DevicePtr ptr, std::size_t n, std::uint8_t seed) {
  std::vector<std::uint8_t> host(n);
  absl::Status read = driver.CopyToHostAsync(0, host.data(), ptr, n, nullptr);
  if (read.ok()) read = driver.SynchronizeStream(0, nullptr);
  if (!read.ok()) {
    ADD_FAILURE() << "reading " << n << " bytes back: " << read;
    return n;
  }
  return WrongBytes(host.data(), n, seed);
}

void SimAllocatorTest::TearDown() {
  if (sim_ != nullptr) TearDownAllocator(*sim_, alloc_, streams_);
}

void SimAllocatorTest::MakeAllocator(SimDriverOptions sim_options, AllocatorOptions options) {
  alloc_.reset();
  streams_.clear();
  sim_ = std::make_unique<SimDriver>(std::move(sim_options));
  absl::StatusOr<std::unique_ptr<CachingAllocator>> made = CachingAllocator::Create(sim_.get(), 0, options);
  ASSERT_TRUE(made.ok()) << made.status();
  alloc_ = *std::move(made);
}

Stream SimAllocatorTest::NewStream() {
  absl::StatusOr<Stream> s = sim_->CreateStream(0);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return nullptr;
  streams_.push_back(*s);
  return *s;
}

void DriverAllocatorTest::SetUp() {
  absl::StatusOr<std::unique_ptr<Driver>> made = GetParam().make();
  if (!made.ok()) {
    if (!GetParam().required && made.status().code() == absl::StatusCode::kUnavailable) {
      GTEST_SKIP() << GetParam().name << " driver unavailable here: " << made.status();
    }
    FAIL() << "cannot create the " << GetParam().name << " driver: " << made.status();
  }
  absl::StatusOr<int> count = (*made)->DeviceCount();
  ASSERT_TRUE(count.ok()) << count.status();
  if (*count == 0 && !GetParam().required) GTEST_SKIP() << "no device";
  ASSERT_GT(*count, 0);
  driver_ = *std::move(made);
  MakeAllocator(TestOptions());
}

void DriverAllocatorTest::TearDown() {
  if (driver_ != nullptr) TearDownAllocator(*driver_, alloc_, streams_);
}

void DriverAllocatorTest::MakeAllocator(AllocatorOptions options) {
  alloc_.reset();
  absl::StatusOr<std::unique_ptr<CachingAllocator>> made = CachingAllocator::Create(driver_.get(), 0, options);
  ASSERT_TRUE(made.ok()) << made.status();
  alloc_ = *std::move(made);
}

Stream DriverAllocatorTest::NewStream() {
  absl::StatusOr<Stream> s = driver_->CreateStream(0);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return nullptr;
  streams_.push_back(*s);
  return *s;
}

DevicePtr DriverAllocatorTest::Alloc(std::size_t size_bytes, TagId tag, Stream stream) {
  absl::StatusOr<DevicePtr> p = alloc_->Allocate(size_bytes, stream, tag);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *p : 0;
}

}  // namespace vmstash::testing
