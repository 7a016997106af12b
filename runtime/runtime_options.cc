// The composed VMSTASH_CONF table: see runtime_options.h.
#include "runtime/runtime_options.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/conf.h"
#include "base/status_macros.h"

namespace vmstash {
namespace {

template <typename Keys>
bool Has(const Keys& keys, absl::string_view key) {
  return std::find(std::begin(keys), std::end(keys), key) != std::end(keys);
}

absl::Status UnknownKey(absl::string_view key) {
  std::string known = absl::StrJoin(kVmmConfKeys, ", ");
  absl::StrAppend(&known, ", ", absl::StrJoin(kAllocatorConfKeys, ", "), ", ", absl::StrJoin(control::kControlConfKeys, ", "),
                  ", ", absl::StrJoin(node::kNodeConfKeys, ", "));
  return absl::InvalidArgumentError(absl::StrCat("VMSTASH_CONF: unknown key '", key, "' (known: ", known, ")"));
}

}  // namespace

absl::StatusOr<RuntimeOptions> ParseRuntimeOptions(absl::string_view conf) {
  VMSTASH_ASSIGN_OR_RETURN(const ConfItems items, SplitConf(conf));
  RuntimeOptions options;
  bool share_set = false;
  for (const auto& [key, value] : items) {
    share_set = share_set || key == "share_chunks";
    if (Has(kVmmConfKeys, key)) {
      VMSTASH_RETURN_IF_ERROR(ApplyVmmOption(key, value, options.vmm));
    } else if (Has(kAllocatorConfKeys, key)) {
      VMSTASH_RETURN_IF_ERROR(ApplyAllocatorOption(key, value, options.allocator));
    } else if (Has(control::kControlConfKeys, key)) {
      VMSTASH_RETURN_IF_ERROR(control::ApplyControlOption(key, value, options.control));
    } else if (Has(node::kNodeConfKeys, key)) {
      VMSTASH_RETURN_IF_ERROR(node::ApplyNodeOption(key, value, options.node));
    } else {
      return UnknownKey(key);
    }
  }
  // A process in the node pool is one of several on its GPU: its chunks are made
  // exportable, so node switches can hand them over (allocator_options.h), unless it said.
  if (options.node.enabled && !share_set) options.allocator.share_chunks = true;
  return options;
}

absl::StatusOr<RuntimeOptions> RuntimeOptionsFromEnvironment() {
  const char* conf = std::getenv("VMSTASH_CONF");
  VMSTASH_ASSIGN_OR_RETURN(RuntimeOptions options, ParseRuntimeOptions(conf == nullptr ? "" : conf));
  // TMS_DEBUG_LOG, torch_memory_saver's debug switch (a build-time one in its 0.0.10 C++; an
  // environment variable for the drop-in): the debug log, unless VMSTASH_CONF names a level.
  if (const char* debug = std::getenv("TMS_DEBUG_LOG");
      debug != nullptr && (std::strcmp(debug, "1") == 0 || std::strcmp(debug, "true") == 0)) {
    absl::StatusOr<ConfItems> items = SplitConf(conf == nullptr ? "" : conf);
    bool named = false;
    for (const auto& [key, value] : items.ok() ? *items : ConfItems()) named = named || key == "log_level";
    if (!named) options.vmm.log_level = LogLevel::kDebug;
  }
  if (const char* driver = std::getenv("VMSTASH_DRIVER"); driver != nullptr && *driver != '\0') {
    absl::StatusOr<DriverKind> kind = ParseDriverKind(driver);
    if (!kind.ok()) return absl::InvalidArgumentError(absl::StrCat("VMSTASH_DRIVER: ", kind.status().message()));
    options.vmm.driver = *kind;
  }
  return options;
}

std::string RuntimeOptionsToString(const RuntimeOptions& options) {
  std::string out;
  AppendVmmOptions(options.vmm, &out);
  AppendAllocatorOptions(options.allocator, &out);
  control::AppendControlOptions(options.control, &out);
  node::AppendNodeOptions(options.node, &out);
  return out;
}

}  // namespace vmstash
