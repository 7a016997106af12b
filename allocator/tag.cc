#include "allocator/tag.h"

#include <pthread.h>

#include <array>
#include <atomic>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/mutex.h"

namespace vmstash {
namespace {

// Process-wide intern table. Names are published through atomics so TagName() does not
// lock; entries are never removed, so the storage lives as long as the process.
struct InternTable {
  Mutex mu;
  absl::flat_hash_map<std::string, TagId> ids ABSL_GUARDED_BY(mu);
  std::array<std::atomic<const std::string*>, kMaxTags> names{};
  std::atomic<int> count{0};

  InternTable() {
    auto* name = new std::string("default");
    ids.emplace(*name, kDefaultTag);
    names[kDefaultTag].store(name, std::memory_order_release);
    count.store(1, std::memory_order_release);
  }
};

InternTable& Table();

// fork(): a thread interning a name at that moment would leave the child's copy of the
// lock held by a thread the child does not have, and the child's first InternTag would
// hang. So the lock is held across fork() (the table is copied consistent) and released
// in both processes. The lock is a leaf (nothing is locked under it), and these handlers
// are registered at static initialization, before any other vmstash handler (process.h,
// Note [Fork]), so their prepare runs last (prepare handlers run in reverse order of
// registration): a thread holding an outer lock that wants this one cannot deadlock it.
void LockTableForFork() ABSL_NO_THREAD_SAFETY_ANALYSIS { Table().mu.Lock(); }
void UnlockTableAfterFork() ABSL_NO_THREAD_SAFETY_ANALYSIS { Table().mu.Unlock(); }

InternTable& Table() {
  static InternTable* table = [] {
    auto* t = new InternTable();  // never destroyed: safe at exit
    ::pthread_atfork(LockTableForFork, UnlockTableAfterFork, UnlockTableAfterFork);
    return t;
  }();
  return *table;
}
[[maybe_unused]] const bool fork_handlers_registered = (Table(), true);

thread_local TagId current_tag = kDefaultTag;

}  // namespace

absl::StatusOr<Policy> ParsePolicy(absl::string_view text) {
  if (text == "discard") return Policy::kDiscard;
  if (text == "backup") return Policy::kBackup;
  return absl::InvalidArgumentError(absl::StrCat("unknown policy '", text, "' (expected discard or backup)"));
}

absl::string_view PolicyName(Policy policy) { return policy == Policy::kBackup ? "backup" : "discard"; }

absl::Status ValidateTagName(absl::string_view name) {
  if (name.empty()) return absl::InvalidArgumentError("tag name is empty");
  if (name.size() > kMaxTagNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("tag name '", name.substr(0, 16), "...' is ", name.size(), " bytes (at most 64)"));
  }
  for (std::size_t i = 0; i < name.size(); ++i) {
    unsigned char c = static_cast<unsigned char>(name[i]);
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "tag name has a non-printable or space character (byte 0x%02x at %d); use printable ASCII", c, i));
    }
  }
  return absl::OkStatus();
}

namespace {

// The id of a valid `name`, or -1 when it was never interned; the table's lock is held.
TagId FindLocked(InternTable& table, absl::string_view name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(table.mu) {
  auto it = table.ids.find(name);
  return it == table.ids.end() ? -1 : it->second;
}

}  // namespace

absl::StatusOr<TagId> InternTag(absl::string_view name) {
  absl::Status valid = ValidateTagName(name);
  if (!valid.ok()) return valid;
  InternTable& table = Table();
  MutexLock lock(&table.mu);
  if (const TagId found = FindLocked(table, name); found >= 0) return found;
  int id = table.count.load(std::memory_order_relaxed);
  if (id >= kMaxTags) {
    return absl::ResourceExhaustedError(absl::StrCat("too many tag names (", kMaxTags, "); cannot add '", name, "'"));
  }
  auto* stored = new std::string(name);
  table.ids.emplace(*stored, id);
  table.names[id].store(stored, std::memory_order_release);
  table.count.store(id + 1, std::memory_order_release);
  return id;
}

absl::StatusOr<TagId> FindTag(absl::string_view name) {
  absl::Status valid = ValidateTagName(name);
  if (!valid.ok()) return valid;
  InternTable& table = Table();
  MutexLock lock(&table.mu);
  const TagId found = FindLocked(table, name);
  if (found < 0) {
    return absl::NotFoundError(absl::StrCat("tag '", name, "' does not exist in this process (never created or used)"));
  }
  return found;
}

absl::string_view TagName(TagId id) {
  if (id < 0 || id >= kMaxTags) return "";
  const std::string* name = Table().names[id].load(std::memory_order_acquire);
  return name == nullptr ? absl::string_view() : absl::string_view(*name);
}

int TagCount() { return Table().count.load(std::memory_order_acquire); }

TagId CurrentTag() { return current_tag; }
void SetCurrentTag(TagId id) { current_tag = id; }

}  // namespace vmstash
