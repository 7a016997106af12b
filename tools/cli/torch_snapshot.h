// TorchSnapshotPickle: our snapshot (allocator/snapshot.h JSON, one device or a list) in
// the pickle schema PyTorch's memory tools read (docs/architecture.md §7): `python -m
// torch.cuda._memory_viz stats|segments|... FILE` and the memory_viz web page.
//
// Mapping: every maximal run of mapped chunks becomes a torch segment (blocks tile it:
// live blocks "active_allocated", free ones "inactive"); the segment's and blocks' frames
// carry one frame naming the vmstash tag and heap, so the viewers group by tag. Paused
// live blocks have no memory, so they are not segments: they appear in device_traces as
// "segment_unmap" entries (size = requested bytes). Pickle protocol 2, built-in types only
// (dict, list, tuple, str, int, bool, None), so unpickling needs nothing but Python.
//
// Thread-safety: pure function.
#ifndef VMSTASH_TOOLS_CLI_TORCH_SNAPSHOT_H_
#define VMSTASH_TOOLS_CLI_TORCH_SNAPSHOT_H_

#include <string>

#include "absl/status/statusor.h"
#include "base/json_reader.h"

namespace vmstash::cli {

absl::StatusOr<std::string> TorchSnapshotPickle(const JsonValue& snapshot);

}  // namespace vmstash::cli

#endif  // VMSTASH_TOOLS_CLI_TORCH_SNAPSHOT_H_
