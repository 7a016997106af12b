// The process runtime: see process.h.
#include "runtime/process.h"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "allocator/host_budget.h"
#include "base/log.h"
#include "base/mutex.h"
#include "base/status_macros.h"
#include "control/endpoint.h"
#include "runtime/call_gate.h"
#include "runtime/control_service.h"
#include "runtime/runtime_options.h"
#include "runtime/tag_exporter.h"
#include "vmm/driver_factory.h"

namespace vmstash::process {
namespace {

struct State {
  Mutex mu;
  bool initialized ABSL_GUARDED_BY(mu) = false;
  std::string conf ABSL_GUARDED_BY(mu);  // canonical, for comparing re-initializations
  RuntimeOptions options ABSL_GUARDED_BY(mu);
  std::unique_ptr<Runtime> runtime ABSL_GUARDED_BY(mu);
  std::unique_ptr<control::ControlServer> control ABSL_GUARDED_BY(mu);
  // Mapped tags (Note [Mapped Tags]): this process's exporter, and the tags it maps.
  std::shared_ptr<share::TagExporter> exporter ABSL_GUARDED_BY(mu);
  std::map<std::uint64_t, std::shared_ptr<share::MappedTag>> mapped ABSL_GUARDED_BY(mu);
  std::uint64_t next_mapped ABSL_GUARDED_BY(mu) = 1;
  // runtime.get() while the phase is open (read by calls without the lock).
  std::atomic<Runtime*> current{nullptr};
};

void RegisterForkHandlers();

// Note [Fork]: set in a forked child while it holds its parent's copy of the runtime.
std::atomic<bool> forked_copy{false};
std::atomic<int> init_pid{0};  // the process that initialized the runtime

absl::Status ForkedChildError() {
  return absl::FailedPreconditionError(absl::StrCat(
      "vmstash was initialized in process ", init_pid.load(std::memory_order_relaxed), "; this process (",
      getpid(), ") is a fork() of it and cannot use that runtime (nor can CUDA be used in a forked child): ",
      "call vmstash_shutdown() here to drop the copy, then vmstash_init() for a runtime of its own"));
}

// Never destroyed: nothing runs at exit while CUDA may be tearing down.
State& TheState() {
  static State* state = [] {
    auto* s = new State();
    RegisterForkHandlers();
    return s;
  }();
  return *state;
}

// Note [Fork].
void ForkPrepare() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  TheState().mu.Lock();
  LockForFork();
  if (TheState().exporter != nullptr) TheState().exporter->LockForFork();
}
void ForkParent() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (TheState().exporter != nullptr) TheState().exporter->UnlockAfterFork();
  UnlockAfterFork();
  TheState().mu.Unlock();
}
void ForkChild() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  State& s = TheState();
  AfterForkInChild();
  UnlockAfterFork();
  if (s.initialized) forked_copy.store(true, std::memory_order_relaxed);
  (void)s.control.release();  // the parent's; see ControlServer's destructor too
  // The parent's threads serve these: the child closes its copies of their connections
  // (so that the peers see them close when the parent ends) and never destroys them.
  if (s.exporter != nullptr) {
    s.exporter->CloseInForkedChild();
    s.exporter->UnlockAfterFork();
    (void)new std::shared_ptr<share::TagExporter>(std::move(s.exporter));
  }
  if (!s.mapped.empty()) {
    for (auto& [handle, m] : s.mapped) m->CloseInForkedChild();
    (void)new std::map<std::uint64_t, std::shared_ptr<share::MappedTag>>(std::move(s.mapped));
    s.mapped.clear();
  }
  s.mu.Unlock();
}
void RegisterForkHandlers() { ::pthread_atfork(ForkPrepare, ForkParent, ForkChild); }

// At process exit (handlers registered with atexit run before the CUDA driver's own
// teardown, registered earlier), no background work may start while the driver goes.
void StopBackgroundWorkAtExit() {
  Call call;
  if (!call.refused().ok()) return;
  if (Runtime* rt = TheState().current.load(std::memory_order_acquire)) rt->StopBackgroundWork();
}

std::unique_ptr<control::ControlServer> StartControlService() {
  absl::StatusOr<std::unique_ptr<control::ControlServer>> server =
      control::ControlServer::Start(control::ServerOptions{}, [](const control::Request& r) -> absl::StatusOr<std::string> {
        Call call;
        VMSTASH_ASSIGN_OR_RETURN(Runtime * rt, call.runtime());
        return HandleControlRequest(*rt, r);
      });
  if (!server.ok()) {
    VMSTASH_LOG(kWarning, "vmstash: control endpoint not started ({}); the CLI cannot see this process",
                server.status().ToString());
    return nullptr;
  }
  VMSTASH_LOG(kDebug, "vmstash: control endpoint at {}", (*server)->socket_path());
  return *std::move(server);
}

