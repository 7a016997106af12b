// The control protocol: see protocol.h.
#include "control/protocol.h"

#include <cstdint>
#include <set>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace vmstash::control {
namespace {

// A cursor over a flat JSON object: strings (with escapes), integers, true/false/null.
class Scanner {
 public:
  explicit Scanner(absl::string_view text) : text_(text) {}

  void SkipSpace() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\r')) ++pos_;
  }
  bool Eat(char c) {
    SkipSpace();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool AtEnd() {
    SkipSpace();
    return pos_ == text_.size();
  }
  char Peek() {
    SkipSpace();
    return pos_ < text_.size() ? text_[pos_] : '\0';
  }
  std::size_t pos() const { return pos_; }

  absl::StatusOr<std::string> String() {
    if (!Eat('"')) return Error("expected a string");
    std::string out;
    while (pos_ < text_.size()) {
      char c = text_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) return Error("control character in a string");
      if (c != '\\') {
        out.push_back(c);
        continue;
      }
      if (pos_ >= text_.size()) break;
      char e = text_[pos_++];
      switch (e) {
        case '"': out.push_back('"'); break;
        case '\\': out.push_back('\\'); break;
        case '/': out.push_back('/'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'n': out.push_back('\n'); break;
        case 'r': out.push_back('\r'); break;
        case 't': out.push_back('\t'); break;
        case 'u': {
          if (pos_ + 4 > text_.size()) return Error("short \\u escape");
          std::uint32_t code = 0;
          for (int i = 0; i < 4; ++i) {
            char h = text_[pos_++];
            int v = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10
                                                    : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
            if (v < 0) return Error("bad \\u escape");
            code = code * 16 + static_cast<std::uint32_t>(v);
          }
          if (code >= 0x80) return Error("non-ASCII \\u escape (tags are ASCII)");
          out.push_back(static_cast<char>(code));
          break;
        }
        default: return Error("bad escape");
      }
    }
    return Error("unterminated string");
  }

  // A JSON integer in [-2^31, 2^31).
  absl::StatusOr<int> Integer() {
    SkipSpace();
    std::size_t start = pos_;
    if (pos_ < text_.size() && text_[pos_] == '-') ++pos_;
    while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
    int value = 0;
    if (pos_ == start || !absl::SimpleAtoi(text_.substr(start, pos_ - start), &value)) {
      return Error("expected an integer");
    }
    return value;
  }

  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("control request: ", what, " at byte ", pos_));
  }

 private:
  absl::string_view text_;
  std::size_t pos_ = 0;
};

}  // namespace

absl::string_view OpName(Op op) {
  switch (op) {
    case Op::kHello: return "hello";
    case Op::kStats: return "stats";
    case Op::kTags: return "tags";
    case Op::kSnapshot: return "snapshot";
    case Op::kPause: return "pause";
    case Op::kResume: return "resume";
  }
  return "hello";
}

absl::StatusOr<Request> ParseRequest(absl::string_view line) {
  if (line.size() > kMaxMessageBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("control request of ", line.size(), " bytes exceeds the limit of ", kMaxMessageBytes));
  }
  Scanner s(line);
  if (!s.Eat('{')) return s.Error("expected '{'");
  Request request;
  bool has_version = false, has_op = false;
  std::set<std::string> seen;
  if (!s.Eat('}')) {
    for (;;) {
      absl::StatusOr<std::string> key = s.String();
      if (!key.ok()) return key.status();
      if (!seen.insert(*key).second) return s.Error(absl::StrCat("duplicate key \"", *key, "\""));
      if (!s.Eat(':')) return s.Error("expected ':'");
      if (*key == "v") {
        absl::StatusOr<int> v = s.Integer();
        if (!v.ok()) return v.status();
        request.version = *v;
        has_version = true;
      } else if (*key == "op") {
        absl::StatusOr<std::string> op = s.String();
        if (!op.ok()) return op.status();
        bool known = false;
        for (Op o : {Op::kHello, Op::kStats, Op::kTags, Op::kSnapshot, Op::kPause, Op::kResume}) {
          if (*op == OpName(o)) request.op = o, known = true;
        }
        if (!known) return absl::InvalidArgumentError(absl::StrCat("control request: unknown op \"", *op, "\""));
        has_op = true;
      } else if (*key == "tag") {
        absl::StatusOr<std::string> tag = s.String();
        if (!tag.ok()) return tag.status();
        request.tag = *std::move(tag);
      } else if (*key == "device") {
        absl::StatusOr<int> d = s.Integer();
        if (!d.ok()) return d.status();
        if (*d < -1) return s.Error("device must be >= -1");
        request.device = *d;
      } else {
        return absl::InvalidArgumentError(absl::StrCat("control request: unknown key \"", *key, "\""));
      }
      if (s.Eat(',')) continue;
      if (s.Eat('}')) break;
      return s.Error("expected ',' or '}'");
    }
  }
  if (!s.AtEnd()) return s.Error("trailing bytes after the object");
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
  return request;
}

