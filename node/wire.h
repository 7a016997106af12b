// The node protocol: what a client process and the node daemon (daemon.h) say to each
// other over the daemon's socket (docs/node.md).
//
// Transport: a Unix SOCK_SEQPACKET socket, `<runtime dir>/vmstashd.sock`
// (control/runtime_dir.h: where, and the trust rules: both ends talk only to their own
// uid). One message is one packet of at most kMaxMessageBytes holding a flat JSON object;
// a packet may carry file descriptors (SCM_RIGHTS): one (hello's reply), or up to
// kMaxFdsPerPacket chunks (offer, take's reply). One reply per request, in order.
//
// Requests (client -> daemon), each with "v":3 (kWireVersion; 2: take names its gaps; 3:
// chunks' uses, restore gaps, settled):
//   {"op":"hello","pid":P}             first, once: the reply carries the pool's memfd
//   {"op":"lease","bytes":N,"tag":T}   N > 0 bytes of the pool for this client
//   {"op":"give","offset":O}           returns this client's lease at O
//   {"op":"stats"}
//   {"op":"begin","pids":"P,Q","timeout_ms":T[,"donors":"P"]}   a node switch (Note
//                                      [Node Switch], node_switch.h) of processes P, Q,
//                                      decided within T ms; the donors pause tags
//   {"op":"vote","txn":X,"pid":P,"ok":B,"reason":R}  P's outcome in switch X; the reply
//                                      comes when X is decided
//   {"op":"outcome","txn":X,"pid":P}   X's decision, "pending", or (X unknown to this
//                                      daemon: begun by one that died) "abort", recorded
//   {"op":"offer","txn":X,"pid":P,"device":D,"sizes":"N,...","uses":"U,...","last":B}
//                                      chunks of P on device D (a UUID) with one
//                                      descriptor and one use (ChunkUse) per size, for the
//                                      other participants of X to take (Note [Node Switch
//                                      Handover]); the last packet of P's offer says so
//   {"op":"take","txn":X,"pid":P,"device":D,"gaps":"N:M[:r],..."}  offered chunks of
//                                      device D for P's gaps (N bytes each, which a chunk
//                                      may overrun by M; ":r": restore copies write it, so
//                                      only chunks whose use says "anywhere" fit it; at
//                                      most kMaxTakeGaps), fitted by base/chunk_fit.h:
//                                      "ready" false while a donor's offer may still come,
//                                      else "sizes", "uses" and their descriptors (at most
//                                      kMaxFdsPerPacket) and "more" when there are more
//                                      (asked for by the same take again: the fit is made
//                                      once per process, device and switch)
//   {"op":"settled","txn":X,"pid":P}   whether every process that took a chunk of P into
//                                      a restore gap in X has voted or exited: "settled",
//                                      and "waiting" (the pids of those that have not)
// Replies: {"v":3,"ok":true,...} with hello: "client", "capacity"; lease: "offset",
// "bytes"; stats: the pool's PoolStats fields and "connected"; begin: "txn"; vote and outcome:
// "decision" ("commit", "abort" or "pending") and "reason"; offer: "kept" (the chunks
// held; the daemon holds at most kMaxHeldChunks, fewer under a low descriptor limit,
// closing the others); take: above — or
// {"v":3,"ok":false,"code":"<absl status code name>","message":"..."}. A reply of another
// version (a daemon of another vmstash release serves the directory) is FailedPrecondition,
// saying how to replace that daemon.
// begin, vote, outcome, offer, take and settled need no hello (a connection of their own: a vote's reply waits
// for the decision, and no other request may be sent on it meanwhile). A lease, give or
// stats before hello, a second hello, an unknown op or key, a missing or mistyped
// field, or another version is an error reply; the daemon keeps serving.
//
// Thread-safety: pure functions (Send/Receive: one caller per socket at a time).
#ifndef VMSTASH_NODE_WIRE_H_
#define VMSTASH_NODE_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/chunk_fit.h"
#include "base/json_reader.h"

