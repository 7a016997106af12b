// The control protocol: line-delimited JSON between the `vmstash` CLI and the control
// endpoint of a process using vmstash (docs/architecture.md §8).
//
// One request per connection: a single line (at most kMaxMessageBytes, '\n'-terminated)
// holding a flat JSON object:
//   {"v":1,"op":"hello"|"stats"|"tags"|"snapshot"|"pause"|"resume","tag":"...","device":0}
//   {"v":1,"op":"switch","pause":"a,b","resume":"c,d","device":0}
//   {"v":1,"op":"switch",...,"txn":"<id>","timeout_ms":T}   this process's part of a node
//       switch (node/node_switch.h, Note [Node Switch]): its outcome is voted to the node
//       daemon, and the switch commits or rolls back as decided there (T: the switch's
//       timeout, after which this process stops waiting for the decision)
// "tag" is required by pause/resume; "switch" takes comma-separated tag lists ("pause",
// "resume"; at least one tag in all; a tag holding a comma cannot be named there, pause
// and resume it instead); "device" is optional (default -1: every device in use). The
// reply is one line:
//   {"v":1,"ok":true,"result":<JSON>}   or
//   {"v":1,"ok":false,"error":{"code":"INVALID_ARGUMENT","message":"..."}}
// A request with another "v" gets FAILED_PRECONDITION naming both versions; unknown ops,
// unknown keys, nesting, duplicate keys and malformed JSON get INVALID_ARGUMENT; the server
// keeps serving. Requests and replies are read by the project's one strict JSON reader
// (base/json_reader.h: bounded nesting) and written by its one writer; the parsers are fuzzed.
//
// Thread-safety: pure functions.
#ifndef VMSTASH_CONTROL_PROTOCOL_H_
#define VMSTASH_CONTROL_PROTOCOL_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace vmstash::control {

inline constexpr int kProtocolVersion = 1;
inline constexpr std::size_t kMaxMessageBytes = std::size_t{64} << 10;  // requests
inline constexpr std::size_t kMaxReplyBytes = std::size_t{256} << 20;   // snapshots can be large

enum class Op { kHello, kStats, kTags, kSnapshot, kPause, kResume, kSwitch };

struct Request {
  int version = kProtocolVersion;
  Op op = Op::kHello;
  std::string tag;  // pause/resume
  std::vector<std::string> pause;   // switch
  std::vector<std::string> resume;  // switch
  int device = -1;  // -1: every device in use
  std::string txn;     // switch: a node switch's id (empty: a switch of this process alone)
  int timeout_ms = 0;  // switch with txn: > 0
};

absl::string_view OpName(Op op);
// Parses one request line (without the '\n').
absl::StatusOr<Request> ParseRequest(absl::string_view line);
// The request line for `request` (with the '\n').
std::string FormatRequest(const Request& request);
// Reply lines (with the '\n'); `result_json` must be valid JSON.
std::string OkReply(absl::string_view result_json);
std::string ErrorReply(const absl::Status& status);
// Splits a reply line into the result JSON (ok) or the error it carries. An ok reply is
// recognised by OkReply's exact framing and its result returned as text, unparsed (the
// caller's reader parses it once); any other line is read in full (version, error).
absl::StatusOr<std::string> ParseReply(absl::string_view line);

}  // namespace vmstash::control

#endif  // VMSTASH_CONTROL_PROTOCOL_H_
