// Hooks: see hooks.h.
#include "allocator/hooks.h"

#include <cstddef>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace vmstash {
namespace {

// The (allocator, tag) pairs whose hooks the calling thread is running: a hook that
// pauses or resumes its own tag would wait for itself on the tag's control lock.
struct HookFrame {
  const void* owner;
  TagId tag;
};
thread_local std::vector<HookFrame> hook_frames;

// Marks `tag` (and, for a switch, every other tag of it) as this thread's hooks' own.
class HookScope {
 public:
  HookScope(const void* owner, TagId tag, const std::vector<TagId>& also) : count_(1 + also.size()) {
    hook_frames.push_back({owner, tag});
    for (TagId t : also) hook_frames.push_back({owner, t});
  }
  ~HookScope() { hook_frames.resize(hook_frames.size() - count_); }
  HookScope(const HookScope&) = delete;
  HookScope& operator=(const HookScope&) = delete;

 private:
  std::size_t count_;
};

constexpr absl::string_view kDonePayload = "type.vmstash.dev/transition-done";

}  // namespace

bool InOwnHook(const void* owner, TagId tag) {
  for (const HookFrame& f : hook_frames) {
    if (f.owner == owner && f.tag == tag) return true;
  }
  return false;
}

bool TransitionDone(const absl::Status& status) {
  return !status.ok() && status.GetPayload(kDonePayload).has_value();
}

absl::Status MarkTransitionDone(absl::Status status) {
  if (!status.ok()) status.SetPayload(kDonePayload, absl::Cord("done"));
  return status;
}

absl::Status RunHooks(const void* owner, int device, TagId tag, const TransitionHooks& hooks, bool before_pause,
                      const std::vector<TagId>& also_mine) {
  HookScope scope(owner, tag, also_mine);
  absl::Status first;  // after-resume: every hook runs; the first error is returned, marked done
  for (const auto& [before, after] : hooks) {
    const TransitionHook& hook = before_pause ? before : after;
    if (!hook) continue;
    absl::Status s = hook(tag, device);
    if (s.ok()) continue;
    if (before_pause) {
      return absl::Status(s.code(),
                          absl::StrCat("pause of tag '", TagName(tag), "': before-pause hook: ", s.message()));
    }
    if (first.ok()) {
      first = MarkTransitionDone(absl::Status(
          s.code(), absl::StrCat("tag '", TagName(tag), "' resumed, but an after-resume hook failed: ", s.message())));
    }
  }
  return first;
}

absl::Status ControlLocks::Acquire(const std::vector<TagPool*>& pools, int device, const char* what) {
  const bool in_hook = !hook_frames.empty();
  for (TagPool* pool : pools) {
    Mutex* mu = pool->control_mu();
    if (!in_hook) {
      mu->Lock();
    } else if (!mu->TryLock()) {
      for (auto it = held_.rbegin(); it != held_.rend(); ++it) (*it)->Unlock();
      held_.clear();
      return absl::FailedPreconditionError(absl::StrCat(
          what, " of tag '", TagName(pool->id()), "' on device ", device, " from a hook: the tag is in another "
          "transition, and a hook may not wait for one (that transition may be waiting for the hook's own); "
          "retry after the hook returns"));
    }
    held_.push_back(mu);
  }
  return absl::OkStatus();
}

}  // namespace vmstash
