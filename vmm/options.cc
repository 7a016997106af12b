#include "vmm/options.h"

#include <cstdlib>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "vmm/status_macros.h"

namespace vmstash {
namespace {

constexpr absl::string_view kLevelNames[] = {"debug", "info", "warning", "error", "off"};

absl::Status BadValue(absl::string_view key, absl::string_view value, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("VMSTASH_CONF: bad value '", value, "' for key '", key, "': ", why));
}

absl::Status ApplyKey(absl::string_view key, absl::string_view value, Options& options) {
  if (key == "driver") {
    absl::StatusOr<DriverKind> kind = ParseDriverKind(value);
    if (!kind.ok()) return BadValue(key, value, kind.status().message());
    options.driver = *kind;
  } else if (key == "log_level") {
    for (int i = 0; i < 5; ++i) {
      if (kLevelNames[i] == value) {
        options.log_level = static_cast<LogLevel>(i);
        return absl::OkStatus();
      }
    }
    return BadValue(key, value, "expected debug, info, warning, error or off");
  } else if (key == "sim_devices") {
    int n = 0;
    if (!absl::SimpleAtoi(value, &n) || n < 1 || n > 64) return BadValue(key, value, "expected 1..64");
    options.sim_devices = n;
  } else if (key == "sim_capacity") {
    absl::StatusOr<std::uint64_t> size = ParseSize(value);
    if (!size.ok()) return BadValue(key, value, size.status().message());
    options.sim_capacity_bytes = *size;
  } else if (key == "sim_granularity") {
    absl::StatusOr<std::uint64_t> size = ParseSize(value);
    if (!size.ok()) return BadValue(key, value, size.status().message());
    if (*size < 4096 || (*size & (*size - 1)) != 0) {
      return BadValue(key, value, "must be a power of two of at least 4K");
    }
    options.sim_granularity_bytes = *size;
  } else if (key == "sim_fail") {
    absl::StatusOr<std::vector<FaultRule>> rules = ParseFaultRules(value);
    if (!rules.ok()) return BadValue(key, value, rules.status().message());
    options.sim_faults = *std::move(rules);
  } else if (key == "bypass" || key == "auto_prepare" || key == "control") {
    bool* flag = key == "bypass" ? &options.bypass : key == "control" ? &options.control : &options.auto_prepare;
    if (value == "1" || value == "true") *flag = true;
    else if (value == "0" || value == "false") *flag = false;
    else return BadValue(key, value, "expected 0 or 1");
  } else if (key == "backup") {
    if (value == "pinned") options.backup_pageable = false;
    else if (value == "pageable") options.backup_pageable = true;
    else return BadValue(key, value, "expected pinned or pageable");
  } else if (key == "min_chunk" || key == "max_chunk" || key == "heap_va") {
    absl::StatusOr<std::uint64_t> size = ParseSize(value);
    if (!size.ok()) return BadValue(key, value, size.status().message());
    if (key == "heap_va") {
      options.heap_va_bytes = *size;
    } else if (*size == 0) {
      return BadValue(key, value, "must be > 0");
    } else if (key == "min_chunk") {
      options.min_chunk_bytes = *size;
    } else {
      options.max_chunk_bytes = *size;
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "VMSTASH_CONF: unknown key '", key,
        "' (known: driver, log_level, sim_devices, sim_capacity, sim_granularity, sim_fail, bypass, "
        "min_chunk, max_chunk, heap_va, backup, auto_prepare, control)"));
  }
  return absl::OkStatus();
}

std::string SizeToString(std::uint64_t bytes) {
  constexpr char kSuffix[] = {'T', 'G', 'M', 'K'};
  for (int i = 0; i < 4; ++i) {
    std::uint64_t unit = std::uint64_t{1} << (10 * (4 - i));
    if (bytes != 0 && bytes % unit == 0) return absl::StrCat(bytes / unit, std::string(1, kSuffix[i]));
  }
  return absl::StrCat(bytes);
}

}  // namespace

