// The C ABI (torch_plugin/include/vmstash/vmstash.h): thin extern "C" shims over the
// process runtime (runtime/process.h, runtime/runtime.h). Each entry point converts its
// arguments (C strings to tags, cudaStream_t to Stream, pointers to DevicePtr), runs the
// runtime call inside a process Call (shim.h: Note [Shutdown] in process.h), and turns the
// result into a code or NULL with the message in vmstash_last_error().
//
// Fast path: vmstash_malloc/vmstash_free read the device's allocator lock-free
// (Runtime::AllocatorInUse) inside the Call's two plain stores.
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <tuple>
#include <vector>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "allocator/tag.h"
#include "base/json_writer.h"
#include "base/log.h"
#include "base/version.h"
#include "runtime/process.h"
#include "runtime/runtime.h"
#include "torch_plugin/c_abi/shim.h"
#include "torch_plugin/include/vmstash/vmstash.h"

namespace vmstash {
namespace c_abi {

thread_local std::string last_error;
thread_local int last_error_code = VMSTASH_OK;
thread_local bool last_error_done = false;

// Note [Status Codes] (vmstash.h): Fail returns status.code() as it is, so the C table
// must hold every absl::StatusCode under its number (c_abi_test checks each name too).
#define VMSTASH_COUNT_CODE(name, number) +1
static_assert(0 VMSTASH_STATUS_CODES(VMSTASH_COUNT_CODE) == static_cast<int>(absl::StatusCode::kUnauthenticated) + 1,
              "vmstash.h's VMSTASH_STATUS_CODES lists every absl::StatusCode");
#undef VMSTASH_COUNT_CODE
static_assert(VMSTASH_OK == static_cast<int>(absl::StatusCode::kOk) &&
                  VMSTASH_ABORTED == static_cast<int>(absl::StatusCode::kAborted) &&
                  VMSTASH_UNAUTHENTICATED == static_cast<int>(absl::StatusCode::kUnauthenticated),
              "the C codes are the absl::StatusCode numbers");

int Fail(const absl::Status& status) {
  // The code's name and the message: a status's payloads are marks for code, not text.
  last_error = absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message());
  last_error_code = static_cast<int>(status.code());
  last_error_done = Runtime::TransitionDone(status);
  return last_error_code;
}

SavedError SaveError() { return SavedError{last_error, last_error_code, last_error_done}; }

absl::Status SavedError::ToStatus() const {
  const auto status_code = static_cast<absl::StatusCode>(code);
  absl::string_view text = message;
  absl::ConsumePrefix(&text, absl::StrCat(absl::StatusCodeToString(status_code), ": "));  // Fail's format
  return absl::Status(status_code, text);
}

int RestoreError(const SavedError& saved) {
  last_error = saved.message;
  last_error_code = saved.code;
  last_error_done = saved.done;
  return saved.code;
}

namespace {

static_assert(VMSTASH_TAG_SLOTS == TagRegistry::kSlots, "the C header's slot count is the registry's");
static_assert(VMSTASH_NOOP < 0, "VMSTASH_NOOP is not an absl::StatusCode");

// A tag argument that may name a tag not created yet (create, current tag, slot, hooks):
// interned on first use.
absl::StatusOr<TagId> TagArg(const char* tag) {
  if (tag == nullptr) return absl::InvalidArgumentError("tag must not be NULL");
  return InternTag(tag);
}

// A tag argument that must name an existing tag (transitions, backups, stores, caches):
// looked up, never interned, so that unknown names cannot fill the tag table; a name
// never created is NotFound.
absl::StatusOr<TagId> ExistingTagArg(const char* tag) {
  if (tag == nullptr) return absl::InvalidArgumentError("tag must not be NULL");
  return FindTag(tag);
}

Stream StreamArg(cudaStream_t stream) { return reinterpret_cast<Stream>(stream); }


// A JSON document of the runtime as a malloc'ed string, or NULL with the error recorded.
template <typename Fn>
char* JsonCall(Fn fn) noexcept {
  char* out = nullptr;
  WithRuntime([&](Runtime& rt) {
    absl::StatusOr<std::string> json = fn(rt);
    if (!json.ok()) return Fail(json.status());
    out = CopyOut(*json);
    return out != nullptr ? 0 : Fail(absl::ResourceExhaustedError("vmstash: host out of memory"));
  });
  return out;
}


int Transition(const char* tag, int device, bool pause, const CachingAllocator::LiveRanges* live) noexcept {
  return WithRuntime([&](Runtime& rt) {
    absl::StatusOr<TagId> id = ExistingTagArg(tag);
    if (!id.ok()) return Fail(id.status());
    return TransitionCode(pause ? rt.Pause(*id, device, live) : rt.Resume(*id, device));
  });
}




template <int kSlot>
void* SlotMalloc(std::size_t size, int device, cudaStream_t stream) noexcept {
  void* out = nullptr;
  WithRuntime([&](Runtime& rt) {
    const TagId tag = rt.SlotTag(kSlot);
    if (tag < 0) {
      return Fail(absl::FailedPreconditionError(absl::StrCat("vmstash_malloc_slot", kSlot, " is not bound to a tag")));
    }
    return Allocate(rt, size, device, stream, tag, &out);
  });
  return out;
}

// The hook adapters: a C function pointer and its user pointer as a TransitionHook.
CachingAllocator::TransitionHook Adapt(vmstash_hook_fn fn, void* user, const char* which) {
  if (fn == nullptr) return nullptr;
  return [fn, user, which](TagId tag, int device) {
    const int code = fn(TagName(tag).data(), device, user);
    return code == 0 ? absl::OkStatus() : absl::AbortedError(absl::StrCat(which, " hook returned ", code));
  };
}


// A switch request's C arguments, checked and parsed.
struct SwitchArgs {
  std::vector<TagId> pause, resume;
  Runtime::LiveRangesByDevice ranges;
};

absl::Status ParseSwitch(const char* const* pause_tags, size_t n_pause, const char* const* resume_tags,
                         size_t n_resume, const vmstash_live_ranges* live, size_t n_live, const char* what,
                         SwitchArgs* args) {
  if ((n_pause != 0 && pause_tags == nullptr) || (n_resume != 0 && resume_tags == nullptr) ||
      (n_live != 0 && live == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": a NULL array with a nonzero count"));
  }
  for (auto [tags, n, out] :
       {std::tuple{pause_tags, n_pause, &args->pause}, std::tuple{resume_tags, n_resume, &args->resume}}) {
    for (size_t i = 0; i < n; ++i) {
      absl::StatusOr<TagId> id = ExistingTagArg(tags[i]);
      if (!id.ok()) return id.status();
      out->push_back(*id);
    }
  }
  for (size_t i = 0; i < n_live; ++i) {
    absl::StatusOr<TagId> id = ExistingTagArg(live[i].tag);
    if (!id.ok()) return id.status();
    if (absl::Status s = AddLiveEntry(live[i], *id, what, &args->ranges); !s.ok()) return s;
  }
  return absl::OkStatus();
}


}  // namespace