absl::Status InitLocked(State& s, const char* conf) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
  VMSTASH_ASSIGN_OR_RETURN(RuntimeOptions options,
                           conf == nullptr ? RuntimeOptionsFromEnvironment() : ParseRuntimeOptions(conf));
  std::string canonical = RuntimeOptionsToString(options);
  if (s.initialized) {
    if (conf == nullptr || canonical == s.conf) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat("vmstash is already initialized with '", s.conf,
                                                      "'; cannot re-initialize with '", canonical, "'"));
  }
  SetLogLevel(options.vmm.log_level);
  VMSTASH_ASSIGN_OR_RETURN(std::unique_ptr<Driver> driver, CreateDriver(options.vmm));
  VMSTASH_ASSIGN_OR_RETURN(s.runtime, Runtime::Create(std::move(driver), options.allocator, options.node));
  if (options.node.enabled) {  // Note [Node Leases]: never a reason to fail the initialization
    if (absl::Status connected = s.runtime->node().Connect(/*start=*/true); !connected.ok()) {
      VMSTASH_LOG(kWarning, "vmstash: node:1, but no node pool ({}); backups use this process's own memory",
                  connected.ToString());
    }
  }
  // The host-memory cap is the process's (allocator/host_budget.h): each initialization
  // sets it from its conf (absent host_max: no cap).
  HostBudget::Process().SetLimit(options.allocator.host_max_bytes);
  static const bool registered = std::atexit(StopBackgroundWorkAtExit) == 0;
  (void)registered;
  s.options = std::move(options);
  s.conf = std::move(canonical);
  s.initialized = true;
  init_pid.store(static_cast<int>(getpid()), std::memory_order_relaxed);
  s.current.store(s.runtime.get(), std::memory_order_release);
  if (s.options.control.serve) s.control = StartControlService();
  return absl::OkStatus();
}

// Why a shutdown may not go on: stash arenas (Runtime::dependents), or uses of mapped
// tags in progress (acquired through the C ABI and not released: their memory would be
// unmapped under them); OK when nothing holds it. `when` completes the message.
absl::Status BusyLocked(State& s, const char* when) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
  if (const int n = s.runtime != nullptr ? s.runtime->dependents() : 0; n != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("vmstash shutdown: ", n, " stash arena(s) ", when, "; destroy them first"));
  }
  for (const auto& [handle, m] : s.mapped) {
    if (m->users() > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "vmstash shutdown: a use of tag '", m->tag(), "' of process ", m->pid(), " mapped here (handle ", handle,
          ") is in progress; release it first (vmstash_mapped_release, or leave vmstash.weights' use())"));
    }
  }
  return absl::OkStatus();
}

// Shutdown's last step, once no call is in flight.
void DestroyLocked(State& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
  s.current.store(nullptr, std::memory_order_release);
  s.runtime.reset();
  s.initialized = false;
  SetPhase(Phase::kShutDown);
}

// Shutdown in a forked child (Note [Fork]): the parent's copy is abandoned, not destroyed.
void AbandonForkedCopyLocked(State& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
  s.current.store(nullptr, std::memory_order_release);
  (void)s.runtime.release();
  s.initialized = false;
  SetPhase(Phase::kShutDown);
  forked_copy.store(false, std::memory_order_relaxed);
}

}  // namespace

Call::Call() {
  const Phase p = EnterCall();
  if (p == Phase::kOpen) {
    if (forked_copy.load(std::memory_order_relaxed)) refused_ = ForkedChildError();
    return;
  }
  refused_ = absl::FailedPreconditionError(p == Phase::kClosing
                                               ? "vmstash is shutting down (a shutdown is in progress); the call was refused"
                                               : "vmstash was shut down; call vmstash_init() to use it again");
}

Call::~Call() { LeaveCall(); }

absl::StatusOr<Runtime*> Call::runtime() {
  if (!refused_.ok()) return refused_;
  State& s = TheState();
  if (Runtime* rt = s.current.load(std::memory_order_acquire)) return rt;
  MutexLock lock(&s.mu);
  if (!s.initialized) VMSTASH_RETURN_IF_ERROR(InitLocked(s, nullptr));
  return s.runtime.get();
}

Runtime* Call::runtime_if_initialized() const {
  return refused_.ok() ? TheState().current.load(std::memory_order_acquire) : nullptr;
}

absl::Status Init(const char* conf) {
  State& s = TheState();
  MutexLock lock(&s.mu);
  if (forked_copy.load(std::memory_order_relaxed)) return ForkedChildError();
  if (CurrentPhase() == Phase::kClosing) return absl::FailedPreconditionError("vmstash_init: a shutdown is in progress");
  VMSTASH_RETURN_IF_ERROR(InitLocked(s, conf));
  SetPhase(Phase::kOpen);
  return absl::OkStatus();
}