absl::StatusOr<std::uint64_t> ParseSize(absl::string_view text) {
  absl::string_view digits = absl::StripAsciiWhitespace(text);
  std::uint64_t shift = 0;
  absl::string_view rest = digits;
  // Accept "16G", "16GiB", "16GB" (binary units in all cases).
  if (absl::EndsWith(rest, "iB")) rest.remove_suffix(2);
  else if (absl::EndsWith(rest, "B") && rest.size() > 1 && !absl::ascii_isdigit(rest[rest.size() - 2])) rest.remove_suffix(1);
  if (!rest.empty()) {
    switch (absl::ascii_toupper(rest.back())) {
      case 'K': shift = 10; break;
      case 'M': shift = 20; break;
      case 'G': shift = 30; break;
      case 'T': shift = 40; break;
      default: break;
    }
    if (shift != 0) rest.remove_suffix(1);
  }
  std::uint64_t value = 0;
  if (rest.empty() || !absl::SimpleAtoi(rest, &value)) {
    return absl::InvalidArgumentError(absl::StrCat("'", text, "' is not a size (examples: 4096, 512K, 2M, 16G)"));
  }
  if (shift != 0 && value > (~std::uint64_t{0} >> shift)) {
    return absl::InvalidArgumentError(absl::StrCat("size '", text, "' overflows 64 bits"));
  }
  return value << shift;
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

absl::StatusOr<Options> ParseOptions(absl::string_view conf) {
  Options options;
  std::set<std::string> seen;
  for (absl::string_view item : absl::StrSplit(conf, ',')) {
    item = absl::StripAsciiWhitespace(item);
    if (item.empty()) continue;
    std::vector<absl::string_view> kv = absl::StrSplit(item, absl::MaxSplits(':', 1));
    if (kv.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("VMSTASH_CONF: item '", item, "' is not of the form key:value"));
    }
    absl::string_view key = absl::StripAsciiWhitespace(kv[0]);
    absl::string_view value = absl::StripAsciiWhitespace(kv[1]);
    if (!seen.insert(std::string(key)).second) {
      return absl::InvalidArgumentError(absl::StrCat("VMSTASH_CONF: key '", key, "' is given twice"));
    }
    VMSTASH_RETURN_IF_ERROR(ApplyKey(key, value, options));
  }
  return options;
}

absl::StatusOr<Options> OptionsFromEnvironment() {
  const char* conf = std::getenv("VMSTASH_CONF");
  VMSTASH_ASSIGN_OR_RETURN(Options options, ParseOptions(conf == nullptr ? "" : conf));
  if (const char* driver = std::getenv("VMSTASH_DRIVER"); driver != nullptr && *driver != '\0') {
    absl::StatusOr<DriverKind> kind = ParseDriverKind(driver);
    if (!kind.ok()) return absl::InvalidArgumentError(absl::StrCat("VMSTASH_DRIVER: ", kind.status().message()));
    options.driver = *kind;
  }
  return options;
}

std::string OptionsToString(const Options& options) {
  std::string out = absl::StrCat("driver:", DriverKindName(options.driver),
                                 ",log_level:", kLevelNames[static_cast<int>(options.log_level)],
                                 ",sim_devices:", options.sim_devices,
                                 ",sim_capacity:", SizeToString(options.sim_capacity_bytes),
                                 ",sim_granularity:", SizeToString(options.sim_granularity_bytes));
  if (!options.sim_faults.empty()) absl::StrAppend(&out, ",sim_fail:", FaultRulesToString(options.sim_faults));
  absl::StrAppend(&out, ",bypass:", options.bypass ? 1 : 0, ",min_chunk:", SizeToString(options.min_chunk_bytes),
                  ",max_chunk:", SizeToString(options.max_chunk_bytes),
                  ",heap_va:", SizeToString(options.heap_va_bytes),
                  ",backup:", options.backup_pageable ? "pageable" : "pinned",
                  ",auto_prepare:", options.auto_prepare ? 1 : 0, ",control:", options.control ? 1 : 0);
  return out;
}

}  // namespace vmstash
