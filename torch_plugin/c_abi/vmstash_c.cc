// The C ABI (torch_plugin/include/vmstash/vmstash.h) over one process-wide Runtime:
// the driver, the options and one CachingAllocator per device, created on first use.
//
// Fast path: vmstash_malloc/vmstash_free read the device's allocator from an atomic
// array (no lock besides the allocator's own). Creation and shutdown take the runtime
// mutex. Every entry point catches everything (std::bad_alloc included), records the
// message in a thread-local string and returns a code or NULL.
//
// Note [Shutdown]
//   Every entry point runs inside a CallScope: it counts itself in its thread's in-flight
//   counter, then checks the runtime's phase (call_gate.h). vmstash_shutdown sets the phase
//   to "closing", stops the control endpoint (outside the lock; a request it serves
//   completes or fails), waits until no call is in flight, and only then destroys the
//   allocators and the driver. The gate's fences make a call either see "closing" and
//   fail with FailedPrecondition, or be counted and complete before anything is
//   destroyed. After a shutdown every call fails with
//   FailedPrecondition until vmstash_init is called again (no silent re-initialization
//   from the environment, which would drop the options given to vmstash_init). A
//   shutdown from inside a vmstash call (a hook) would wait for itself: it fails.
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "allocator/caching_allocator.h"
#include "allocator/tag.h"
#include "torch_plugin/c_abi/call_gate.h"
#include "torch_plugin/c_abi/control_service.h"
#include "torch_plugin/c_abi/runtime_access.h"
#include "torch_plugin/include/vmstash/vmstash.h"
#include "vmm/driver_factory.h"
#include "vmm/log.h"
#include "vmm/mutex.h"
#include "vmm/options.h"
#include "vmm/status_macros.h"

namespace vmstash {
namespace {

constexpr int kMaxDevices = 64;

thread_local std::string last_error;

using c_abi::Phase;

// Every entry point's body runs inside one (Note [Shutdown]; the counting: call_gate.h).
class CallScope {
 public:
  CallScope() {
    const Phase p = c_abi::EnterCall();
    if (p == Phase::kOpen) return;
    refused_ = absl::FailedPreconditionError(
        p == Phase::kClosing ? "vmstash is shutting down (vmstash_shutdown in progress); the call was refused"
                             : "vmstash was shut down; call vmstash_init() to use it again");
  }
  ~CallScope() { c_abi::LeaveCall(); }
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;
  // OK, or why the call must not touch the runtime.
  const absl::Status& refused() const { return refused_; }

 private:
  absl::Status refused_;
};

int Fail(const absl::Status& status) {
  last_error = status.ToString();
  return static_cast<int>(status.code());
}

struct Runtime {
  Mutex mu;
  bool initialized ABSL_GUARDED_BY(mu) = false;
  std::string conf ABSL_GUARDED_BY(mu);
  Options options ABSL_GUARDED_BY(mu);
  std::unique_ptr<Driver> driver ABSL_GUARDED_BY(mu);
  int device_count ABSL_GUARDED_BY(mu) = 0;
  std::unique_ptr<CachingAllocator> owned[kMaxDevices] ABSL_GUARDED_BY(mu);
  std::vector<std::pair<TagId, Policy>> tag_policies ABSL_GUARDED_BY(mu);
  struct Hooks {
    TagId tag;
    vmstash_hook_fn before;
    vmstash_hook_fn after;
    void* user;
  };
  std::vector<Hooks> hooks ABSL_GUARDED_BY(mu);
  std::atomic<CachingAllocator*> allocators[kMaxDevices] = {};
  // Tag bound to each vmstash_malloc_slot<s> (-1: free slot); bound once, never unbound.
  std::atomic<TagId> slot_tags[VMSTASH_TAG_SLOTS];
  Runtime() {
    for (auto& t : slot_tags) t.store(-1, std::memory_order_relaxed);
  }
  std::atomic<bool> ready{false};
  std::atomic<std::size_t> memory_margin{0};
  std::atomic<int> dependents{0};  // stash arenas alive (they hold allocator pointers)
  std::unique_ptr<control::ControlServer> control ABSL_GUARDED_BY(mu);  // never destroyed either
};

void RegisterForkHandlers();

// Never destroyed: nothing runs at exit while CUDA may be tearing down.
Runtime& TheRuntime() {
  static Runtime* runtime = [] {
    auto* r = new Runtime();
    RegisterForkHandlers();
    return r;
  }();
  return *runtime;
}

// fork(): the runtime lock is held across it, so the child's copy is consistent; in the
// child only the forking thread exists, so the in-flight count is that thread's own, and
// the control endpoint (thread, socket) stays the parent's: the child never stops it or
// removes its socket (the child's copy is dropped without being destroyed).
void ForkPrepare() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  TheRuntime().mu.Lock();
  c_abi::LockForFork();
}
void ForkParent() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  c_abi::UnlockAfterFork();
  TheRuntime().mu.Unlock();
}
void ForkChild() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  Runtime& rt = TheRuntime();
  c_abi::AfterForkInChild();
  c_abi::UnlockAfterFork();
  (void)rt.control.release();  // the parent's; see ControlServer's destructor too
  rt.mu.Unlock();
}
void RegisterForkHandlers() { ::pthread_atfork(ForkPrepare, ForkParent, ForkChild); }

