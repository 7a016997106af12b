// torch_memory_saver's settings and environment: see tms_env.h.
#include "torch_plugin/c_abi/tms_env.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

namespace vmstash::tms {
namespace {

bool Flag(std::initializer_list<const char*> names) {
  for (const char* name : names) {
    const char* v = std::getenv(name);
    if (v != nullptr && (std::strcmp(v, "1") == 0 || std::strcmp(v, "true") == 0)) return true;
  }
  return false;
}

Environment Read() {
  Environment env;
  env.whole_process = Flag({"TMS_INIT_ENABLE", "VMSTASH_PRELOAD_ALL"});
  env.cpu_backup = Flag({"TMS_INIT_ENABLE_CPU_BACKUP", "VMSTASH_PRELOAD_BACKUP"});
  env.disk_backup = Flag({"TMS_INIT_ENABLE_DISK_BACKUP"});
  env.retain = Flag({"TMS_RETAIN_CPU_BACKUP"});
  if (const char* v = std::getenv("TMS_INIT_CPU_BACKUP_BACKEND"); v != nullptr && v[0] != '\0') {
    if (!ParseBackend(v, &env.backend)) {
      env.backend = Setting::kPinned;
      env.backend_error = std::string("TMS_INIT_CPU_BACKUP_BACKEND must be 'pinned' or 'mmap', got '") + v + "'";
      std::fprintf(stderr, "vmstash: %s; using pinned\n", env.backend_error.c_str());
    }
  }
  if (const char* v = std::getenv("TMS_DISK_BACKUP_DIR"); v != nullptr && v[0] != '\0') env.disk_dir = v;
  return env;
}

}  // namespace

const char* SettingName(Setting s) {
  switch (s) {
    case Setting::kDiscard: return "discard";
    case Setting::kPinned: return "pinned";
    case Setting::kMmap: return "mmap";
    case Setting::kDisk: return "disk";
  }
  return "?";
}

bool ParseSetting(const char* text, Setting* out) {
  for (Setting s : {Setting::kDiscard, Setting::kPinned, Setting::kMmap, Setting::kDisk}) {
    if (text != nullptr && std::strcmp(text, SettingName(s)) == 0) {
      *out = s;
      return true;
    }
  }
  return false;
}

bool ParseBackend(const char* text, Setting* out) {
  Setting s;
  if (!ParseSetting(text, &s) || (s != Setting::kPinned && s != Setting::kMmap)) return false;
  *out = s;
  return true;
}

Setting Environment::DefaultSetting() const {
  if (disk_backup) return Setting::kDisk;
  return cpu_backup ? backend : Setting::kDiscard;
}

const Environment& Env() {
  static const Environment* env = new Environment(Read());  // leaked: read until the process ends
  return *env;
}

}  // namespace vmstash::tms
