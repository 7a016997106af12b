// torch_memory_saver's C entry points on vmstash (torch_plugin/include/vmstash/vmstash_tms.h,
// which lists them and their differences): linked into libvmstash.so and
// libvmstash_preload.so with the rest of the C ABI, so the drop-in wheel's library, the
// Python layer and a preloaded process's global scope all reach one implementation.
//
// Layout:
//   per thread   ThreadState: torch_memory_saver's config (tag, cpu/disk backup, backend;
//                from the TMS_INIT_* variables at the thread's first use), the routing
//                override (tms.h) and the regions pushed by the Python layer.
//   per process  Registry: (torch_memory_saver tag, backup setting) -> vmstash tag (Note
//                [TMS Tags] in vmstash_tms.h), entries never removed (names stay valid);
//                the disk backup directory; retain_cpu_backup; the preload library's
//                process tag.
//   transitions  tms_pause moves all of a tag's vmstash tags (every tag's, for NULL) in one
//                vmstash_switch, all or nothing; tms_resume resumes them one after
//                another and stops at the first failure. Each backup tag's retention is
//                set first (allocator/tag_pool.h, Note [Retained Backups]): its backup
//                goes with its freed blocks, and a resume keeps it readable while
//                retain_cpu_backup is on, else hands its host memory back to the OS
//                (give_back; the next pause pins it again).
//
// Errors: the exported calls never exit; those returning a code or NULL record the message
// (vmstash_last_error); TMS's void setters record it too and keep the previous value.
// Thread-safety: the registry, the directory and the retain flag are guarded; a thread's
// state is its own.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <initializer_list>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "allocator/backup_arena.h"
#include "allocator/tag.h"
#include "base/json_writer.h"
#include "runtime/runtime.h"
#include "torch_plugin/c_abi/shim.h"
#include "torch_plugin/c_abi/tms.h"
#include "torch_plugin/include/vmstash/vmstash.h"
#include "torch_plugin/include/vmstash/vmstash_tms.h"

#define VMSTASH_TMS_EXPORT __attribute__((visibility("default")))

