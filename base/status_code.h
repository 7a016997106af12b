// An error's code named across a process boundary: the control protocol's and the node
// protocols' error replies carry absl::StatusCodeToString's name of it.
//
// Thread-safety: pure functions.
#ifndef VMSTASH_BASE_STATUS_CODE_H_
#define VMSTASH_BASE_STATUS_CODE_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace vmstash {

// The code named `name` ("NOT_FOUND", ...); kUnknown for a name that is none, and for
// "OK": an error never carries OK (an error reply saying "OK" would read as success).
inline absl::StatusCode ErrorCodeNamed(absl::string_view name) {
  for (int c = 1; c <= static_cast<int>(absl::StatusCode::kUnauthenticated); ++c) {
    if (absl::StatusCodeToString(static_cast<absl::StatusCode>(c)) == name) return static_cast<absl::StatusCode>(c);
  }
  return absl::StatusCode::kUnknown;
}

}  // namespace vmstash

#endif  // VMSTASH_BASE_STATUS_CODE_H_
