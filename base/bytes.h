// Byte arithmetic and formatting shared by every layer: rounding sizes to a
// unit (granularity, alignment), printing addresses/handles and sizes in messages.
//
// Thread-safety: pure functions.
#ifndef VMSTASH_BASE_BYTES_H_
#define VMSTASH_BASE_BYTES_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/str_format.h"

namespace vmstash {

// `v` rounded up to a multiple of `unit` (unit > 0).
inline std::size_t RoundUp(std::size_t v, std::size_t unit) { return (v + unit - 1) / unit * unit; }

// "0x7f12..." for addresses and handles in error messages.
inline std::string Hex(std::uint64_t v) { return absl::StrFormat("%#x", v); }

// 1536 -> "1.50 KiB"; below 1 KiB: "512 B". The one human-readable size format (logs,
// errors, the CLI's tables).
std::string HumanBytes(std::uint64_t bytes);

}  // namespace vmstash

#endif  // VMSTASH_BASE_BYTES_H_
