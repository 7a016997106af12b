// JsonValue: the project's one JSON reader, a small document model used by the control
// protocol (control/protocol.h) and the CLI, which renders the stats and snapshots a
// process sends (allocator/stats.h, allocator/snapshot.h).
//
// Strict RFC 8259: the number grammar exactly, \u escapes with exactly four hex digits
// (surrogate pairs joined into one UTF-8 sequence; a lone surrogate is an error),
// control characters in strings and duplicate object keys rejected, nothing after the
// document but whitespace. Nesting is limited (kMaxDepth), so hostile input cannot
// exhaust the stack. Numbers are kept as double plus, when integral, int64. Errors are
// InvalidArgument naming the byte offset.
//
// Thread-safety: values are plain data.
#ifndef VMSTASH_BASE_JSON_READER_H_
#define VMSTASH_BASE_JSON_READER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace vmstash {

class JsonValue {
 public:
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };

  static constexpr int kMaxDepth = 64;
  static absl::StatusOr<JsonValue> Parse(absl::string_view text);

  Type type() const { return type_; }
  bool is_array() const { return type_ == Type::kArray; }
  bool is_object() const { return type_ == Type::kObject; }
  // Typed reads with a fallback for missing/mistyped values (the CLI shows what it can).
  std::int64_t Int(std::int64_t fallback = 0) const { return type_ == Type::kNumber ? int_ : fallback; }
  double Number(double fallback = 0) const { return type_ == Type::kNumber ? number_ : fallback; }
  bool Bool(bool fallback = false) const { return type_ == Type::kBool ? bool_ : fallback; }
  const std::string& String() const { return string_; }
  const std::vector<JsonValue>& items() const { return items_; }
  const std::vector<std::pair<std::string, JsonValue>>& members() const { return members_; }
  // Member `key` of an object (a null value when absent); chains: v["a"]["b"].
  const JsonValue& operator[](absl::string_view key) const;

 private:
  friend class JsonParser;
  Type type_ = Type::kNull;
  bool bool_ = false;
  double number_ = 0;
  std::int64_t int_ = 0;
  std::string string_;
  std::vector<JsonValue> items_;
  std::vector<std::pair<std::string, JsonValue>> members_;
};

}  // namespace vmstash

#endif  // VMSTASH_BASE_JSON_READER_H_
