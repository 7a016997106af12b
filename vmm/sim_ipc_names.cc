// The simulator's interprocess-event names: see sim_ipc_names.h.
#include "vmm/sim_ipc_names.h"

#include <dirent.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "vmm/driver.h"

namespace vmstash {
namespace {

constexpr char kHandleMagic[8] = {'v', 'm', 's', 'i', 'm', 'e', 'v', '1'};
constexpr std::size_t kNameBytes = kIpcEventHandleBytes - sizeof(kHandleMagic);
constexpr absl::string_view kNamePrefix = "/vmstash-simev-";

}  // namespace

std::string NewSimIpcName() {
  static std::atomic<std::uint64_t> count{0};
  std::uint64_t x = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
                    (count.load() * 0x9e3779b97f4a7c15ull);
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  return absl::StrFormat("%s%d-%x-%08x", kNamePrefix, ::getpid(), count.fetch_add(1), static_cast<std::uint32_t>(x));
}

std::string SimIpcHandle(const std::string& name) {
  std::string handle(kIpcEventHandleBytes, '\0');
  std::memcpy(&handle[0], kHandleMagic, sizeof(kHandleMagic));
  std::memcpy(&handle[sizeof(kHandleMagic)], name.data(), std::min(name.size(), kNameBytes - 1));
  return handle;
}

absl::StatusOr<std::string> SimIpcNameOf(const std::string& handle) {
  if (handle.size() != kIpcEventHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("OpenIpcEvent: a handle of ", handle.size(),
                                                   " bytes (an event's handle has ", kIpcEventHandleBytes, ")"));
  }
  // The magic, then a name of ours ("/vmstash-simev-...", no other '/'), zero padded.
  const absl::string_view field(handle.data() + sizeof(kHandleMagic), kNameBytes);
  const std::size_t end = field.find('\0');
  const absl::string_view name = field.substr(0, end);
  if (std::memcmp(handle.data(), kHandleMagic, sizeof(kHandleMagic)) != 0 || end == absl::string_view::npos ||
      name.substr(0, kNamePrefix.size()) != kNamePrefix || name.find('/', 1) != absl::string_view::npos ||
      field.find_first_not_of('\0', end) != absl::string_view::npos) {
    return absl::InvalidArgumentError("OpenIpcEvent: not an interprocess event handle of the simulator");
  }
  return std::string(name);
}

void SweepDeadSimIpcNames() {
  DIR* d = ::opendir("/dev/shm");
  if (d == nullptr) return;
  const absl::string_view prefix = kNamePrefix.substr(1);
  while (dirent* entry = ::readdir(d)) {
    const absl::string_view name = entry->d_name;
    int pid = 0;
    if (!absl::StartsWith(name, prefix)) continue;
    const absl::string_view rest = name.substr(prefix.size());
    if (!absl::SimpleAtoi(rest.substr(0, rest.find('-')), &pid) || pid <= 0) continue;
    if (::kill(pid, 0) != 0 && errno == ESRCH) ::shm_unlink(absl::StrCat("/", name).c_str());
  }
  ::closedir(d);
}

}  // namespace vmstash
