// The control protocol: see protocol.h.
#include "control/protocol.h"

#include <cstdint>
#include <climits>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/json_reader.h"
#include "base/status_code.h"
#include "base/json_writer.h"
#include "base/status_macros.h"

namespace vmstash::control {
namespace {

absl::Status RequestError(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("control request: ", what));
}

// A JSON integer in [lo, 2^31).
absl::StatusOr<int> IntField(const JsonValue& v, absl::string_view key, int lo) {
  if (v.type() != JsonValue::Type::kNumber || static_cast<double>(v.Int()) != v.Number() || v.Int() < lo ||
      v.Int() > INT32_MAX) {
    return RequestError(absl::StrCat("\"", key, "\" must be an integer >= ", lo));
  }
  return static_cast<int>(v.Int());
}

absl::StatusOr<std::string> StringField(const JsonValue& v, absl::string_view key) {
  if (v.type() != JsonValue::Type::kString) return RequestError(absl::StrCat("\"", key, "\" must be a string"));
  return v.String();
}

}  // namespace

absl::string_view OpName(Op op) {
  switch (op) {
    case Op::kHello: return "hello";
    case Op::kStats: return "stats";
    case Op::kTags: return "tags";
    case Op::kSnapshot: return "snapshot";
    case Op::kPause: return "pause";
    case Op::kResume: return "resume";
    case Op::kSwitch: return "switch";
  }
  return "hello";
}

absl::StatusOr<Request> ParseRequest(absl::string_view line) {
  if (line.size() > kMaxMessageBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("control request of ", line.size(), " bytes exceeds the limit of ", kMaxMessageBytes));
  }
  absl::StatusOr<JsonValue> doc = JsonValue::Parse(line);
  if (!doc.ok()) return RequestError(doc.status().message());
  if (!doc->is_object()) return RequestError("expected a JSON object");
  Request request;
  bool has_version = false, has_op = false;
  for (const auto& [key, value] : doc->members()) {
    if (key == "v") {
      VMSTASH_ASSIGN_OR_RETURN(request.version, IntField(value, key, INT32_MIN));
      has_version = true;
    } else if (key == "op") {
      VMSTASH_ASSIGN_OR_RETURN(const std::string op, StringField(value, key));
      bool known = false;
      for (Op o : {Op::kHello, Op::kStats, Op::kTags, Op::kSnapshot, Op::kPause, Op::kResume, Op::kSwitch}) {
        if (op == OpName(o)) request.op = o, known = true;
      }
      if (!known) return RequestError(absl::StrCat("unknown op \"", op, "\""));
      has_op = true;
    } else if (key == "tag") {
      VMSTASH_ASSIGN_OR_RETURN(request.tag, StringField(value, key));
      for (char c : request.tag) {
        if (static_cast<unsigned char>(c) >= 0x80) return RequestError("non-ASCII tag (tags are ASCII)");
      }
    } else if (key == "pause" || key == "resume") {
      VMSTASH_ASSIGN_OR_RETURN(const std::string list, StringField(value, key));
      std::vector<std::string>& out = key == "pause" ? request.pause : request.resume;
      for (absl::string_view name : absl::StrSplit(list, ',', absl::SkipEmpty())) {
        for (char c : name) {
          if (static_cast<unsigned char>(c) >= 0x80) return RequestError("non-ASCII tag (tags are ASCII)");
        }
        out.emplace_back(name);
      }
    } else if (key == "device") {
      VMSTASH_ASSIGN_OR_RETURN(request.device, IntField(value, key, -1));
    } else if (key == "txn") {
      VMSTASH_ASSIGN_OR_RETURN(request.txn, StringField(value, key));
      // node/decision_record.h's IsSwitchId: 32 lowercase hex digits.
      if (request.txn.size() != 32) return RequestError("\"txn\" must be a switch id (32 hex digits)");
      for (char c : request.txn) {
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) {
          return RequestError("\"txn\" must be a switch id (32 hex digits)");
        }
      }
    } else if (key == "timeout_ms") {
      VMSTASH_ASSIGN_OR_RETURN(request.timeout_ms, IntField(value, key, 1));
    } else {
      return RequestError(absl::StrCat("unknown key \"", key, "\""));
    }
  }
  if (!has_version) return absl::InvalidArgumentError("control request: missing \"v\" (protocol version)");
  if (request.version != kProtocolVersion) {
    return absl::FailedPreconditionError(absl::StrCat("control protocol version ", request.version,
                                                      " is not supported (this process speaks ", kProtocolVersion,
                                                      ")"));
  }
  if (!has_op) return absl::InvalidArgumentError("control request: missing \"op\"");
  if ((request.op == Op::kPause || request.op == Op::kResume) && request.tag.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("control request: ", OpName(request.op), " needs a \"tag\""));
  }
  if (request.op == Op::kSwitch && request.pause.empty() && request.resume.empty()) {
    return absl::InvalidArgumentError("control request: switch needs a \"pause\" or \"resume\" tag list");
  }
  if (request.txn.empty() != (request.timeout_ms == 0) || (!request.txn.empty() && request.op != Op::kSwitch)) {
    return absl::InvalidArgumentError(
        "control request: \"txn\" and \"timeout_ms\" go together, and only with switch");
  }
  if (request.op != Op::kSwitch && (!request.pause.empty() || !request.resume.empty())) {
    return absl::InvalidArgumentError(absl::StrCat("control request: ", OpName(request.op),
                                                   " takes no \"pause\"/\"resume\" lists"));
  }
  return request;
}