namespace vmstash::tms {
namespace {

bool EnvFlag(std::initializer_list<const char*> names) {
  for (const char* name : names) {
    const char* v = std::getenv(name);
    if (v != nullptr && (std::strcmp(v, "1") == 0 || std::strcmp(v, "true") == 0)) return true;
  }
  return false;
}

// Whole-process mode's variables (the preload library routes every thread).
bool WholeProcessEnv() {
  static const bool all = EnvFlag({"VMSTASH_PRELOAD_ALL", "TMS_INIT_ENABLE"});
  return all;
}

// --- Backup settings ---------------------------------------------------------------------

enum class Setting { kDiscard, kPinned, kMmap, kDisk };

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

// A cpu_backup_backend value: "pinned" or "mmap" (TMS's names).
bool ParseBackend(const char* text, Setting* out) {
  return ParseSetting(text, out) && (*out == Setting::kPinned || *out == Setting::kMmap);
}

// TMS_INIT_CPU_BACKUP_BACKEND: unset or empty is pinned; a bad value is said once and
// taken as pinned (the Python layer refuses it with a ValueError).
Setting EnvBackend() {
  static const Setting backend = [] {
    const char* v = std::getenv("TMS_INIT_CPU_BACKUP_BACKEND");
    Setting s = Setting::kPinned;
    if (v != nullptr && v[0] != '\0' && !ParseBackend(v, &s)) {
      std::fprintf(stderr, "vmstash: TMS_INIT_CPU_BACKUP_BACKEND='%s' is not pinned or mmap; using pinned\n", v);
      s = Setting::kPinned;
    }
    return s;
  }();
  return backend;
}

// --- Per thread ---------------------------------------------------------------------------

struct ThreadConfig {
  std::string tag = "default";
  // VMSTASH_PRELOAD_BACKUP: vmstash's name for it (ProcessSetting reads both).
  bool cpu_backup = EnvFlag({"TMS_INIT_ENABLE_CPU_BACKUP", "VMSTASH_PRELOAD_BACKUP"});
  bool disk_backup = EnvFlag({"TMS_INIT_ENABLE_DISK_BACKUP"});
  Setting backend = EnvBackend();
  bool configured = false;  // set through tms_set_* or a pushed region: routing follows it
};

Setting SettingOf(const ThreadConfig& c) {
  if (c.disk_backup) return Setting::kDisk;
  return c.cpu_backup ? c.backend : Setting::kDiscard;
}

struct Saved {
  ThreadConfig config;
  int routed;
};

struct ThreadState {
  ThreadConfig config;
  int routed = -1;  // tms.h: -1 unset, 0 never, 1 always
  std::vector<Saved> pushed;
};

ThreadState& State() {
  thread_local ThreadState state;
  return state;
}

bool InRegion() {
  const char* tag = vmstash_get_current_tag();
  return tag != nullptr && std::strcmp(tag, "default") != 0;
}

bool Interesting() {
  const int routed = State().routed;
  if (routed >= 0) return routed == 1;
  return WholeProcessEnv() || InRegion();
}

// --- Per process --------------------------------------------------------------------------

std::atomic<const char*> process_tag{nullptr};

// The whole-process tag's setting, from the variables the preload library reads.
Setting ProcessSetting() {
  if (EnvFlag({"TMS_INIT_ENABLE_DISK_BACKUP"})) return Setting::kDisk;
  if (EnvFlag({"TMS_INIT_ENABLE_CPU_BACKUP", "VMSTASH_PRELOAD_BACKUP"})) return EnvBackend();
  return Setting::kDiscard;
}

std::mutex dir_mu;
std::string& DiskDir() {  // guarded by dir_mu
  static auto* dir = new std::string([] {
    const char* v = std::getenv("TMS_DISK_BACKUP_DIR");
    return std::string(v != nullptr && v[0] != '\0' ? v : "/tmp");
  }());
  return *dir;
}
std::string CurrentDiskDir() {
  std::lock_guard<std::mutex> lock(dir_mu);
  return DiskDir();
}

std::atomic<int> retain{-1};  // -1: TMS_RETAIN_CPU_BACKUP, read at the first use
bool Retain() {
  int r = retain.load();
  if (r < 0) {
    int expected = -1;
    retain.compare_exchange_strong(expected, EnvFlag({"TMS_RETAIN_CPU_BACKUP"}) ? 1 : 0);
    r = retain.load();
  }
  return r == 1;
}

struct TagEntry {
  std::string tms_tag;
  Setting setting;
  std::string name;         // the vmstash tag
  std::string disk_dir;     // kDisk: the directory its store was last set to
  bool process = false;     // the preload library's process tag (created by it, not here)
};

// fn(Runtime&, TagId) -> absl::Status on the existing vmstash tag `name`, as a C code.
template <typename Fn>
int OnTag(const std::string& name, Fn fn) {
  return c_abi::WithRuntime([&](Runtime& rt) {
    absl::StatusOr<TagId> id = FindTag(name);
    if (!id.ok()) return c_abi::Fail(id.status());
    return c_abi::Code(fn(rt, *id));
  });
}

// The vmstash store of a backup setting, set on `name` (disk: in `dir`, torch_memory_saver's
// directory, read at each pause: not checked here; the pause that writes there fails with
// NOT_FOUND, nothing paused, where it does not exist).
int SetStore(const std::string& name, Setting setting, const std::string& dir) {
  const BackupStore store = setting == Setting::kPinned ? BackupStore{}
                            : setting == Setting::kMmap ? BackupStore{BackupStore::Kind::kPageable, ""}
                                                        : BackupStore{BackupStore::Kind::kDiskFiles, dir};
  return OnTag(name, [&](Runtime& rt, TagId id) {
    return rt.SetBackupStore(id, store, /*directory_must_exist=*/false);
  });
}

class Registry {
 public:
  // The entry of (tms_tag, setting), its vmstash tag declared on first use; nullptr with
  // the error recorded on failure (a later call tries again).
  const TagEntry* Resolve(const std::string& tms_tag, Setting setting) {
    std::lock_guard<std::mutex> lock(mu_);
    AddProcessEntryLocked();
    bool taken = false;
    for (const TagEntry& e : entries_) {
      if (e.tms_tag != tms_tag) continue;
      if (e.setting == setting) return &e;
      taken = true;
    }
    TagEntry e{tms_tag, setting, FreeNameLocked(taken ? absl::StrCat(tms_tag, ":", SettingName(setting)) : tms_tag),
               "", false};
    if (vmstash_create_tag(e.name.c_str(), setting == Setting::kDiscard ? "discard" : "backup") != 0) return nullptr;
    if (setting != Setting::kDiscard) {
      if (setting == Setting::kDisk) e.disk_dir = CurrentDiskDir();
      if (SetStore(e.name, setting, e.disk_dir) != 0) return nullptr;
    }
    entries_.push_back(std::move(e));
    return &entries_.back();
  }

