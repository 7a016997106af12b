#include "tests/replay/trace.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include "allocator/caching_allocator.h"
#include "allocator/testing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/replay/caching_allocator_target.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

using ::testing::HasSubstr;

TEST(TraceTest, ParseErrorsNameTheLine) {
  EXPECT_TRUE(ParseTraceCsv("# comment\n\na,1,512,0\nf,1\n").ok());
  for (const char* bad : {"a,1,512", "a,x,512,0", "a,1,0,0", "a,1,512,-1", "f", "f,1,2", "z,1", "a,1,12q,0"}) {
    absl::StatusOr<std::vector<TraceOp>> ops = ParseTraceCsv(std::string("a,9,512,0\n") + bad);
    ASSERT_EQ(ops.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(ops.status().message()), HasSubstr("line 2")) << bad;
  }
}

TEST(TraceTest, GeneratedTraceRoundTripsThroughCsv) {
  std::vector<TraceOp> ops = GenerateTrainingTrace(1, 3, 4, 8 * kMiB);
  absl::StatusOr<std::vector<TraceOp>> back = ParseTraceCsv(TraceToCsv(ops));
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->size(), ops.size());
  for (std::size_t i = 0; i < ops.size(); ++i) {
    EXPECT_EQ((*back)[i].allocate, ops[i].allocate);
    EXPECT_EQ((*back)[i].id, ops[i].id);
    EXPECT_EQ((*back)[i].size_bytes, ops[i].size_bytes);
  }
  // Same seed, same trace.
  EXPECT_EQ(TraceToCsv(GenerateTrainingTrace(1, 3, 4, 8 * kMiB)), TraceToCsv(ops));
}

class FakeTarget : public ReplayTarget {
 public:
  absl::StatusOr<std::uint64_t> Allocate(std::uint64_t size, int) override { return next_ += size; }
  absl::Status Free(std::uint64_t) override { return absl::OkStatus(); }
  std::uint64_t PeakReservedBytes() override { return 42; }
  std::uint64_t next_ = 0;
};

TEST(TraceTest, ReplayTracksPeakAllocatedAndRejectsBadIds) {
  FakeTarget fake;
  absl::StatusOr<ReplayResult> r = Replay(*ParseTraceCsv("a,1,100,0\na,2,50,0\nf,1\na,3,70,0\n"), fake);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->peak_allocated_bytes, 150u);
  EXPECT_EQ(r->peak_reserved_bytes, 42u);
  EXPECT_EQ(r->operations, 4u);
  EXPECT_EQ(Replay(*ParseTraceCsv("f,1\n"), fake).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Replay(*ParseTraceCsv("a,1,5,0\na,1,5,0\n"), fake).status().code(), absl::StatusCode::kInvalidArgument);
}

// Replays a trace on the caching allocator over SimDriver and reports the ratio.
ReplayResult ReplayOnSim(const std::vector<TraceOp>& ops, AllocatorOptions options = {}) {
  SimDriver sim(SimDriverOptions{1, std::uint64_t{64} << 30, 2 * kMiB, {}});
  auto alloc = *CachingAllocator::Create(&sim, 0, options);
  ReplayResult result;
  {
    CachingAllocatorTarget target(alloc.get());
    absl::StatusOr<ReplayResult> r = Replay(ops, target);
    EXPECT_TRUE(r.ok()) << r.status();
    if (r.ok()) result = *r;
  }
  EXPECT_TRUE(alloc->Validate().ok());
  alloc.reset();
  EXPECT_TRUE(sim.CheckNoLeaks().ok());
  return result;
}

TEST(TraceTest, TrainingTraceOnTheCachingAllocator) {
  std::vector<TraceOp> ops = GenerateTrainingTrace(7, 8, 12, 16 * kMiB);
  ReplayResult r = ReplayOnSim(ops);
  std::printf("training trace: %llu ops, peak allocated %.1f MiB, peak reserved %.1f MiB, ratio %.3f\n",
              static_cast<unsigned long long>(r.operations), r.peak_allocated_bytes / 1048576.0,
              r.peak_reserved_bytes / 1048576.0, r.ratio());
  EXPECT_GE(r.ratio(), 1.0);
  EXPECT_LE(r.ratio(), 1.10);  // fragmentation and growth overshoot stay small
}

TEST(TraceTest, CheckedInSampleTraceReplays) {
  std::ifstream in("tests/replay/data/sample_trace.csv");
  ASSERT_TRUE(in.good()) << "tests/replay/data/sample_trace.csv missing";
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<std::vector<TraceOp>> ops = ParseTraceCsv(text.str());
  ASSERT_TRUE(ops.ok()) << ops.status();
  ReplayResult r = ReplayOnSim(*ops);
  EXPECT_GT(r.operations, 100u);
  EXPECT_GE(r.ratio(), 1.0);
  EXPECT_LE(r.ratio(), 1.5);
}

}  // namespace
}  // namespace vmstash
