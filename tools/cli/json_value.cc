// JsonValue: see json_value.h.
#include "tools/cli/json_value.h"

#include <cmath>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace vmstash::cli {

class JsonParser {
 public:
  explicit JsonParser(absl::string_view text) : text_(text) {}

  absl::StatusOr<JsonValue> Document() {
    JsonValue v;
    if (absl::Status s = Value(&v, 0); !s.ok()) return s;
    Space();
    if (pos_ != text_.size()) return Error("trailing bytes");
    return v;
  }

 private:
  static constexpr int kMaxDepth = 64;

  void Space() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\n' || text_[pos_] == '\r' ||
                                   text_[pos_] == '\t')) {
      ++pos_;
    }
  }
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("JSON: ", what, " at byte ", pos_));
  }
  bool Literal(absl::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  absl::Status Value(JsonValue* v, int depth) {
    if (depth > kMaxDepth) return Error("nested too deeply");
    Space();
    if (pos_ >= text_.size()) return Error("unexpected end");
    char c = text_[pos_];
    if (c == '{') return Object(v, depth);
    if (c == '[') return Array(v, depth);
    if (c == '"') {
      v->type_ = JsonValue::Type::kString;
      return String(&v->string_);
    }
    if (Literal("true") || Literal("false")) {
      v->type_ = JsonValue::Type::kBool;
      v->bool_ = text_[pos_ - 1] == 'e' && text_[pos_ - 2] == 'u';
      return absl::OkStatus();
    }
    if (Literal("null")) return absl::OkStatus();
    return Number(v);
  }

  absl::Status Number(JsonValue* v) {
    std::size_t start = pos_;
    if (pos_ < text_.size() && text_[pos_] == '-') ++pos_;
    bool integral = true;
    while (pos_ < text_.size() && ((text_[pos_] >= '0' && text_[pos_] <= '9') || text_[pos_] == '.' ||
                                   text_[pos_] == 'e' || text_[pos_] == 'E' || text_[pos_] == '+' ||
                                   text_[pos_] == '-')) {
      if (text_[pos_] == '.' || text_[pos_] == 'e' || text_[pos_] == 'E') integral = false;
      ++pos_;
    }
    if (pos_ == start) return Error("unexpected character");
    std::string digits(text_.substr(start, pos_ - start));
    char* end = nullptr;
    v->type_ = JsonValue::Type::kNumber;
    v->number_ = std::strtod(digits.c_str(), &end);
    if (end != digits.c_str() + digits.size() || !std::isfinite(v->number_)) return Error("bad number");
    v->int_ = integral ? std::strtoll(digits.c_str(), nullptr, 10) : static_cast<std::int64_t>(v->number_);
    return absl::OkStatus();
  }

  absl::Status String(std::string* out) {
    ++pos_;  // the opening quote
    while (pos_ < text_.size()) {
      char c = text_[pos_++];
      if (c == '"') return absl::OkStatus();
      if (static_cast<unsigned char>(c) < 0x20) return Error("control character in a string");
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (pos_ >= text_.size()) break;
      char e = text_[pos_++];
      switch (e) {
        case '"': case '\\': case '/': out->push_back(e); break;
        case 'b': out->push_back('\b'); break;
        case 'f': out->push_back('\f'); break;
        case 'n': out->push_back('\n'); break;
        case 'r': out->push_back('\r'); break;
        case 't': out->push_back('\t'); break;
        case 'u': {
          if (pos_ + 4 > text_.size()) return Error("short \\u escape");
          unsigned code = std::strtoul(std::string(text_.substr(pos_, 4)).c_str(), nullptr, 16);
          pos_ += 4;
          if (code < 0x80) {
            out->push_back(static_cast<char>(code));
          } else if (code < 0x800) {
            out->push_back(static_cast<char>(0xC0 | (code >> 6)));
            out->push_back(static_cast<char>(0x80 | (code & 0x3F)));
          } else {
            out->push_back(static_cast<char>(0xE0 | (code >> 12)));
            out->push_back(static_cast<char>(0x80 | ((code >> 6) & 0x3F)));
            out->push_back(static_cast<char>(0x80 | (code & 0x3F)));
          }
          break;
        }
        default: return Error("bad escape");
      }
    }
    return Error("unterminated string");
  }

  absl::Status Array(JsonValue* v, int depth) {
    ++pos_;
    v->type_ = JsonValue::Type::kArray;
    Space();
    if (pos_ < text_.size() && text_[pos_] == ']') return ++pos_, absl::OkStatus();
    for (;;) {
      v->items_.emplace_back();
      if (absl::Status s = Value(&v->items_.back(), depth + 1); !s.ok()) return s;
      Space();
      if (pos_ < text_.size() && text_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < text_.size() && text_[pos_] == ']') return ++pos_, absl::OkStatus();
      return Error("expected ',' or ']'");
    }
  }

  absl::Status Object(JsonValue* v, int depth) {
    ++pos_;
    v->type_ = JsonValue::Type::kObject;
    Space();
    if (pos_ < text_.size() && text_[pos_] == '}') return ++pos_, absl::OkStatus();
    for (;;) {
      Space();
      if (pos_ >= text_.size() || text_[pos_] != '"') return Error("expected a key");
      std::string key;
      if (absl::Status s = String(&key); !s.ok()) return s;
      Space();
      if (pos_ >= text_.size() || text_[pos_] != ':') return Error("expected ':'");
      ++pos_;
      v->members_.emplace_back(std::move(key), JsonValue());
      if (absl::Status s = Value(&v->members_.back().second, depth + 1); !s.ok()) return s;
      Space();
      if (pos_ < text_.size() && text_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < text_.size() && text_[pos_] == '}') return ++pos_, absl::OkStatus();
      return Error("expected ',' or '}'");
    }
  }

  absl::string_view text_;
  std::size_t pos_ = 0;
};

absl::StatusOr<JsonValue> JsonValue::Parse(absl::string_view text) { return JsonParser(text).Document(); }

const JsonValue& JsonValue::operator[](absl::string_view key) const {
  static const JsonValue* const kNull = new JsonValue();
  for (const auto& [k, v] : members_) {
    if (k == key) return v;
  }
  return *kNull;
}

absl::StatusOr<std::vector<const JsonValue*>> PerDevice(const JsonValue& reply, absl::string_view what) {
  std::vector<const JsonValue*> out;
  if (reply.is_array()) {
    for (const JsonValue& d : reply.items()) out.push_back(&d);
  } else if (reply.is_object()) {
    out.push_back(&reply);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(what, ": expected an object or a list of them"));
  }
  return out;
}

std::string HumanBytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) bytes /= 1024, ++u;
  return u == 0 ? absl::StrFormat("%.0f %s", bytes, units[u]) : absl::StrFormat("%.1f %s", bytes, units[u]);
}

}  // namespace vmstash::cli
