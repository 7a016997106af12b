// torch_memory_saver's backup settings and environment variables, read in one place.
//
// What: the backup setting of a torch_memory_saver tag (Setting: discard, pinned, mmap,
// disk; its names and parsing), and the variables torch_memory_saver reads (TMS_*) with
// vmstash's preload aliases, read once at the first use into Environment. Every reader
// of them asks here: the per-thread defaults and the registry of tms_c.cc, the preload
// library's whole-process routing and process tag (torch_plugin/preload/
// vmstash_preload.cc), and the Python layer (vmstash_tms_check_env,
// vmstash_tms_whole_process in vmstash_tms.h).
//
// A flag is on when its value is "1" or "true" (torch_memory_saver's rule); a bad
// TMS_INIT_CPU_BACKUP_BACKEND is taken as pinned, said once on stderr, and kept as
// backend_error (the Python layer raises it as a ValueError).
//
// Thread-safety: Env() is built once (a function-local static) and never changes.
#ifndef VMSTASH_TORCH_PLUGIN_C_ABI_TMS_ENV_H_
#define VMSTASH_TORCH_PLUGIN_C_ABI_TMS_ENV_H_

#include <string>

namespace vmstash::tms {

enum class Setting { kDiscard, kPinned, kMmap, kDisk };
const char* SettingName(Setting s);
// "discard", "pinned", "mmap" or "disk".
bool ParseSetting(const char* text, Setting* out);
// A cpu_backup_backend value: "pinned" or "mmap" (torch_memory_saver's names).
bool ParseBackend(const char* text, Setting* out);

struct Environment {
  bool whole_process = false;  // TMS_INIT_ENABLE or VMSTASH_PRELOAD_ALL: every allocation managed
  bool cpu_backup = false;     // TMS_INIT_ENABLE_CPU_BACKUP or VMSTASH_PRELOAD_BACKUP
  bool disk_backup = false;    // TMS_INIT_ENABLE_DISK_BACKUP
  Setting backend = Setting::kPinned;  // TMS_INIT_CPU_BACKUP_BACKEND (unset or empty: pinned)
  std::string backend_error;           // a bad TMS_INIT_CPU_BACKUP_BACKEND ("" when good)
  std::string disk_dir = "/tmp";       // TMS_DISK_BACKUP_DIR (unset or empty: /tmp)
  bool retain = false;                 // TMS_RETAIN_CPU_BACKUP

  // A thread's default backup setting, and the whole-process tag's: disk, else the backend
  // with a cpu backup, else discard.
  Setting DefaultSetting() const;
};

const Environment& Env();

}  // namespace vmstash::tms

#endif  // VMSTASH_TORCH_PLUGIN_C_ABI_TMS_ENV_H_
