#include "vmm/driver_op.h"

#include "gtest/gtest.h"

namespace vmstash {
namespace {

TEST(DriverOpTest, NamesRoundTrip) {
  for (int i = 0; i < kNumDriverOps; ++i) {
    auto op = static_cast<DriverOp>(i);
    absl::StatusOr<DriverOp> back = DriverOpFromName(DriverOpName(op));
    ASSERT_TRUE(back.ok()) << DriverOpName(op);
    EXPECT_EQ(*back, op);
  }
  absl::StatusOr<DriverOp> bad = DriverOpFromName("mapp");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'mapp'"), absl::string_view::npos);
}

TEST(DriverOpTest, ParsesFaultRules) {
  absl::StatusOr<std::vector<FaultRule>> rules = ParseFaultRules("create_chunk@3=oom+map@2x4=internal");
  ASSERT_TRUE(rules.ok()) << rules.status();
  ASSERT_EQ(rules->size(), 2u);
  EXPECT_EQ((*rules)[0], (FaultRule{DriverOp::kCreateChunk, 3, 1, absl::StatusCode::kResourceExhausted}));
  EXPECT_EQ((*rules)[1], (FaultRule{DriverOp::kMap, 2, 4, absl::StatusCode::kInternal}));
  EXPECT_EQ(FaultRulesToString(*rules), "create_chunk@3=resource_exhausted+map@2x4=internal");
}

TEST(DriverOpTest, RejectsBadFaultRulesNamingThem) {
  for (const char* bad : {"create_chunk", "create_chunk@0=oom", "create_chunk@1", "nope@1=oom",
                          "map@1=teapot", "map@1x0=oom", "map@x=oom"}) {
    absl::StatusOr<std::vector<FaultRule>> rules = ParseFaultRules(bad);
    EXPECT_EQ(rules.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(rules.status().message().find(bad), absl::string_view::npos) << rules.status();
  }
}

TEST(DriverOpTest, CountersCount) {
  OpCounters counters;
  EXPECT_EQ(counters.Count(DriverOp::kMap), 1u);
  EXPECT_EQ(counters.Count(DriverOp::kMap), 2u);
  counters.AddBytesToHost(10);
  counters.AddBytesToDevice(20);
  DriverCounters snap = counters.Snapshot();
  EXPECT_EQ(snap.Calls(DriverOp::kMap), 2u);
  EXPECT_EQ(snap.Calls(DriverOp::kUnmap), 0u);
  EXPECT_EQ(snap.bytes_to_host, 10u);
  EXPECT_EQ(snap.bytes_to_device, 20u);
}

}  // namespace
}  // namespace vmstash
