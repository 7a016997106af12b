// The demo cycle on SimDriver: data survives at the same address, and a failure injected
// at every driver call it makes comes back as that status with nothing leaked.
#include "tools/demo/pause_resume_cycle.h"

#include "gtest/gtest.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

constexpr std::size_t kG = 2 << 20;

CycleOptions Small() {
  CycleOptions options;
  options.size_bytes = 8 * kG;
  options.chunk_bytes = 2 * kG;
  return options;
}

TEST(PauseResumeCycleTest, DataSurvivesAtTheSameAddress) {
  SimDriver sim;
  absl::StatusOr<CycleReport> report = RunPauseResumeCycle(sim, Small());
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->bytes_verified, 8 * kG);
  EXPECT_EQ(report->chunks_before, 4u);
  EXPECT_EQ(report->chunks_after, 1u) << "resume re-chunks into one chunk";
  EXPECT_EQ(report->free_while_paused - report->free_before_pause, 8 * kG) << "pause gives the memory back";
  EXPECT_EQ(report->free_after_resume, report->free_before_pause);
  EXPECT_TRUE(sim.CheckNoLeaks().ok()) << sim.CheckNoLeaks();
  EXPECT_NE(FormatCycleReport("sim", *report).find("same address"), std::string::npos);
}

TEST(PauseResumeCycleTest, SizesAreRoundedToTheGranularity) {
  SimDriver sim;
  CycleOptions options;
  options.size_bytes = 3 * kG + 1;
  options.chunk_bytes = 1;
  absl::StatusOr<CycleReport> report = RunPauseResumeCycle(sim, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->size_bytes, 4 * kG);
  EXPECT_EQ(report->chunks_before, 4u);
}

TEST(PauseResumeCycleTest, OutOfDeviceMemoryIsResourceExhausted) {
  SimDriverOptions sim_options;
  sim_options.capacity_bytes = 4 * kG;
  SimDriver sim(sim_options);
  absl::StatusOr<CycleReport> report = RunPauseResumeCycle(sim, Small());
  EXPECT_EQ(report.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(sim.CheckNoLeaks().ok()) << sim.CheckNoLeaks();
}

TEST(PauseResumeCycleTest, EveryDriverCallSiteFailsCleanly) {
  // A clean run tells how often each operation is called.
  SimDriver clean;
  ASSERT_TRUE(RunPauseResumeCycle(clean, Small()).ok());
  const DriverCounters calls = clean.Counters();
  int injected = 0;
  for (int i = 0; i < kNumDriverOps; ++i) {
    const auto op = static_cast<DriverOp>(i);
    for (std::uint64_t nth = 1; nth <= calls.Calls(op); ++nth) {
      for (absl::StatusCode code : {absl::StatusCode::kResourceExhausted, absl::StatusCode::kInternal}) {
        SCOPED_TRACE(testing::Message() << DriverOpName(op) << "@" << nth << " code " << static_cast<int>(code));
        SimDriver sim;
        sim.InjectFault(FaultRule{op, static_cast<int>(nth), 1, code});
        absl::StatusOr<CycleReport> report = RunPauseResumeCycle(sim, Small());
        EXPECT_EQ(report.status().code(), code) << report.status();
        EXPECT_EQ(sim.Counters().failed_calls, 1u);
        EXPECT_TRUE(sim.CheckNoLeaks().ok()) << sim.CheckNoLeaks();
        ++injected;
      }
    }
  }
  EXPECT_GT(injected, 40);
}

}  // namespace
}  // namespace vmstash
