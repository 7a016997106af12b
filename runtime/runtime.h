// Runtime: the process-level layer above the allocators (docs/architecture.md §Layers).
// Built from an injected Driver (CreateDriver(options.vmm) in a program, a SimDriver in
// tests), it owns:
//   - one CachingAllocator per device, created on first use (a device the process never
//     used gets none, and no CUDA context, from pause, resume or the control service);
//   - the one registry of tags (tag_registry.h): policies, allocation slots, hooks, each
//     applied to every allocator, and to each new one;
//   - device iteration with all-or-nothing semantics for pause, resume and switch (Note
//     [All-or-Nothing Transitions]);
//   - the memory margin, the stats and snapshot documents, background work;
//   - a count of dependents (stash arenas holding allocator pointers);
//   - this process's side of the node pool (node_leases.h), which every allocator's
//     backups lease from once it is connected (VMSTASH_CONF node:1, or node().Connect).
// The process-wide instance, its initialization from VMSTASH_CONF, the shutdown protocol
// and the control endpoint are process.h's; the C ABI is a thin shim over both.
//
// Note [All-or-Nothing Transitions]
//   A pause, resume or switch over several devices (device -1: every device in use) runs
//   device by device, in device order, on the devices where its tags have memory (the
//   others are skipped; a tag the process never declared and never allocated in is
//   NotFound). The result is true when some device changed, false when every device
//   already was in the requested state. The rule: after a failed call, every device and
//   tag is as before, or the error says exactly which device is in which state and the
//   call that recovers it. Two kinds of error keep it:
//   (1) The transition failed on device k (a driver error, out of memory, a before-pause
//       hook's veto). Device k is as before (the allocator's own rollback; a tag whose
//       memory could not be mapped back is "broken", as the allocator's message says),
//       the devices after k were never touched, and the devices this call already
//       changed are changed back in reverse order (resumed, paused, switched back). The
//       error has the failing device's code and names it with the tag's state there, then
//       the outcome of each device's rollback: "resumed again", "paused again", "switched
//       back" (its after-resume hook failing is named but harmless: the state is back),
//       or "NOT ..." with the state left there and the call that finishes the job on that
//       device (Pause/Resume/Switch of that device: the rollback itself failed, e.g. the
//       memory to resume is gone). A discard tag that a rollback paused and resumed again
//       has undefined bytes there, as after any resume.
//   (2) The transition is done on every device, but after-resume hooks failed on some.
//       The allocator reports a hook error after the tag is resumed (Resume, and Switch's
//       "switch done, but ..."), so such a device is done, not failed: the loop goes on,
//       every device is transitioned, and the error at the end (the first hook's code,
//       TransitionDone() true) says the transition is done everywhere and lists each
//       device whose hooks failed, with their messages. Nothing is rolled back: the hooks
//       already ran with the tag resumed (their side effects happened), and undoing a
//       user callback's failure would mean a pause (its own hooks, copies, a memory
//       release that can itself fail) on every device, trading a fully known state for
//       a possibly mixed one. The tag is where the caller asked; the caller redoes what
//       the failed hook was to do. A device whose hooks failed is still rolled back, as
//       in (1), when a later device fails the transition itself.
//   How a device's error is told apart: the allocator marks the error of a Resume or
//   Switch that is done but whose after-resume hooks failed
//   (CachingAllocator::TransitionDone); such an error is (2), any other (1). The error of
//   (2) returned here carries the same mark (TransitionDone below). Callers above (the C
//   ABI, Python, the control service) get these statuses as they are: the message
//   carries the states.
//   Pause takes a liveness hint for every device (the same list) or per device (one C
//   call from Python carries every device's MemPool ranges, so that a multi-device pause
//   is one all-or-nothing call).
//
// Thread-safety: every method is thread-safe except the destructor, which needs that no
// other call is in flight (the process runtime's gate ensures it). AllocatorInUse and
// SlotTag are lock-free; creation, declarations and hooks take mu_, which is never held
// while an allocator runs a pause, a resume or a hook, nor while SetBackupStore waits for
// a tag's transition (it holds store_mu_ then). Lock order: store_mu_, mu_, then an
// allocator's locks.
#ifndef VMSTASH_RUNTIME_RUNTIME_H_
#define VMSTASH_RUNTIME_RUNTIME_H_

#include <atomic>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "allocator/allocator_options.h"
#include "allocator/caching_allocator.h"
#include "allocator/tag.h"
#include "base/json_writer.h"
#include "base/mutex.h"
#include "node/node_options.h"
#include "runtime/node_leases.h"
#include "runtime/tag_registry.h"
#include "vmm/driver.h"

