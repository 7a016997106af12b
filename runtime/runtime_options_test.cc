#include "runtime/runtime_options.h"

#include <cstdlib>

#include "gtest/gtest.h"

namespace vmstash {
namespace {

TEST(RuntimeOptionsTest, EmptyGivesEveryLayersDefaults) {
  absl::StatusOr<RuntimeOptions> options = ParseRuntimeOptions("");
  ASSERT_TRUE(options.ok());
  EXPECT_EQ(options->vmm.driver, DriverKind::kAuto);
  EXPECT_EQ(options->vmm.sim_granularity_bytes, std::size_t{2} << 20);
  EXPECT_EQ(options->allocator.min_chunk_bytes, AllocatorOptions{}.min_chunk_bytes);
  EXPECT_TRUE(options->control.serve);
}

TEST(RuntimeOptionsTest, EachLayersKeysReachThatLayer) {
  absl::StatusOr<RuntimeOptions> options = ParseRuntimeOptions(
      " driver:sim, log_level:debug,sim_devices:3,sim_capacity:1536M,sim_granularity:64K,"
      "sim_fail:map@2=internal,bypass:1,min_chunk:4M,max_chunk:1G,heap_va:64G,backup:pageable,auto_prepare:0,control:0,"
      "host_max:512M,spill_dir:/tmp");
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->vmm.driver, DriverKind::kSim);
  EXPECT_EQ(options->vmm.sim_devices, 3);
  EXPECT_EQ(options->vmm.sim_faults.size(), 1u);
  EXPECT_TRUE(options->allocator.bypass);
  EXPECT_EQ(options->allocator.max_chunk_bytes, std::size_t{1} << 30);
  EXPECT_EQ(options->allocator.backup_store.kind, BackupStore::Kind::kPageable);
  EXPECT_FALSE(options->allocator.auto_prepare);
  EXPECT_EQ(options->allocator.host_max_bytes, std::size_t{512} << 20);
  EXPECT_EQ(options->allocator.spill_dir, "/tmp");
  EXPECT_FALSE(options->control.serve);
  // The canonical string parses back to the same options.
  absl::StatusOr<RuntimeOptions> again = ParseRuntimeOptions(RuntimeOptionsToString(*options));
  ASSERT_TRUE(again.ok()) << again.status() << " for " << RuntimeOptionsToString(*options);
  EXPECT_EQ(RuntimeOptionsToString(*again), RuntimeOptionsToString(*options));
}

TEST(RuntimeOptionsTest, TheNodePoolMakesChunksShareableUnlessSaidOtherwise) {
  EXPECT_FALSE(ParseRuntimeOptions("").value().allocator.share_chunks);
  EXPECT_TRUE(ParseRuntimeOptions("node:1").value().allocator.share_chunks);
  EXPECT_FALSE(ParseRuntimeOptions("node:1,share_chunks:0").value().allocator.share_chunks);
  EXPECT_FALSE(ParseRuntimeOptions("share_chunks:0,node:1").value().allocator.share_chunks);
  EXPECT_TRUE(ParseRuntimeOptions("share_chunks:1").value().allocator.share_chunks);
  EXPECT_FALSE(ParseRuntimeOptions("share_chunks:2").ok());
}

TEST(RuntimeOptionsTest, UnknownKeyIsOneErrorListingEveryLayersKeys) {
  absl::StatusOr<RuntimeOptions> options = ParseRuntimeOptions("driver:sim,expandable_segments:true");
  EXPECT_EQ(options.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(options.status().message());
  EXPECT_NE(message.find("unknown key 'expandable_segments'"), std::string::npos) << message;
  for (const char* key : {"driver", "sim_fail", "min_chunk", "auto_prepare", "host_max", "spill_dir", "control"}) {
    EXPECT_NE(message.find(key), std::string::npos) << key << " missing from: " << message;
  }
}

TEST(RuntimeOptionsTest, BadValuesAndDuplicatesAreErrors) {
  for (const char* bad : {"driver:gpu", "sim_devices:0", "driver", "driver:sim,driver:cuda", "bypass:yes",
                          "min_chunk:0", "backup:disk", "control:2", "host_max:lots", "spill_dir:"}) {
    EXPECT_EQ(ParseRuntimeOptions(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(ParseRuntimeOptions("spill_dir:/nonexistent/vmstash-spill").status().code(), absl::StatusCode::kNotFound);
}

TEST(RuntimeOptionsTest, TorchMemorySaversDebugLogTurnsOnTheDebugLogUnlessTheConfNamesALevel) {
  ::unsetenv("VMSTASH_CONF");
  ::setenv("TMS_DEBUG_LOG", "1", 1);
  EXPECT_EQ(RuntimeOptionsFromEnvironment().value().vmm.log_level, LogLevel::kDebug);
  ::setenv("VMSTASH_CONF", "log_level:error", 1);
  EXPECT_EQ(RuntimeOptionsFromEnvironment().value().vmm.log_level, LogLevel::kError);
  ::unsetenv("VMSTASH_CONF");
  ::setenv("TMS_DEBUG_LOG", "0", 1);
  EXPECT_EQ(RuntimeOptionsFromEnvironment().value().vmm.log_level, LogLevel::kWarning);
  ::unsetenv("TMS_DEBUG_LOG");
}

TEST(RuntimeOptionsTest, EnvironmentIsReadOnce) {
  ::setenv("VMSTASH_CONF", "driver:cuda,sim_devices:2", 1);
  ::setenv("VMSTASH_DRIVER", "sim", 1);
  absl::StatusOr<RuntimeOptions> options = RuntimeOptionsFromEnvironment();
  ASSERT_TRUE(options.ok()) << options.status();
  EXPECT_EQ(options->vmm.driver, DriverKind::kSim) << "VMSTASH_DRIVER overrides VMSTASH_CONF";
  EXPECT_EQ(options->vmm.sim_devices, 2);
  ::setenv("VMSTASH_DRIVER", "tpu", 1);
  EXPECT_EQ(RuntimeOptionsFromEnvironment().status().code(), absl::StatusCode::kInvalidArgument);
  ::unsetenv("VMSTASH_DRIVER");
  ::unsetenv("VMSTASH_CONF");
}

}  // namespace
}  // namespace vmstash
