// Tags: named groups of allocations paused and resumed together (docs/architecture.md §2, §5).
//
// A tag name is 1..64 printable ASCII characters (0x21..0x7e; no spaces or control
// characters). Names are interned process-wide into small integer TagIds, so the current
// tag of a thread is one int and the allocation path never hashes a string. The intern
// table holds at most kMaxTags names and is never shrunk (tags are few and long-lived).
// TagId 0 is "default".
//
// The current tag is thread-local: SetCurrentTag()/ScopedTag select where the calling
// thread's allocations go. Policies belong to the allocator that owns a tag's memory
// (CachingAllocator::CreateTag), not to the name.
//
// Thread-safety: every function is thread-safe.
#ifndef VMSTASH_ALLOCATOR_TAG_H_
#define VMSTASH_ALLOCATOR_TAG_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace vmstash {

using TagId = std::int32_t;
inline constexpr TagId kDefaultTag = 0;
inline constexpr int kMaxTags = 4096;
inline constexpr std::size_t kMaxTagNameBytes = 64;

// What pause does with a tag's bytes.
enum class Policy {
  kDiscard,  // contents are undefined after resume
  kBackup,   // live bytes are copied to the backup arena and restored exactly
};
absl::StatusOr<Policy> ParsePolicy(absl::string_view text);
absl::string_view PolicyName(Policy policy);

// OK, or InvalidArgument saying why `name` is not a valid tag name.
absl::Status ValidateTagName(absl::string_view name);
// The id of `name`, interning it on first use. InvalidArgument for a bad name;
// ResourceExhausted when kMaxTags names exist.
absl::StatusOr<TagId> InternTag(absl::string_view name);
// The id of `name` when it is already interned, never interning it: for requests that
// only name an existing tag (pause, resume, switch, ...), so that unknown names cannot fill
// the table. InvalidArgument for a bad name; NotFound for a name never interned.
absl::StatusOr<TagId> FindTag(absl::string_view name);
// The name of an interned id ("" for an id never handed out).
absl::string_view TagName(TagId id);
// Number of interned names (ids are 0..count-1).
int TagCount();

// The calling thread's current tag (kDefaultTag until set).
TagId CurrentTag();
void SetCurrentTag(TagId id);

// Sets the current tag for a scope and restores the previous one.
class ScopedTag {
 public:
  explicit ScopedTag(TagId id) : previous_(CurrentTag()) { SetCurrentTag(id); }
  ~ScopedTag() { SetCurrentTag(previous_); }
  ScopedTag(const ScopedTag&) = delete;
  ScopedTag& operator=(const ScopedTag&) = delete;

 private:
  TagId previous_;
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_TAG_H_
