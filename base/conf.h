// VMSTASH_CONF's syntax, shared by the layers that own its keys: each layer keeps its own
// options struct and the parser of its own keys (vmm/vmm_options.h, allocator/
// allocator_options.h, control/control_options.h); runtime/runtime_options.h composes them
// into the one table and reads the environment.
//
// Format: "key:value,key:value". Whitespace around items, keys and values is ignored; an
// empty item (a trailing comma) is ignored; an item without ':' or a key given twice is
// InvalidArgument. Sizes accept an integer with an optional binary suffix: 4096, 512K, 2M,
// 16G, 1T (also KiB/MiB/GiB/TiB and KB/MB/GB/TB, all binary).
//
// Thread-safety: pure functions.
#ifndef VMSTASH_BASE_CONF_H_
#define VMSTASH_BASE_CONF_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace vmstash {

using ConfItems = std::vector<std::pair<std::string, std::string>>;

// The (key, value) items of `conf`, in order.
absl::StatusOr<ConfItems> SplitConf(absl::string_view conf);

// InvalidArgument "VMSTASH_CONF: bad value '<value>' for key '<key>': <why>".
absl::Status BadConfValue(absl::string_view key, absl::string_view value, absl::string_view why);

// "16G" -> 17179869184. InvalidArgument naming `text` on a bad value or overflow.
absl::StatusOr<std::uint64_t> ParseSize(absl::string_view text);
// 17179869184 -> "16G" (the largest unit that divides it; "0" for 0).
std::string SizeToString(std::uint64_t bytes);
// "0"/"false" or "1"/"true" for `key`, else BadConfValue.
absl::StatusOr<bool> ParseConfFlag(absl::string_view key, absl::string_view value);

}  // namespace vmstash

#endif  // VMSTASH_BASE_CONF_H_
