// JsonWriter: a minimal streaming JSON writer for stats and snapshots.
//
// Usage: w.BeginObject(); w.Key("a"); w.Int(1); w.EndObject(); w.str(). Commas are placed
// automatically; strings are escaped (control characters as \u00XX). Numbers are written
// exactly (64-bit integers, never as doubles). Misuse (a key outside an object) is a
// programming error, not checked at run time.
//
// Thread-safety: none; one writer per thread.
#ifndef VMSTASH_BASE_JSON_WRITER_H_
#define VMSTASH_BASE_JSON_WRITER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace vmstash {

class JsonWriter {
 public:
  void BeginObject() { Open('{'); }
  void EndObject() { Close('}'); }
  void BeginArray() { Open('['); }
  void EndArray() { Close(']'); }
  void Key(absl::string_view key);
  void String(absl::string_view value);
  void Int(std::int64_t value);
  void Uint(std::uint64_t value);
  void Double(double value);
  void Bool(bool value);
  void Null();
  // Helpers for "key": value pairs.
  void Field(absl::string_view key, absl::string_view value) { Key(key); String(value); }
  void Field(absl::string_view key, const char* value) { Key(key); String(value); }
  void Field(absl::string_view key, std::uint64_t value) { Key(key); Uint(value); }
  void Field(absl::string_view key, std::int64_t value) { Key(key); Int(value); }
  void Field(absl::string_view key, int value) { Key(key); Int(value); }
  void Field(absl::string_view key, bool value) { Key(key); Bool(value); }
  void Field(absl::string_view key, double value) { Key(key); Double(value); }

  const std::string& str() const { return out_; }

 private:
  void Open(char c);
  void Close(char c);
  void BeforeValue();
  std::string out_;
  std::vector<bool> first_;  // per open container: no element written yet
  bool after_key_ = false;
};

}  // namespace vmstash

#endif  // VMSTASH_BASE_JSON_WRITER_H_