  // Copies of the entries of `tms_tag` (nullptr: all), the process tag's with "default".
  std::vector<TagEntry> Targets(const char* tms_tag) {
    std::lock_guard<std::mutex> lock(mu_);
    AddProcessEntryLocked();
    std::vector<TagEntry> out;
    for (const TagEntry& e : entries_) {
      if (tms_tag == nullptr || e.tms_tag == tms_tag) out.push_back(e);
    }
    return out;
  }

  // A disk entry's store moved to `dir` (the pause set it).
  void NoteDiskDir(const std::string& name, const std::string& dir) {
    std::lock_guard<std::mutex> lock(mu_);
    for (TagEntry& e : entries_) {
      if (e.name == name) e.disk_dir = dir;
    }
  }

 private:
  // `wanted`, or where an entry has that vmstash tag already (a torch_memory_saver tag named
  // like another's second setting, "kv:pinned", or the process tag's name), the first of
  // `wanted`:2, `wanted`:3, ... that none has: two entries never share a vmstash tag.
  std::string FreeNameLocked(const std::string& wanted) const {
    auto used = [&](const std::string& name) {
      return std::any_of(entries_.begin(), entries_.end(), [&](const TagEntry& e) { return e.name == name; });
    };
    std::string name = wanted;
    for (int n = 2; used(name); ++n) name = absl::StrCat(wanted, ":", n);
    return name;
  }

  void AddProcessEntryLocked() {
    const char* process = process_tag.load();
    if (process == nullptr || has_process_) return;
    has_process_ = true;
    // The preload library set its store from TMS_DISK_BACKUP_DIR.
    const char* dir = std::getenv("TMS_DISK_BACKUP_DIR");
    entries_.push_front(TagEntry{"default", ProcessSetting(), process, dir != nullptr && dir[0] ? dir : "/tmp", true});
  }

