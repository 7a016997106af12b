// PerDevice: see per_device.h.
#include "tools/cli/per_device.h"

#include "absl/strings/str_cat.h"

namespace vmstash::cli {

absl::StatusOr<std::vector<const JsonValue*>> PerDevice(const JsonValue& reply, absl::string_view what) {
  std::vector<const JsonValue*> out;
  if (reply.is_array()) {
    for (const JsonValue& d : reply.items()) out.push_back(&d);
  } else if (reply.is_object()) {
    out.push_back(&reply);
  } else {
    return absl::InvalidArgumentError(absl::StrCat(what, ": expected an object or a list of them"));
  }
  return out;
}

}  // namespace vmstash::cli
