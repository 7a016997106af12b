// Allocation traces: a CSV format, a synthetic training-step generator, and a replayer
// that reports peak reserved / peak allocated for any allocator behind ReplayTarget.
//
// CSV, one operation per line ('#' starts a comment, blank lines ignored):
//   a,<id>,<size_bytes>,<stream>    allocate; <id> names the block for its free
//   f,<id>                           free the block allocated as <id>
// <stream> is a small index (0 = default stream); the target maps it to a real stream.
// Parse errors name the line number and what is wrong.
//
// The replayer tracks peak allocated itself (sum of live requested sizes), so every
// target is measured the same way, and asks the target for its peak reserved bytes at
// the end (our Stats, or torch's reserved_bytes peak).
#ifndef VMSTASH_TESTS_REPLAY_TRACE_H_
#define VMSTASH_TESTS_REPLAY_TRACE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace vmstash {

struct TraceOp {
  bool allocate = true;
  std::uint64_t id = 0;
  std::uint64_t size_bytes = 0;  // allocations
  int stream = 0;                // allocations
};

absl::StatusOr<std::vector<TraceOp>> ParseTraceCsv(absl::string_view text);
std::string TraceToCsv(const std::vector<TraceOp>& ops);

// A synthetic trace shaped like LLM training steps with variable sequence lengths:
// per step, a forward pass keeps per-layer activations (sizes scale with the step's
// token count) and allocates/frees temporaries; backward frees activations in reverse
// order while allocating gradient temporaries; every few steps, an optimizer phase.
// `scale_bytes` is the size of one [tokens x hidden] activation at the longest length.
std::vector<TraceOp> GenerateTrainingTrace(std::uint64_t seed, int steps, int layers, std::uint64_t scale_bytes);

class ReplayTarget {
 public:
  virtual ~ReplayTarget() = default;
  virtual absl::StatusOr<std::uint64_t> Allocate(std::uint64_t size_bytes, int stream) = 0;
  virtual absl::Status Free(std::uint64_t ptr) = 0;
  virtual std::uint64_t PeakReservedBytes() = 0;
};

struct ReplayResult {
  std::uint64_t operations = 0;
  std::uint64_t peak_allocated_bytes = 0;  // live requested bytes, tracked by the replayer
  std::uint64_t peak_reserved_bytes = 0;   // from the target
  double seconds = 0;
  double ratio() const {
    return peak_allocated_bytes == 0 ? 0 : static_cast<double>(peak_reserved_bytes) / peak_allocated_bytes;
  }
};

// Replays `ops`; blocks still live at the end are freed. InvalidArgument for a free of an
// unknown id or a duplicate id; the target's errors are returned with the line's index.
absl::StatusOr<ReplayResult> Replay(const std::vector<TraceOp>& ops, ReplayTarget& target);

}  // namespace vmstash

#endif  // VMSTASH_TESTS_REPLAY_TRACE_H_
