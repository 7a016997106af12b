// The handover of chunks through the daemon (Note [Node Switch Handover], node_switch.h;
// chunk_trade.h, wire.h offer/take) between real processes: the daemon in a child, this
// process a donor, a taker in another child. Offered descriptors (memfds standing for
// chunks) reach one taker of the same device, once, after every other donor is in; bad
// offers and takes are refused; the daemon keeps no descriptor past the decision.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "node/chunk_trade.h"
#include "node/decision_record.h"
#include "node/switch_vote.h"
#include "node/testing.h"
#include "node/wire.h"

namespace vmstash::node {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

absl::StatusOr<std::string> Begin(const std::string& dir, const std::vector<pid_t>& pids,
                                  const std::vector<pid_t>& donors, int timeout_ms = 20000) {
  WireRequest r;
  r.op = WireOp::kBegin;
  r.pids = absl::StrJoin(pids, ",");
  r.donors = absl::StrJoin(donors, ",");
  r.timeout_ms = static_cast<std::uint64_t>(timeout_ms);
  absl::StatusOr<JsonValue> reply = AskOnce(dir, r, 5000);
  if (!reply.ok()) return reply.status();
  return (*reply)["txn"].String();
}

// This process, the initiator and a participant of `txn`, is told its outcome in both
// roles, so the daemon forgets the switch (and stops watching this process); then waits
// up to 5 s for the daemon to hold `want` descriptors.
int ForgetAndCountFds(const std::string& dir, const std::string& txn, pid_t daemon, int want) {
  WireRequest r;
  r.op = WireOp::kOutcome;
  r.txn = txn;
  r.pid = ::getpid();
  for (int role = 0; role < 2; ++role) EXPECT_TRUE(AskOnce(dir, r, 5000).ok());
  int n = OpenFds(daemon);
  for (int i = 0; i < 250 && n != want; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    n = OpenFds(daemon);
  }
  return n;
}

// A chunk stand-in: a memfd whose first bytes say `text`.
TradedChunk Marked(const std::string& text, std::size_t size = 4096) {
  const int fd = ::memfd_create("chunk", MFD_CLOEXEC);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::ftruncate(fd, static_cast<off_t>(size)), 0);
  EXPECT_EQ(::pwrite(fd, text.data(), text.size(), 0), static_cast<ssize_t>(text.size()));
  return {fd, size};
}

std::string Mark(int fd) {
  char buf[32] = {};
  const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)).c_str() : "";
}

// One gap that holds every chunk a test offers.
const std::vector<FitGap> kRoomForAll = {{std::size_t{1} << 40, 0, false}};

TradeOptions Options(const std::string& dir, const std::string& txn, const std::string& device, int ms = 5000,
                     std::vector<FitGap> gaps = kRoomForAll) {
  TradeOptions o;
  o.dir = dir;
  o.txn = txn;
  o.device = device;
  o.deadline = Clock::now() + std::chrono::milliseconds(ms);
  o.gaps = std::move(gaps);
  return o;
}

// A child that takes the chunks of `device` for `gaps` in the switch it reads from a
// pipe, and writes back how long it waited and the marks of what it got
// ("ms|mark:size,...", or "CODE|message" on failure), then takes again ("|again:N").
class Taker : public SwitchChild {
 public:
  Taker(const std::string& dir, const std::string& device, std::vector<FitGap> gaps = kRoomForAll,
        bool linger = false)
      : SwitchChild(
            [=](const std::string& txn) {
          const auto start = Clock::now();
          absl::StatusOr<std::vector<TradedChunk>> got = TakeChunks(Options(dir, txn, device, 5000, gaps));
          if (!got.ok()) {
            return absl::StrCat(absl::StatusCodeToString(got.status().code()), "|", got.status().message());
          }
          std::vector<std::string> marks;
          for (const TradedChunk& c : *got) {
            marks.push_back(absl::StrCat(Mark(c.fd), ":", c.size_bytes));
            ::close(c.fd);
          }
          const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
          absl::StatusOr<std::vector<TradedChunk>> again = TakeChunks(Options(dir, txn, device, 5000, gaps));
          return absl::StrCat(ms, "|", absl::StrJoin(marks, ","), "|again:", again.ok() ? again->size() : 999);
            },
            linger) {}
};

