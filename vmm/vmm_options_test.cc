#include "vmm/vmm_options.h"

#include "gtest/gtest.h"

namespace vmstash {
namespace {

TEST(VmmOptionsTest, ParsesEveryKeyAndRoundTrips) {
  VmmOptions options;
  for (const auto& [k, v] : {std::pair<const char*, const char*>{"driver", "sim"}, {"log_level", "debug"},
                             {"sim_devices", "3"}, {"sim_capacity", "1536M"}, {"sim_granularity", "64K"},
                             {"sim_fail", "map@2=internal"}}) {
    ASSERT_TRUE(ApplyVmmOption(k, v, options).ok()) << k;
  }
  EXPECT_EQ(options.driver, DriverKind::kSim);
  EXPECT_EQ(options.log_level, LogLevel::kDebug);
  EXPECT_EQ(options.sim_devices, 3);
  EXPECT_EQ(options.sim_capacity_bytes, std::size_t{1536} << 20);
  EXPECT_EQ(options.sim_granularity_bytes, std::size_t{64} << 10);
  ASSERT_EQ(options.sim_faults.size(), 1u);
  std::string text;
  AppendVmmOptions(options, &text);
  EXPECT_EQ(text, "driver:sim,log_level:debug,sim_devices:3,sim_capacity:1536M,sim_granularity:64K,sim_fail:" +
                      FaultRulesToString(options.sim_faults));
}

TEST(VmmOptionsTest, BadValuesNameKeyAndValue) {
  for (const auto& [k, v] : {std::pair<const char*, const char*>{"driver", "gpu"}, {"log_level", "loud"},
                             {"sim_devices", "0"}, {"sim_devices", "65"}, {"sim_capacity", "12Q"},
                             {"sim_granularity", "3000"}, {"sim_granularity", "1K"}, {"sim_fail", "map"}}) {
    VmmOptions options;
    absl::Status s = ApplyVmmOption(k, v, options);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k << ":" << v;
    EXPECT_NE(s.message().find(absl::StrCat("'", k, "'")), absl::string_view::npos) << s;
  }
}

}  // namespace
}  // namespace vmstash
