// Options: the one configuration struct, parsed once from VMSTASH_CONF and passed by value.
//
// Format: VMSTASH_CONF="key:value,key:value". Whitespace around items is ignored; an
// empty item (trailing comma) is ignored; an unknown key, a key given twice or a bad value
// is an InvalidArgument error that names the key and the value. Sizes accept an integer
// with an optional binary suffix: 4096, 512K, 2M, 16G, 1T (also KiB/MiB/GiB/TiB).
//
// Keys (later components add theirs here):
//   driver          auto | cuda | sim     auto: CUDA if a GPU is usable, else the simulator
//   log_level       debug | info | warning | error | off
//   sim_devices     number of simulated devices (1..64)
//   sim_capacity    device memory of each simulated device
//   sim_granularity VMM granularity of the simulator (power of two, >= 4K)
//   sim_fail        fault-injection rules, see ParseFaultRules (driver_op.h)
//   bypass          0 | 1   allocator: every allocation straight to the driver (no caching),
//                           for compute-sanitizer and for finding use-after-free
//   min_chunk       allocator: smallest chunk of a large heap (default 20M, rounded up to
//                           the granularity)
//   max_chunk       allocator: largest chunk made by geometric growth (default 2G); a
//                           single larger request still gets one chunk of its own size
//   heap_va         allocator: VA reserved per heap at a time (default 0 = 2x device memory)
//   backup          pinned | pageable   where paused `backup` bytes go: pinned host memory
//                           (default; link speed) or pageable mmap (RSS given back after resume)
//   control         1 | 0   serve the control endpoint (Unix socket, see control/endpoint.h)
//                           that the `vmstash` CLI talks to (default 1)
//   auto_prepare    1 | 0   allocator: a background thread sizes the backup arena of a
//                           `backup` tag as the tag grows, so even the first pause runs at
//                           link speed (default 1; 0: only explicit Prepare)
//
// OptionsFromEnvironment() is the only place in the project that reads the environment:
// VMSTASH_CONF, and VMSTASH_DRIVER (same values as `driver`, overrides it).
#ifndef VMSTASH_VMM_OPTIONS_H_
#define VMSTASH_VMM_OPTIONS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "vmm/driver_op.h"
#include "vmm/log.h"

namespace vmstash {

enum class DriverKind { kAuto, kCuda, kSim };

struct Options {
  DriverKind driver = DriverKind::kAuto;
  LogLevel log_level = LogLevel::kWarning;
  int sim_devices = 1;
  std::size_t sim_capacity_bytes = std::size_t{16} << 30;
  std::size_t sim_granularity_bytes = std::size_t{2} << 20;
  std::vector<FaultRule> sim_faults;
  bool bypass = false;
  std::size_t min_chunk_bytes = std::size_t{20} << 20;
  std::size_t max_chunk_bytes = std::size_t{2} << 30;
  std::size_t heap_va_bytes = 0;
  bool backup_pageable = false;
  bool auto_prepare = true;
  bool control = true;
};

absl::StatusOr<Options> ParseOptions(absl::string_view conf);
// Parses VMSTASH_CONF, then applies VMSTASH_DRIVER.
absl::StatusOr<Options> OptionsFromEnvironment();
// The canonical VMSTASH_CONF string for `options` (round-trips through ParseOptions).
std::string OptionsToString(const Options& options);

// "16G" -> 17179869184. InvalidArgument naming `text` on a bad value or overflow.
absl::StatusOr<std::uint64_t> ParseSize(absl::string_view text);
absl::StatusOr<DriverKind> ParseDriverKind(absl::string_view text);
absl::string_view DriverKindName(DriverKind kind);

}  // namespace vmstash

#endif  // VMSTASH_VMM_OPTIONS_H_