bool Initialized() {
  return TheState().current.load(std::memory_order_acquire) != nullptr && CurrentPhase() == Phase::kOpen &&
         !forked_copy.load(std::memory_order_relaxed);
}

// Note [Shutdown].
absl::Status Shutdown() {
  if (CallDepth() > 0) {
    return absl::FailedPreconditionError(
        "vmstash shutdown called from inside a vmstash call (a pause/resume hook?): it would wait for itself");
  }
  State& s = TheState();
  if (forked_copy.load(std::memory_order_relaxed)) {
    MutexLock lock(&s.mu);
    AbandonForkedCopyLocked(s);
    return absl::OkStatus();
  }
  std::unique_ptr<control::ControlServer> control;
  {
    MutexLock lock(&s.mu);
    const Phase p = CurrentPhase();
    if (p == Phase::kShutDown) return absl::OkStatus();
    if (p == Phase::kClosing) return absl::FailedPreconditionError("vmstash shutdown: already in progress");
    if (absl::Status busy = BusyLocked(s, "still exist"); !busy.ok()) return busy;
    SetPhase(Phase::kClosing);
    control = std::move(s.control);
  }
  // Outside the lock: a request the endpoint is serving may be waiting for it.
  control.reset();
  while (!NoCallsInFlight()) std::this_thread::sleep_for(std::chrono::microseconds(100));
  // No call in flight, none can start: the exporter and the mapped tags go (a map or a
  // share in flight had its entry in by now), then the runtime.
  std::shared_ptr<share::TagExporter> exporter;
  std::map<std::uint64_t, std::shared_ptr<share::MappedTag>> mapped;
  {
    MutexLock lock(&s.mu);
    if (absl::Status busy = BusyLocked(s, "were made meanwhile, or are still there"); !busy.ok()) {
      SetPhase(Phase::kOpen);
      if (s.options.control.serve) s.control = StartControlService();
      return busy;
    }
    exporter = std::move(s.exporter);
    mapped.swap(s.mapped);
    if (exporter != nullptr) s.runtime->SetTransitionObserver(nullptr);
  }
  exporter.reset();  // its importers see their connections close
  mapped.clear();    // no use in progress (BusyLocked): nothing waits
  MutexLock lock(&s.mu);
  DestroyLocked(s);
  return absl::OkStatus();
}

absl::StatusOr<std::uint64_t> ShareTag(Runtime& runtime, TagId tag, const std::string& index, const std::string& name) {
  State& s = TheState();
  std::shared_ptr<share::TagExporter> exporter;
  {
    MutexLock lock(&s.mu);
    if (s.exporter == nullptr) {
      VMSTASH_ASSIGN_OR_RETURN(s.exporter, share::TagExporter::Start(&runtime, share::ShareOptions{}));
      runtime.SetTransitionObserver(s.exporter);
    }
    exporter = s.exporter;
  }
  return exporter->Share(tag, index, name);
}

absl::Status UnshareTag(TagId tag) {
  State& s = TheState();
  std::shared_ptr<share::TagExporter> exporter;
  {
    MutexLock lock(&s.mu);
    exporter = s.exporter;
  }
  if (exporter == nullptr) return absl::NotFoundError(absl::StrCat("tag '", TagName(tag), "' is not shared"));
  return exporter->Unshare(tag);
}

absl::StatusOr<std::uint64_t> MapTag(Runtime& runtime, int pid, const std::string& tag, int device, int timeout_ms) {
  VMSTASH_RETURN_IF_ERROR(runtime.CheckDevice(device));
  share::MapOptions options;
  if (timeout_ms > 0) options.timeout_ms = timeout_ms;
  VMSTASH_ASSIGN_OR_RETURN(std::unique_ptr<share::MappedTag> m,
                           share::MappedTag::Map(&runtime.driver(), device, pid, tag, options, &runtime.node()));
  State& s = TheState();
  MutexLock lock(&s.mu);
  const std::uint64_t handle = s.next_mapped++;
  s.mapped.emplace(handle, std::move(m));
  return handle;
}

absl::StatusOr<std::shared_ptr<share::MappedTag>> Mapped(std::uint64_t handle) {
  State& s = TheState();
  MutexLock lock(&s.mu);
  auto it = s.mapped.find(handle);
  if (it == s.mapped.end()) return absl::NotFoundError(absl::StrCat("no mapped tag has handle ", handle));
  return it->second;
}

absl::StatusOr<std::shared_ptr<share::MappedTag>> TakeMapped(std::uint64_t handle) {
  State& s = TheState();
  MutexLock lock(&s.mu);
  auto it = s.mapped.find(handle);
  if (it == s.mapped.end()) return absl::NotFoundError(absl::StrCat("no mapped tag has handle ", handle));
  std::shared_ptr<share::MappedTag> m = std::move(it->second);
  s.mapped.erase(it);
  return m;
}

}  // namespace vmstash::process