// The control endpoint's answer to "hello": driver and devices in use.
void DescribeRuntime(JsonWriter& w) {
  Runtime& r = TheRuntime();
  MutexLock lock(&r.mu);
  w.Field("driver", r.driver != nullptr ? std::string(r.driver->Name()) : "none (shut down)");
  w.Field("device_count", r.device_count);
  w.Key("devices_in_use");
  w.BeginArray();
  for (int d = 0; d < r.device_count; ++d) {
    if (r.allocators[d].load(std::memory_order_acquire) != nullptr) w.Int(d);
  }
  w.EndArray();
}

absl::Status InitLocked(Runtime& rt, const char* conf) ABSL_EXCLUSIVE_LOCKS_REQUIRED(rt.mu) {
  absl::StatusOr<Options> options = conf == nullptr ? OptionsFromEnvironment() : ParseOptions(conf);
  if (!options.ok()) return options.status();
  std::string canonical = OptionsToString(*options);
  if (rt.initialized) {
    if (conf == nullptr || canonical == rt.conf) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat("vmstash is already initialized with '", rt.conf,
                                                      "'; cannot re-initialize with '", canonical, "'"));
  }
  SetLogLevel(options->log_level);
  absl::StatusOr<std::unique_ptr<Driver>> driver = CreateDriver(*options);
  if (!driver.ok()) return driver.status();
  absl::StatusOr<int> count = (*driver)->DeviceCount();
  if (!count.ok()) return count.status();
  rt.driver = *std::move(driver);
  rt.device_count = std::min(*count, kMaxDevices);
  rt.options = *options;
  rt.conf = canonical;
  rt.initialized = true;
  rt.ready.store(true, std::memory_order_release);
  if (options->control) rt.control = StartControlService(DescribeRuntime);
  return absl::OkStatus();
}

absl::Status HookStatus(int code, const char* which) {
  return code == 0 ? absl::OkStatus()
                   : absl::AbortedError(absl::StrCat(which, " hook returned ", code));
}

absl::Status AddHooksTo(CachingAllocator& a, const Runtime::Hooks& h) {
  CachingAllocator::TransitionHook before, after;
  if (h.before != nullptr) {
    before = [h](TagId tag, int device) {
      return HookStatus(h.before(TagName(tag).data(), device, h.user), "before-pause");
    };
  }
  if (h.after != nullptr) {
    after = [h](TagId tag, int device) {
      return HookStatus(h.after(TagName(tag).data(), device, h.user), "after-resume");
    };
  }
  return a.AddHooks(h.tag, std::move(before), std::move(after));
}

std::vector<CachingAllocator*> AllocatorsInUse();

// When the process ends (handlers registered with atexit run before the CUDA driver's
// own teardown, registered earlier), no background work may start while the driver goes.
void StopBackgroundWorkAtExit() {
  CallScope scope;
  if (!scope.refused().ok()) return;
  for (CachingAllocator* a : AllocatorsInUse()) a->StopBackgroundWork();
}

// The allocator of `device` when the process uses it, else nullptr (never creates one).
CachingAllocator* AllocatorInUse(int device) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return TheRuntime().allocators[device].load(std::memory_order_acquire);
}