TEST(ChunkTrade, OffersReachOneTakerOfTheirDeviceOnceEveryDonorIsIn) {
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  const int before = OpenFds(daemon.pid());
  Taker taker(dir, "dev-1");
  absl::StatusOr<std::string> txn = Begin(dir, {::getpid(), taker.pid()}, {::getpid()});
  ASSERT_TRUE(txn.ok()) << txn.status();
  taker.Go(*txn);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the taker waits for this donor
  std::vector<TradedChunk> chunks;
  std::vector<std::string> want;
  for (int i = 0; i < 40; ++i) {  // more than one packet holds
    chunks.push_back(Marked(absl::StrCat("c", i), 4096 * (i + 1)));
    want.push_back(absl::StrCat("c", i, ":", 4096 * (i + 1)));
  }
  absl::StatusOr<std::size_t> kept = OfferChunks(Options(dir, *txn, "dev-1"), chunks);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(*kept, 40u);
  // Another device's chunk, offered by the same donor in a second call, goes to nobody here.
  kept = OfferChunks(Options(dir, *txn, "dev-2"), {Marked("other")});
  EXPECT_TRUE(kept.ok()) << kept.status();
  const std::string result = taker.Result();
  const std::vector<std::string> parts = absl::StrSplit(result, '|');
  ASSERT_EQ(parts.size(), 3u) << result;
  // Every chunk, in order: a take answered before the donor's offer would have had none.
  EXPECT_EQ(parts[1], absl::StrJoin(want, ",")) << "every chunk, in order, with its size";
  EXPECT_EQ(parts[2], "again:0") << "a chunk is given once";
  // This donor takes nothing of its own.
  absl::StatusOr<std::vector<TradedChunk>> mine = TakeChunks(Options(dir, *txn, "dev-2"));
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_TRUE(mine->empty());
  // The decision closes what is left (the dev-2 chunk).
  VoteOptions v;
  v.dir = dir;
  v.txn = *txn;
  v.hard_deadline = Clock::now() + std::chrono::seconds(10);
  EXPECT_FALSE(VoteAndWait(v, absl::InternalError("done")).ok());
  EXPECT_EQ(ForgetAndCountFds(dir, *txn, daemon.pid(), before), before)
      << "the daemon keeps no descriptor past the decision";
}

// Three takers, one after another, each with its own gaps: each gets the chunks that fit
// its gaps by FitChunks and leaves the rest for the next. A byte count could not say
// this: two gaps of 4 MiB take two chunks of 4 MiB, not one of 8, and a gap of 6 MiB that
// may be overrun by 2 MiB takes a chunk of 8 MiB.
TEST(ChunkTrade, TakersShareTheOffersByWhatFitsTheirGaps) {
  constexpr std::size_t kMiB = std::size_t{1} << 20;
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  const int before = OpenFds(daemon.pid());
  // They stay alive until the end: a participant that exits aborts the switch.
  Taker fours(dir, "dev-1", {{4 * kMiB, 0, false}, {4 * kMiB, 0, false}}, true);
  Taker overrun(dir, "dev-1", {{6 * kMiB, 2 * kMiB, false}}, true);
  Taker big(dir, "dev-1", {{8 * kMiB, 0, false}, {1 * kMiB, 0, false}}, true);
  absl::StatusOr<std::string> txn =
      Begin(dir, {::getpid(), fours.pid(), overrun.pid(), big.pid()}, {::getpid()});
  ASSERT_TRUE(txn.ok()) << txn.status();
  absl::StatusOr<std::size_t> kept =
      OfferChunks(Options(dir, *txn, "dev-1"), {Marked("a", 8 * kMiB), Marked("b", 4 * kMiB),
                                                Marked("c", 8 * kMiB), Marked("d", 4 * kMiB), Marked("e", 16 * kMiB)});
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(*kept, 5u);
  auto got = [](Taker& t, const std::string& txn_id) {
    t.Go(txn_id);
    const std::string r = t.Result();
    const std::vector<std::string> parts = absl::StrSplit(r, '|');
    return parts.size() == 3 ? parts[1] + "|" + parts[2] : r;
  };
  EXPECT_EQ(got(fours, *txn), absl::StrCat("b:", 4 * kMiB, ",d:", 4 * kMiB, "|again:0"));
  EXPECT_EQ(got(overrun, *txn), absl::StrCat("a:", 8 * kMiB, "|again:0"));
  EXPECT_EQ(got(big, *txn), absl::StrCat("c:", 8 * kMiB, "|again:0")) << "the 16 MiB chunk fits no gap";
  // A take naming no gap gets nothing, and the chunk that fits no gap is still held.
  absl::StatusOr<std::vector<TradedChunk>> none = TakeChunks(Options(dir, *txn, "dev-1", 5000, {}));
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->empty());
  VoteOptions v;
  v.dir = dir;
  v.txn = *txn;
  v.hard_deadline = Clock::now() + std::chrono::seconds(10);
  EXPECT_FALSE(VoteAndWait(v, absl::InternalError("done")).ok());
  // None went where restore copies write: the donor waits for no one at the abort.
  EXPECT_TRUE(AwaitTakers(Options(dir, *txn, "dev-1", 300)).ok());
  for (Taker* t : {&fours, &overrun, &big}) t->Kill();  // the daemon stops watching them
  EXPECT_EQ(ForgetAndCountFds(dir, *txn, daemon.pid(), before), before)
      << "the chunk nobody took is closed at the decision";
}