// The helpers both fronts use (shim.h says what each does).
int TransitionCode(const absl::StatusOr<bool>& changed) {
  if (!changed.ok()) return Fail(changed.status());
  return *changed ? VMSTASH_OK : VMSTASH_NOOP;
}

int AllocatorFor(Runtime& rt, int device, CachingAllocator** out) {
  *out = rt.AllocatorInUse(device);
  if (*out != nullptr) return 0;
  absl::StatusOr<CachingAllocator*> made = rt.Allocator(device);
  if (!made.ok()) return Fail(made.status());
  *out = *made;
  return 0;
}

int Allocate(Runtime& rt, std::size_t size, int device, cudaStream_t stream, TagId tag, void** out) {
  CachingAllocator* a = nullptr;
  if (const int code = AllocatorFor(rt, device, &a); code != 0) return code;
  absl::StatusOr<DevicePtr> p = a->Allocate(size, StreamArg(stream), tag);
  if (!p.ok()) return Fail(p.status());
  *out = reinterpret_cast<void*>(*p);
  return 0;
}

void* MallocIn(std::size_t size, int device, cudaStream_t stream, TagId tag) noexcept {
  void* out = nullptr;
  WithRuntime([&](Runtime& rt) { return Allocate(rt, size, device, stream, tag, &out); });
  return out;
}