std::string FormatRequest(const Request& request) {
  JsonWriter w;
  w.BeginObject();
  w.Field("v", request.version);
  w.Field("op", OpName(request.op));
  if (!request.tag.empty()) w.Field("tag", request.tag);
  if (!request.pause.empty()) w.Field("pause", absl::StrJoin(request.pause, ","));
  if (!request.resume.empty()) w.Field("resume", absl::StrJoin(request.resume, ","));
  if (request.device != -1) w.Field("device", request.device);
  if (!request.txn.empty()) {
    w.Field("txn", request.txn);
    w.Field("timeout_ms", request.timeout_ms);
  }
  w.EndObject();
  return w.str() + "\n";
}

std::string OkReply(absl::string_view result_json) {
  return absl::StrCat("{\"v\":", kProtocolVersion, ",\"ok\":true,\"result\":", result_json, "}\n");
}

std::string ErrorReply(const absl::Status& status) {
  JsonWriter w;
  w.BeginObject();
  w.Field("v", kProtocolVersion);
  w.Field("ok", false);
  w.Key("error");
  w.BeginObject();
  w.Field("code", absl::StatusCodeToString(status.code()));
  w.Field("message", status.message());
  w.EndObject();
  w.EndObject();
  return w.str() + "\n";
}

absl::StatusOr<std::string> ParseReply(absl::string_view line) {
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.remove_suffix(1);
  // OkReply's exact framing: the result is the text between its prefix and the final '}'.
  // It is not parsed here: its reader parses it once (a snapshot can be hundreds of MiB).
  const std::string ok_prefix = absl::StrCat("{\"v\":", kProtocolVersion, ",\"ok\":true,\"result\":");
  if (absl::StartsWith(line, ok_prefix) && absl::EndsWith(line, "}")) {
    return std::string(line.substr(ok_prefix.size(), line.size() - ok_prefix.size() - 1));
  }
  absl::StatusOr<JsonValue> doc = JsonValue::Parse(line);
  if (!doc.ok() || !doc->is_object()) {
    return absl::InternalError(absl::StrCat("malformed control reply (", doc.ok() ? "not an object" : doc.status().message(),
                                            "): ", line.substr(0, 80)));
  }
  const JsonValue& v = (*doc)["v"];
  if (v.type() != JsonValue::Type::kNumber || v.Int() != kProtocolVersion) {
    return absl::FailedPreconditionError(absl::StrCat("the process answered with another control protocol version: ",
                                                      line.substr(0, 40)));
  }
  const JsonValue& error = (*doc)["error"];
  if ((*doc)["ok"].type() != JsonValue::Type::kBool || (*doc)["ok"].Bool() || !error.is_object()) {
    return absl::InternalError(absl::StrCat("malformed control reply: ", line.substr(0, 80)));
  }
  // Never OK: an error reply cannot carry it (found by the fuzzer).
  return absl::Status(ErrorCodeNamed(error["code"].String()), error["message"].String());
}

}  // namespace vmstash::control
