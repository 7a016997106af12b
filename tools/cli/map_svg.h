// MapSvg: a self-contained picture of a process's address spaces (our snapshot JSON, one
// device or a list): one bar per reservation segment, scaled to the part that holds
// chunks or blocks; mapped chunks filled in the tag's colour, unmapped holes grey; live
// blocks solid, free blocks light, paused live blocks (no memory behind them) dashed
// outlines; a legend of tags. As SVG, or an HTML page embedding it.
//
// Thread-safety: pure function.
#ifndef VMSTASH_TOOLS_CLI_MAP_SVG_H_
#define VMSTASH_TOOLS_CLI_MAP_SVG_H_

#include <string>

#include "absl/status/statusor.h"
#include "base/json_reader.h"

namespace vmstash::cli {

absl::StatusOr<std::string> MapSvg(const JsonValue& snapshot, const std::string& title);
std::string MapHtml(const std::string& svg, const std::string& title);

}  // namespace vmstash::cli

#endif  // VMSTASH_TOOLS_CLI_MAP_SVG_H_
