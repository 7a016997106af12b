// Byte patterns for tests: a position-dependent pattern written into memory the host can
// address (the simulated driver's device memory included, where a DevicePtr is a host
// address) and counted back byte by byte, so a lost, shifted or partial restore shows.
//
// Thread-safety: pure functions over the caller's memory.
#ifndef VMSTASH_BASE_BYTE_PATTERN_H_
#define VMSTASH_BASE_BYTE_PATTERN_H_

#include <cstddef>
#include <cstdint>

namespace vmstash {

inline std::uint8_t PatternByte(std::size_t i, std::uint8_t seed) { return static_cast<std::uint8_t>(seed + i * 7); }

inline void FillPattern(void* p, std::size_t n, std::uint8_t seed) {
  auto* b = static_cast<std::uint8_t*>(p);
  for (std::size_t i = 0; i < n; ++i) b[i] = PatternByte(i, seed);
}
inline void FillPattern(std::uint64_t address, std::size_t n, std::uint8_t seed) {
  FillPattern(reinterpret_cast<void*>(address), n, seed);
}

// Bytes of [p, p + n) that differ from FillPattern's.
inline std::size_t WrongBytes(const void* p, std::size_t n, std::uint8_t seed) {
  const auto* b = static_cast<const std::uint8_t*>(p);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) wrong += b[i] != PatternByte(i, seed);
  return wrong;
}
inline std::size_t WrongBytes(std::uint64_t address, std::size_t n, std::uint8_t seed) {
  return WrongBytes(reinterpret_cast<const void*>(address), n, seed);
}

}  // namespace vmstash

#endif  // VMSTASH_BASE_BYTE_PATTERN_H_