// Chunks go where their use allows: one only for discard covers never into a restore gap
// (strict); an "anywhere" one does, with its giver's event handle. The giver, at an
// abort, waits for such a taker until it voted or exited.
TEST(ChunkTrade, RestoreGapsTakeOnlyChunksTheirGiverCanRestoreAndTheGiverWaitsForTheirTakers) {
  constexpr std::size_t kMiB = std::size_t{1} << 20;
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  const std::vector<FitGap> gaps = {{8 * kMiB, 0, true}, {4 * kMiB, 0, false}};
  SwitchChild taker(
      [&](const std::string& txn) {
        absl::StatusOr<std::vector<TradedChunk>> got = TakeChunks(Options(dir, txn, "dev-1", 5000, gaps));
        if (!got.ok()) return std::string(got.status().message());
        std::vector<std::string> marks;
        for (const TradedChunk& c : *got) {
          const std::string use = !c.use.wait_event.empty() ? "e" + c.use.wait_event.substr(0, 2)
                                  : c.use.anywhere          ? "+"
                                                            : "-";
          marks.push_back(absl::StrCat(Mark(c.fd), ":", c.size_bytes / kMiB, ":", use));
          ::close(c.fd);
        }
        return absl::StrJoin(marks, ",");
      },
      /*linger=*/true);
  absl::StatusOr<std::string> txn = Begin(dir, {::getpid(), taker.pid()}, {::getpid()});
  ASSERT_TRUE(txn.ok()) << txn.status();
  std::vector<TradedChunk> chunks = {Marked("a", 8 * kMiB), Marked("b", 8 * kMiB), Marked("c", 4 * kMiB)};
  chunks[1].use = {true, std::string(64, 'E')};
  chunks[2].use = {true, ""};
  absl::StatusOr<std::size_t> kept = OfferChunks(Options(dir, *txn, "dev-1"), chunks);
  ASSERT_TRUE(kept.ok()) << kept.status();
  // Undecided, a taker may still come: never settled yet, with no taker so far.
  const absl::Status undecided = AwaitTakers(Options(dir, *txn, "dev-1", 200));
  EXPECT_EQ(undecided.code(), absl::StatusCode::kDeadlineExceeded) << undecided;
  EXPECT_THAT(std::string(undecided.message()), HasSubstr("not decided")) << undecided;
  taker.Go(*txn);
  // "a" may go only where nothing restores: the 4 MiB gap cannot hold it, the 8 MiB one is
  // a restore gap. "b" (anywhere, with its event) fills the restore gap; "c" the other, and
  // goes out as a chunk for such gaps only (its giver is not waiting for this taker: the
  // taker, fitting again what it could import, may not move it into a restore gap).
  EXPECT_EQ(taker.Result(), "b:8:eEE,c:4:-");
  const absl::Status waiting = AwaitTakers(Options(dir, *txn, "dev-1", 300));
  EXPECT_EQ(waiting.code(), absl::StatusCode::kDeadlineExceeded) << waiting;
  EXPECT_THAT(std::string(waiting.message()), HasSubstr(absl::StrCat(taker.pid()))) << waiting;
  // Noted on disk before the chunk went out: a giver whose daemon is gone reads it there.
  EXPECT_EQ(RecordedTakers(dir, *txn, ::getpid()).value(), std::vector<pid_t>{taker.pid()});
  EXPECT_EQ(RecordedTakers(dir, *txn, taker.pid()).value(), std::vector<pid_t>{});
  taker.Kill();  // it exits without voting: the switch aborts, and it can write no more
  // This process learns the abort, as the initiator and as a participant, before it asks:
  // its ask is then the last thing the daemon keeps the switch for, and must say settled
  // (the switch is forgotten by that ask; the record and its notes linger on disk).
  WireRequest outcome;
  outcome.op = WireOp::kOutcome;
  outcome.txn = *txn;
  outcome.pid = ::getpid();
  for (int i = 0; i < 250; ++i) {
    absl::StatusOr<JsonValue> d = AskOnce(dir, outcome, 5000);
    ASSERT_TRUE(d.ok()) << d.status();
    if ((*d)["decision"].String() != "pending") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(AskOnce(dir, outcome, 5000).ok());
  const absl::Status settled = AwaitTakers(Options(dir, *txn, "dev-1", 300));
  EXPECT_TRUE(settled.ok()) << settled;
  // Asked again (the answer's reply lost, say): the switch is forgotten but still settled.
  const absl::Status again = AwaitTakers(Options(dir, *txn, "dev-1", 300));
  EXPECT_TRUE(again.ok()) << again;
  // A switch the daemon does not know (it died, another took its place): nothing noted for
  // it, so no process took this one's chunks; one noted cannot be shown done.
  EXPECT_TRUE(AwaitTakers(Options(dir, std::string(32, 'b'), "dev-1", 300)).ok());
  ASSERT_TRUE(RecordTaker(dir, std::string(32, 'c'), ::getpid(), 4242).ok());
  const absl::Status unknown = AwaitTakers(Options(dir, std::string(32, 'c'), "dev-1", 300));
  EXPECT_EQ(unknown.code(), absl::StatusCode::kUnavailable) << unknown;
  EXPECT_THAT(std::string(unknown.message()), HasSubstr("4242")) << unknown;
  daemon.Stop();  // and with no daemon at all
  EXPECT_TRUE(AwaitTakers(Options(dir, std::string(32, 'd'), "dev-1", 300)).ok());
  EXPECT_EQ(AwaitTakers(Options(dir, std::string(32, 'c'), "dev-1", 300)).code(), absl::StatusCode::kUnavailable);
  RemoveDecision(dir, std::string(32, 'c'));
  EXPECT_TRUE(RecordedTakers(dir, std::string(32, 'c'), ::getpid()).value().empty()) << "removed with its record";
}

TEST(ChunkTrade, ATakerStopsWaitingWhenTheDonorVotesOrExitsWithoutOffering) {
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  // A donor that exits without offering: the switch aborts, the take returns nothing.
  const pid_t quiet = ::fork();
  if (quiet == 0) {
    ::pause();
    ::_exit(0);
  }
  absl::StatusOr<std::string> txn = Begin(dir, {::getpid(), quiet}, {quiet});
  ASSERT_TRUE(txn.ok()) << txn.status();
  std::thread killer([quiet] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    ::kill(quiet, SIGKILL);
  });
  absl::StatusOr<std::vector<TradedChunk>> got = TakeChunks(Options(dir, *txn, "dev-1"));
  killer.join();
  ::waitpid(quiet, nullptr, 0);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->empty());
  // A donor that hangs: the take gives up at its own deadline.
  const pid_t hung = ::fork();
  if (hung == 0) {
    ::pause();
    ::_exit(0);
  }
  txn = Begin(dir, {::getpid(), hung}, {hung});
  ASSERT_TRUE(txn.ok()) << txn.status();
  got = TakeChunks(Options(dir, *txn, "dev-1", 300));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded) << got.status();
  ::kill(hung, SIGKILL);
  ::waitpid(hung, nullptr, 0);
}

