// torch_memory_saver's C entry points on vmstash (torch_plugin/include/vmstash/vmstash_tms.h,
// which lists them and their differences): linked into libvmstash.so and
// libvmstash_preload.so with the rest of the C ABI, so the drop-in wheel's library, the
// Python layer and a preloaded process's global scope all reach one implementation.
//
// Layout:
//   level        a front on the runtime, as vmstash_c.cc is: runtime calls through
//                shim.h, never the public C functions; torch_memory_saver's variables
//                come from tms_env.h (read there, once).
//   per thread   ThreadState: torch_memory_saver's config (tag, cpu/disk backup, backend;
//                their defaults from tms_env.h's Environment), the routing
//                override (tms.h) and the regions pushed by the Python layer.
//   per process  Registry: (torch_memory_saver tag, backup setting) -> vmstash tag (Note
//                [TMS Tags] in vmstash_tms.h), entries never removed (names stay valid);
//                the disk backup directory; retain_cpu_backup; the preload library's
//                process tag.
//   transitions  tms_pause moves all of a tag's vmstash tags (every tag's, for NULL) in one
//                switch, all or nothing; tms_resume resumes them one after
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
#include "torch_plugin/include/vmstash/vmstash_tms.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "allocator/backup_arena.h"
#include "allocator/tag.h"
#include "base/status_macros.h"
#include "runtime/process.h"
#include "runtime/runtime.h"
#include "torch_plugin/c_abi/shim.h"
#include "torch_plugin/c_abi/tms.h"
#include "torch_plugin/c_abi/tms_env.h"
#include "torch_plugin/include/vmstash/vmstash.h"

#define VMSTASH_TMS_EXPORT __attribute__((visibility("default")))

namespace vmstash::tms {
namespace {

// --- Per thread ---------------------------------------------------------------------------

struct ThreadConfig {
  std::string tag = "default";
  bool cpu_backup = Env().cpu_backup;
  bool disk_backup = Env().disk_backup;
  Setting backend = Env().backend;
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

bool InRegion() { return CurrentTag() != kDefaultTag; }

bool Interesting() {
  const int routed = State().routed;
  if (routed >= 0) return routed == 1;
  return Env().whole_process || InRegion();
}

// --- Per process --------------------------------------------------------------------------

std::atomic<const char*> process_tag{nullptr};

std::mutex dir_mu;
std::string& DiskDir() {  // guarded by dir_mu
  static auto* dir = new std::string(Env().disk_dir);
  return *dir;
}
std::string CurrentDiskDir() {
  std::lock_guard<std::mutex> lock(dir_mu);
  return DiskDir();
}

std::atomic<int> retain{-1};  // -1: TMS_RETAIN_CPU_BACKUP (tms_env.h)
bool Retain() {
  const int r = retain.load();
  return r < 0 ? Env().retain : r == 1;
}

struct TagEntry {
  std::string tms_tag;
  Setting setting;
  std::string name;         // the vmstash tag
  std::string disk_dir;     // kDisk: the directory its store was last set to
  bool process = false;     // the preload library's process tag (created by it, not here)
};

// The vmstash store of a backup setting, set on `name` (disk: in `dir`, torch_memory_saver's
// directory, read at each pause: not checked here; the pause that writes there fails with
// NOT_FOUND, nothing paused, where it does not exist).
absl::Status SetStore(Runtime& rt, const std::string& name, Setting setting, const std::string& dir) {
  const BackupStore store = setting == Setting::kPinned ? BackupStore{}
                            : setting == Setting::kMmap ? BackupStore{BackupStore::Kind::kPageable, ""}
                                                        : BackupStore{BackupStore::Kind::kDiskFiles, dir};
  VMSTASH_ASSIGN_OR_RETURN(const TagId id, FindTag(name));
  return rt.SetBackupStore(id, store, /*directory_must_exist=*/false);
}

class Registry {
 public:
  // The entry of (tms_tag, setting), its vmstash tag declared on first use (a failure
  // declares nothing: a later call tries again).
  absl::StatusOr<const TagEntry*> Resolve(Runtime& rt, const std::string& tms_tag, Setting setting) {
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
    VMSTASH_ASSIGN_OR_RETURN(const TagId id, InternTag(e.name));
    VMSTASH_RETURN_IF_ERROR(rt.CreateTag(id, setting == Setting::kDiscard ? Policy::kDiscard : Policy::kBackup));
    if (setting != Setting::kDiscard) {
      if (setting == Setting::kDisk) e.disk_dir = CurrentDiskDir();
      VMSTASH_RETURN_IF_ERROR(SetStore(rt, e.name, setting, e.disk_dir));
    }
    entries_.push_back(std::move(e));
    return &entries_.back();
  }

