// The handover of chunks, participant's side: see chunk_trade.h.
#include "node/chunk_trade.h"

#include <unistd.h>

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "node/decision_record.h"
#include "node/wire.h"

namespace vmstash::node {
namespace {

using Clock = std::chrono::steady_clock;

int MsLeft(Clock::time_point deadline) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<std::int64_t>(ms, 0, 600000));
}

// One request on `socket` and its reply (the descriptors attached: the caller's).
absl::StatusOr<Received> Ask(int socket, const WireRequest& request, const std::vector<int>& fds, int timeout_ms) {
  if (absl::Status s = SendFds(socket, FormatRequest(request), fds); !s.ok()) return s;
  return Receive(socket, timeout_ms, kMaxFdsPerPacket);
}

}  // namespace

absl::StatusOr<std::size_t> OfferChunks(const TradeOptions& options, std::vector<TradedChunk> chunks) {
  auto close_from = [&chunks](std::size_t first) {
    for (std::size_t i = first; i < chunks.size(); ++i) ::close(chunks[i].fd);
  };
  absl::StatusOr<int> socket = ConnectTrusted(options.dir);
  if (!socket.ok()) {
    close_from(0);
    return socket.status();
  }
  std::size_t kept = 0;
  absl::Status failed;
  std::size_t at = 0;
  do {  // at least one packet: an empty offer says "nothing more" too
    const std::size_t n = std::min(kMaxFdsPerPacket, chunks.size() - at);
    WireRequest r;
    r.op = WireOp::kOffer;
    r.txn = options.txn;
    r.pid = ::getpid();
    r.device = options.device;
    std::vector<std::string> sizes;
    std::vector<ChunkUse> uses;
    std::vector<int> fds;
    for (std::size_t i = at; i < at + n; ++i) {
      sizes.push_back(absl::StrCat(chunks[i].size_bytes));
      uses.push_back(chunks[i].use);
      fds.push_back(chunks[i].fd);
    }
    r.sizes = absl::StrJoin(sizes, ",");
    r.uses = FormatUses(uses);
    r.last = at + n == chunks.size();
    absl::StatusOr<Received> got = Ask(*socket, r, fds, std::max(MsLeft(options.deadline), 1000));
    for (int fd : fds) ::close(fd);  // the daemon has its own copies now
    at += n;
    if (!got.ok()) {
      failed = got.status();
      break;
    }
    CloseAll(*got);
    absl::StatusOr<JsonValue> doc = ParseReply(got->message);
    if (!doc.ok()) {
      failed = doc.status();
      break;
    }
    kept += static_cast<std::size_t>((*doc)["kept"].Int(0));
  } while (at < chunks.size());
  close_from(at);
  ::close(*socket);
  if (!failed.ok()) return failed;
  return kept;
}

absl::StatusOr<std::vector<TradedChunk>> TakeChunks(const TradeOptions& options) {
  absl::StatusOr<int> socket = ConnectTrusted(options.dir);
  if (!socket.ok()) return socket.status();
  std::vector<TradedChunk> taken;
  absl::Status failed;
  int pause_us = options.poll_us;
  for (;;) {
    if (Clock::now() >= options.deadline) {
      failed = absl::DeadlineExceededError("node switch: the other processes' chunks did not come in time");
      break;
    }
    WireRequest r;
    r.op = WireOp::kTake;
    r.txn = options.txn;
    r.pid = ::getpid();
    r.device = options.device;
    r.gaps = options.gaps;
    absl::StatusOr<Received> got = Ask(*socket, r, {}, std::max(MsLeft(options.deadline), 1));
    if (!got.ok()) {
      failed = got.status();
      break;
    }
    absl::StatusOr<JsonValue> doc = ParseReply(got->message);
    if (!doc.ok()) {
      CloseAll(*got);
      failed = doc.status();
      break;
    }
    if (!(*doc)["ready"].Bool(false)) {  // a donor's offer may still come
      CloseAll(*got);
      std::this_thread::sleep_for(std::chrono::microseconds(pause_us));
      pause_us = std::min(2 * pause_us, 1000);
      continue;
    }
    absl::StatusOr<std::vector<std::size_t>> sizes = ParseSizes((*doc)["sizes"].String());
    absl::StatusOr<std::vector<ChunkUse>> uses =
        sizes.ok() ? ParseUses((*doc)["uses"].String(), sizes->size()) : sizes.status();
    if (!sizes.ok() || !uses.ok() || sizes->size() != got->fds.size()) {
      CloseAll(*got);
      failed = absl::InternalError("node switch: the daemon's chunks do not match their sizes and uses");
      break;
    }
    for (std::size_t i = 0; i < sizes->size(); ++i) taken.push_back({got->fds[i], (*sizes)[i], (*uses)[i]});
    if (!(*doc)["more"].Bool(false)) break;
  }
  ::close(*socket);
  if (!failed.ok()) {
    for (const TradedChunk& c : taken) ::close(c.fd);
    return failed;
  }
  return taken;
}

absl::Status AwaitTakers(const TradeOptions& options) {
  WireRequest r;
  r.op = WireOp::kSettled;
  r.txn = options.txn;
  r.pid = ::getpid();
  int pause_us = options.poll_us;
  std::string last;  // why it is not settled yet
  for (;;) {
    absl::StatusOr<JsonValue> doc = AskOnce(options.dir, r, std::max(MsLeft(options.deadline), 1));
    if (doc.ok()) {
      if ((*doc)["settled"].Bool(false)) return absl::OkStatus();
      const std::string waiting = (*doc)["waiting"].String();
      last = waiting.empty() ? std::string("the switch was not decided (a process may still take this process's memory)")
                             : absl::StrCat("process(es) ", waiting, " took this process's memory and neither "
                                            "finished nor exited");
    } else if (absl::IsNotFound(doc.status()) || DaemonGone(options.dir)) {
      // The daemon that granted the chunks is gone (none serves, or another that does not
      // know the switch): nothing more is granted, and the takers noted on disk
      // (decision_record.h) tell whether any process took these chunks at all.
      absl::StatusOr<std::vector<pid_t>> noted = RecordedTakers(options.dir, options.txn, ::getpid());
      if (noted.ok() && noted->empty()) return absl::OkStatus();
      return absl::UnavailableError(absl::StrCat(
          "the node daemon cannot say whether the processes that took this process's memory are done (",
          doc.status().message(), ")",
          noted.ok() ? absl::StrCat("; they are ", absl::StrJoin(*noted, ", ")) : std::string()));
    } else {  // alive, but this request failed (refused, slow): ask again
      last = std::string(doc.status().message());
    }
    if (Clock::now() >= options.deadline) return absl::DeadlineExceededError(last);
    std::this_thread::sleep_for(std::chrono::microseconds(pause_us));
    pause_us = std::min(2 * pause_us, 1000);
  }
}

}  // namespace vmstash::node