TEST(ChunkTrade, TwoDonorsThatOfferNothingAndTakeDoNotWaitForEachOther) {
  // Both named donors (their requests name tags to pause, all already paused): neither
  // offers, both take. A take counts as the taker's offer: neither waits for the other.
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  Taker taker(dir, "dev-1");
  absl::StatusOr<std::string> txn = Begin(dir, {::getpid(), taker.pid()}, {::getpid(), taker.pid()});
  ASSERT_TRUE(txn.ok()) << txn.status();
  taker.Go(*txn);
  const auto start = Clock::now();
  absl::StatusOr<std::vector<TradedChunk>> got = TakeChunks(Options(dir, *txn, "dev-1", 10000));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->empty());
  const std::string result = taker.Result();
  EXPECT_THAT(result, ::testing::EndsWith("||again:0")) << result;
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5)) << "they waited for each other";
}

TEST(ChunkTrade, BadOffersAndTakesAreRefusedAndTheirDescriptorsClosed) {
  const std::string dir = PrivateDir();
  DaemonProcess daemon(dir);
  ASSERT_TRUE(daemon.started());
  const int before = OpenFds(daemon.pid());
  const pid_t other = ::fork();
  if (other == 0) {
    ::pause();
    ::_exit(0);
  }
  absl::StatusOr<std::string> txn = Begin(dir, {::getpid(), other}, {::getpid()});
  ASSERT_TRUE(txn.ok()) << txn.status();
  // Unknown switch.
  EXPECT_EQ(OfferChunks(Options(dir, std::string(32, 'a'), "d"), {Marked("x")}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(TakeChunks(Options(dir, std::string(32, 'a'), "d")).status().code(), absl::StatusCode::kNotFound);
  // Raw requests: another pid's offer, sizes that do not match the descriptors, a take
  // for another pid.
  absl::StatusOr<int> s = ConnectTrusted(dir);
  ASSERT_TRUE(s.ok()) << s.status();
  auto ask = [&](WireRequest r, std::vector<int> fds) {
    EXPECT_TRUE(SendFds(*s, FormatRequest(r), fds).ok());
    for (int fd : fds) ::close(fd);
    absl::StatusOr<Received> got = Receive(*s, 5000);
    EXPECT_TRUE(got.ok()) << got.status();
    return got.ok() ? ParseReply(got->message).status() : got.status();
  };
  WireRequest r;
  r.op = WireOp::kOffer;
  r.txn = *txn;
  r.pid = other;
  r.device = "d";
  r.sizes = "4096";
  r.uses = "-";
  r.last = true;
  absl::Status refused = ask(r, {Marked("x").fd});
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied) << refused;
  r.pid = ::getpid();
  // Uses that are not one per chunk, or not "-", "+" or an event handle's hex digits.
  for (const std::string& uses : {std::string(""), std::string("-,-"), std::string("x"), std::string("++"),
                                  std::string(kEventHandleHex - 2, 'a'), std::string(kEventHandleHex, 'g')}) {
    r.uses = uses;
    refused = ask(r, {Marked("x").fd});
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << uses << ": " << refused;
    EXPECT_THAT(std::string(refused.message()), HasSubstr("uses")) << refused;
  }
  r.sizes = "4096,4096";
  r.uses = "-,+";
  refused = ask(r, {Marked("x").fd});
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("2 sizes came with 1 descriptors"));
  for (const char* sizes : {"0", "+4096", " 4096", "4096,"}) {
    r.sizes = sizes;
    refused = ask(r, {Marked("x").fd});
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << sizes << ": " << refused;
  }
  WireRequest t;
  t.op = WireOp::kTake;
  t.txn = *txn;
  t.pid = other;
  t.device = "d";
  refused = ask(t, {});
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied) << refused;
  // Gaps that are not BYTES:OVERRUN, a gap of 0 bytes, or more gaps than a take may name.
  const std::string take_head =
      absl::StrCat(R"({"v":3,"op":"take","txn":")", *txn, R"(","pid":)", ::getpid(), R"(,"device":"d","gaps":")");
  std::string too_many;
  for (std::size_t i = 0; i <= kMaxTakeGaps; ++i) absl::StrAppend(&too_many, i == 0 ? "" : ",", "1:0");
  for (const std::string& gaps : {std::string("4096"), std::string("0:0"), std::string("a:1"),
                                  std::string("4096:-1"), std::string("4096:0,"), std::string(" +4096:0"),
                                  std::string("4096:0:0"), std::string("4096:0:rr"), std::string("4096:0:r:r"),
                                  too_many}) {
    ASSERT_TRUE(SendFds(*s, take_head + gaps + R"("})", {}).ok());
    absl::StatusOr<Received> reply = Receive(*s, 5000);
    ASSERT_TRUE(reply.ok()) << reply.status();
    const absl::Status bad = ParseReply(reply->message).status();
    EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << gaps.substr(0, 40) << ": " << bad;
    EXPECT_THAT(std::string(bad.message()), HasSubstr("gaps")) << bad;
  }
  WireRequest stats;
  stats.op = WireOp::kStats;
  refused = ask(stats, {Marked("x").fd});
  EXPECT_THAT(std::string(refused.message()), HasSubstr("only an offer passes descriptors"));
  ::close(*s);
  // After the decision, an offer is refused.
  ::kill(other, SIGKILL);
  ::waitpid(other, nullptr, 0);
  absl::Status late;
  for (int i = 0; i < 100; ++i) {  // the daemon learns the exit from its pidfd
    late = OfferChunks(Options(dir, *txn, "d"), {Marked("x")}).status();
    if (late.code() == absl::StatusCode::kFailedPrecondition) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition) << late;
  EXPECT_EQ(ForgetAndCountFds(dir, *txn, daemon.pid(), before), before) << "every descriptor sent was closed";
}

}  // namespace
}  // namespace vmstash::node