absl::Status AddLiveEntry(const vmstash_live_ranges& l, TagId id, const char* what,
                          Runtime::LiveRangesByDevice* out) {
  if (l.n != 0 && (l.starts == nullptr || l.sizes == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": live ranges with NULL arrays and n > 0"));
  }
  CachingAllocator::LiveRanges& r = (*out)[l.device][id];
  for (size_t k = 0; k < l.n; ++k) r.emplace_back(l.starts[k], l.sizes[k]);
  return absl::OkStatus();
}

int WithBackupOf(Runtime& rt, int device, const std::function<absl::Status(CachingAllocator*)>& read) {
  if (device >= 0) {
    CachingAllocator* a = nullptr;
    if (const int code = AllocatorFor(rt, device, &a); code != 0) return code;
    return Code(read(a));
  }
  absl::Status last = absl::NotFoundError("no device's allocator is in use");
  for (CachingAllocator* a : rt.AllocatorsInUse()) {
    last = read(a);
    if (!absl::IsNotFound(last)) return Code(last);
  }
  return Fail(last);
}

int Free(Runtime& rt, void* ptr, int device) {
  CachingAllocator* a = nullptr;
  if (const int code = AllocatorFor(rt, device, &a); code != 0) return code;
  absl::Status s = a->Free(reinterpret_cast<DevicePtr>(ptr));
  if (!s.ok()) VMSTASH_LOG(kError, "vmstash_free: {}", s.ToString());
  return Code(s);
}

char* CopyOut(const std::string& text) {
  char* out = static_cast<char*>(std::malloc(text.size() + 1));
  if (out != nullptr) std::memcpy(out, text.c_str(), text.size() + 1);
  return out;
}

}  // namespace c_abi
}  // namespace vmstash

using namespace vmstash;         // NOLINT: the C entry points below are thin
using namespace vmstash::c_abi;  // NOLINT

extern "C" {

int vmstash_init(const char* options) noexcept {
  try {
    return Code(process::Init(options));
  } catch (...) {
    return Fail(absl::InternalError("vmstash_init: unexpected exception"));
  }
}

int vmstash_is_initialized(void) noexcept { return process::Initialized() ? 1 : 0; }

int vmstash_shutdown(void) noexcept {
  try {
    return Code(process::Shutdown());
  } catch (...) {
    return Fail(absl::InternalError("vmstash_shutdown: unexpected exception"));
  }
}

const char* vmstash_version(void) noexcept { return kVersion; }

void* vmstash_malloc(size_t size, int device, cudaStream_t stream) noexcept {
  return MallocIn(size, device, stream, CurrentTag());
}

#define VMSTASH_SLOT(s) \
  void* vmstash_malloc_slot##s(size_t size, int device, cudaStream_t stream) noexcept { \
    return SlotMalloc<s>(size, device, stream);                                       \
  }