namespace vmstash {

// A call that may change tags' chunks (runtime/tag_exporter.h, Note [Mapped Tags]):
// the tags whose chunks it may unmap or release (`revoke`; every tag: `all`), those whose
// chunks it may map anew (`regrant`), and those it may resume (`resume`: it reads their
// backups), on `device` (Runtime::kAllDevices: any).
struct ChunkChange {
  std::vector<TagId> revoke;
  std::vector<TagId> regrant;
  bool all = false;
  int device = -1;
  std::vector<TagId> resume;
};
// Told around every such call (Runtime::SetTransitionObserver).
class TransitionObserver {
 public:
  virtual ~TransitionObserver() = default;
  // Before the call: an error vetoes it (the call returns that error, nothing changed).
  virtual absl::Status BeforeChunksChange(const ChunkChange& change) = 0;
  // After the call, whatever its outcome (after a veto too).
  virtual void AfterChunksChange(const ChunkChange& change) = 0;
};

class Runtime {
 public:
  static constexpr int kMaxDevices = 64;
  static constexpr int kAllDevices = -1;

  // InvalidArgument for a null driver; the driver's error when it cannot count devices.
  // `node`: the node pool's options (not connected here: process.h connects for node:1).
  static absl::StatusOr<std::unique_ptr<Runtime>> Create(std::unique_ptr<Driver> driver, AllocatorOptions options,
                                                         node::NodeOptions node = {});
  // Destroys the allocators (each synchronizes its device and returns its memory), then
  // the node pool's source (its registrations), then the driver.
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  Driver& driver() const { return *driver_; }
  NodeLeases& node() const { return *node_; }
  int device_count() const { return device_count_; }
  // The options every allocator of this runtime was made with.
  const AllocatorOptions& allocator_options() const { return options_; }
  // InvalidArgument naming the device count and the driver for a device that does not exist.
  absl::Status CheckDevice(int device) const;

  // The allocator of `device` if the process uses it, else nullptr (never creates one).
  CachingAllocator* AllocatorInUse(int device) const {
    if (device < 0 || device >= kMaxDevices) return nullptr;
    return allocators_[device].load(std::memory_order_acquire);
  }
  // The allocator of `device`, created on first use with every declared tag and hook.
  absl::StatusOr<CachingAllocator*> Allocator(int device);
  std::vector<CachingAllocator*> AllocatorsInUse() const;

  // Tags. CreateTag declares `tag` with `policy` on every allocator, present and future:
  // idempotent for the same policy, FailedPrecondition for another one.
  absl::Status CreateTag(TagId tag, Policy policy);
  std::optional<Policy> TagPolicy(TagId tag) const;
  // Declared tags with their policies, in declaration order.
  std::vector<std::pair<TagId, Policy>> Tags() const;
  // Where the declared `backup` tag's later pauses put its bytes, on every allocator,
  // present and future (CachingAllocator::SetBackupStore); all or nothing. NotFound for an
  // undeclared tag or (with `directory_must_exist`) a disk directory that does not exist;
  // without it the pause that writes there checks (torch_memory_saver's directory, read at
  // each pause). FailedPrecondition for a discard tag or one paused on some device.
  absl::Status SetBackupStore(TagId tag, const BackupStore& store, bool directory_must_exist = true);
  // Whether the declared tag's backup is prepared ahead of its pauses, on every device,
  // present and future (CachingAllocator::SetPrepareAhead). NotFound for an undeclared tag.
  absl::Status SetPrepareAhead(TagId tag, bool ahead);
  // The tag's store: its choice, else the allocator options' default.
  BackupStore TagBackupStore(TagId tag) const;
  absl::StatusOr<int> BindSlot(TagId tag);
  TagId SlotTag(int slot) const { return registry_.SlotTag(slot); }
  // Hooks run around every pause/resume of `tag` on each device (CachingAllocator::AddHooks).
  absl::Status AddHooks(TagId tag, CachingAllocator::TransitionHook before_pause,
                        CachingAllocator::TransitionHook after_resume);