// Initializes the runtime from the environment on first use; InvalidArgument for a
// device that does not exist.
absl::Status CheckDeviceLocked(Runtime& rt, int device) ABSL_EXCLUSIVE_LOCKS_REQUIRED(rt.mu) {
  if (!rt.initialized) VMSTASH_RETURN_IF_ERROR(InitLocked(rt, nullptr));
  if (device < 0 || device >= rt.device_count) {
    return absl::InvalidArgumentError(
        absl::StrCat("device ", device, " does not exist (", rt.device_count, " device(s), driver ", rt.driver->Name(), ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<CachingAllocator*> AllocatorFor(int device) {
  if (CachingAllocator* a = AllocatorInUse(device)) return a;
  Runtime& rt = TheRuntime();
  MutexLock lock(&rt.mu);
  VMSTASH_RETURN_IF_ERROR(CheckDeviceLocked(rt, device));
  if (rt.owned[device] == nullptr) {
    absl::StatusOr<std::unique_ptr<CachingAllocator>> a =
        CachingAllocator::Create(rt.driver.get(), device, AllocatorOptions::FromOptions(rt.options));
    if (!a.ok()) return a.status();
    for (const auto& [tag, policy] : rt.tag_policies) {
      absl::Status s = (*a)->CreateTag(tag, policy);
      if (!s.ok()) return s;
    }
    for (const Runtime::Hooks& h : rt.hooks) {
      absl::Status s = AddHooksTo(**a, h);
      if (!s.ok()) return s;
    }
    (*a)->SetMemoryMargin(rt.memory_margin.load());
    static const bool registered = std::atexit(StopBackgroundWorkAtExit) == 0;
    (void)registered;
    rt.owned[device] = *std::move(a);
    rt.allocators[device].store(rt.owned[device].get(), std::memory_order_release);
  }
  return rt.owned[device].get();
}

// Allocators in use, for calls over all devices.
std::vector<CachingAllocator*> AllocatorsInUse() {
  std::vector<CachingAllocator*> out;
  for (int d = 0; d < kMaxDevices; ++d) {
    if (CachingAllocator* a = AllocatorInUse(d)) out.push_back(a);
  }
  return out;
}

// The allocator of `device`, or of every device in use (-1).
absl::StatusOr<std::vector<CachingAllocator*>> Targets(int device) {
  if (device == -1) return AllocatorsInUse();
  absl::StatusOr<CachingAllocator*> a = AllocatorFor(device);
  if (!a.ok()) return a.status();
  return std::vector<CachingAllocator*>{*a};
}

char* CopyString(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out == nullptr) return nullptr;
  std::memcpy(out, s.data(), s.size() + 1);
  return out;
}

// Runs an entry point's body: counted for Note [Shutdown], exceptions turned into codes.
template <typename Fn>
int Guard(Fn fn) noexcept {
  try {
    CallScope scope;
    if (!scope.refused().ok()) return Fail(scope.refused());
    return fn();
  } catch (const std::bad_alloc&) {
    return Fail(absl::ResourceExhaustedError("vmstash: host out of memory"));
  } catch (...) {
    return Fail(absl::InternalError("vmstash: unexpected exception"));
  }
}

// Runs `fn` on the allocator of `device`, or of every device in use (-1).
template <typename Fn>
int OnDevices(int device, Fn fn) noexcept {
  return Guard([&] {
    absl::StatusOr<std::vector<CachingAllocator*>> targets = Targets(device);
    if (!targets.ok()) return Fail(targets.status());
    bool changed = false;
    for (CachingAllocator* a : *targets) {
      absl::StatusOr<bool> r = fn(*a);
      if (!r.ok()) return Fail(r.status());
      changed = changed || *r;
    }
    return changed || targets->empty() ? 0 : VMSTASH_NOOP;
  });
}

absl::StatusOr<TagId> TagArg(const char* tag) {
  if (tag == nullptr) return absl::InvalidArgumentError("tag must not be NULL");
  return InternTag(tag);
}

// The allocators a pause/resume of `device` (-1: all in use) concerns, without creating
// one (and a CUDA context) on a device this process never used.
absl::StatusOr<std::vector<CachingAllocator*>> ExistingTargets(int device) {
  if (device == -1) return AllocatorsInUse();
  if (CachingAllocator* a = AllocatorInUse(device)) return std::vector{a};
  Runtime& rt = TheRuntime();
  MutexLock lock(&rt.mu);
  VMSTASH_RETURN_IF_ERROR(CheckDeviceLocked(rt, device));
  return std::vector<CachingAllocator*>{};  // never used: no tag has memory there
}

// True when `tag` was created through vmstash_create_tag or has a pool on some device.
bool TagKnown(TagId tag) {
  Runtime& rt = TheRuntime();
  {
    MutexLock lock(&rt.mu);
    for (const auto& [known, policy] : rt.tag_policies) {
      if (known == tag) return true;
    }
  }
  for (CachingAllocator* a : AllocatorsInUse()) {
    if (a->TagPolicy(tag).ok()) return true;
  }
  return false;
}

// Pause (or resume) of `tag` on every target, all or nothing: when one device fails,
// the devices this call already changed are changed back (resumed, or paused again) and
// the error names the failing device and the outcome of that rollback. Devices where
// the tag has no memory are skipped; a tag unknown to the process is NotFound.
// `hint` (pauses only, optional): vmstash_pause_live's byte ranges.
struct LiveHint {
  const uint64_t* starts;
  const uint64_t* sizes;
  size_t n;
};
int TransitionOnDevices(const char* tag, int device, bool pause, const LiveHint* hint) noexcept {
  return Guard([&] {
    absl::StatusOr<TagId> id = TagArg(tag);
    if (!id.ok()) return Fail(id.status());
    CachingAllocator::LiveRanges ranges;
    if (hint != nullptr) {
      ranges.reserve(hint->n);
      for (size_t i = 0; i < hint->n; ++i) ranges.emplace_back(hint->starts[i], hint->sizes[i]);
    }
    const CachingAllocator::LiveRanges* live = hint != nullptr ? &ranges : nullptr;
    absl::StatusOr<std::vector<CachingAllocator*>> targets = ExistingTargets(device);
    if (!targets.ok()) return Fail(targets.status());
    const char* verb = pause ? "pause" : "resume";
    std::vector<CachingAllocator*> changed;
    for (CachingAllocator* a : *targets) {
      absl::StatusOr<CachingAllocator::Transition> r = pause ? a->Pause(*id, live) : a->Resume(*id);
      if (r.ok()) {
        if (*r == CachingAllocator::Transition::kDone) changed.push_back(a);
        continue;
      }
      if (absl::IsNotFound(r.status())) continue;  // no memory of the tag on this device
      std::string rollback;
      for (auto it = changed.rbegin(); it != changed.rend(); ++it) {
        absl::StatusOr<CachingAllocator::Transition> undo = pause ? (*it)->Resume(*id) : (*it)->Pause(*id);
        absl::StrAppend(&rollback, rollback.empty() ? "" : ", ", "device ", (*it)->device(), " ",
                        undo.ok() ? (pause ? "resumed again" : "paused again")
                                  : absl::StrCat("NOT restored (", undo.status().message(), ")"));
      }
      return Fail(absl::Status(
          r.status().code(),
          absl::StrCat(verb, " of tag '", tag, "' failed on device ", a->device(), ": ", r.status().message(),
                       rollback.empty() ? "" : absl::StrCat("; rolled back: ", rollback))));
    }
    if (changed.empty() && !TagKnown(*id)) {
      return Fail(absl::NotFoundError(absl::StrCat(verb, ": tag '", tag, "' does not exist in this process")));
    }
    return changed.empty() ? VMSTASH_NOOP : VMSTASH_OK;
  });
}

void* MallocIn(size_t size, int device, cudaStream_t stream, TagId tag) noexcept {
  void* out = nullptr;
  Guard([&] {
    absl::StatusOr<CachingAllocator*> a = AllocatorFor(device);
    if (!a.ok()) return Fail(a.status());
    absl::StatusOr<DevicePtr> p = (*a)->Allocate(size, reinterpret_cast<Stream>(stream), tag);
    if (!p.ok()) return Fail(p.status());
    out = reinterpret_cast<void*>(*p);
    return 0;
  });
  return out;
}

template <int kSlot>
void* SlotMalloc(size_t size, int device, cudaStream_t stream) noexcept {
  const TagId tag = TheRuntime().slot_tags[kSlot].load(std::memory_order_acquire);
  if (tag < 0) {
    Fail(absl::FailedPreconditionError(absl::StrCat("vmstash_malloc_slot", kSlot, " is not bound to a tag")));
    return nullptr;
  }
  return MallocIn(size, device, stream, tag);
}

}  // namespace

namespace c_abi {
absl::StatusOr<CachingAllocator*> DeviceAllocator(int device) { return AllocatorFor(device); }
int Fail(const absl::Status& status) { return vmstash::Fail(status); }
int Guarded(absl::FunctionRef<int()> fn) noexcept { return Guard([&] { return fn(); }); }
void CountDependent(int delta) { TheRuntime().dependents.fetch_add(delta); }
bool DeviceInUse(int device) { return AllocatorInUse(device) != nullptr; }
}  // namespace c_abi
}  // namespace vmstash

using namespace vmstash;  // NOLINT: the C entry points below are thin

extern "C" {

int vmstash_init(const char* options) noexcept {
  try {
    Runtime& rt = TheRuntime();
    MutexLock lock(&rt.mu);
    if (c_abi::CurrentPhase() == Phase::kClosing) {
      return Fail(absl::FailedPreconditionError("vmstash_init: vmstash_shutdown is in progress"));
    }
    absl::Status s = InitLocked(rt, options);
    if (!s.ok()) return Fail(s);
    c_abi::SetPhase(Phase::kOpen);
    return 0;
  } catch (...) {
    return Fail(absl::InternalError("vmstash_init: unexpected exception"));
  }
}

int vmstash_is_initialized(void) noexcept { return TheRuntime().ready.load(std::memory_order_acquire) ? 1 : 0; }

// See Note [Shutdown].
int vmstash_shutdown(void) noexcept {
  if (c_abi::CallDepth() > 0) {
    return Fail(absl::FailedPreconditionError(
        "vmstash_shutdown called from inside a vmstash call (a pause/resume hook?): it would wait for itself"));
  }
  try {
    Runtime& rt = TheRuntime();
    std::unique_ptr<control::ControlServer> control;
    {
      MutexLock lock(&rt.mu);
      const Phase p = c_abi::CurrentPhase();
      if (p == Phase::kShutDown) return 0;
      if (p == Phase::kClosing) return Fail(absl::FailedPreconditionError("vmstash_shutdown: already in progress"));
      if (const int n = rt.dependents.load(); n != 0) {
        return Fail(absl::FailedPreconditionError(
            absl::StrCat("vmstash_shutdown: ", n, " stash arena(s) still exist; destroy them first")));
      }
      c_abi::SetPhase(Phase::kClosing);
      rt.ready.store(false, std::memory_order_release);
      control = std::move(rt.control);
    }
    // Outside the lock: a request the endpoint is serving may be waiting for it.
    control.reset();
    while (!c_abi::NoCallsInFlight()) std::this_thread::sleep_for(std::chrono::microseconds(100));
    MutexLock lock(&rt.mu);
    if (const int n = rt.dependents.load(); n != 0) {  // created by a call that was in flight
      c_abi::SetPhase(Phase::kOpen);
      rt.ready.store(rt.initialized, std::memory_order_release);
      if (rt.initialized && rt.options.control) rt.control = StartControlService(DescribeRuntime);
      return Fail(absl::FailedPreconditionError(
          absl::StrCat("vmstash_shutdown: ", n, " stash arena(s) were created meanwhile; destroy them first")));
    }
    for (int d = 0; d < kMaxDevices; ++d) rt.allocators[d].store(nullptr, std::memory_order_release);
    for (auto& a : rt.owned) a.reset();
    rt.driver.reset();
    rt.initialized = false;
    rt.tag_policies.clear();
    rt.hooks.clear();
    rt.device_count = 0;
    c_abi::SetPhase(Phase::kShutDown);
    return 0;
  } catch (...) {
    return Fail(absl::InternalError("vmstash_shutdown: unexpected exception"));
  }
}

const char* vmstash_version(void) noexcept { return "0.3.0"; }

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
  Guard([&] {
    absl::StatusOr<TagId> id = TagArg(tag);
    if (!id.ok()) return Fail(id.status());
    Runtime& rt = TheRuntime();
    MutexLock lock(&rt.mu);
    for (int s = 0; s < VMSTASH_TAG_SLOTS; ++s) {
      TagId bound = rt.slot_tags[s].load(std::memory_order_relaxed);
      if (bound == *id) return slot = s, 0;
      if (bound < 0) {
        rt.slot_tags[s].store(*id, std::memory_order_release);
        return slot = s, 0;
      }
    }
    return Fail(absl::ResourceExhaustedError(
        absl::StrCat("all ", VMSTASH_TAG_SLOTS, " tag slots are bound; tag '", tag, "' gets none")));
  });
  return slot;
}

void vmstash_free(void* ptr, size_t size, int device, cudaStream_t stream) noexcept {
  (void)size;
  (void)stream;  // the block's own stream orders its reuse; see Note [Stream-Ordered Reuse]
  Guard([&] {
    if (ptr == nullptr) return 0;
    absl::StatusOr<CachingAllocator*> a = AllocatorFor(device);
    if (!a.ok()) return Fail(a.status());
    absl::Status s = (*a)->Free(reinterpret_cast<DevicePtr>(ptr));
    if (!s.ok()) {
      VMSTASH_LOG(kError, "vmstash_free: {}", s.ToString());
      return Fail(s);
    }
    return 0;
  });
}

int vmstash_owner_device(const void* ptr) noexcept {
  if (ptr == nullptr) return -1;
  int owner = -1;
  Guard([&] {
    for (CachingAllocator* a : AllocatorsInUse()) {
      if (a->Owns(reinterpret_cast<DevicePtr>(ptr))) return owner = a->device(), 0;
    }
    return 0;
  });
  return owner;
}

int vmstash_record_stream(void* ptr, int device, cudaStream_t stream) noexcept {
  return Guard([&] {
    absl::StatusOr<CachingAllocator*> a = AllocatorFor(device);
    if (!a.ok()) return Fail(a.status());
    absl::Status s = (*a)->RecordStream(reinterpret_cast<DevicePtr>(ptr), reinterpret_cast<Stream>(stream));
    return s.ok() ? 0 : Fail(s);
  });
}

int vmstash_create_tag(const char* tag, const char* policy) noexcept {
  return Guard([&] {
    if (tag == nullptr || policy == nullptr) return Fail(absl::InvalidArgumentError("tag and policy must not be NULL"));
    absl::StatusOr<TagId> id = InternTag(tag);
    if (!id.ok()) return Fail(id.status());
    absl::StatusOr<Policy> p = ParsePolicy(policy);
    if (!p.ok()) return Fail(p.status());
    Runtime& rt = TheRuntime();
    MutexLock lock(&rt.mu);
    for (const auto& [known, known_policy] : rt.tag_policies) {
      if (known == *id && known_policy != *p) {
        return Fail(absl::FailedPreconditionError(
            absl::StrCat("tag '", tag, "' already exists with policy ", PolicyName(known_policy))));
      }
    }
    for (auto& a : rt.owned) {
      if (a == nullptr) continue;
      absl::Status s = a->CreateTag(*id, *p);
      if (!s.ok()) return Fail(s);
    }
    rt.tag_policies.emplace_back(*id, *p);
    return 0;
  });
}

int vmstash_set_current_tag(const char* tag) noexcept {
  return Guard([&] {
    if (tag == nullptr) return Fail(absl::InvalidArgumentError("tag must not be NULL"));
    absl::StatusOr<TagId> id = InternTag(tag);
    if (!id.ok()) return Fail(id.status());
    SetCurrentTag(*id);
    return 0;
  });
}

const char* vmstash_get_current_tag(void) noexcept { return TagName(CurrentTag()).data(); }

int vmstash_pause(const char* tag, int device) noexcept { return TransitionOnDevices(tag, device, true, nullptr); }

int vmstash_pause_live(const char* tag, int device, const uint64_t* starts, const uint64_t* sizes,
                       size_t n) noexcept {
  if (n != 0 && (starts == nullptr || sizes == nullptr)) {
    return Fail(absl::InvalidArgumentError("vmstash_pause_live: NULL range arrays with n > 0"));
  }
  const LiveHint hint{starts, sizes, n};
  return TransitionOnDevices(tag, device, true, &hint);
}

int vmstash_read_backup(const void* ptr, size_t size, int device, void* dst) noexcept {
  return Guard([&] {
    absl::StatusOr<CachingAllocator*> a = AllocatorFor(device);
    if (!a.ok()) return Fail(a.status());
    absl::Status s = (*a)->ReadBackup(reinterpret_cast<DevicePtr>(ptr), size, dst);
    return s.ok() ? 0 : Fail(s);
  });
}

int vmstash_set_memory_margin(size_t bytes) noexcept {
  return Guard([&] {
    Runtime& rt = TheRuntime();
    MutexLock lock(&rt.mu);
    rt.memory_margin.store(bytes);
    for (auto& a : rt.owned) {
      if (a != nullptr) a->SetMemoryMargin(bytes);
    }
    return 0;
  });
}

int vmstash_resume(const char* tag, int device) noexcept { return TransitionOnDevices(tag, device, false, nullptr); }

int vmstash_prepare(const char* tag, int device, size_t bytes) noexcept {
  absl::StatusOr<TagId> id = TagArg(tag);
  if (!id.ok()) return Fail(id.status());
  int rc = OnDevices(device, [&](CachingAllocator& a) -> absl::StatusOr<bool> {
    VMSTASH_RETURN_IF_ERROR(a.Prepare(*id, bytes));
    return true;
  });
  return rc == VMSTASH_NOOP ? 0 : rc;
}

int vmstash_release_backup(const char* tag, int device) noexcept {
  absl::StatusOr<TagId> id = TagArg(tag);
  if (!id.ok()) return Fail(id.status());
  int rc = OnDevices(device, [&](CachingAllocator& a) -> absl::StatusOr<bool> {
    absl::Status s = a.ReleaseBackup(*id);
    if (absl::IsNotFound(s)) return true;  // never used on that device: nothing to release
    VMSTASH_RETURN_IF_ERROR(s);
    return true;
  });
  return rc == VMSTASH_NOOP ? 0 : rc;
}

int vmstash_register_hooks(const char* tag, vmstash_hook_fn before_pause, vmstash_hook_fn after_resume,
                           void* user) noexcept {
  return Guard([&] {
    absl::StatusOr<TagId> id = TagArg(tag);
    if (!id.ok()) return Fail(id.status());
    Runtime& rt = TheRuntime();
    MutexLock lock(&rt.mu);
    Runtime::Hooks h{*id, before_pause, after_resume, user};
    for (auto& a : rt.owned) {
      if (a == nullptr) continue;
      absl::Status s = AddHooksTo(*a, h);
      if (!s.ok()) return Fail(s);
    }
    rt.hooks.push_back(h);
    return 0;
  });
}

int vmstash_empty_cache(int device, const char* tag) noexcept {
  return Guard([&] {
    TagId id = -1;
    if (tag != nullptr) {
      absl::StatusOr<TagId> t = InternTag(tag);
      if (!t.ok()) return Fail(t.status());
      id = *t;
    }
    absl::StatusOr<std::vector<CachingAllocator*>> targets = Targets(device);
    if (!targets.ok()) return Fail(targets.status());
    for (CachingAllocator* a : *targets) {
      absl::Status s = id < 0 ? a->EmptyCache() : a->EmptyCache(id);
      if (!s.ok()) return Fail(s);
    }
    return 0;
  });
}

static char* JsonFor(int device, bool snapshot) noexcept {
  char* out = nullptr;
  Guard([&] {
    absl::StatusOr<std::vector<CachingAllocator*>> targets = Targets(device);
    if (!targets.ok()) return Fail(targets.status());
    std::string json;
    for (CachingAllocator* a : *targets) {
      if (!json.empty()) json += ",";
      json += snapshot ? SnapshotToJson(a->TakeSnapshot()) : StatsToJson(a->Stats());
    }
    if (device == -1) json = "[" + json + "]";
    out = CopyString(json);
    if (out == nullptr) return Fail(absl::ResourceExhaustedError("vmstash: host out of memory"));
    return 0;
  });
  return out;
}

char* vmstash_stats_json(int device) noexcept { return JsonFor(device, false); }
char* vmstash_snapshot_json(int device) noexcept { return JsonFor(device, true); }
void vmstash_string_free(char* s) noexcept { std::free(s); }
const char* vmstash_last_error(void) noexcept { return vmstash::last_error.c_str(); }

}  // extern "C"