VMSTASH_SLOT(0) VMSTASH_SLOT(1) VMSTASH_SLOT(2) VMSTASH_SLOT(3) VMSTASH_SLOT(4) VMSTASH_SLOT(5) VMSTASH_SLOT(6)
VMSTASH_SLOT(7) VMSTASH_SLOT(8) VMSTASH_SLOT(9) VMSTASH_SLOT(10) VMSTASH_SLOT(11) VMSTASH_SLOT(12) VMSTASH_SLOT(13)
VMSTASH_SLOT(14) VMSTASH_SLOT(15) VMSTASH_SLOT(16) VMSTASH_SLOT(17) VMSTASH_SLOT(18) VMSTASH_SLOT(19)
VMSTASH_SLOT(20) VMSTASH_SLOT(21) VMSTASH_SLOT(22) VMSTASH_SLOT(23) VMSTASH_SLOT(24) VMSTASH_SLOT(25)
VMSTASH_SLOT(26) VMSTASH_SLOT(27) VMSTASH_SLOT(28) VMSTASH_SLOT(29) VMSTASH_SLOT(30) VMSTASH_SLOT(31)
#undef VMSTASH_SLOT
static_assert(VMSTASH_TAG_SLOTS == 32, "one VMSTASH_SLOT line per slot");

int vmstash_bind_tag_slot(const char* tag) noexcept {
  int slot = -1;
  WithRuntime([&](Runtime& rt) {
    absl::StatusOr<TagId> id = TagArg(tag);
    if (!id.ok()) return Fail(id.status());
    absl::StatusOr<int> s = rt.BindSlot(*id);
    if (!s.ok()) return Fail(s.status());
    slot = *s;
    return 0;
  });
  return slot;
}

void vmstash_free(void* ptr, size_t size, int device, cudaStream_t stream) noexcept {
  (void)size;
  (void)stream;  // the block's own stream orders its reuse; see Note [Stream-Ordered Reuse]
  if (ptr == nullptr) return;
  WithRuntime([&](Runtime& rt) { return Free(rt, ptr, device); });
}

int vmstash_owner_device(const void* ptr) noexcept {
  if (ptr == nullptr) return -1;
  int owner = -1;
  Guard([&](process::Call& call) {
    if (Runtime* rt = call.runtime_if_initialized()) owner = rt->OwnerDevice(reinterpret_cast<DevicePtr>(ptr));
    return 0;
  });
  return owner;
}

int vmstash_record_stream(void* ptr, int device, cudaStream_t stream) noexcept {
  return WithRuntime([&](Runtime& rt) {
    CachingAllocator* a = nullptr;
    if (const int code = AllocatorFor(rt, device, &a); code != 0) return code;
    return Code(a->RecordStream(reinterpret_cast<DevicePtr>(ptr), StreamArg(stream)));
  });
}

int vmstash_create_tag(const char* tag, const char* policy) noexcept {
  return WithRuntime([&](Runtime& rt) {
    if (tag == nullptr || policy == nullptr) return Fail(absl::InvalidArgumentError("tag and policy must not be NULL"));
    absl::StatusOr<TagId> id = InternTag(tag);
    if (!id.ok()) return Fail(id.status());
    absl::StatusOr<Policy> p = ParsePolicy(policy);
    if (!p.ok()) return Fail(p.status());
    return Code(rt.CreateTag(*id, *p));
  });
}

const char* vmstash_tag_policy(const char* tag) noexcept {
  const char* out = nullptr;
  WithRuntime([&](Runtime& rt) {
    absl::StatusOr<TagId> id = ExistingTagArg(tag);
    if (!id.ok()) return Fail(id.status());
    std::optional<Policy> p = rt.TagPolicy(*id);
    if (!p) return Fail(absl::NotFoundError(absl::StrCat("tag '", tag, "' was never declared")));
    out = PolicyName(*p).data();  // string literals
    return 0;
  });
  return out;
}

char* vmstash_tags_json(void) noexcept {
  return JsonCall([](Runtime& rt) -> absl::StatusOr<std::string> {
    JsonWriter w;
    w.BeginObject();
    for (const auto& [tag, policy] : rt.Tags()) w.Field(TagName(tag), PolicyName(policy));
    w.EndObject();
    return w.str();
  });
}