  // Transitions over `device` or every device in use (kAllDevices); Note [All-or-Nothing
  // Transitions]. `live` (pauses only, optional): the byte ranges known to be live.
  using LiveRangesByDevice = absl::flat_hash_map<int, CachingAllocator::LiveRangesByTag>;
  absl::StatusOr<bool> Pause(TagId tag, int device, const CachingAllocator::LiveRanges* live = nullptr);
  // The same with each device's own hint: live[d][tag] on device d (a device without one
  // pauses without a hint, copying every live block of a backup tag).
  absl::StatusOr<bool> Pause(TagId tag, int device, const LiveRangesByDevice& live);
  absl::StatusOr<bool> Resume(TagId tag, int device);
  // Pauses `pause` and resumes `resume` in one transaction per device
  // (CachingAllocator::Switch, Note [Switch Protocol]) over `device` or every device in
  // use, all or nothing across devices (Note [All-or-Nothing Transitions]: devices already
  // switched are switched back). On each device only the tags with memory there take part.
  // `live` (optional): per device, per outgoing tag, the byte ranges known to be live.
  absl::StatusOr<bool> Switch(const std::vector<TagId>& pause, const std::vector<TagId>& resume, int device,
                              const LiveRangesByDevice* live = nullptr);
  // Switch as one of several processes' switches that all commit or all roll back (Note
  // [Agreed Switch] in allocator/switch.h): `agree` is called exactly once, whatever
  // happens. It covers one device of this process (one rank per GPU): `device`, or with
  // -1 the one device where these tags hold memory (or the one allocator where none
  // does); InvalidArgument when several do. `exchange` (optional): chunks traded with the
  // other processes (allocator/switch_exchange.h).
  absl::StatusOr<bool> AgreedSwitch(const std::vector<TagId>& pause, const std::vector<TagId>& resume, int device,
                                    const LiveRangesByDevice* live, const CachingAllocator::SwitchAgree& agree,
                                    SwitchExchange* exchange = nullptr);
  // True for the error of a Pause/Resume/Switch that is done on every device although
  // after-resume hooks failed on some (Note [All-or-Nothing Transitions], case 2); false
  // for OK and for every other error.
  static bool TransitionDone(const absl::Status& status);
  // Backup arenas of `tag` (CachingAllocator::Prepare / ReleaseBackup) on `device` or
  // every device in use. A device where the tag never had memory has nothing to release.
  absl::Status Prepare(TagId tag, int device, std::size_t bytes);
  absl::Status ReleaseBackup(TagId tag, int device);
  // What `tag`'s backup arenas do after a resume (Note [Retained Backups] in
  // allocator/tag_pool.h), on every device where the tag has memory now (set it before the
  // pause or resume it is for).
  absl::Status SetBackupRetention(TagId tag, BackupRetention retention);
  absl::Status EmptyCache(int device, std::optional<TagId> tag);
  // Who is told around pause, resume, switch and empty_cache (null: nobody). The observer
  // runs outside the runtime's locks, in the calling thread.
  void SetTransitionObserver(std::shared_ptr<TransitionObserver> observer) ABSL_LOCKS_EXCLUDED(mu_);

  // Applies to every allocator, present and future.
  void SetMemoryMargin(std::size_t bytes);

  // Allocator stats / snapshot documents: one object for a device, an array (one per
  // device in use) for kAllDevices.
  absl::StatusOr<std::string> StatsJson(int device);
  absl::StatusOr<std::string> SnapshotJson(int device);
  // The device whose allocator returned `ptr`, or -1.
  int OwnerDevice(DevicePtr ptr) const;
  // The control endpoint's "hello" fields: driver, device count, devices in use.
  void Describe(JsonWriter& w) const;
  // Stops the allocators' background threads (at process exit).
  void StopBackgroundWork();

  // Objects holding allocator pointers (stash arenas): +1 / -1 as they come and go.
  void AddDependent(int delta) { dependents_.fetch_add(delta, std::memory_order_acq_rel); }
  int dependents() const { return dependents_.load(std::memory_order_acquire); }

 private:
  Runtime(std::unique_ptr<Driver> driver, int device_count, AllocatorOptions options,
          std::shared_ptr<NodeLeases> node);

  // The allocators `device` concerns: one (created on first use) or every one in use.
  absl::StatusOr<std::vector<CachingAllocator*>> Targets(int device);
  // The same without creating one: empty for a device the process never used.
  absl::StatusOr<std::vector<CachingAllocator*>> ExistingTargets(int device) const;
  // The hint of one device: `all` for every device, else by_device[device][tag].
  struct Hints {
    const CachingAllocator::LiveRanges* all = nullptr;
    const LiveRangesByDevice* by_device = nullptr;
    const CachingAllocator::LiveRanges* For(int device, TagId tag) const;
  };
  absl::StatusOr<bool> Transition(TagId tag, int device, bool pause, const Hints& hints);
  bool TagKnown(TagId tag) const;
  absl::StatusOr<std::string> JsonOf(int device, bool snapshot);
  // NotFound for a tag this process never declared, InvalidArgument for no tag at all.
  absl::Status CheckSwitchTags(const std::vector<TagId>& pause, const std::vector<TagId>& resume) const;

  // The observer around a call (Note [Mapped Tags]): Before now, After when destroyed.
  class Observed;
  std::shared_ptr<TransitionObserver> Observer() const ABSL_LOCKS_EXCLUDED(mu_);

  const std::unique_ptr<Driver> driver_;
  const int device_count_;
  // After driver_ (it uses it), before options_ (which shares it with every allocator).
  std::shared_ptr<NodeLeases> node_;
  const AllocatorOptions options_;
  mutable Mutex mu_;
  Mutex store_mu_ ABSL_ACQUIRED_BEFORE(mu_);  // one SetBackupStore at a time (it waits for transitions without mu_)
  std::unique_ptr<CachingAllocator> owned_[kMaxDevices] ABSL_GUARDED_BY(mu_);
  std::atomic<CachingAllocator*> allocators_[kMaxDevices] = {};
  TagRegistry registry_;  // mutators and lists under mu_, SlotTag lock-free
  std::size_t memory_margin_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<int> dependents_{0};
  std::shared_ptr<TransitionObserver> observer_ ABSL_GUARDED_BY(mu_);
};

}  // namespace vmstash

#endif  // VMSTASH_RUNTIME_RUNTIME_H_
