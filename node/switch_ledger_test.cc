// SwitchLedger (switch_ledger.h): every way a node switch is decided, alone.
#include "node/switch_ledger.h"

#include <gtest/gtest.h>

#include <string>

namespace vmstash::node {
namespace {

TEST(SwitchLedger, EveryOkVoteCommits) {
  SwitchLedger l;
  ASSERT_TRUE(l.Begin("t", {10, 20}, 1000).ok());
  auto d = l.Vote("t", 10, true, "");
  ASSERT_TRUE(d.ok());
  EXPECT_FALSE(d->has_value());
  EXPECT_EQ(l.NextDeadline(), 1000);
  d = l.Vote("t", 20, true, "");
  ASSERT_TRUE(d.ok() && d->has_value());
  EXPECT_TRUE((*d)->commit);
  EXPECT_FALSE(l.NextDeadline().has_value());
  EXPECT_TRUE(l.Expire(5000).empty());  // decided: the deadline no longer counts
}

TEST(SwitchLedger, TheFirstFailedVoteAbortsNamingTheProcess) {
  SwitchLedger l;
  ASSERT_TRUE(l.Begin("t", {10, 20, 30}, 1000).ok());
  auto d = l.Vote("t", 20, false, "out of memory");
  ASSERT_TRUE(d.ok() && d->has_value());
  EXPECT_FALSE((*d)->commit);
  EXPECT_EQ((*d)->reason, "process 20: out of memory");
  // A later OK vote learns the abort; it does not turn it into a commit.
  d = l.Vote("t", 10, true, "");
  ASSERT_TRUE(d.ok() && d->has_value());
  EXPECT_FALSE((*d)->commit);
  d = l.Vote("t", 30, true, "");
  EXPECT_FALSE((*d)->commit);
}

TEST(SwitchLedger, AMissingVoteAtTheDeadlineAbortsNamingTheSilent) {
  SwitchLedger l;
  ASSERT_TRUE(l.Begin("t", {10, 20, 30}, 1000).ok());
  ASSERT_TRUE(l.Vote("t", 20, true, "").ok());
  EXPECT_TRUE(l.Expire(999).empty());
  auto ids = l.Expire(1000);
  ASSERT_EQ(ids.size(), 1u);
  auto d = l.Decision("t");
  ASSERT_TRUE(d.ok() && d->has_value());
  EXPECT_FALSE((*d)->commit);
  EXPECT_NE((*d)->reason.find("processes 10, 30 did not vote"), std::string::npos) << (*d)->reason;
}

TEST(SwitchLedger, AnExitBeforeVotingAborts) {
  SwitchLedger l;
  ASSERT_TRUE(l.Begin("t", {10, 20, 30}, 1000).ok());
  ASSERT_TRUE(l.Vote("t", 10, true, "").ok());
  EXPECT_TRUE(l.Exited(10).empty());  // it voted: its exit decides nothing
  auto ids = l.Exited(20);
  ASSERT_EQ(ids.size(), 1u);
  auto d = l.Decision("t");
  EXPECT_EQ((*d)->reason, "process 20 exited before it voted");
}

TEST(SwitchLedger, BadRequestsAreRefused) {
  SwitchLedger l;
  EXPECT_EQ(l.Begin("t", {}, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(l.Begin("t", {10, 10}, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(l.Begin("t", {0}, 1).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(l.Begin("t", {10, 20}, 1).ok());
  EXPECT_EQ(l.Begin("t", {30}, 1).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(l.Vote("u", 10, true, "").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(l.Vote("t", 30, true, "").status().code(), absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(l.Vote("t", 10, true, "").ok());
  EXPECT_EQ(l.Vote("t", 10, true, "").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(l.Decision("u").status().code(), absl::StatusCode::kNotFound);
}

TEST(SwitchLedger, AProcessTakesPartInOneUndecidedSwitchAtATime) {
  SwitchLedger l;
  ASSERT_TRUE(l.Begin("t", {10, 20}, 1000).ok());
  absl::Status busy = l.Begin("u", {30, 20}, 1000);
  EXPECT_EQ(busy.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(busy.message().find("process 20 takes part in switch t"), std::string::npos) << busy;
  EXPECT_TRUE(l.Begin("v", {30}, 1000).ok());
  ASSERT_TRUE(l.Vote("t", 10, false, "x").ok());  // decided: its processes are free again
  EXPECT_TRUE(l.Begin("u", {20}, 1000).ok());
}

TEST(SwitchLedger, UndecidedSwitchesAreBounded) {
  SwitchLedger l;
  for (std::size_t i = 0; i < SwitchLedger::kMaxOpen; ++i) {
    ASSERT_TRUE(l.Begin(std::to_string(i), {static_cast<pid_t>(10 + i)}, 1).ok());
  }
  EXPECT_EQ(l.Begin("x", {10}, 1).code(), absl::StatusCode::kResourceExhausted);
  l.Expire(1);  // all decided: room again
  EXPECT_TRUE(l.Begin("x", {10}, 100).ok());
}

TEST(SwitchLedger, TheRecordWinsAndTheSwitchIsForgottenOnceEveryoneKnows) {
  SwitchLedger l;
  ASSERT_TRUE(l.Begin("t", {10, 20, 30}, 1000).ok());
  ASSERT_TRUE(l.Vote("t", 10, true, "").ok());
  ASSERT_TRUE(l.Vote("t", 20, true, "").ok());
  EXPECT_EQ(l.Watched(), (std::vector<pid_t>{10, 20, 30}));
  ASSERT_TRUE(l.Vote("t", 30, true, "").ok());
  l.Settle("t", SwitchDecision{false, "recorded first elsewhere"});
  auto d = l.Decision("t");
  EXPECT_FALSE((*d)->commit);
  EXPECT_FALSE(l.Told("t", 10));
  EXPECT_TRUE(l.TakeForgotten().empty());
  EXPECT_EQ(l.Exited(20).size(), 0u);
  EXPECT_EQ(l.Watched(), (std::vector<pid_t>{30}));
  EXPECT_TRUE(l.Told("t", 30));
  EXPECT_EQ(l.TakeForgotten(), (std::vector<std::string>{"t"}));
  EXPECT_EQ(l.size(), 0u);
}

TEST(SwitchLedger, TheInitiatorIsToldTooBeforeTheSwitchIsForgotten) {
  SwitchLedger l;
  ASSERT_TRUE(l.Begin("t", {10}, 1000, /*observer=*/99).ok());
  EXPECT_EQ(l.Watched(), (std::vector<pid_t>{10, 99}));
  ASSERT_TRUE(l.Vote("t", 10, true, "").ok());
  EXPECT_FALSE(l.Told("t", 10));  // the observer has not been told
  EXPECT_FALSE(l.Told("t", 10, /*observer=*/true));  // 10 is not the observer
  EXPECT_TRUE(l.Told("t", 99, /*observer=*/true));
  ASSERT_TRUE(l.Begin("u", {10}, 1000, /*observer=*/99).ok());
  ASSERT_TRUE(l.Vote("u", 10, true, "").ok());
  EXPECT_FALSE(l.Told("u", 10));
  EXPECT_TRUE(l.Exited(99).empty());  // an observer's exit decides nothing, and forgets
  EXPECT_EQ(l.size(), 0u);
  ASSERT_TRUE(l.Begin("v", {10}, 1000, /*observer=*/99).ok());
  EXPECT_TRUE(l.Exited(99).empty());  // undecided: the observer's exit does not abort
  EXPECT_FALSE(l.Decision("v")->has_value());
}

TEST(SwitchLedger, ASwitchDecidedByTheLastExitIsForgotten) {
  SwitchLedger l;
  ASSERT_TRUE(l.Begin("t", {10}, 1000, /*observer=*/99).ok());
  EXPECT_TRUE(l.Exited(99).empty());
  EXPECT_EQ(l.Exited(10).size(), 1u);
  EXPECT_EQ(l.size(), 0u);
  EXPECT_EQ(l.TakeForgotten(), (std::vector<std::string>{"t"}));
}

TEST(SwitchLedger, ATakerWaitsForEveryOtherDonorsOfferVoteOrExit) {
  SwitchLedger l;
  // 10 and 20 pause (donors), 30 only resumes.
  ASSERT_TRUE(l.Begin("t", {10, 20, 30}, 1000, 0, {10, 20}).ok());
  EXPECT_EQ(l.OffersIn("t", 30).value(), false);
  ASSERT_TRUE(l.Offered("t", 10).ok());
  EXPECT_EQ(l.OffersIn("t", 30).value(), false);
  EXPECT_EQ(l.OffersIn("t", 20).value(), true) << "its own offer is not waited for";
  ASSERT_TRUE(l.Vote("t", 20, true, "").ok());  // voted without offering: nothing more comes
  EXPECT_EQ(l.OffersIn("t", 30).value(), true);

  ASSERT_TRUE(l.Begin("u", {40, 50}, 1000, 0, {40}).ok());
  EXPECT_EQ(l.OffersIn("u", 50).value(), false);
  EXPECT_FALSE(l.Exited(40).empty());  // decided abort: taking finds nothing to wait for
  EXPECT_EQ(l.OffersIn("u", 50).value(), true);
  EXPECT_EQ(l.Offered("u", 50).code(), absl::StatusCode::kFailedPrecondition);

  ASSERT_TRUE(l.Begin("v", {60, 70}, 1000).ok());  // no donors named: nothing to wait for
  EXPECT_EQ(l.OffersIn("v", 70).value(), true);
  EXPECT_EQ(l.OffersIn("v", 99).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(l.Offered("v", 99).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(l.OffersIn("w", 60).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(l.Offered("w", 60).code(), absl::StatusCode::kNotFound);
}

// Note [Node Switch Handover]: a donor whose chunks went into restore gaps learns when
// their takers can write them no more (each voted or exited), and the aborted switch
// stays until it has asked.
TEST(SwitchLedger, AGiverWaitsForItsWritingTakersAndIsKeptUntilItAsks) {
  SwitchLedger l;
  ASSERT_TRUE(l.Begin("t", {10, 20, 30}, 1000, 0, {10}).ok());
  ASSERT_TRUE(l.Offered("t", 10, true, /*writable=*/true).ok());
  EXPECT_EQ(l.Unsettled("t", 10)->waiting, std::vector<pid_t>{}) << "no taker yet";
  EXPECT_FALSE(l.Unsettled("t", 10)->settled) << "undecided: a taker may still come";
  ASSERT_TRUE(l.Took("t", 20, 10).ok());
  ASSERT_TRUE(l.Took("t", 30, 10).ok());
  ASSERT_TRUE(l.Took("t", 30, 10).ok());  // twice: one taker
  EXPECT_EQ(l.Unsettled("t", 10)->waiting, (std::vector<pid_t>{20, 30}));
  ASSERT_TRUE(l.Vote("t", 20, false, "its map failed").ok());  // aborts; 20's copies are done
  EXPECT_EQ(l.Unsettled("t", 10)->waiting, (std::vector<pid_t>{30}));
  EXPECT_FALSE(l.Unsettled("t", 10)->settled);
  EXPECT_FALSE(l.Told("t", 10));
  EXPECT_FALSE(l.Told("t", 20));
  EXPECT_TRUE(l.Exited(30).empty());  // exited: it writes no more (and the switch was decided)
  EXPECT_EQ(l.Watched(), (std::vector<pid_t>{10})) << "the giver's exit still matters";
  EXPECT_EQ(l.size(), 1u) << "kept: the giver has not asked";
  const SwitchLedger::Settlement last = l.Unsettled("t", 10).value();
  EXPECT_EQ(last.waiting, std::vector<pid_t>{});
  EXPECT_TRUE(last.settled) << "the ask that lets the switch be forgotten says settled";
  EXPECT_EQ(l.size(), 0u) << "asked and answered: forgotten";
  EXPECT_EQ(l.TakeForgotten(), (std::vector<std::string>{"t"}));

  // A commit keeps no one waiting; bad requests.
  ASSERT_TRUE(l.Begin("u", {10, 20}, 1000, 0, {10}).ok());
  ASSERT_TRUE(l.Offered("u", 10, true, true).ok());
  ASSERT_TRUE(l.Took("u", 20, 10).ok());
  EXPECT_EQ(l.Took("u", 99, 10).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(l.Took("u", 20, 99).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(l.Took("x", 20, 10).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(l.Unsettled("u", 99).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(l.Unsettled("x", 10).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(l.Vote("u", 10, true, "").ok());
  ASSERT_TRUE(l.Vote("u", 20, true, "").ok());
  EXPECT_FALSE(l.Told("u", 10));
  EXPECT_TRUE(l.Told("u", 20)) << "committed: the giver is not waited for";
  // A giver that exits before asking lets the aborted switch go.
  ASSERT_TRUE(l.Begin("v", {10, 20}, 1000, 0, {10}).ok());
  ASSERT_TRUE(l.Offered("v", 10, true, true).ok());
  ASSERT_TRUE(l.Vote("v", 20, false, "no").ok());
  EXPECT_FALSE(l.Told("v", 20));
  EXPECT_FALSE(l.Told("v", 10));
  EXPECT_TRUE(l.Exited(10).empty());
  EXPECT_EQ(l.size(), 0u);
}

}  // namespace
}  // namespace vmstash::node
