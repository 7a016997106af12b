// VmmOptions: vmm's VMSTASH_CONF keys (the syntax: base/conf.h; the composed table and
// the environment: runtime/runtime_options.h).
//
//   driver          auto | cuda | sim     auto: CUDA if a GPU is usable, else the simulator
//   log_level       debug | info | warning | error | off
//   sim_devices     number of simulated devices (1..64)
//   sim_capacity    device memory of each simulated device
//   sim_granularity VMM granularity of the simulator (power of two, >= 4K)
//   sim_fail        fault-injection rules, see ParseFaultRules (driver_op.h)
#ifndef VMSTASH_VMM_VMM_OPTIONS_H_
#define VMSTASH_VMM_VMM_OPTIONS_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/log.h"
#include "vmm/driver_op.h"

namespace vmstash {

enum class DriverKind { kAuto, kCuda, kSim };

struct VmmOptions {
  DriverKind driver = DriverKind::kAuto;
  LogLevel log_level = LogLevel::kWarning;
  int sim_devices = 1;
  std::size_t sim_capacity_bytes = std::size_t{16} << 30;
  std::size_t sim_granularity_bytes = std::size_t{2} << 20;
  std::vector<FaultRule> sim_faults;
};

inline constexpr absl::string_view kVmmConfKeys[] = {"driver",          "log_level", "sim_devices", "sim_capacity",
                                                     "sim_granularity", "sim_fail"};

// Sets `key` (one of kVmmConfKeys) from `value`; InvalidArgument naming both on a bad value.
absl::Status ApplyVmmOption(absl::string_view key, absl::string_view value, VmmOptions& options);
// Appends the canonical "key:value" items of `options` (comma-separated, none leading).
void AppendVmmOptions(const VmmOptions& options, std::string* out);

absl::StatusOr<DriverKind> ParseDriverKind(absl::string_view text);
absl::string_view DriverKindName(DriverKind kind);

}  // namespace vmstash

#endif  // VMSTASH_VMM_VMM_OPTIONS_H_
