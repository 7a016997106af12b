// vmm's VMSTASH_CONF keys: see vmm_options.h.
#include "vmm/vmm_options.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/conf.h"

namespace vmstash {
namespace {

constexpr absl::string_view kLevelNames[] = {"debug", "info", "warning", "error", "off"};

absl::StatusOr<std::uint64_t> SizeValue(absl::string_view key, absl::string_view value) {
  absl::StatusOr<std::uint64_t> size = ParseSize(value);
  if (!size.ok()) return BadConfValue(key, value, size.status().message());
  return *size;
}

}  // namespace

absl::Status ApplyVmmOption(absl::string_view key, absl::string_view value, VmmOptions& options) {
  if (key == "driver") {
    absl::StatusOr<DriverKind> kind = ParseDriverKind(value);
    if (!kind.ok()) return BadConfValue(key, value, kind.status().message());
    options.driver = *kind;
  } else if (key == "log_level") {
    for (int i = 0; i < 5; ++i) {
      if (kLevelNames[i] == value) {
        options.log_level = static_cast<LogLevel>(i);
        return absl::OkStatus();
      }
    }
    return BadConfValue(key, value, "expected debug, info, warning, error or off");
  } else if (key == "sim_devices") {
    int n = 0;
    if (!absl::SimpleAtoi(value, &n) || n < 1 || n > 64) return BadConfValue(key, value, "expected 1..64");
    options.sim_devices = n;
  } else if (key == "sim_capacity") {
    absl::StatusOr<std::uint64_t> size = SizeValue(key, value);
    if (!size.ok()) return size.status();
    options.sim_capacity_bytes = *size;
  } else if (key == "sim_granularity") {
    absl::StatusOr<std::uint64_t> size = SizeValue(key, value);
    if (!size.ok()) return size.status();
    if (*size < 4096 || (*size & (*size - 1)) != 0) return BadConfValue(key, value, "must be a power of two of at least 4K");
    options.sim_granularity_bytes = *size;
  } else if (key == "sim_fail") {
    absl::StatusOr<std::vector<FaultRule>> rules = ParseFaultRules(value);
    if (!rules.ok()) return BadConfValue(key, value, rules.status().message());
    options.sim_faults = *std::move(rules);
  } else {
    return absl::InvalidArgumentError(absl::StrCat("ApplyVmmOption: '", key, "' is not a vmm key"));
  }
  return absl::OkStatus();
}

void AppendVmmOptions(const VmmOptions& options, std::string* out) {
  absl::StrAppend(out, out->empty() ? "" : ",", "driver:", DriverKindName(options.driver),
                  ",log_level:", kLevelNames[static_cast<int>(options.log_level)],
                  ",sim_devices:", options.sim_devices, ",sim_capacity:", SizeToString(options.sim_capacity_bytes),
                  ",sim_granularity:", SizeToString(options.sim_granularity_bytes));
  if (!options.sim_faults.empty()) absl::StrAppend(out, ",sim_fail:", FaultRulesToString(options.sim_faults));
}

absl::StatusOr<DriverKind> ParseDriverKind(absl::string_view text) {
  if (text == "auto") return DriverKind::kAuto;
  if (text == "cuda") return DriverKind::kCuda;
  if (text == "sim") return DriverKind::kSim;
  return absl::InvalidArgumentError(absl::StrCat("unknown driver '", text, "' (expected auto, cuda or sim)"));
}

absl::string_view DriverKindName(DriverKind kind) {
  switch (kind) {
    case DriverKind::kAuto: return "auto";
    case DriverKind::kCuda: return "cuda";
    case DriverKind::kSim: return "sim";
  }
  return "auto";
}

}  // namespace vmstash
