// Runtime: the process-level layer above the allocators (docs/architecture.md §Layers).
// Built from an injected Driver (CreateDriver(options.vmm) in a program, a SimDriver in
// tests), it owns:
//   - one CachingAllocator per device, created on first use (a device the process never
//     used gets none, and no CUDA context, from pause, resume or the control service);
//   - the one registry of tags (tag_registry.h): policies, allocation slots, hooks, each
//     applied to every allocator, and to each new one;
//   - device iteration with all-or-nothing semantics for pause and resume (Note
//     [All-or-Nothing Transitions]);
//   - the memory margin, the stats and snapshot documents, background work;
//   - a count of dependents (stash arenas holding allocator pointers).
// The process-wide instance, its initialization from VMSTASH_CONF, the shutdown protocol
// and the control endpoint are process.h's; the C ABI is a thin shim over both.
//
// Note [All-or-Nothing Transitions]
//   A pause (or resume) of a tag over several devices (device -1: every device in use)
//   either changes every device where the tag has memory or none: when one device fails,
//   the devices this call already changed are changed back (resumed, or paused again) in
//   reverse order, and the error names the failing device and the outcome of that
//   rollback. Devices where the tag has no memory are skipped; a tag the process never
//   declared and never allocated in is NotFound. The result is true when some device
//   changed, false when every device already was in the requested state.
//
// Thread-safety: every method is thread-safe except the destructor, which needs that no
// other call is in flight (the process runtime's gate ensures it). AllocatorInUse and
// SlotTag are lock-free; creation, declarations and hooks take mu_, which is never held
// while an allocator runs a pause, a resume or a hook. Lock order: mu_, then an
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
#include "runtime/tag_registry.h"
#include "vmm/driver.h"

namespace vmstash {

class Runtime {
 public:
  static constexpr int kMaxDevices = 64;
  static constexpr int kAllDevices = -1;

  // InvalidArgument for a null driver; the driver's error when it cannot count devices.
  static absl::StatusOr<std::unique_ptr<Runtime>> Create(std::unique_ptr<Driver> driver, AllocatorOptions options);
  // Destroys the allocators (each synchronizes its device and returns its memory), then
  // the driver.
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  Driver& driver() const { return *driver_; }
  int device_count() const { return device_count_; }
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
  // undeclared tag, FailedPrecondition for a discard tag or one paused on some device.
  absl::Status SetBackupStore(TagId tag, const BackupStore& store);
  // The tag's store: its choice, else the allocator options' default.
  BackupStore TagBackupStore(TagId tag) const;
  absl::StatusOr<int> BindSlot(TagId tag);
  TagId SlotTag(int slot) const { return registry_.SlotTag(slot); }
  // Hooks run around every pause/resume of `tag` on each device (CachingAllocator::AddHooks).
  absl::Status AddHooks(TagId tag, CachingAllocator::TransitionHook before_pause,
                        CachingAllocator::TransitionHook after_resume);

  // Transitions over `device` or every device in use (kAllDevices); Note [All-or-Nothing
  // Transitions]. `live` (pauses only, optional): the byte ranges known to be live.
  absl::StatusOr<bool> Pause(TagId tag, int device, const CachingAllocator::LiveRanges* live = nullptr);
  absl::StatusOr<bool> Resume(TagId tag, int device);
  // Pauses `pause` and resumes `resume` in one transaction per device
  // (CachingAllocator::Switch, Note [Switch Protocol]) over `device` or every device in
  // use, all or nothing across devices (Note [All-or-Nothing Transitions]: devices already
  // switched are switched back). On each device only the tags with memory there take part.
  // `live` (optional): per device, per outgoing tag, the byte ranges known to be live.
  using LiveRangesByDevice = absl::flat_hash_map<int, CachingAllocator::LiveRangesByTag>;
  absl::StatusOr<bool> Switch(const std::vector<TagId>& pause, const std::vector<TagId>& resume, int device,
                              const LiveRangesByDevice* live = nullptr);
  // Backup arenas of `tag` (CachingAllocator::Prepare / ReleaseBackup) on `device` or
  // every device in use. A device where the tag never had memory has nothing to release.
  absl::Status Prepare(TagId tag, int device, std::size_t bytes);
  absl::Status ReleaseBackup(TagId tag, int device);
  absl::Status EmptyCache(int device, std::optional<TagId> tag);
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
  Runtime(std::unique_ptr<Driver> driver, int device_count, AllocatorOptions options);

  // The allocators `device` concerns: one (created on first use) or every one in use.
  absl::StatusOr<std::vector<CachingAllocator*>> Targets(int device);
  // The same without creating one: empty for a device the process never used.
  absl::StatusOr<std::vector<CachingAllocator*>> ExistingTargets(int device) const;
  absl::StatusOr<bool> Transition(TagId tag, int device, bool pause, const CachingAllocator::LiveRanges* live);
  bool TagKnown(TagId tag) const;
  absl::StatusOr<std::string> JsonOf(int device, bool snapshot);

  const std::unique_ptr<Driver> driver_;
  const int device_count_;
  const AllocatorOptions options_;
  mutable Mutex mu_;
  std::unique_ptr<CachingAllocator> owned_[kMaxDevices] ABSL_GUARDED_BY(mu_);
  std::atomic<CachingAllocator*> allocators_[kMaxDevices] = {};
  TagRegistry registry_;  // mutators and lists under mu_, SlotTag lock-free
  std::size_t memory_margin_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<int> dependents_{0};
};

}  // namespace vmstash

#endif  // VMSTASH_RUNTIME_RUNTIME_H_
