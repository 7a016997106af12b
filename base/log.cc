#include "base/log.h"

#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

namespace vmstash {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kWarning)};
std::atomic<LogSink> g_sink{nullptr};

char LevelLetter(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return 'D';
    case LogLevel::kInfo: return 'I';
    case LogLevel::kWarning: return 'W';
    case LogLevel::kError: return 'E';
    case LogLevel::kOff: break;
  }
  return '?';
}

const char* BaseName(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash == nullptr ? path : slash + 1;
}

}  // namespace

void SetLogLevel(LogLevel level) { g_level.store(static_cast<int>(level), std::memory_order_relaxed); }
LogLevel GetLogLevel() { return static_cast<LogLevel>(g_level.load(std::memory_order_relaxed)); }
void SetLogSink(LogSink sink) { g_sink.store(sink, std::memory_order_release); }

namespace log_internal {

void Emit(LogLevel level, const char* file, int line, const std::string& message) {
  timespec now{};
  clock_gettime(CLOCK_REALTIME, &now);
  tm local{};
  localtime_r(&now.tv_sec, &local);
  std::string text = fmt::format("[vmstash {} {:02}:{:02}:{:02}.{:06} tid={} {}:{}] {}", LevelLetter(level),
                                 local.tm_hour, local.tm_min, local.tm_sec, now.tv_nsec / 1000,
                                 static_cast<long>(syscall(SYS_gettid)), BaseName(file), line, message);
  LogSink sink = g_sink.load(std::memory_order_acquire);
  if (sink != nullptr) {
    sink(level, text);
    return;
  }
  text.push_back('\n');
  // One write keeps concurrent lines whole; a failed log write is deliberately ignored.
  ssize_t ignored = ::write(STDERR_FILENO, text.data(), text.size());
  (void)ignored;
}

}  // namespace log_internal
}  // namespace vmstash