  std::mutex mu_;
  std::deque<TagEntry> entries_;  // a deque: pointers to entries stay valid
  bool has_process_ = false;
};

Registry& Tags() {
  static auto* registry = new Registry;  // leaked: used until the process ends
  return *registry;
}

// --- Transitions --------------------------------------------------------------------------

bool Exists(const std::string& name) { return vmstash_tag_policy(name.c_str()) != nullptr; }

int SetRetention(const std::string& name, bool keep_after_resume) {
  // retain_cpu_backup off: the pinned memory goes back to the OS after each resume.
  return OnTag(name, [&](Runtime& rt, TagId id) {
    return rt.SetBackupRetention(id, BackupRetention{keep_after_resume, true, !keep_after_resume});
  });
}

// A backup tag about to pause: its disk store follows the present directory (SetStore),
// its backup goes with its blocks (Note [Retained Backups]). A tag paused already refuses
// a new store: its pause is a no-op.
int BeforePause(const TagEntry& t) {
  if (t.setting == Setting::kDiscard) return 0;
  if (t.setting == Setting::kDisk) {
    const std::string dir = CurrentDiskDir();
    if (dir != t.disk_dir) {
      const int rc = SetStore(t.name, t.setting, dir);
      if (rc == 0) Tags().NoteDiskDir(t.name, dir);
      if (rc != 0 && rc != VMSTASH_FAILED_PRECONDITION) return rc;  // paused already: the pause is a no-op
    }
  }
  return SetRetention(t.name, Retain());
}

// The vmstash tags of `tms_tag` (nullptr: all) that exist: the process tag exists only
// once it has allocated.
std::vector<TagEntry> ExistingTargets(const char* tms_tag) {
  std::vector<TagEntry> out;
  for (TagEntry& t : Tags().Targets(tms_tag)) {
    if (Exists(t.name)) out.push_back(std::move(t));
  }
  return out;
}

// A pause of several tags moves them in one vmstash_switch: all or nothing without a
// rollback that could itself fail (a switch keeps the outgoing chunks until it commits;
// pausing the tags one by one released each tag's memory at once, so undoing them after a
// later tag's failure had to create it again, and another process may have taken it). A
// pause of one tag goes through vmstash's pause. A resume moves the tags one after
// another, each through its own resume (faster than one switch, which maps every incoming
// piece before its first copy), and stops at the first that fails, its error naming the
// tags resumed before it: pausing those again is not safe (another thread may have used
// them meanwhile, or paused them on one device itself). The measurements behind both
// choices, and why a resume right after a multi-tag pause runs slower (the driver's work
// after a release): bench/HISTORY.md, "torch_memory_saver's pause and resume of several tags".
int Pause(const char* tms_tag, const vmstash_live_ranges* live, std::size_t n_live) {
  if (live == nullptr && n_live > 0) {
    return c_abi::Fail(absl::InvalidArgumentError("tms pause: NULL liveness hints with n_live > 0"));
  }
  const std::vector<TagEntry> targets = ExistingTargets(tms_tag);
  if (targets.empty()) return 0;
  std::vector<const char*> names;
  for (const TagEntry& t : targets) {
    // Two torch_memory_saver tags may resolve to one vmstash tag ("kv" pinned after a
    // discard "kv" is "kv:pinned", as is a tag named "kv:pinned"): it moves once.
    if (std::any_of(names.begin(), names.end(), [&](const char* n) { return t.name == n; })) continue;
    if (const int rc = BeforePause(t); rc != 0) return rc;  // nothing paused yet
    names.push_back(t.name.c_str());
  }
  std::vector<vmstash_live_ranges> mine;  // the hints of these tags (others, and untagged ones, are not ours)
  for (std::size_t i = 0; i < n_live; ++i) {
    for (const char* name : names) {
      if (live[i].tag != nullptr && std::strcmp(live[i].tag, name) == 0) mine.push_back(live[i]);
    }
  }
  const int rc = names.size() == 1
                     ? vmstash_pause_live_devices(names[0], -1, mine.data(), mine.size())
                     : vmstash_switch(names.data(), names.size(), nullptr, 0, -1, mine.data(), mine.size());
  return rc == VMSTASH_NOOP ? 0 : rc;  // every tag paused already: TMS's no-op
}

int Resume(const char* tms_tag) {
  const bool keep = Retain();
  std::vector<std::string> resumed;
  std::optional<c_abi::SavedError> hook_failed;  // a tag resumed whose after-resume hook failed
  for (const TagEntry& t : ExistingTargets(tms_tag)) {
    int rc = t.setting == Setting::kDiscard ? 0 : SetRetention(t.name, keep);
    if (rc == 0) rc = vmstash_resume(t.name.c_str(), -1);
    if (rc == VMSTASH_NOOP) continue;
    if (rc != 0 && vmstash_last_error_done() == 1) {  // resumed all the same: go on, report it
      if (!hook_failed.has_value()) hook_failed = c_abi::SaveError();
      rc = 0;
    }
    if (rc != 0) {
      if (resumed.empty()) return rc;
      const absl::Status error = c_abi::SaveError().ToStatus();
      return c_abi::Fail(absl::Status(error.code(), absl::StrCat(error.message(), " (tms resume: resumed before it: '",
                                                                 absl::StrJoin(resumed, "', '"),
                                                                 "'; the others stay paused)")));
    }
    resumed.push_back(t.name);
  }
  return hook_failed.has_value() ? c_abi::RestoreError(*hook_failed) : 0;
}

// The calling thread's allocation in its configured tag (tms_torch_malloc).
void* MallocInConfiguredTag(std::size_t size, int device, cudaStream_t stream) {
  if (!Interesting()) {
    c_abi::Fail(absl::FailedPreconditionError(
        "tms_torch_malloc outside an interesting region (torch_memory_saver allocates only inside region())"));
    return nullptr;
  }
  bool error = false;
  const char* tag = AllocationTag(&error);
  if (error) return nullptr;
  const std::string previous = vmstash_get_current_tag();
  if (tag != nullptr && vmstash_set_current_tag(tag) != 0) return nullptr;
  void* p = vmstash_malloc(size, device, stream);
  if (tag != nullptr) {
    const c_abi::SavedError saved = c_abi::SaveError();
    (void)vmstash_set_current_tag(previous.c_str());
    c_abi::RestoreError(saved);
  }
  return p;
}

void SetBool(bool ThreadConfig::*field, bool value) {
  ThreadState& s = State();
  s.config.*field = value;
  s.config.configured = true;
}

}  // namespace

int RoutedOverride() { return State().routed; }

int SetRoutedOverride(int routed) {
  ThreadState& s = State();
  const int previous = s.routed;
  s.routed = routed < 0 ? -1 : routed == 0 ? 0 : 1;
  return previous;
}

void SetProcessTag(const char* name) { process_tag.store(name); }

const char* AllocationTag(bool* error) {
  *error = false;
  const ThreadConfig& c = State().config;
  if (!c.configured) return nullptr;
  const TagEntry* entry = Tags().Resolve(c.tag, SettingOf(c));
  if (entry == nullptr) {
    *error = true;
    return nullptr;
  }
  return entry->process ? "default" : entry->name.c_str();
}

}  // namespace vmstash::tms

