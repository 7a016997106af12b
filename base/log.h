// A small logging module on fmt (Debian 12's abseil has no absl/log).
//
// VMSTASH_LOG(kWarning, "unmap of {:#x} failed: {}", va, status.ToString());
//
// One line per message: "[vmstash W 12:34:56.789012 tid=1234 file.cc:42] text", written
// with a single write(2) to stderr (or to a sink a test installs), so lines from several
// threads never interleave. The arguments are formatted only when the level is enabled.
// The level is process-wide and set from Options (`log_level`); default kWarning.
// Thread-safety: all functions may be called from any thread. Never call VMSTASH_LOG while
// holding an allocator lock if the sink may block (docs/architecture.md §10); the default sink does not.
#ifndef VMSTASH_BASE_LOG_H_
#define VMSTASH_BASE_LOG_H_

#include <string>

#include "absl/strings/string_view.h"
#include "fmt/format.h"

namespace vmstash {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kOff = 4 };

void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
inline bool LogEnabled(LogLevel level) { return level >= GetLogLevel() && level != LogLevel::kOff; }

// Replaces where lines go; nullptr restores stderr. The sink receives the whole line
// without the trailing newline. For tests.
using LogSink = void (*)(LogLevel level, absl::string_view line);
void SetLogSink(LogSink sink);

namespace log_internal {
void Emit(LogLevel level, const char* file, int line, const std::string& message);
}  // namespace log_internal

}  // namespace vmstash

// absl::string_view is its own type in Debian's abseil (ABSL_OPTION_USE_STD_STRING_VIEW 0);
// let fmt format it like any string.
template <>
struct fmt::formatter<absl::string_view> : fmt::formatter<fmt::string_view> {
  template <typename FormatContext>
  auto format(absl::string_view s, FormatContext& ctx) const {
    return fmt::formatter<fmt::string_view>::format(fmt::string_view(s.data(), s.size()), ctx);
  }
};

#define VMSTASH_LOG(level, ...)                                                    \
  do {                                                                             \
    if (::vmstash::LogEnabled(::vmstash::LogLevel::level)) {                       \
      ::vmstash::log_internal::Emit(::vmstash::LogLevel::level, __FILE__, __LINE__, \
                                    ::fmt::format(__VA_ARGS__));                   \
    }                                                                              \
  } while (0)

#endif  // VMSTASH_BASE_LOG_H_
