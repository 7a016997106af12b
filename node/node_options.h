// NodeOptions: the node pool's VMSTASH_CONF keys (the syntax: base/conf.h; the composed
// table: runtime/runtime_options.h; what the pool is: docs/node.md).
//
//   node           1 | 0   back up pinned tags in the node pool (allocator/host_lease.h,
//                          Note [Pool-Backed Backups]), starting the node daemon (vmstashd)
//                          when none serves (default 0)
//   node_capacity  SIZE    the pool's size when this process starts the daemon (default 0:
//                          half of the host's memory); a daemon already serving keeps its own
//   node_pin       1 | 0   pin the whole pool in this process ahead of its first pause, in the
//                          background, once a backup tag grows (default 0: each part of the
//                          pool is pinned by the first pause that leases it; runtime/
//                          node_leases.h, Note [Node Leases])
#ifndef VMSTASH_NODE_NODE_OPTIONS_H_
#define VMSTASH_NODE_NODE_OPTIONS_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/conf.h"

namespace vmstash::node {

struct NodeOptions {
  bool enabled = false;
  std::size_t capacity_bytes = 0;  // 0: half of the host's memory
  bool pin_ahead = false;          // node_pin
  std::string dir;                 // empty: control::DefaultRuntimeDir() (tests set it)
};

inline constexpr absl::string_view kNodeConfKeys[] = {"node", "node_capacity", "node_pin"};

// Sets `key` (one of kNodeConfKeys) from `value`; InvalidArgument naming both otherwise.
inline absl::Status ApplyNodeOption(absl::string_view key, absl::string_view value, NodeOptions& options) {
  if (key == "node" || key == "node_pin") {
    absl::StatusOr<bool> flag = ParseConfFlag(key, value);
    if (!flag.ok()) return flag.status();
    (key == "node" ? options.enabled : options.pin_ahead) = *flag;
    return absl::OkStatus();
  }
  if (key == "node_capacity") {
    absl::StatusOr<std::uint64_t> size = ParseSize(value);
    if (!size.ok()) return BadConfValue(key, value, size.status().message());
    options.capacity_bytes = static_cast<std::size_t>(*size);
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("ApplyNodeOption: '", key, "' is not a node key"));
}

inline void AppendNodeOptions(const NodeOptions& options, std::string* out) {
  absl::StrAppend(out, out->empty() ? "" : ",", "node:", options.enabled ? 1 : 0,
                  ",node_capacity:", SizeToString(options.capacity_bytes), ",node_pin:", options.pin_ahead ? 1 : 0);
}

}  // namespace vmstash::node

#endif  // VMSTASH_NODE_NODE_OPTIONS_H_