  // The entries of `tms_tag` (nullptr: all), the process tag's with "default": pointers,
  // valid until the process ends (entries are never removed).
  std::vector<const TagEntry*> Targets(const char* tms_tag) {
    std::lock_guard<std::mutex> lock(mu_);
    AddProcessEntryLocked();
    std::vector<const TagEntry*> out;
    for (const TagEntry& e : entries_) {
      if (tms_tag == nullptr || e.tms_tag == tms_tag) out.push_back(&e);
    }
    return out;
  }

  // A disk entry's store directory, and its move to `dir` (the pause set it).
  std::string DiskDirOf(const TagEntry& e) {
    std::lock_guard<std::mutex> lock(mu_);
    return e.disk_dir;
  }
  void NoteDiskDir(const TagEntry& e, const std::string& dir) {
    std::lock_guard<std::mutex> lock(mu_);
    for (TagEntry& x : entries_) {
      if (&x == &e) x.disk_dir = dir;
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
    // The preload library made it and set its store from the same environment.
    entries_.push_front(TagEntry{"default", Env().DefaultSetting(), process, Env().disk_dir, true});
  }

  std::mutex mu_;
  std::deque<TagEntry> entries_;  // a deque: pointers to entries stay valid
  bool has_process_ = false;
};

Registry& Tags() {
  static auto* registry = new Registry;  // leaked: used until the process ends
  return *registry;
}

// Resolve inside a Call: the entry, or nullptr with the error recorded.
const TagEntry* ResolveEntry(const std::string& tms_tag, Setting setting) {
  const TagEntry* entry = nullptr;
  c_abi::WithRuntime([&](Runtime& rt) {
    absl::StatusOr<const TagEntry*> e = Tags().Resolve(rt, tms_tag, setting);
    if (!e.ok()) return c_abi::Fail(e.status());
    entry = *e;
    return 0;
  });
  return entry;
}

// --- Transitions --------------------------------------------------------------------------

absl::Status SetRetention(Runtime& rt, const std::string& name, bool keep_after_resume) {
  VMSTASH_ASSIGN_OR_RETURN(const TagId id, FindTag(name));
  // retain_cpu_backup off: the pinned memory goes back to the OS after each resume.
  return rt.SetBackupRetention(id, BackupRetention{keep_after_resume, true, !keep_after_resume});
}

// A backup tag about to pause: its disk store follows the present directory (SetStore),
// its backup goes with its blocks (Note [Retained Backups]). A tag paused already refuses
// a new store: its pause is a no-op.
absl::Status BeforePause(Runtime& rt, const TagEntry& t) {
  if (t.setting == Setting::kDiscard) return absl::OkStatus();
  if (t.setting == Setting::kDisk) {
    const std::string dir = CurrentDiskDir();
    if (dir != Tags().DiskDirOf(t)) {
      absl::Status s = SetStore(rt, t.name, t.setting, dir);
      if (s.ok()) Tags().NoteDiskDir(t, dir);
      if (!s.ok() && !absl::IsFailedPrecondition(s)) return s;  // paused already: the pause is a no-op
    }
  }
  return SetRetention(rt, t.name, Retain());
}

// The entries of `tms_tag` (nullptr: all) whose vmstash tags exist, with their ids: the
// process tag exists only once it has allocated.
std::vector<std::pair<const TagEntry*, TagId>> ExistingTargets(Runtime& rt, const char* tms_tag) {
  std::vector<std::pair<const TagEntry*, TagId>> out;
  for (const TagEntry* t : Tags().Targets(tms_tag)) {
    absl::StatusOr<TagId> id = FindTag(t->name);
    if (id.ok() && rt.TagPolicy(*id).has_value()) out.emplace_back(t, *id);
  }
  return out;
}

// A pause of several tags moves them in one switch: all or nothing without a rollback
// that could itself fail (a switch keeps the outgoing chunks until it commits; pausing the
// tags one by one released each tag's memory at once, so undoing them after a later tag's
// failure had to create it again, and another process may have taken it). A pause of one
// tag goes through vmstash's pause. A resume moves the tags one after another, each
// through its own resume (faster than one switch, which maps every incoming piece before
// its first copy), and stops at the first that fails, its error naming the tags resumed
// before it: pausing those again is not safe (another thread may have used them meanwhile,
// or paused them on one device itself). The measurements behind both choices, and why a
// resume right after a multi-tag pause runs slower (the driver's work after a release):
// bench/HISTORY.md, "torch_memory_saver's pause and resume of several tags". An entry of
// `live` applies to the vmstash tag its `tag` names (others are not ours: skipped).
absl::Status Pause(Runtime& rt, const char* tms_tag, const vmstash_live_ranges* live, std::size_t n_live) {
  if (live == nullptr && n_live > 0) {
    return absl::InvalidArgumentError("tms pause: NULL liveness hints with n_live > 0");
  }
  std::vector<TagId> ids;
  std::vector<const std::string*> names;
  for (const auto& [t, id] : ExistingTargets(rt, tms_tag)) {
    // Two torch_memory_saver tags may resolve to one vmstash tag ("kv" pinned after a
    // discard "kv" is "kv:pinned", as is a tag named "kv:pinned"): it moves once.
    if (std::find(ids.begin(), ids.end(), id) != ids.end()) continue;
    VMSTASH_RETURN_IF_ERROR(BeforePause(rt, *t));  // nothing paused yet
    ids.push_back(id);
    names.push_back(&t->name);
  }
  if (ids.empty()) return absl::OkStatus();
  Runtime::LiveRangesByDevice ranges;
  for (std::size_t i = 0; i < n_live; ++i) {
    for (std::size_t k = 0; k < ids.size(); ++k) {
      if (live[i].tag == nullptr || *names[k] != live[i].tag) continue;
      if (live[i].device < 0 || live[i].device >= rt.device_count()) {
        return absl::InvalidArgumentError(absl::StrCat("tms pause: liveness hints ", i, " name device ",
                                                       live[i].device, ", not a device of this process; nothing "
                                                       "was paused"));
      }
      VMSTASH_RETURN_IF_ERROR(c_abi::AddLiveEntry(live[i], ids[k], "tms pause", &ranges));
    }
  }
  absl::StatusOr<bool> changed = ids.size() == 1
                                     ? rt.Pause(ids[0], Runtime::kAllDevices, ranges)
                                     : rt.Switch(ids, {}, Runtime::kAllDevices, ranges.empty() ? nullptr : &ranges);
  return changed.status();  // every tag paused already: torch_memory_saver's no-op
}

absl::Status Resume(Runtime& rt, const char* tms_tag) {
  const bool keep = Retain();
  std::vector<std::string> resumed;
  absl::Status hook_failed;  // the first tag resumed whose after-resume hook failed
  for (const auto& [t, id] : ExistingTargets(rt, tms_tag)) {
    const absl::Status retention = t->setting == Setting::kDiscard ? absl::OkStatus() : SetRetention(rt, t->name, keep);
    absl::StatusOr<bool> changed = retention.ok() ? rt.Resume(id, Runtime::kAllDevices) : retention;
    if (changed.ok() && !*changed) continue;  // not paused
    if (!changed.ok() && Runtime::TransitionDone(changed.status())) {  // resumed all the same: go on, report it
      if (hook_failed.ok()) hook_failed = changed.status();
    } else if (!changed.ok()) {
      if (resumed.empty()) return changed.status();
      return absl::Status(changed.status().code(),
                          absl::StrCat(changed.status().message(), " (tms resume: resumed before it: '",
                                       absl::StrJoin(resumed, "', '"), "'; the others stay paused)"));
    }
    resumed.push_back(t->name);
  }
  return hook_failed;
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
  TagId id = CurrentTag();
  if (tag != nullptr) {
    absl::StatusOr<TagId> found = FindTag(tag);
    if (!found.ok()) {
      c_abi::Fail(found.status());
      return nullptr;
    }
    id = *found;
  }
  return c_abi::MallocIn(size, device, stream, id);
}

// fn(Runtime&) -> absl::Status as a code, on a runtime that is there: before the runtime
// is made, or after vmstash_shutdown, no vmstash tag exists, so a torch_memory_saver pause
// or resume has nothing to move and does not make one (0).
template <typename Fn>
int OnExistingRuntime(Fn fn) noexcept {
  return c_abi::Guard([&](process::Call& call) {
    Runtime* rt = call.runtime_if_initialized();
    return rt == nullptr ? 0 : c_abi::Code(fn(*rt));
  });
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
  const TagEntry* entry = ResolveEntry(c.tag, SettingOf(c));
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
  vmstash::c_abi::WithRuntime([&](vmstash::Runtime& rt) {
    rt.SetMemoryMargin(static_cast<std::size_t>(value));
    return 0;
  });
}

VMSTASH_TMS_EXPORT void tms_set_retain_cpu_backup(bool retain_cpu_backup) noexcept {
  vmstash::tms::retain.store(retain_cpu_backup ? 1 : 0);
}

VMSTASH_TMS_EXPORT bool tms_get_retain_cpu_backup(void) noexcept { return vmstash::tms::Retain(); }

VMSTASH_TMS_EXPORT int tms_pause(const char* tag) noexcept {
  return vmstash::tms::OnExistingRuntime(
      [&](vmstash::Runtime& rt) { return vmstash::tms::Pause(rt, tag, nullptr, 0); });
}

VMSTASH_TMS_EXPORT int tms_resume(const char* tag) noexcept {
  return vmstash::tms::OnExistingRuntime([&](vmstash::Runtime& rt) { return vmstash::tms::Resume(rt, tag); });
}

VMSTASH_TMS_EXPORT uint8_t* tms_get_cpu_backup_pointer(const uint8_t* gpu_ptr, uint64_t size) noexcept {
  const void* found = nullptr;
  vmstash::c_abi::WithRuntime([&](vmstash::Runtime& rt) {
    return vmstash::c_abi::WithBackupOf(rt, -1, [&](vmstash::CachingAllocator* a) -> absl::Status {
      absl::StatusOr<const void*> at =
          a->BackupAddress(reinterpret_cast<vmstash::DevicePtr>(gpu_ptr), static_cast<std::size_t>(size));
      if (at.ok()) found = *at;
      return at.status();
    });
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
  (void)size;
  (void)stream;  // the block's own stream orders its reuse (vmstash_free)
  if (ptr == nullptr) return;
  vmstash::c_abi::WithRuntime([&](vmstash::Runtime& rt) { return vmstash::c_abi::Free(rt, ptr, device); });
}

VMSTASH_TMS_EXPORT const char* vmstash_tms_tag(const char* tms_tag, const char* setting) noexcept {
  vmstash::tms::Setting s;
  if (tms_tag == nullptr || !vmstash::tms::ParseSetting(setting, &s)) {
    vmstash::c_abi::Fail(absl::InvalidArgumentError(
        "vmstash_tms_tag: a tag and a setting (discard, pinned, mmap or disk) are required"));
    return nullptr;
  }
  try {
    const vmstash::tms::TagEntry* e = vmstash::tms::ResolveEntry(tms_tag, s);
    return e != nullptr ? e->name.c_str() : nullptr;
  } catch (...) {
    vmstash::c_abi::Fail(absl::InternalError("vmstash_tms_tag: unexpected exception"));
    return nullptr;
  }
}

VMSTASH_TMS_EXPORT int vmstash_tms_targets(const char* tms_tag, const char** names, size_t capacity,
                                           size_t* count) noexcept {
  if (count == nullptr || (names == nullptr && capacity > 0)) {
    return vmstash::c_abi::Fail(
        absl::InvalidArgumentError("vmstash_tms_targets: NULL count, or NULL names with capacity > 0"));
  }
  try {
    const std::vector<const vmstash::tms::TagEntry*> targets = vmstash::tms::Tags().Targets(tms_tag);
    *count = targets.size();
    for (size_t i = 0; i < targets.size() && i < capacity; ++i) names[i] = targets[i]->name.c_str();
    return 0;
  } catch (...) {
    return vmstash::c_abi::Fail(absl::ResourceExhaustedError("vmstash_tms_targets: host out of memory"));
  }
}

VMSTASH_TMS_EXPORT int vmstash_tms_check_env(void) noexcept {
  const std::string& error = vmstash::tms::Env().backend_error;
  return error.empty() ? 0 : vmstash::c_abi::Fail(absl::InvalidArgumentError(error));
}

VMSTASH_TMS_EXPORT int vmstash_tms_whole_process(void) noexcept { return vmstash::tms::Env().whole_process ? 1 : 0; }

VMSTASH_TMS_EXPORT const char* vmstash_tms_process_tag(void) noexcept { return vmstash::tms::process_tag.load(); }

VMSTASH_TMS_EXPORT int vmstash_tms_pause(const char* tms_tag, const vmstash_live_ranges* live,
                                         size_t n_live) noexcept {
  if (live == nullptr && n_live > 0) {  // refused with or without a runtime
    return vmstash::c_abi::Fail(absl::InvalidArgumentError("tms pause: NULL liveness hints with n_live > 0"));
  }
  return vmstash::tms::OnExistingRuntime(
      [&](vmstash::Runtime& rt) { return vmstash::tms::Pause(rt, tms_tag, live, n_live); });
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
