// SwitchExchange: how one process's part of a switch across processes trades physical
// memory with the other parts (Note [Node Switch Handover], node/node_switch.h): the
// chunks this part releases at its commit are offered, and the chunks other parts
// offered are taken for this part's covers.
//
// The transaction (switch_transaction.h) calls Offer once when it has outgoing tags (after
// its backup copies are queued, and the events they wait for recorded), Take before it
// maps its incoming covers, and, when it rolls back after offering chunks that may be
// written, AwaitTakers before it writes them again. Whatever these return, the switch's
// contract holds: a chunk that cannot be offered is released at the commit as in a switch
// of one process, a cover that gets no foreign chunk is filled with fresh memory, and a
// chunk whose takers cannot be shown done is not written (its tag is broken). Implemented
// by the runtime over the node daemon; the allocator sees only this interface (arrows
// point one way).
#ifndef VMSTASH_ALLOCATOR_SWITCH_EXCHANGE_H_
#define VMSTASH_ALLOCATOR_SWITCH_EXCHANGE_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/chunk_fit.h"

namespace vmstash {

// An exported chunk: a descriptor (Driver::ExportChunkFd), the chunk's size, and how a
// taker may use it.
struct SharedChunk {
  int fd = -1;
  std::size_t size_bytes = 0;
  // Also into covers that restore copies write: its giver has backed its bytes up (and
  // restores them at an abort); otherwise only into covers that restore nothing.
  bool anywhere = false;
  // Driver::ExportIpcEvent of the giver, recorded after its last copy that reads the
  // chunk: a restore copy into it waits for it first (empty: nothing reads it).
  std::string wait_event;
};

class SwitchExchange {
 public:
  virtual ~SwitchExchange() = default;
  // Offers `chunks` of device `device` (Driver::DeviceUuid), which this part releases at
  // its commit and leaves untouched until then. The descriptors become the exchange's
  // (closed by it, whatever it returns). An error is logged by the caller, not fatal.
  virtual absl::Status Offer(const std::string& device, std::vector<SharedChunk> chunks) = 0;
  // Chunks the other parts offered for `device` that fit `gaps` (this part's gaps left to
  // fresh memory, handoff_plan.h OpenGaps; strict ones are written by restore copies and
  // take `anywhere` chunks only) by FitChunks (base/chunk_fit.h), each given to one taker
  // only; those that fit no gap stay for the other takers. The descriptors become the
  // caller's. It may wait until every other part that pauses has offered, voted or exited
  // (never past the switch's deadline). Empty when none.
  virtual absl::StatusOr<std::vector<SharedChunk>> Take(const std::string& device, const std::vector<FitGap>& gaps) = 0;
  // After an abort, by a part that offered `anywhere` chunks: OK once every part that took
  // them into covers that restore copies write has voted (its copies done: a part votes
  // only then) or exited; otherwise why that cannot be known (the deadline passed, the
  // daemon is gone).
  virtual absl::Status AwaitTakers() = 0;
  // The most gaps one Take may name (the part sends its largest, and places what it gets
  // into exactly those).
  virtual std::size_t MaxGaps() const = 0;
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_SWITCH_EXCHANGE_H_