int vmstash_set_current_tag(const char* tag) noexcept {
  return Guard([&](process::Call&) {
    absl::StatusOr<TagId> id = TagArg(tag);
    if (!id.ok()) return Fail(id.status());
    SetCurrentTag(*id);
    return 0;
  });
}

const char* vmstash_get_current_tag(void) noexcept { return TagName(CurrentTag()).data(); }

int vmstash_pause(const char* tag, int device) noexcept { return Transition(tag, device, true, nullptr); }

// Deprecated (vmstash.h): one hint, for `device` or (-1) for every device.
int vmstash_pause_live(const char* tag, int device, const uint64_t* starts, const uint64_t* sizes,
                       size_t n) noexcept {
  if (n != 0 && (starts == nullptr || sizes == nullptr)) {
    return Fail(absl::InvalidArgumentError("vmstash_pause_live: NULL range arrays with n > 0"));
  }
  try {
    CachingAllocator::LiveRanges ranges;
    ranges.reserve(n);
    for (size_t i = 0; i < n; ++i) ranges.emplace_back(starts[i], sizes[i]);
    return Transition(tag, device, true, &ranges);
  } catch (const std::bad_alloc&) {
    return Fail(absl::ResourceExhaustedError("vmstash: host out of memory"));
  }
}

int vmstash_resume(const char* tag, int device) noexcept { return Transition(tag, device, false, nullptr); }


int vmstash_switch(const char* const* pause_tags, size_t n_pause, const char* const* resume_tags, size_t n_resume,
                   int device, const vmstash_live_ranges* live, size_t n_live) noexcept {
  try {
    SwitchArgs args;
    absl::Status parsed = ParseSwitch(pause_tags, n_pause, resume_tags, n_resume, live, n_live, "vmstash_switch", &args);
    if (!parsed.ok()) return Fail(parsed);
    return WithRuntime([&](Runtime& rt) {
      return TransitionCode(rt.Switch(args.pause, args.resume, device, n_live == 0 ? nullptr : &args.ranges));
    });
  } catch (const std::bad_alloc&) {
    return Fail(absl::ResourceExhaustedError("vmstash: host out of memory"));
  }
}

int vmstash_switch_agreed(const char* const* pause_tags, size_t n_pause, const char* const* resume_tags,
                          size_t n_resume, int device, const vmstash_live_ranges* live, size_t n_live,
                          vmstash_agree_fn agree, void* ctx) noexcept {
  if (agree == nullptr) return Fail(absl::InvalidArgumentError("vmstash_switch_agreed: a NULL agreement"));
  // Note [Agreed Switch]: the agreement hears this process's outcome exactly once.
  bool called = false;
  const CachingAllocator::SwitchAgree agreement = [agree, ctx, &called](const absl::Status& local) {
    called = true;
    char reason[1024] = {0};
    const std::string message(local.message());
    if (agree(ctx, static_cast<int>(local.code()), message.c_str(), reason, sizeof reason) == 0) {
      return absl::OkStatus();
    }
    reason[sizeof reason - 1] = 0;
    return absl::AbortedError(reason[0] != 0 ? reason : "the agreement said no");
  };
  int rc = 0;
  try {
    SwitchArgs args;
    absl::Status parsed =
        ParseSwitch(pause_tags, n_pause, resume_tags, n_resume, live, n_live, "vmstash_switch_agreed", &args);
    rc = !parsed.ok() ? Fail(parsed) : WithRuntime([&](Runtime& rt) {
      return TransitionCode(
          rt.AgreedSwitch(args.pause, args.resume, device, n_live == 0 ? nullptr : &args.ranges, agreement));
    });
  } catch (const std::bad_alloc&) {
    rc = Fail(absl::ResourceExhaustedError("vmstash: host out of memory"));
  }
  // Refused before the runtime (bad arguments, no runtime, no memory): still one answer.
  if (!called) (void)agreement(absl::Status(static_cast<absl::StatusCode>(rc), vmstash_last_error()));
  return rc;
}