namespace vmstash::node {

inline constexpr int kWireVersion = 3;
inline constexpr std::size_t kMaxMessageBytes = std::size_t{16} << 10;
inline constexpr const char* kSocketName = "vmstashd.sock";
inline constexpr std::size_t kMaxFdsPerPacket = 32;
inline constexpr std::size_t kMaxHeldChunks = 4096;
inline constexpr std::size_t kMaxTakeGaps = 256;  // a take's gaps: at most ~42 bytes each, within kMaxMessageBytes

enum class WireOp { kHello, kLease, kGive, kStats, kBegin, kVote, kOutcome, kOffer, kTake, kSettled };

// How a taker may use an offered chunk (Note [Node Switch Handover]). On the wire, one per
// chunk: "-" (only where no restore copy writes), "+" (anywhere: its giver can restore
// its bytes) or kEventHandleHex hex digits (anywhere, but a restore copy into it first
// waits for that event of its giver: Driver::ExportIpcEvent).
struct ChunkUse {
  bool anywhere = false;
  std::string wait_event;  // the event handle's bytes (empty: nothing to wait for)
  friend bool operator==(const ChunkUse& a, const ChunkUse& b) {
    return a.anywhere == b.anywhere && a.wait_event == b.wait_event;
  }
};
inline constexpr std::size_t kEventHandleHex = 128;

struct WireRequest {
  WireOp op = WireOp::kStats;
  std::int64_t pid = 0;      // hello
  std::uint64_t bytes = 0;   // lease
  std::string tag;           // lease
  std::uint64_t offset = 0;  // give
  std::string pids;          // begin: comma-separated
  std::uint64_t timeout_ms = 0;  // begin
  std::string donors;        // begin: comma-separated (optional)
  std::string txn;           // vote, outcome, offer, take, settled
  bool ok = false;           // vote
  std::string reason;        // vote
  std::string device;        // offer, take
  std::string sizes;         // offer: comma-separated byte counts
  std::string uses;          // offer: FormatUses, one per size
  bool last = false;         // offer
  std::vector<FitGap> gaps;  // take (strict: a restore gap)
};
// "N,N,..." (empty: none) as byte counts, each > 0; InvalidArgument otherwise.
absl::StatusOr<std::vector<std::size_t>> ParseSizes(absl::string_view sizes);
// "N:M[:r],..." (empty: none) as gaps of N > 0 bytes, each overrun by at most M, strict
// with ":r"; at most kMaxTakeGaps. InvalidArgument otherwise.
absl::StatusOr<std::vector<FitGap>> ParseGaps(absl::string_view gaps);
std::string FormatGaps(const std::vector<FitGap>& gaps);
// The uses of `count` chunks (ChunkUse); InvalidArgument for another count or a bad one.
absl::StatusOr<std::vector<ChunkUse>> ParseUses(absl::string_view uses, std::size_t count);
std::string FormatUses(const std::vector<ChunkUse>& uses);

std::string FormatRequest(const WireRequest& request);
absl::StatusOr<WireRequest> ParseRequest(absl::string_view text);
// An error reply for `status` (not OK).
std::string FormatError(const absl::Status& status);
// A reply's document when it says ok, else its error as a status (the code it names);
// FailedPrecondition for a reply of another version (IsOtherVersion).
absl::StatusOr<JsonValue> ParseReply(absl::string_view text);
// Whether `status` is ParseReply's for a daemon of another protocol version: final, since
// that daemon can serve no request of this library.
bool IsOtherVersion(const absl::Status& status);

// `<dir>/vmstashd.sock`.
std::string SocketPath(const std::string& dir);
// A socket connected to the daemon at `path` (its peer not checked yet: control::PeerOf).
// Unavailable, naming the path and why, when nothing serves there.
absl::StatusOr<int> Connect(const std::string& path);
// A socket connected to the daemon serving `dir` (empty: control::DefaultRuntimeDir()),
// under the trust rules: the directory ours and closed to others, the daemon our uid.
absl::StatusOr<int> ConnectTrusted(const std::string& dir);
// One request on a connection of its own (ConnectTrusted), its reply waited for up to
// `timeout_ms`, the connection closed: the reply's document, or the failure (the daemon's
// error as a status). The node switch's requests go this way (a vote's reply waits for a
// decision, so it may not share a lease client's connection).
absl::StatusOr<JsonValue> AskOnce(const std::string& dir, const WireRequest& request, int timeout_ms);
// True when no daemon can be serving `dir`: its socket is missing or refuses connections
// (a daemon alive but hung still has its socket accepting, or its queue full).
bool DaemonGone(const std::string& dir);

// One packet, with `fd` attached when >= 0 (it stays the caller's).
absl::Status Send(int socket, absl::string_view message, int fd = -1);
// One packet with `fds` attached (at most kMaxFdsPerPacket; they stay the caller's).
absl::Status SendFds(int socket, absl::string_view message, const std::vector<int>& fds);
struct Received {
  std::string message;
  int fd = -1;           // the first descriptor attached: the receiver's to close
  std::vector<int> fds;  // all of them, `fd` first (at most the max_fds asked for)
};
// The next packet, waiting up to `timeout_ms` (< 0: no limit; 0: only what is there).
// Unavailable when the peer closed the connection (an empty packet is an empty message,
// not a close); DeadlineExceeded on timeout; InvalidArgument for a packet too long. Of
// the descriptors on one packet the first `max_fds` are kept, the others closed.
absl::StatusOr<Received> Receive(int socket, int timeout_ms, std::size_t max_fds = 1);
// Closes every descriptor of `r`.
void CloseAll(Received& r);

}  // namespace vmstash::node

#endif  // VMSTASH_NODE_WIRE_H_
