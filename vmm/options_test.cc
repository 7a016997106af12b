#include "vmm/options.h"

#include <cstdlib>

#include "gtest/gtest.h"

namespace vmstash {
namespace {

TEST(OptionsTest, EmptyGivesDefaults) {
  absl::StatusOr<Options> options = ParseOptions("");
  ASSERT_TRUE(options.ok());
  EXPECT_EQ(options->driver, DriverKind::kAuto);
  EXPECT_EQ(options->sim_granularity_bytes, std::size_t{2} << 20);
}

TEST(OptionsTest, ParsesEveryKey) {
  absl::StatusOr<Options> options = ParseOptions(
      " driver:sim, log_level:debug,sim_devices:3,sim_capacity:1536M,sim_granularity:64K,"
      "sim_fail:map@2=internal,bypass:1,min_chunk:4M,max_chunk:1G,heap_va:64G,backup:pageable,auto_prepare:0,control:0,");
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->driver, DriverKind::kSim);
  EXPECT_EQ(options->log_level, LogLevel::kDebug);
  EXPECT_EQ(options->sim_devices, 3);
  EXPECT_EQ(options->sim_capacity_bytes, std::size_t{1536} << 20);
  EXPECT_EQ(options->sim_granularity_bytes, std::size_t{64} << 10);
  ASSERT_EQ(options->sim_faults.size(), 1u);
  EXPECT_TRUE(options->bypass);
  EXPECT_EQ(options->min_chunk_bytes, std::size_t{4} << 20);
  EXPECT_EQ(options->max_chunk_bytes, std::size_t{1} << 30);
  EXPECT_EQ(options->heap_va_bytes, std::size_t{64} << 30);
  EXPECT_TRUE(options->backup_pageable);
  EXPECT_FALSE(options->auto_prepare);
  EXPECT_FALSE(options->control);
  // The canonical string parses back to the same options.
  absl::StatusOr<Options> again = ParseOptions(OptionsToString(*options));
  ASSERT_TRUE(again.ok()) << again.status() << " for " << OptionsToString(*options);
  EXPECT_EQ(OptionsToString(*again), OptionsToString(*options));
}

TEST(OptionsTest, UnknownKeyIsAnErrorNamingIt) {
  absl::StatusOr<Options> options = ParseOptions("driver:sim,expandable_segments:true");
  EXPECT_EQ(options.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(options.status().message().find("'expandable_segments'"), absl::string_view::npos);
}

TEST(OptionsTest, BadValuesAndDuplicatesAreErrors) {
  for (const char* bad : {"driver:gpu", "log_level:loud", "sim_devices:0", "sim_devices:65", "sim_capacity:12Q",
                          "sim_granularity:3000", "sim_granularity:1K", "sim_fail:map", "driver", "driver:sim,driver:cuda",
                          "sim_capacity:99999999999T", "bypass:yes", "min_chunk:0", "max_chunk:big", "backup:disk", "auto_prepare:2"}) {
    absl::StatusOr<Options> options = ParseOptions(bad);
    EXPECT_EQ(options.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(OptionsTest, ParsesSizes) {
  EXPECT_EQ(ParseSize("4096").value(), 4096u);
  EXPECT_EQ(ParseSize("2M").value(), 2u << 20);
  EXPECT_EQ(ParseSize("16GiB").value(), std::uint64_t{16} << 30);
  EXPECT_EQ(ParseSize("1t").value(), std::uint64_t{1} << 40);
  EXPECT_EQ(ParseSize("512KB").value(), 512u << 10);
  EXPECT_FALSE(ParseSize("").ok());
  EXPECT_FALSE(ParseSize("G").ok());
  EXPECT_FALSE(ParseSize("-1").ok());
}

TEST(OptionsTest, EnvironmentIsReadOnce) {
  ::setenv("VMSTASH_CONF", "driver:cuda,sim_devices:2", 1);
  ::setenv("VMSTASH_DRIVER", "sim", 1);
  absl::StatusOr<Options> options = OptionsFromEnvironment();
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->driver, DriverKind::kSim) << "VMSTASH_DRIVER overrides VMSTASH_CONF";
  EXPECT_EQ(options->sim_devices, 2);
  ::setenv("VMSTASH_DRIVER", "tpu", 1);
  EXPECT_EQ(OptionsFromEnvironment().status().code(), absl::StatusCode::kInvalidArgument);
  ::unsetenv("VMSTASH_DRIVER");
  ::unsetenv("VMSTASH_CONF");
}

}  // namespace
}  // namespace vmstash
