// The tag registry: see tag_registry.h.
#include "runtime/tag_registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace vmstash {

TagRegistry::TagRegistry() {
  for (auto& s : slots_) s.store(-1, std::memory_order_relaxed);
}

absl::StatusOr<bool> TagRegistry::Declare(TagId tag, Policy policy) {
  if (std::optional<Policy> known = PolicyOf(tag)) {
    if (*known == policy) return false;
    return absl::FailedPreconditionError(absl::StrCat("tag '", TagName(tag), "' already exists with policy ",
                                                      PolicyName(*known), "; cannot declare it ", PolicyName(policy)));
  }
  declared_.emplace_back(tag, policy);
  return true;
}

void TagRegistry::Forget(TagId tag) {
  declared_.erase(std::remove_if(declared_.begin(), declared_.end(), [tag](const auto& d) { return d.first == tag; }),
                  declared_.end());
  stores_.erase(std::remove_if(stores_.begin(), stores_.end(), [tag](const auto& d) { return d.first == tag; }),
                stores_.end());
}

std::optional<Policy> TagRegistry::PolicyOf(TagId tag) const {
  for (const auto& [known, policy] : declared_) {
    if (known == tag) return policy;
  }
  return std::nullopt;
}

void TagRegistry::SetStore(TagId tag, const BackupStore& store) {
  for (auto& [known, s] : stores_) {
    if (known == tag) {
      s = store;
      return;
    }
  }
  stores_.emplace_back(tag, store);
}

std::optional<BackupStore> TagRegistry::StoreOf(TagId tag) const {
  for (const auto& [known, s] : stores_) {
    if (known == tag) return s;
  }
  return std::nullopt;
}

void TagRegistry::SetPrepareAhead(TagId tag, bool ahead) {
  auto it = std::find(not_ahead_.begin(), not_ahead_.end(), tag);
  if (ahead && it != not_ahead_.end()) not_ahead_.erase(it);
  if (!ahead && it == not_ahead_.end()) not_ahead_.push_back(tag);
}

absl::StatusOr<int> TagRegistry::BindSlot(TagId tag) {
  for (int s = 0; s < kSlots; ++s) {
    const TagId bound = slots_[s].load(std::memory_order_relaxed);
    if (bound == tag) return s;
    if (bound < 0) {
      slots_[s].store(tag, std::memory_order_release);
      return s;
    }
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("all ", kSlots, " tag slots are bound; tag '", TagName(tag), "' gets none"));
}

}  // namespace vmstash
