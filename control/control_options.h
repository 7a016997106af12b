// ControlOptions: the control endpoint's VMSTASH_CONF key (the syntax: base/conf.h; the
// composed table: runtime/runtime_options.h).
//
//   control  1 | 0   serve the control endpoint (Unix socket, see endpoint.h) that the
//                    `vmstash` CLI talks to (default 1)
#ifndef VMSTASH_CONTROL_CONTROL_OPTIONS_H_
#define VMSTASH_CONTROL_CONTROL_OPTIONS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/conf.h"

namespace vmstash::control {

struct ControlOptions {
  bool serve = true;
};

inline constexpr absl::string_view kControlConfKeys[] = {"control"};

// Sets `key` (one of kControlConfKeys) from `value`.
inline absl::Status ApplyControlOption(absl::string_view key, absl::string_view value, ControlOptions& options) {
  if (key != "control") {
    return absl::InvalidArgumentError(absl::StrCat("ApplyControlOption: '", key, "' is not a control key"));
  }
  absl::StatusOr<bool> flag = ParseConfFlag(key, value);
  if (!flag.ok()) return flag.status();
  options.serve = *flag;
  return absl::OkStatus();
}

inline void AppendControlOptions(const ControlOptions& options, std::string* out) {
  absl::StrAppend(out, out->empty() ? "" : ",", "control:", options.serve ? 1 : 0);
}

}  // namespace vmstash::control

#endif  // VMSTASH_CONTROL_CONTROL_OPTIONS_H_
