// JsonValue: a small JSON document model for the CLI, which renders the stats and
// snapshots a process sends (allocator/stats.h, allocator/snapshot.h). Strict RFC 8259
// parsing with a nesting limit; numbers are kept as double plus, when integral, int64.
//
// Thread-safety: values are plain data.
#ifndef VMSTASH_TOOLS_CLI_JSON_VALUE_H_
#define VMSTASH_TOOLS_CLI_JSON_VALUE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace vmstash::cli {

class JsonValue {
 public:
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };

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

// The per-device documents of a reply that is one object (one device) or a list of them
// (every device in use); InvalidArgument naming `what` otherwise.
absl::StatusOr<std::vector<const JsonValue*>> PerDevice(const JsonValue& reply, absl::string_view what);

// 1536 -> "1.5 KiB" (bytes below 1 KiB: "512 B").
std::string HumanBytes(double bytes);

}  // namespace vmstash::cli

#endif  // VMSTASH_TOOLS_CLI_JSON_VALUE_H_
