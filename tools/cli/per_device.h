// PerDevice: the per-device documents of a stats or snapshot reply, which is one object
// (one device asked) or a list of them (every device in use).
#ifndef VMSTASH_TOOLS_CLI_PER_DEVICE_H_
#define VMSTASH_TOOLS_CLI_PER_DEVICE_H_

#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/json_reader.h"

namespace vmstash::cli {

// InvalidArgument naming `what` for anything else.
absl::StatusOr<std::vector<const JsonValue*>> PerDevice(const JsonValue& reply, absl::string_view what);

}  // namespace vmstash::cli

#endif  // VMSTASH_TOOLS_CLI_PER_DEVICE_H_
