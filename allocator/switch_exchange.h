// SwitchExchange: how one process's part of a switch across processes trades physical
// memory with the other parts (Note [Node Switch Handover], node/node_switch.h): the
// chunks this part releases at its commit are offered, and the chunks other parts
// offered are taken for this part's covers that receive no restore copies.
//
// The transaction (switch_transaction.h) calls Offer once when it has outgoing tags,
// then Take with the gaps it has left to fill with fresh memory; both before its
// vote. Whatever either returns, the switch's contract holds: a chunk that cannot be
// offered is released at the commit as in a switch of one process, and a cover that gets
// no foreign chunk is filled with fresh memory. Implemented by the runtime over the node
// daemon; the allocator sees only this interface (arrows point one way).
#ifndef VMSTASH_ALLOCATOR_SWITCH_EXCHANGE_H_
#define VMSTASH_ALLOCATOR_SWITCH_EXCHANGE_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/chunk_fit.h"

namespace vmstash {

// An exported chunk: a descriptor (Driver::ExportChunkFd) and the chunk's size.
struct SharedChunk {
  int fd = -1;
  std::size_t size_bytes = 0;
};

class SwitchExchange {
 public:
  virtual ~SwitchExchange() = default;
  // Offers `chunks` of device `device` (Driver::DeviceUuid), which this part releases at
  // its commit and leaves untouched until then. The descriptors become the exchange's
  // (closed by it, whatever it returns). An error is logged by the caller, not fatal.
  virtual absl::Status Offer(const std::string& device, std::vector<SharedChunk> chunks) = 0;
  // Chunks the other parts offered for `device` that fit `gaps` (this part's gaps left to
  // fresh memory, handoff_plan.h OpenGaps) by FitChunks (base/chunk_fit.h), each given to
  // one taker only; those that fit no gap stay for the other takers. The descriptors
  // become the caller's. It may wait until every other part that pauses has offered,
  // voted or exited (never past the switch's deadline). Empty when none.
  virtual absl::StatusOr<std::vector<SharedChunk>> Take(const std::string& device, const std::vector<FitGap>& gaps) = 0;
  // The most gaps one Take may name (the part sends its largest, and places what it gets
  // into exactly those).
  virtual std::size_t MaxGaps() const = 0;
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_SWITCH_EXCHANGE_H_