using vmstash::tms::State;

extern "C" {

VMSTASH_TMS_EXPORT void tms_set_interesting_region(bool is_interesting_region) noexcept {
  vmstash::tms::SetRoutedOverride(is_interesting_region ? 1 : 0);
  State().config.configured = true;
}

VMSTASH_TMS_EXPORT bool tms_get_interesting_region(void) noexcept { return vmstash::tms::Interesting(); }

VMSTASH_TMS_EXPORT void tms_set_current_tag(const char* tag) noexcept {
  if (tag == nullptr) {
    vmstash::c_abi::Fail(absl::InvalidArgumentError("tms_set_current_tag: tag must not be NULL (kept the tag)"));
    return;
  }
  try {
    State().config.tag = tag;  // may allocate
    State().config.configured = true;
  } catch (const std::bad_alloc&) {
    vmstash::c_abi::Fail(absl::ResourceExhaustedError("tms_set_current_tag: host out of memory (kept the tag)"));
  }
}

VMSTASH_TMS_EXPORT const char* tms_get_current_tag(void) noexcept { return State().config.tag.c_str(); }

VMSTASH_TMS_EXPORT bool tms_get_enable_cpu_backup(void) noexcept { return State().config.cpu_backup; }

VMSTASH_TMS_EXPORT void tms_set_enable_cpu_backup(bool enable_cpu_backup) noexcept {
  vmstash::tms::SetBool(&vmstash::tms::ThreadConfig::cpu_backup, enable_cpu_backup);
}

VMSTASH_TMS_EXPORT const char* tms_get_cpu_backup_backend(void) noexcept {
  return vmstash::tms::SettingName(State().config.backend);
}

VMSTASH_TMS_EXPORT void tms_set_cpu_backup_backend(const char* backend) noexcept {
  vmstash::tms::Setting s;
  if (!vmstash::tms::ParseBackend(backend, &s)) {
    vmstash::c_abi::Fail(absl::InvalidArgumentError(absl::StrCat(
        "tms_set_cpu_backup_backend: '", backend != nullptr ? backend : "(null)",
        "' is not pinned or mmap (kept ", vmstash::tms::SettingName(State().config.backend), ")")));
    return;
  }
  State().config.backend = s;
  State().config.configured = true;
}

VMSTASH_TMS_EXPORT bool tms_get_enable_disk_backup(void) noexcept { return State().config.disk_backup; }

VMSTASH_TMS_EXPORT void tms_set_enable_disk_backup(bool enable_disk_backup) noexcept {
  vmstash::tms::SetBool(&vmstash::tms::ThreadConfig::disk_backup, enable_disk_backup);
}

VMSTASH_TMS_EXPORT void tms_set_disk_backup_dir(const char* dir) noexcept {
  if (dir == nullptr || dir[0] == '\0') {
    vmstash::c_abi::Fail(absl::InvalidArgumentError("tms_set_disk_backup_dir: no directory given (kept the old one)"));
    return;
  }
  std::lock_guard<std::mutex> lock(vmstash::tms::dir_mu);
  vmstash::tms::DiskDir() = dir;
}

VMSTASH_TMS_EXPORT void set_memory_margin_bytes(uint64_t value) noexcept {
  (void)vmstash_set_memory_margin(static_cast<size_t>(value));
}

VMSTASH_TMS_EXPORT void tms_set_retain_cpu_backup(bool retain_cpu_backup) noexcept {
  vmstash::tms::retain.store(retain_cpu_backup ? 1 : 0);
}

VMSTASH_TMS_EXPORT bool tms_get_retain_cpu_backup(void) noexcept { return vmstash::tms::Retain(); }

VMSTASH_TMS_EXPORT int tms_pause(const char* tag) noexcept {
  try {
    return vmstash::tms::Pause(tag, nullptr, 0);
  } catch (...) {
    return vmstash::c_abi::Fail(absl::InternalError("tms_pause: unexpected exception"));
  }
}

VMSTASH_TMS_EXPORT int tms_resume(const char* tag) noexcept {
  try {
    return vmstash::tms::Resume(tag);
  } catch (...) {
    return vmstash::c_abi::Fail(absl::InternalError("tms_resume: unexpected exception"));
  }
}

VMSTASH_TMS_EXPORT uint8_t* tms_get_cpu_backup_pointer(const uint8_t* gpu_ptr, uint64_t size) noexcept {
  const void* found = nullptr;
  vmstash::c_abi::WithRuntime([&](vmstash::Runtime& rt) {
    const auto ptr = reinterpret_cast<vmstash::DevicePtr>(gpu_ptr);
    absl::Status last = absl::NotFoundError(absl::StrCat("no backup holds ", size, " bytes at ", ptr));
    for (vmstash::CachingAllocator* a : rt.AllocatorsInUse()) {
      absl::StatusOr<const void*> at = a->BackupAddress(ptr, static_cast<std::size_t>(size));
      if (at.ok()) {
        found = *at;
        return 0;
      }
      if (absl::IsNotFound(last)) last = at.status();  // the first error that says more stays
    }
    return vmstash::c_abi::Fail(last);
  });
  return const_cast<uint8_t*>(static_cast<const uint8_t*>(found));
}

VMSTASH_TMS_EXPORT void* tms_torch_malloc(ssize_t size, int device, cudaStream_t stream) noexcept {
  if (size < 0) {
    vmstash::c_abi::Fail(absl::InvalidArgumentError("tms_torch_malloc: negative size"));
    return nullptr;
  }
  try {
    return vmstash::tms::MallocInConfiguredTag(static_cast<std::size_t>(size), device, stream);
  } catch (...) {
    vmstash::c_abi::Fail(absl::InternalError("tms_torch_malloc: unexpected exception"));
    return nullptr;
  }
}

VMSTASH_TMS_EXPORT void tms_torch_free(void* ptr, ssize_t size, int device, cudaStream_t stream) noexcept {
  vmstash_free(ptr, size < 0 ? 0 : static_cast<size_t>(size), device, stream);
}

VMSTASH_TMS_EXPORT const char* vmstash_tms_tag(const char* tms_tag, const char* setting) noexcept {
  vmstash::tms::Setting s;
  if (tms_tag == nullptr || !vmstash::tms::ParseSetting(setting, &s)) {
    vmstash::c_abi::Fail(absl::InvalidArgumentError(
        "vmstash_tms_tag: a tag and a setting (discard, pinned, mmap or disk) are required"));
    return nullptr;
  }
  try {
    const vmstash::tms::TagEntry* e = vmstash::tms::Tags().Resolve(tms_tag, s);
    return e != nullptr ? e->name.c_str() : nullptr;
  } catch (...) {
    vmstash::c_abi::Fail(absl::InternalError("vmstash_tms_tag: unexpected exception"));
    return nullptr;
  }
}

VMSTASH_TMS_EXPORT char* vmstash_tms_targets_json(const char* tms_tag) noexcept {
  try {
    vmstash::JsonWriter w;
    w.BeginArray();
    for (const vmstash::tms::TagEntry& t : vmstash::tms::Tags().Targets(tms_tag)) {
      w.BeginArray();
      w.String(t.name);
      w.String(vmstash::tms::SettingName(t.setting));
      w.EndArray();
    }
    w.EndArray();
    char* out = static_cast<char*>(std::malloc(w.str().size() + 1));
    if (out == nullptr) {
      vmstash::c_abi::Fail(absl::ResourceExhaustedError("vmstash: host out of memory"));
      return nullptr;
    }
    std::memcpy(out, w.str().c_str(), w.str().size() + 1);
    return out;
  } catch (...) {
    vmstash::c_abi::Fail(absl::InternalError("vmstash_tms_targets_json: unexpected exception"));
    return nullptr;
  }
}

VMSTASH_TMS_EXPORT int vmstash_tms_pause(const char* tms_tag, const vmstash_live_ranges* live,
                                         size_t n_live) noexcept {
  try {
    return vmstash::tms::Pause(tms_tag, live, n_live);
  } catch (...) {
    return vmstash::c_abi::Fail(absl::InternalError("vmstash_tms_pause: unexpected exception"));
  }
}

VMSTASH_TMS_EXPORT int vmstash_tms_push_region(const char* tag, int enable_cpu_backup, const char* backend,
                                               int enable_disk_backup) noexcept {
  vmstash::tms::Setting s = State().config.backend;
  if (tag == nullptr || (backend != nullptr && !vmstash::tms::ParseBackend(backend, &s))) {
    return vmstash::c_abi::Fail(absl::InvalidArgumentError(
        "vmstash_tms_push_region: a tag is required and the backend must be NULL, pinned or mmap"));
  }
  try {
    vmstash::tms::ThreadState& st = State();
    st.pushed.push_back(vmstash::tms::Saved{st.config, st.routed});
    st.config.tag = tag;
    st.config.cpu_backup = enable_cpu_backup != 0;
    st.config.backend = s;
    st.config.disk_backup = enable_disk_backup != 0;
    st.config.configured = true;
    st.routed = 1;
    return 0;
  } catch (...) {
    return vmstash::c_abi::Fail(absl::ResourceExhaustedError("vmstash_tms_push_region: host out of memory"));
  }
}

VMSTASH_TMS_EXPORT int vmstash_tms_pop_region(void) noexcept {
  vmstash::tms::ThreadState& st = State();
  if (st.pushed.empty()) {
    return vmstash::c_abi::Fail(absl::FailedPreconditionError("vmstash_tms_pop_region: no region was pushed"));
  }
  st.config = std::move(st.pushed.back().config);
  st.routed = st.pushed.back().routed;
  st.pushed.pop_back();
  return 0;
}

VMSTASH_TMS_EXPORT int vmstash_tms_set_interesting(int interesting) noexcept {
  return vmstash::tms::SetRoutedOverride(interesting);
}

}  // extern "C"
