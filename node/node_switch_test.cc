// The node switch's protocol (Note [Node Switch], node_switch.h) between real processes:
// the daemon in a child process, participants in children that vote (switch_vote.h),
// fail, never vote, exit, or outlive the daemon; the decision records
// (decision_record.h). The participants' own switches are the allocator's (tested there)
// and run end to end in torch_plugin/python/tests/test_node_switch.py.
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "base/json_reader.h"
#include "control/runtime_dir.h"
#include "node/decision_record.h"
#include "node/node_switch.h"
#include "node/switch_vote.h"
#include "node/testing.h"
#include "node/wire.h"

namespace vmstash::node {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

absl::StatusOr<JsonValue> Ask(const std::string& dir, const WireRequest& r) { return AskOnce(dir, r, 5000); }

absl::StatusOr<std::string> Begin(const std::string& dir, const std::vector<pid_t>& pids, int timeout_ms) {
  WireRequest r;
  r.op = WireOp::kBegin;
  r.pids = absl::StrJoin(pids, ",");
  r.timeout_ms = static_cast<std::uint64_t>(timeout_ms);
  absl::StatusOr<JsonValue> reply = Ask(dir, r);
  if (!reply.ok()) return reply.status();
  return (*reply)["txn"].String();
}

// A participant in a child process: it waits for the switch's id on a pipe, then (after
// `delay_ms`) votes `local` and reports what VoteAndWait returned ("CODE|message").
class Participant : public SwitchChild {
 public:
  Participant(const std::string& dir, absl::Status local, int delay_ms = 0, int hard_ms = 10000)
      : SwitchChild([=](const std::string& txn) {
          std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
          VoteOptions o;
          o.dir = dir;
          o.txn = txn;
          o.hard_deadline = Clock::now() + std::chrono::milliseconds(hard_ms);
          const absl::Status s = VoteAndWait(o, local);
          return absl::StrCat(absl::StatusCodeToString(s.code()), "|", s.message());
        }) {}
};

// Polls until `pred()` or 5 s.
template <typename Pred>
bool Eventually(Pred pred) {
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (Clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return pred();
}

TEST(NodeSwitchProtocol, EveryOkVoteCommitsAndIsRecorded) {
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  Participant a(dir, absl::OkStatus()), b(dir, absl::OkStatus(), 100);
  absl::StatusOr<std::string> txn = Begin(dir, {a.pid(), b.pid()}, 10000);
  ASSERT_TRUE(txn.ok()) << txn.status();
  EXPECT_TRUE(IsSwitchId(*txn));
  a.Go(*txn);
  b.Go(*txn);
  EXPECT_EQ(a.Result(), "OK|");
  EXPECT_EQ(b.Result(), "OK|");
  absl::StatusOr<std::optional<SwitchDecision>> d = ReadDecision(dir, *txn);
  ASSERT_TRUE(d.ok() && d->has_value());
  EXPECT_TRUE((*d)->commit);
  // The initiator (this process) learns it too, from the daemon, however late it asks.
  WireRequest outcome;
  outcome.op = WireOp::kOutcome;
  outcome.txn = *txn;
  outcome.pid = ::getpid();
  absl::StatusOr<JsonValue> reply = Ask(dir, outcome);
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ((*reply)["decision"].String(), "commit");
}

TEST(NodeSwitchProtocol, AFailedVoteAbortsEveryoneNamingTheProcessAndItsReason) {
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  Participant a(dir, absl::ResourceExhaustedError("out of device memory"), 50), b(dir, absl::OkStatus());
  absl::StatusOr<std::string> txn = Begin(dir, {a.pid(), b.pid()}, 10000);
  ASSERT_TRUE(txn.ok()) << txn.status();
  a.Go(*txn);
  b.Go(*txn);
  const std::string rb = b.Result();
  EXPECT_THAT(rb, HasSubstr("ABORTED|"));
  EXPECT_THAT(rb, HasSubstr(absl::StrCat("process ", a.pid(), ": out of device memory")));
  EXPECT_EQ(a.Result(), "RESOURCE_EXHAUSTED|out of device memory");  // its own failure
}

// A participant of another release votes in protocol version 1: the daemon cannot read
// the vote, counts it as a no naming the versions, and everyone learns the abort now, not
// at the switch's deadline.
TEST(NodeSwitchProtocol, AVoteInAnotherProtocolVersionAbortsTheSwitchNamingIt) {
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  SwitchChild old_release([dir](const std::string& txn) {
    absl::StatusOr<int> c = ConnectTrusted(dir);
    if (!c.ok()) return std::string(c.status().message());
    const std::string vote =
        absl::StrCat(R"({"v":1,"op":"vote","txn":")", txn, R"(","pid":)", ::getpid(), R"(,"ok":true,"reason":""})");
    std::string out = "sent";
    if (!Send(*c, vote).ok()) out = "not sent";
    (void)Receive(*c, 5000);
    ::close(*c);
    return out;
  }, /*linger=*/true);
  Participant b(dir, absl::OkStatus(), 200, 60000);
  absl::StatusOr<std::string> txn = Begin(dir, {old_release.pid(), b.pid()}, 60000);
  ASSERT_TRUE(txn.ok()) << txn.status();
  old_release.Go(*txn);
  EXPECT_EQ(old_release.Result(), "sent");
  b.Go(*txn);
  const std::string rb = b.Result();
  EXPECT_THAT(rb, HasSubstr("ABORTED|"));
  EXPECT_THAT(rb, HasSubstr(absl::StrCat("process ", old_release.pid(), ": it speaks node protocol version 1")));
  EXPECT_THAT(rb, ::testing::Not(HasSubstr("did not vote"))) << rb;
}

TEST(NodeSwitchProtocol, AParticipantSilentPastTheTimeoutAbortsTheSwitch) {
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  Participant a(dir, absl::OkStatus()), hung(dir, absl::OkStatus());  // `hung` is never told to go
  absl::StatusOr<std::string> txn = Begin(dir, {a.pid(), hung.pid()}, 300);
  ASSERT_TRUE(txn.ok()) << txn.status();
  a.Go(*txn);
  const std::string ra = a.Result();
  EXPECT_THAT(ra, HasSubstr("ABORTED|"));
  EXPECT_THAT(ra, HasSubstr(absl::StrCat("process ", hung.pid(), " did not vote by the deadline")));
  // When it runs again, its vote learns the abort (the decision stands).
  hung.Go(*txn);
  EXPECT_THAT(hung.Result(), HasSubstr("did not vote by the deadline"));
}

TEST(NodeSwitchProtocol, AParticipantThatExitsBeforeVotingAbortsTheSwitch) {
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  Participant a(dir, absl::OkStatus(), 300), dies(dir, absl::OkStatus());
  absl::StatusOr<std::string> txn = Begin(dir, {a.pid(), dies.pid()}, 20000);
  ASSERT_TRUE(txn.ok()) << txn.status();
  const pid_t dead = dies.pid();
  dies.Kill();
  a.Go(*txn);
  const std::string ra = a.Result();
  EXPECT_THAT(ra, HasSubstr("ABORTED|"));
  EXPECT_THAT(ra, HasSubstr(absl::StrCat("process ", dead, " exited before it voted")));
}

TEST(NodeSwitchProtocol, ADaemonThatDiesBeforeDecidingMeansAbort) {
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  Participant a(dir, absl::OkStatus()), silent(dir, absl::OkStatus());
  absl::StatusOr<std::string> txn = Begin(dir, {a.pid(), silent.pid()}, 20000);
  ASSERT_TRUE(txn.ok()) << txn.status();
  a.Go(*txn);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // a voted and waits
  daemon.Kill();
  const std::string ra = a.Result();
  EXPECT_THAT(ra, HasSubstr("ABORTED|"));
  EXPECT_THAT(ra, HasSubstr("the node daemon died before deciding"));
  absl::StatusOr<std::optional<SwitchDecision>> d = ReadDecision(dir, *txn);
  ASSERT_TRUE(d.ok() && d->has_value());  // recorded: the silent one learns the same
  EXPECT_FALSE((*d)->commit);
  silent.Go(*txn);
  EXPECT_THAT(silent.Result(), HasSubstr("the node daemon died before deciding"));
}

TEST(NodeSwitchProtocol, ARecordedCommitIsLearnedWithTheDaemonGone) {
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  Participant a(dir, absl::OkStatus());
  absl::StatusOr<std::string> txn = Begin(dir, {a.pid()}, 20000);
  ASSERT_TRUE(txn.ok()) << txn.status();
  daemon.Kill();
  // The daemon had decided and recorded the commit when it died, before telling `a`.
  ASSERT_TRUE(RecordDecision(dir, *txn, {a.pid()}, SwitchDecision{true, ""}).ok());
  a.Go(*txn);
  EXPECT_EQ(a.Result(), "OK|");
}

TEST(NodeSwitchProtocol, ADaemonStartedAgainPresumesAbortForASwitchItDidNotBegin) {
  const std::string dir = PrivateDir();
  DaemonProcess first(dir);
  ASSERT_TRUE(first.started());
  Participant a(dir, absl::OkStatus());
  absl::StatusOr<std::string> txn = Begin(dir, {a.pid()}, 20000);
  ASSERT_TRUE(txn.ok()) << txn.status();
  first.Kill();
  DaemonProcess second(dir);
  ASSERT_TRUE(second.started());
  a.Go(*txn);
  EXPECT_THAT(a.Result(), HasSubstr("is gone and had not decided"));
}

TEST(NodeSwitchProtocol, AHungDaemonMeansAbortAtTheParticipantsDeadline) {
  const std::string dir = PrivateDir();
  // A "daemon" that accepts connections and never answers.
  const int fd = ListenAsDaemon(dir, 8);
  ASSERT_GE(fd, 0);
  Participant a(dir, absl::OkStatus(), 0, 400);
  a.Go("0123456789abcdef0123456789abcdef");
  EXPECT_THAT(a.Result(), HasSubstr(absl::StrCat("process ", a.pid(), " had no decision by its deadline")));
  ::close(fd);
}

TEST(NodeSwitchProtocol, AFailedVoteWhoseReasonIsAllControlCharactersStillArrives) {
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  Participant b(dir, absl::OkStatus());
  absl::StatusOr<std::string> txn = Begin(dir, {::getpid(), b.pid()}, 20000);
  ASSERT_TRUE(txn.ok()) << txn.status();
  b.Go(*txn);
  VoteOptions o;
  o.dir = dir;
  o.txn = *txn;
  o.hard_deadline = Clock::now() + std::chrono::seconds(30);
  const absl::Status mine = VoteAndWait(o, absl::InternalError(std::string(30000, '\x01')));
  EXPECT_EQ(mine.code(), absl::StatusCode::kInternal);
  const std::string rb = b.Result();  // at once, not at the deadline
  EXPECT_THAT(rb, HasSubstr(absl::StrCat("ABORTED|node switch ", *txn, " rolled back: process ", ::getpid(), ": ")));
}

TEST(NodeSwitchProtocol, AVoteTheDaemonRefusesIsFinal) {
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  VoteOptions o;
  o.dir = dir;
  o.txn = "ab";  // malformed: refused at once, not retried until the deadline
  o.hard_deadline = Clock::now() + std::chrono::seconds(30);
  const auto t0 = Clock::now();
  EXPECT_EQ(VoteAndWait(o, absl::OkStatus()).code(), absl::StatusCode::kInvalidArgument);
  const pid_t other = ::fork();  // a switch this process takes no part in
  if (other == 0) {
    ::pause();
    ::_exit(0);
  }
  absl::StatusOr<std::string> txn = Begin(dir, {other}, 20000);
  ASSERT_TRUE(txn.ok()) << txn.status();
  o.txn = *txn;
  EXPECT_EQ(VoteAndWait(o, absl::OkStatus()).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(10));
  ::kill(other, SIGKILL);
  ::waitpid(other, nullptr, 0);
}

TEST(NodeSwitchProtocol, AVoteAfterTheDeadlineFindsTheSwitchAborted) {
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  Participant a(dir, absl::OkStatus()), b(dir, absl::OkStatus());
  absl::StatusOr<std::string> txn = Begin(dir, {a.pid(), b.pid()}, 1000);
  ASSERT_TRUE(txn.ok()) << txn.status();
  a.Go(*txn);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ::kill(daemon.pid(), SIGSTOP);  // the serving thread held up past the deadline
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  b.Go(*txn);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // b's vote waits in the daemon's queue
  ::kill(daemon.pid(), SIGCONT);
  EXPECT_THAT(a.Result(), HasSubstr("did not vote by the deadline"));
  EXPECT_THAT(b.Result(), HasSubstr("did not vote by the deadline"));
}

TEST(NodeSwitchProtocol, TheFirstRecordWins) {
  const std::string dir = PrivateDir();
  const std::string id = "00000000000000000000000000000001";
  absl::StatusOr<SwitchDecision> first = RecordDecision(dir, id, {1}, SwitchDecision{true, ""});
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<SwitchDecision> second = RecordDecision(dir, id, {1}, SwitchDecision{false, "late"});
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE(second->commit);
  EXPECT_EQ(RecordDecision(dir, "../x", {1}, SwitchDecision{}).status().code(), absl::StatusCode::kInvalidArgument);
  // Records of processes all gone are swept (pid 1 lives; a reaped child does not).
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  ASSERT_TRUE(RecordDecision(dir, "00000000000000000000000000000002", {child}, SwitchDecision{}).ok());
  EXPECT_EQ(SweepDecisions(dir), 1);
  EXPECT_TRUE(ReadDecision(dir, id)->has_value());
  // A record naming only a dead process stays while a giver or taker noted for it lives:
  // the giver may still read the notes (Note [Node Switch Handover]); and goes after.
  const std::string noted = "00000000000000000000000000000003";
  ASSERT_TRUE(RecordDecision(dir, noted, {child}, SwitchDecision{}).ok());
  ASSERT_TRUE(RecordTaker(dir, noted, ::getpid(), child).ok());
  EXPECT_EQ(SweepDecisions(dir), 0);
  EXPECT_EQ(RecordedTakers(dir, noted, ::getpid()).value(), std::vector<pid_t>{child});
  const pid_t giver = ::fork();
  if (giver == 0) ::_exit(0);
  ::waitpid(giver, nullptr, 0);
  const std::string gone = "00000000000000000000000000000004";
  ASSERT_TRUE(RecordDecision(dir, gone, {}, SwitchDecision{}).ok());
  ASSERT_TRUE(RecordTaker(dir, gone, giver, child).ok());
  EXPECT_EQ(SweepDecisions(dir), 1);
  EXPECT_TRUE(RecordedTakers(dir, gone, giver)->empty()) << "removed with its record";
  // The default runtime directory (a process's own) is the one read and written.
  ASSERT_EQ(::setenv("VMSTASH_RUNTIME_DIR", dir.c_str(), 1), 0);
  ASSERT_TRUE(RecordTaker("", gone, ::getpid(), 77).ok());
  EXPECT_EQ(RecordedTakers(dir, gone, ::getpid()).value(), std::vector<pid_t>{77});
  EXPECT_EQ(RecordedTakers("", gone, ::getpid()).value(), std::vector<pid_t>{77});
  ::unsetenv("VMSTASH_RUNTIME_DIR");
}

TEST(NodeSwitchProtocol, BadRequestsAreRefusedClearly) {
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  EXPECT_EQ(Begin(dir, {::getpid()}, 0).status().code(), absl::StatusCode::kInvalidArgument);
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  EXPECT_THAT(Begin(dir, {child}, 1000).status().message(), HasSubstr(absl::StrCat("no process ", child)));
  absl::StatusOr<std::string> txn = Begin(dir, {::getpid(), 1}, 1000);
  ASSERT_TRUE(txn.ok());
  WireRequest vote;
  vote.op = WireOp::kVote;
  vote.txn = *txn;
  vote.pid = 1;  // not us
  vote.ok = true;
  EXPECT_EQ(Ask(dir, vote).status().code(), absl::StatusCode::kPermissionDenied);
  WireRequest outcome;
  outcome.op = WireOp::kOutcome;
  outcome.txn = "../../etc";
  EXPECT_EQ(Ask(dir, outcome).status().code(), absl::StatusCode::kInvalidArgument);
  outcome.txn = *txn;
  absl::StatusOr<JsonValue> pending = Ask(dir, outcome);
  ASSERT_TRUE(pending.ok());
  EXPECT_EQ((*pending)["decision"].String(), "pending");
}

// A participant that votes in switch after switch: it reads a switch id and its vote ('1'
// OK, '0' a failure) from a pipe, votes, and writes back 'c' (commit), 'a' (abort) or 'e'.
class Voter {
 public:
  explicit Voter(const std::string& dir) {
    int go[2], out[2];
    if (::pipe(go) != 0 || ::pipe(out) != 0) return;
    pid_ = ::fork();
    if (pid_ == 0) {
      // Only its own pipes: another voter's write end held here would keep that voter from
      // seeing its end of input.
      for (int fd = 3; fd < 1024; ++fd) {
        if (fd != go[0] && fd != out[1]) ::close(fd);
      }
      char msg[33];
      while (::read(go[0], msg, 33) == 33) {
        VoteOptions o;
        o.dir = dir;
        o.txn = std::string(msg, 32);
        o.hard_deadline = Clock::now() + std::chrono::seconds(30);
        const absl::Status local = msg[32] == '1' ? absl::OkStatus() : absl::InternalError("injected");
        const absl::Status s = VoteAndWait(o, local);
        const char r = !local.ok() ? 'a' : s.ok() ? 'c' : absl::IsAborted(s) ? 'a' : 'e';
        (void)!::write(out[1], &r, 1);
      }
      ::_exit(0);
    }
    ::close(go[0]);
    ::close(out[1]);
    go_ = go[1];
    out_ = out[0];
  }
  ~Voter() {
    ::close(go_);
    ::close(out_);
    ::waitpid(pid_, nullptr, 0);
  }
  pid_t pid() const { return pid_; }
  void Vote(const std::string& txn, bool ok) {
    const std::string msg = txn + (ok ? "1" : "0");
    (void)!::write(go_, msg.data(), msg.size());
  }
  char Outcome() {
    char r = '?';
    return ::read(out_, &r, 1) == 1 ? r : '?';
  }

 private:
  pid_t pid_ = -1;
  int go_ = -1, out_ = -1;
};

TEST(NodeSwitchProtocol, ManySwitchesAtOnceEachDecidedOneWayForAll) {
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  constexpr int kPairs = 4, kRounds = 30;
  std::vector<std::unique_ptr<Voter>> voters;
  for (int i = 0; i < 2 * kPairs; ++i) voters.push_back(std::make_unique<Voter>(dir));
  int commits = 0, aborts = 0;
  for (int round = 0; round < kRounds; ++round) {
    std::vector<std::string> txns;
    for (int p = 0; p < kPairs; ++p) {  // every pair's switch begun and voted at once
      absl::StatusOr<std::string> txn = Begin(dir, {voters[2 * p]->pid(), voters[2 * p + 1]->pid()}, 10000);
      ASSERT_TRUE(txn.ok()) << txn.status();
      txns.push_back(*txn);
    }
    for (int i = 0; i < 2 * kPairs; ++i) voters[i]->Vote(txns[i / 2], (round * 7 + i) % 5 != 0);
    for (int p = 0; p < kPairs; ++p) {
      const bool expect_commit = (round * 7 + 2 * p) % 5 != 0 && (round * 7 + 2 * p + 1) % 5 != 0;
      const char a = voters[2 * p]->Outcome(), b = voters[2 * p + 1]->Outcome();
      EXPECT_EQ(a, b) << "round " << round << " pair " << p;
      EXPECT_EQ(a, expect_commit ? 'c' : 'a') << "round " << round << " pair " << p;
      absl::StatusOr<std::optional<SwitchDecision>> d = ReadDecision(dir, txns[p]);
      ASSERT_TRUE(d.ok() && d->has_value());
      EXPECT_EQ((*d)->commit, expect_commit);
      (expect_commit ? commits : aborts) += 1;
    }
  }
  EXPECT_GT(commits, 0);
  EXPECT_GT(aborts, 0);
}

TEST(NodeSwitchParts, PidTagListsAreParsedPerProcess) {
  absl::StatusOr<std::vector<NodeSwitchPart>> parts = ParseNodeSwitchParts("10:train, 20:kv_cache,10:opt", "20:weights");
  ASSERT_TRUE(parts.ok()) << parts.status();
  ASSERT_EQ(parts->size(), 2u);
  EXPECT_EQ((*parts)[0].pid, 10);
  EXPECT_EQ((*parts)[0].pause, (std::vector<std::string>{"train", "opt"}));
  EXPECT_EQ((*parts)[1].resume, (std::vector<std::string>{"weights"}));
  for (const char* bad : {"train", "x:train", "0:a", "10:", "-1:a"}) {
    EXPECT_EQ(ParseNodeSwitchParts(bad, "").status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(ParseNodeSwitchParts("10:a", "10:a").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseNodeSwitchParts("", "").status().code(), absl::StatusCode::kInvalidArgument);
  NodeSwitchRequest none;
  EXPECT_EQ(RunNodeSwitch(none).status().code(), absl::StatusCode::kInvalidArgument);
}

// A daemon of another release (protocol version 1) serves the directory: the vote is
// refused at once with the reason, not waited on until the deadline as a lost reply.
TEST(NodeSwitchTest, AVoteToADaemonOfAnotherVersionIsRefusedWithTheReason) {
  const std::string dir = PrivateDir();
  const int listener = ListenAsDaemon(dir, 8);
  ASSERT_GE(listener, 0);
  std::thread old_daemon([listener] {
    for (int served = 0; served < 8; ++served) {
      const int c = ::accept(listener, nullptr, nullptr);
      if (c < 0) return;
      if (Receive(c, 5000).ok()) {
        (void)Send(c, R"({"v":1,"ok":false,"code":"FAILED_PRECONDITION","message":"node protocol: version 2, )"
                      R"(this daemon speaks version 1"})");
      }
      ::close(c);
    }
  });
  VoteOptions v;
  v.dir = dir;
  v.txn = std::string(32, 'a');
  v.hard_deadline = Clock::now() + std::chrono::seconds(30);
  const absl::Status s = VoteAndWait(v, absl::OkStatus());
  ::shutdown(listener, SHUT_RDWR);
  ::close(listener);
  old_daemon.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("the vote was refused")) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("node protocol version 1")) << s;
  EXPECT_THAT(std::string(s.message()), ::testing::Not(HasSubstr("deadline"))) << s;
}

}  // namespace
}  // namespace vmstash::node
