// JsonValue: see json_value.h.
#include "base/json_reader.h"

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace vmstash {

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
    if (depth > JsonValue::kMaxDepth) return Error("nested too deeply");
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

  bool Digits() {
    const std::size_t start = pos_;
    while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
    return pos_ > start;
  }

  // number = [ "-" ] ( "0" / 1-9 *DIGIT ) [ "." 1*DIGIT ] [ ( "e" / "E" ) [ "+" / "-" ] 1*DIGIT ]
  absl::Status Number(JsonValue* v) {
    const std::size_t start = pos_;
    if (pos_ < text_.size() && text_[pos_] == '-') ++pos_;
    if (pos_ < text_.size() && text_[pos_] == '0') {
      ++pos_;
    } else if (!Digits()) {
      return Error(pos_ == start ? "unexpected character" : "bad number");
    }
    bool integral = true;
    if (pos_ < text_.size() && text_[pos_] == '.') {
      ++pos_;
      integral = false;
      if (!Digits()) return Error("bad number (no digit after '.')");
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      ++pos_;
      integral = false;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
      if (!Digits()) return Error("bad number (no digit in the exponent)");
    }
    const std::string digits(text_.substr(start, pos_ - start));
    v->type_ = JsonValue::Type::kNumber;
    v->number_ = std::strtod(digits.c_str(), nullptr);
    if (!std::isfinite(v->number_)) return Error("number out of range");
    if (integral) {
      errno = 0;
      v->int_ = std::strtoll(digits.c_str(), nullptr, 10);
      if (errno == ERANGE) v->int_ = static_cast<std::int64_t>(v->number_ < 0 ? INT64_MIN : INT64_MAX);
    } else {
      // Truncated toward zero and clamped (a cast out of range is undefined; found by the fuzzer).
      v->int_ = v->number_ >= 9.2233720368547758e18    ? INT64_MAX
                : v->number_ <= -9.2233720368547758e18 ? INT64_MIN
                                                       : static_cast<std::int64_t>(v->number_);
    }
    return absl::OkStatus();
  }

  // Four hex digits at pos_ (advanced past them), or -1.
  int Hex4() {
    if (pos_ + 4 > text_.size()) return -1;
    int code = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = text_[pos_ + i];
      const int d = c >= '0' && c <= '9' ? c - '0'
                    : c >= 'a' && c <= 'f' ? c - 'a' + 10
                    : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                           : -1;
      if (d < 0) return -1;
      code = code * 16 + d;
    }
    pos_ += 4;
    return code;
  }

  // After "\u": one code point (a surrogate pair counts as one), appended as UTF-8.
  absl::Status Escape(std::string* out) {
    int code = Hex4();
    if (code < 0) return Error("\\u escape needs four hex digits");
    if (code >= 0xDC00 && code <= 0xDFFF) return Error("lone low surrogate in a \\u escape");
    std::uint32_t cp = static_cast<std::uint32_t>(code);
    if (code >= 0xD800 && code <= 0xDBFF) {
      if (text_.substr(pos_, 2) != "\\u") return Error("high surrogate without its low half");
      pos_ += 2;
      const int low = Hex4();
      if (low < 0xDC00 || low > 0xDFFF) return Error("high surrogate without its low half");
      cp = 0x10000 + ((cp - 0xD800) << 10) + static_cast<std::uint32_t>(low - 0xDC00);
    }
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
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
        case 'u':
          if (absl::Status st = Escape(out); !st.ok()) return st;
          break;
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
      for (const auto& member : v->members_) {
        if (member.first == key) return Error(absl::StrCat("duplicate key \"", key, "\""));
      }
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

}  // namespace vmstash