int vmstash_read_backup(const void* ptr, size_t size, int device, void* dst) noexcept {
  return WithRuntime([&](Runtime& rt) {
    return WithBackupOf(rt, device, [&](CachingAllocator* a) {
      return a->ReadBackup(reinterpret_cast<DevicePtr>(ptr), size, dst);
    });
  });
}

int vmstash_backup_address(const void* ptr, size_t size, int device, const void** address) noexcept {
  if (address == nullptr) return Fail(absl::InvalidArgumentError("vmstash_backup_address: null output"));
  *address = nullptr;
  return WithRuntime([&](Runtime& rt) {
    return WithBackupOf(rt, device, [&](CachingAllocator* a) -> absl::Status {
      absl::StatusOr<const void*> found = a->BackupAddress(reinterpret_cast<DevicePtr>(ptr), size);
      if (found.ok()) *address = *found;
      return found.status();
    });
  });
}

int vmstash_set_memory_margin(size_t bytes) noexcept {
  return WithRuntime([&](Runtime& rt) {
    rt.SetMemoryMargin(bytes);
    return 0;
  });
}

int vmstash_prepare(const char* tag, int device, size_t bytes) noexcept {
  return WithRuntime([&](Runtime& rt) {
    absl::StatusOr<TagId> id = ExistingTagArg(tag);
    if (!id.ok()) return Fail(id.status());
    return Code(rt.Prepare(*id, device, bytes));
  });
}

int vmstash_release_backup(const char* tag, int device) noexcept {
  return WithRuntime([&](Runtime& rt) {
    absl::StatusOr<TagId> id = ExistingTagArg(tag);
    if (!id.ok()) return Fail(id.status());
    return Code(rt.ReleaseBackup(*id, device));
  });
}

int vmstash_set_backup_store(const char* tag, const char* store, const char* directory) noexcept {
  return WithRuntime([&](Runtime& rt) {
    absl::StatusOr<TagId> id = ExistingTagArg(tag);
    if (!id.ok()) return Fail(id.status());
    if (store == nullptr) return Fail(absl::InvalidArgumentError("vmstash_set_backup_store: NULL store"));
    absl::StatusOr<BackupStore::Kind> kind = ParseBackupStoreKind(store);
    if (!kind.ok()) return Fail(kind.status());
    return Code(rt.SetBackupStore(*id, BackupStore{*kind, directory != nullptr ? directory : ""}));
  });
}

int vmstash_set_prepare_ahead(const char* tag, int ahead) noexcept {
  return WithRuntime([&](Runtime& rt) {
    absl::StatusOr<TagId> id = ExistingTagArg(tag);
    if (!id.ok()) return Fail(id.status());
    return Code(rt.SetPrepareAhead(*id, ahead != 0));
  });
}

char* vmstash_backup_store(const char* tag) noexcept {
  return JsonCall([&](Runtime& rt) -> absl::StatusOr<std::string> {
    absl::StatusOr<TagId> id = ExistingTagArg(tag);
    if (!id.ok()) return id.status();
    return DescribeBackupStore(rt.TagBackupStore(*id));
  });
}

int vmstash_register_hooks(const char* tag, vmstash_hook_fn before_pause, vmstash_hook_fn after_resume,
                           void* user) noexcept {
  return WithRuntime([&](Runtime& rt) {
    absl::StatusOr<TagId> id = TagArg(tag);
    if (!id.ok()) return Fail(id.status());
    return Code(rt.AddHooks(*id, Adapt(before_pause, user, "before-pause"), Adapt(after_resume, user, "after-resume")));
  });
}

int vmstash_empty_cache(int device, const char* tag) noexcept {
  return WithRuntime([&](Runtime& rt) {
    std::optional<TagId> id;
    if (tag != nullptr) {
      absl::StatusOr<TagId> t = FindTag(tag);
      if (!t.ok()) return Fail(t.status());
      id = *t;
    }
    return Code(rt.EmptyCache(device, id));
  });
}