namespace {

void AppendJsonString(std::string* out, absl::string_view s) {
  out->push_back('"');
  for (char c : s) {
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      case '\t': out->append("\\t"); break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppend(out, "\\u00", absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2));
        } else {
          out->push_back(c);
        }
    }
  }
  out->push_back('"');
}

}  // namespace

std::string FormatRequest(const Request& request) {
  std::string out = absl::StrCat("{\"v\":", request.version, ",\"op\":\"", OpName(request.op), "\"");
  if (!request.tag.empty()) {
    out.append(",\"tag\":");
    AppendJsonString(&out, request.tag);
  }
  if (request.device != -1) absl::StrAppend(&out, ",\"device\":", request.device);
  out.append("}\n");
  return out;
}

std::string OkReply(absl::string_view result_json) {
  return absl::StrCat("{\"v\":", kProtocolVersion, ",\"ok\":true,\"result\":", result_json, "}\n");
}

std::string ErrorReply(const absl::Status& status) {
  std::string out = absl::StrCat("{\"v\":", kProtocolVersion, ",\"ok\":false,\"error\":{\"code\":\"",
                                 absl::StatusCodeToString(status.code()), "\",\"message\":");
  AppendJsonString(&out, status.message());
  out.append("}}\n");
  return out;
}

absl::StatusOr<std::string> ParseReply(absl::string_view line) {
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.remove_suffix(1);
  const std::string ok_prefix = absl::StrCat("{\"v\":", kProtocolVersion, ",\"ok\":true,\"result\":");
  if (absl::StartsWith(line, ok_prefix) && absl::EndsWith(line, "}")) {
    return std::string(line.substr(ok_prefix.size(), line.size() - ok_prefix.size() - 1));
  }
  const std::string err_prefix = absl::StrCat("{\"v\":", kProtocolVersion, ",\"ok\":false,\"error\":{\"code\":\"");
  if (absl::StartsWith(line, err_prefix)) {
    absl::string_view rest = line.substr(err_prefix.size());
    std::size_t q = rest.find('"');
    std::string code(rest.substr(0, q));
    std::size_t m = rest.find("\"message\":");
    Scanner msg(m == absl::string_view::npos ? absl::string_view() : rest.substr(m + 10));
    absl::StatusOr<std::string> message = msg.String();
    std::string text = message.ok() ? *message : std::string(rest);
    absl::StatusCode c = absl::StatusCode::kUnknown;
    for (int i = 1; i <= 16; ++i) {  // not 0: an error reply cannot carry OK (found by the fuzzer)
      if (absl::StatusCodeToString(static_cast<absl::StatusCode>(i)) == code) c = static_cast<absl::StatusCode>(i);
    }
    return absl::Status(c, text);
  }
  if (absl::StartsWith(line, "{\"v\":")) {
    return absl::FailedPreconditionError(absl::StrCat("the process answered with another control protocol version: ",
                                                      line.substr(0, 40)));
  }
  return absl::InternalError(absl::StrCat("malformed control reply: ", line.substr(0, 80)));
}

}  // namespace vmstash::control
