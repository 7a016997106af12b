// The control service's transitions with tag names the process never created (issue 28
// item 4): each is NotFound naming the tag, and none is interned, so a flood of unknown
// names over the control socket cannot fill the tag table. A binary of its own: the tag
// table is process-wide and this test counts its entries.
#include "runtime/control_service.h"

#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

std::unique_ptr<Runtime> MakeRuntime() {
  auto sim = std::make_unique<SimDriver>(SimDriverOptions{1, std::size_t{1} << 30, std::size_t{2} << 20, {}});
  AllocatorOptions options;
  options.auto_prepare = false;
  absl::StatusOr<std::unique_ptr<Runtime>> rt = Runtime::Create(std::move(sim), options);
  EXPECT_TRUE(rt.ok()) << rt.status();
  return *std::move(rt);
}

control::Request Transition(control::Op op, const std::string& tag) {
  control::Request r;
  r.op = op;
  r.tag = tag;
  return r;
}

TEST(ControlServiceTest, UnknownTagNamesAreNotFoundAndNeverInterned) {
  std::unique_ptr<Runtime> rt = MakeRuntime();
  const TagId known = InternTag("cs_known").value();
  ASSERT_TRUE(rt->CreateTag(known, Policy::kBackup).ok());
  CachingAllocator* a = rt->Allocator(0).value();
  const DevicePtr p = a->Allocate(std::size_t{3} << 20, Stream{}, known).value();
  const int before = TagCount();

  // 5000 distinct names in single pauses and resumes, and in switches of 1000 names each
  // (about 16 KB a request, as the issue's `vmstash switch`): more than the table holds.
  for (int i = 0; i < 5000; ++i) {
    const std::string name = "cs_unknown_" + std::to_string(i);
    absl::Status s = HandleControlRequest(*rt, Transition(i % 2 ? control::Op::kPause : control::Op::kResume, name))
                         .status();
    ASSERT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    ASSERT_NE(s.message().find("'" + name + "'"), absl::string_view::npos) << s;
  }
  for (int round = 0; round < 5; ++round) {
    control::Request sw;
    sw.op = control::Op::kSwitch;
    sw.pause.push_back("cs_known");
    for (int i = 0; i < 1000; ++i) sw.resume.push_back("cs_sw_" + std::to_string(round) + "_" + std::to_string(i));
    absl::Status s = HandleControlRequest(*rt, sw).status();
    ASSERT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    EXPECT_NE(s.message().find("'cs_sw_"), absl::string_view::npos) << s;
  }
  EXPECT_EQ(TagCount(), before) << "unknown names were interned";

  // A name interned (by some other call) but never declared nor used is NotFound too: the
  // Runtime answers it.
  ASSERT_TRUE(InternTag("cs_interned_only").ok());
  EXPECT_EQ(HandleControlRequest(*rt, Transition(control::Op::kPause, "cs_interned_only")).status().code(),
            absl::StatusCode::kNotFound);
  // A malformed name is InvalidArgument, before any lookup.
  EXPECT_EQ(HandleControlRequest(*rt, Transition(control::Op::kPause, "bad name")).status().code(),
            absl::StatusCode::kInvalidArgument);

  // The process can still create tags; the known tag is still active (the refused switches
  // changed nothing) and answers.
  absl::StatusOr<TagId> fresh = InternTag("cs_fresh");
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_TRUE(rt->CreateTag(*fresh, Policy::kDiscard).ok());
  EXPECT_EQ(HandleControlRequest(*rt, Transition(control::Op::kPause, "cs_known")).value(), R"({"changed":true})");
  EXPECT_EQ(HandleControlRequest(*rt, Transition(control::Op::kResume, "cs_known")).value(), R"({"changed":true})");
  ASSERT_TRUE(a->Free(p).ok());
}

}  // namespace
}  // namespace vmstash
