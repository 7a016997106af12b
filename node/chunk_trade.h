// The participant's side of the handover of chunks in a node switch (Note [Node Switch
// Handover], node_switch.h): offering the chunks this process releases at its commit to
// the other participants, taking theirs, and, at an abort, waiting until those that took
// its chunks into restore gaps can write there no more — through the node daemon (wire.h:
// offer, take, settled).
//
// Thread-safety: pure functions of the daemon; they block (TakeChunks until the offers
// are in, AwaitTakers until the takers are done, or their deadline).
#ifndef VMSTASH_NODE_CHUNK_TRADE_H_
#define VMSTASH_NODE_CHUNK_TRADE_H_

#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/chunk_fit.h"
#include "node/wire.h"

namespace vmstash::node {

// An exported chunk (Driver::ExportChunkFd), its size and how a taker may use it.
struct TradedChunk {
  int fd = -1;
  std::size_t size_bytes = 0;
  ChunkUse use;
};

struct TradeOptions {
  std::string dir;  // the runtime directory (empty: control::DefaultRuntimeDir())
  std::string txn;  // the switch
  std::string device;  // Driver::DeviceUuid of the chunks' device
  std::chrono::steady_clock::time_point deadline;  // TakeChunks and AwaitTakers wait no longer
  std::vector<FitGap> gaps;  // TakeChunks: the gaps the chunks are for (at most kMaxTakeGaps)
  int poll_us = 100;  // the first pause between asks while a donor's offer may still come (doubling to 1 ms)
};

// Offers `chunks` (possibly none: "this process offers nothing more") as this process's
// whole offer in the switch. The descriptors are closed here, whatever happens; the
// daemon's copies are given to takers or closed at the decision. Returns how many the
// daemon kept (it holds a bounded number), or why none was.
absl::StatusOr<std::size_t> OfferChunks(const TradeOptions& options, std::vector<TradedChunk> chunks);
// The chunks other participants offered for this device that the daemon fitted to
// `options.gaps` (base/chunk_fit.h; those that fit none stay for other takers), once every
// other participant that pauses has offered, voted or exited (or the switch is decided:
// then none). The descriptors are the caller's. DeadlineExceeded at the deadline; the
// daemon's errors.
absl::StatusOr<std::vector<TradedChunk>> TakeChunks(const TradeOptions& options);
// Waits until every process that took this one's chunks into restore gaps in the switch
// has voted or exited (wire.h: settled). OK then; DeadlineExceeded naming those that have
// not by the deadline; the daemon's errors (NotFound: it does not know the switch — a
// daemon started again — so nothing can be said of the takers).
absl::Status AwaitTakers(const TradeOptions& options);

}  // namespace vmstash::node

#endif  // VMSTASH_NODE_CHUNK_TRADE_H_