char* vmstash_stats_json(int device) noexcept {
  return JsonCall([device](Runtime& rt) { return rt.StatsJson(device); });
}
char* vmstash_snapshot_json(int device) noexcept {
  return JsonCall([device](Runtime& rt) { return rt.SnapshotJson(device); });
}
void vmstash_string_free(char* s) noexcept { std::free(s); }
const char* vmstash_last_error(void) noexcept { return last_error.c_str(); }
int vmstash_last_error_code(void) noexcept { return last_error_code; }
const char* vmstash_code_name(int code) noexcept {
  switch (code) {
#define VMSTASH_CODE_CASE(name, number) \
  case number:                          \
    return #name;
    VMSTASH_STATUS_CODES(VMSTASH_CODE_CASE)
#undef VMSTASH_CODE_CASE
    default:
      return nullptr;
  }
}
int vmstash_last_error_done(void) noexcept { return last_error_done ? 1 : 0; }

}  // extern "C"

// The hinted pause (vmstash.h, Note [Liveness Hints]): every device's own hint in one
// Runtime call, all or nothing across devices (runtime.h, Note [All-or-Nothing
// Transitions]), where one call per device would leave the first devices paused when a
// later one fails. Every entry is checked before anything is paused.
namespace {
// The device of entry `i` of vmstash_pause_live_devices's `live` (vmstash.h): a device of
// this process, not named by an earlier entry, and the paused `device` unless that is -1.
absl::Status CheckLiveEntryDevice(const Runtime& rt, int device, const vmstash_live_ranges* live, size_t i) {
  const int d = live[i].device;
  if (d < 0 || d >= rt.device_count()) {
    return absl::InvalidArgumentError(absl::StrCat("vmstash_pause_live_devices: entry ", i, " names device ", d,
                                                   ", not a device of this process (0..", rt.device_count() - 1,
                                                   "); nothing was paused"));
  }
  if (device != Runtime::kAllDevices && d != device) {
    return absl::InvalidArgumentError(absl::StrCat("vmstash_pause_live_devices: entry ", i, " names device ", d,
                                                   ", not the paused device ", device, "; nothing was paused"));
  }
  for (size_t j = 0; j < i; ++j) {
    if (live[j].device == d) {
      return absl::InvalidArgumentError(absl::StrCat("vmstash_pause_live_devices: entry ", i, " names device ", d,
                                                     " again (as entry ", j, " does); nothing was paused"));
    }
  }
  return absl::OkStatus();
}
}  // namespace

extern "C" int vmstash_pause_live_devices(const char* tag, int device, const vmstash_live_ranges* live,
                                          size_t n_live) noexcept {
  if (tag == nullptr) return Fail(absl::InvalidArgumentError("vmstash_pause_live_devices: a NULL tag"));
  if (n_live != 0 && live == nullptr) {
    return Fail(absl::InvalidArgumentError("vmstash_pause_live_devices: NULL ranges with n_live > 0"));
  }
  return WithRuntime([&](Runtime& rt) {
    absl::StatusOr<TagId> id = ExistingTagArg(tag);
    if (!id.ok()) return Fail(id.status());
    Runtime::LiveRangesByDevice ranges;
    for (size_t i = 0; i < n_live; ++i) {
      const vmstash_live_ranges& l = live[i];
      if (absl::Status s = CheckLiveEntryDevice(rt, device, live, i); !s.ok()) return Fail(s);
      if (l.tag != nullptr && std::strcmp(l.tag, tag) != 0) {
        return Fail(absl::InvalidArgumentError(absl::StrCat("vmstash_pause_live_devices: ranges ", i, " name tag '",
                                                            l.tag, "', not the paused tag '", tag, "'")));
      }
      if (absl::Status s = AddLiveEntry(l, *id, "vmstash_pause_live_devices", &ranges); !s.ok()) return Fail(s);
    }
    return TransitionCode(rt.Pause(*id, device, ranges));
  });
}
