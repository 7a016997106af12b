#include "base/json_writer.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace vmstash {

void JsonWriter::BeforeValue() {
  if (after_key_) {
    after_key_ = false;
    return;
  }
  if (!first_.empty()) {
    if (!first_.back()) out_ += ',';
    first_.back() = false;
  }
}

void JsonWriter::Open(char c) {
  BeforeValue();
  out_ += c;
  first_.push_back(true);
}

void JsonWriter::Close(char c) {
  out_ += c;
  first_.pop_back();
}

void JsonWriter::Key(absl::string_view key) {
  String(key);
  out_ += ':';
  after_key_ = true;
}

void JsonWriter::String(absl::string_view value) {
  BeforeValue();
  out_ += '"';
  for (char ch : value) {
    unsigned char c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out_ += "\\\""; break;
      case '\\': out_ += "\\\\"; break;
      case '\n': out_ += "\\n"; break;
      case '\t': out_ += "\\t"; break;
      case '\r': out_ += "\\r"; break;
      default:
        if (c < 0x20) absl::StrAppend(&out_, absl::StrFormat("\\u%04x", c));
        else out_ += ch;
    }
  }
  out_ += '"';
}

void JsonWriter::Int(std::int64_t value) {
  BeforeValue();
  absl::StrAppend(&out_, value);
}

void JsonWriter::Uint(std::uint64_t value) {
  BeforeValue();
  absl::StrAppend(&out_, value);
}

void JsonWriter::Double(double value) {
  BeforeValue();
  if (!std::isfinite(value)) out_ += "null";
  else absl::StrAppend(&out_, absl::StrFormat("%.6g", value));
}

void JsonWriter::Bool(bool value) {
  BeforeValue();
  out_ += value ? "true" : "false";
}

void JsonWriter::Null() {
  BeforeValue();
  out_ += "null";
}

}  // namespace vmstash
