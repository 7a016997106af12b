// TagRegistry: the runtime's one record of the tags a process declared: each tag's
// policy (in declaration order), the backup stores chosen for tags, the tags not prepared
// ahead, the tag bound to each allocation slot, and the pause/
// resume hooks. Tag names and ids are the intern table's (allocator/tag.h, names only);
// each CachingAllocator keeps the policy of the pools it holds, created from this record
// (Runtime applies every declaration and hook to every allocator, and to each new one).
//
// Thread-safety: the mutators and Declared/PolicyOf/Hooks are called under the owning
// Runtime's lock (Runtime::mu_); SlotTag is lock-free (an atomic per slot, bound once and
// never unbound), for the slot allocation entry points.
#ifndef VMSTASH_RUNTIME_TAG_REGISTRY_H_
#define VMSTASH_RUNTIME_TAG_REGISTRY_H_

#include <atomic>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "allocator/caching_allocator.h"
#include "allocator/tag.h"

namespace vmstash {

struct TagHooks {
  TagId tag;
  CachingAllocator::TransitionHook before_pause;
  CachingAllocator::TransitionHook after_resume;
};

class TagRegistry {
 public:
  static constexpr int kSlots = 32;

  TagRegistry();
  TagRegistry(const TagRegistry&) = delete;
  TagRegistry& operator=(const TagRegistry&) = delete;

  // Records `policy` for `tag`: true when the tag is new, false when it already has that
  // policy; FailedPrecondition naming both policies when it has the other one.
  absl::StatusOr<bool> Declare(TagId tag, Policy policy);
  // Undoes the Declare that returned true (a declaration that could not be applied).
  void Forget(TagId tag);
  std::optional<Policy> PolicyOf(TagId tag) const;
  const std::vector<std::pair<TagId, Policy>>& Declared() const { return declared_; }
  // The backup store chosen for a tag (absent: the allocator options' default).
  void SetStore(TagId tag, const BackupStore& store);
  std::optional<BackupStore> StoreOf(TagId tag) const;
  const std::vector<std::pair<TagId, BackupStore>>& Stores() const { return stores_; }
  // Tags whose backup is not prepared ahead (CachingAllocator::SetPrepareAhead): every
  // other tag's is.
  void SetPrepareAhead(TagId tag, bool ahead);
  const std::vector<TagId>& NotPreparedAhead() const { return not_ahead_; }

  // The slot bound to `tag`, binding the first free one; ResourceExhausted when all are bound.
  absl::StatusOr<int> BindSlot(TagId tag);
  // The tag bound to `slot`, or -1.
  TagId SlotTag(int slot) const { return slots_[slot].load(std::memory_order_acquire); }

  void AddHooks(TagHooks hooks) { hooks_.push_back(std::move(hooks)); }
  const std::vector<TagHooks>& Hooks() const { return hooks_; }

 private:
  std::vector<std::pair<TagId, Policy>> declared_;
  std::vector<std::pair<TagId, BackupStore>> stores_;
  std::vector<TagId> not_ahead_;
  std::vector<TagHooks> hooks_;
  std::atomic<TagId> slots_[kSlots];
};

}  // namespace vmstash

#endif  // VMSTASH_RUNTIME_TAG_REGISTRY_H_
