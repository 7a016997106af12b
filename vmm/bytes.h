// Byte arithmetic and formatting shared by vmm and the layers above: rounding sizes to a
// unit (granularity, alignment) and printing addresses/handles in messages.
//
// Thread-safety: pure functions.
#ifndef VMSTASH_VMM_BYTES_H_
#define VMSTASH_VMM_BYTES_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/str_format.h"

namespace vmstash {

// `v` rounded up to a multiple of `unit` (unit > 0).
inline std::size_t RoundUp(std::size_t v, std::size_t unit) { return (v + unit - 1) / unit * unit; }

// "0x7f12..." for addresses and handles in error messages.
inline std::string Hex(std::uint64_t v) { return absl::StrFormat("%#x", v); }

}  // namespace vmstash

#endif  // VMSTASH_VMM_BYTES_H_
