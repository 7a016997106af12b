// VMSTASH_CONF syntax: see conf.h.
#include "base/conf.h"

#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace vmstash {

absl::StatusOr<ConfItems> SplitConf(absl::string_view conf) {
  ConfItems items;
  std::set<std::string> seen;
  for (absl::string_view item : absl::StrSplit(conf, ',')) {
    item = absl::StripAsciiWhitespace(item);
    if (item.empty()) continue;
    std::vector<absl::string_view> kv = absl::StrSplit(item, absl::MaxSplits(':', 1));
    if (kv.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat("VMSTASH_CONF: item '", item, "' is not of the form key:value"));
    }
    std::string key(absl::StripAsciiWhitespace(kv[0]));
    if (!seen.insert(key).second) {
      return absl::InvalidArgumentError(absl::StrCat("VMSTASH_CONF: key '", key, "' is given twice"));
    }
    items.emplace_back(std::move(key), std::string(absl::StripAsciiWhitespace(kv[1])));
  }
  return items;
}

absl::Status BadConfValue(absl::string_view key, absl::string_view value, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("VMSTASH_CONF: bad value '", value, "' for key '", key, "': ", why));
}

absl::StatusOr<std::uint64_t> ParseSize(absl::string_view text) {
  absl::string_view rest = absl::StripAsciiWhitespace(text);
  // Accept "16G", "16GiB", "16GB" (binary units in all cases).
  if (absl::EndsWith(rest, "iB")) {
    rest.remove_suffix(2);
  } else if (absl::EndsWith(rest, "B") && rest.size() > 1 && !absl::ascii_isdigit(rest[rest.size() - 2])) {
    rest.remove_suffix(1);
  }
  std::uint64_t shift = 0;
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

std::string SizeToString(std::uint64_t bytes) {
  constexpr char kSuffix[] = {'T', 'G', 'M', 'K'};
  for (int i = 0; i < 4; ++i) {
    const std::uint64_t unit = std::uint64_t{1} << (10 * (4 - i));
    if (bytes != 0 && bytes % unit == 0) return absl::StrCat(bytes / unit, std::string(1, kSuffix[i]));
  }
  return absl::StrCat(bytes);
}

absl::StatusOr<bool> ParseConfFlag(absl::string_view key, absl::string_view value) {
  if (value == "1" || value == "true") return true;
  if (value == "0" || value == "false") return false;
  return BadConfValue(key, value, "expected 0 or 1");
}

}  // namespace vmstash
