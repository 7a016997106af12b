#include "base/status_macros.h"

#include <memory>

#include "gtest/gtest.h"

namespace vmstash {
namespace {

absl::Status Fails() { return absl::ResourceExhaustedError("full"); }
absl::Status Succeeds() { return absl::OkStatus(); }
absl::StatusOr<int> Value(int v) { return v; }
absl::StatusOr<int> NoValue() { return absl::InvalidArgumentError("no"); }
absl::StatusOr<std::unique_ptr<int>> MoveOnly() { return std::make_unique<int>(5); }

absl::Status Chain(bool fail, int* reached) {
  VMSTASH_RETURN_IF_ERROR(Succeeds());
  *reached = 1;
  VMSTASH_RETURN_IF_ERROR(fail ? Fails() : Succeeds());
  *reached = 2;
  return absl::OkStatus();
}

absl::StatusOr<int> Sum(bool fail) {
  VMSTASH_ASSIGN_OR_RETURN(int a, Value(2));
  VMSTASH_ASSIGN_OR_RETURN(int b, fail ? NoValue() : Value(3));
  // Two uses on one line must not collide.
  VMSTASH_ASSIGN_OR_RETURN(int c, Value(4)); VMSTASH_ASSIGN_OR_RETURN(int d, Value(5));
  VMSTASH_ASSIGN_OR_RETURN(std::unique_ptr<int> e, MoveOnly());
  return a + b + c + d + *e;
}

TEST(StatusMacrosTest, ReturnIfErrorStopsAtTheFirstError) {
  int reached = 0;
  EXPECT_TRUE(Chain(false, &reached).ok());
  EXPECT_EQ(reached, 2);
  reached = 0;
  absl::Status s = Chain(true, &reached);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(), "full");
  EXPECT_EQ(reached, 1);
}

TEST(StatusMacrosTest, AssignOrReturnAssignsOrPropagates) {
  EXPECT_EQ(Sum(false).value(), 19);
  EXPECT_EQ(Sum(true).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace vmstash
