// Hooks: running a tag's transition hooks, and taking the control locks of a transition's
// tags (Note [Pause/Resume Protocol], "Hooks"; Note [Switch Protocol]).
//
// What: RunHooks runs a tag's before-pause or after-resume hooks, marking the calling
// thread as running the hooks of that tag (and of every tag of its switch); InOwnHook
// tells a transition requested from such a hook that it would wait for itself. A hook may
// allocate and free, but not pause, resume or switch the tags it runs for.
// ControlLocks takes the control locks of a transition's pools in ascending tag id order
// (the one order every multi-tag caller uses); from a hook it only tries them, since
// waiting there could deadlock with a transition that holds one and waits for the hook's.
// TransitionDone / MarkTransitionDone: the mark (a status payload) of an error returned
// by a transition that is done (every tag in its requested state) but whose after-resume
// hooks failed.
//
// Thread-safety: the hook frames are per thread; ControlLocks is used by one thread.
#ifndef VMSTASH_ALLOCATOR_HOOKS_H_
#define VMSTASH_ALLOCATOR_HOOKS_H_

#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "allocator/tag.h"
#include "allocator/tag_pool.h"
#include "base/mutex.h"

namespace vmstash {

// True when the calling thread runs hooks of `tag` for `owner` (an allocator): a
// transition of that tag requested now would wait for itself.
bool InOwnHook(const void* owner, TagId tag);

// Runs the before-pause (or after-resume) hooks of `tag`, marked as this thread's hooks of
// `tag` and of `also_mine`. Before pause: the first error, naming the tag (a veto).
// After resume: every hook runs; the first error, marked done (MarkTransitionDone).
absl::Status RunHooks(const void* owner, int device, TagId tag, const TransitionHooks& hooks, bool before_pause,
                      const std::vector<TagId>& also_mine = {});

bool TransitionDone(const absl::Status& status);
absl::Status MarkTransitionDone(absl::Status status);

// The control locks of a transition's pools, taken in the order given (the caller sorted
// them by tag id) and released in reverse. Called from a hook (whose thread already holds
// the control locks of the hook's own transition), a lock is only tried: a busy one is
// FailedPrecondition, nothing held. "From a hook" is known per thread: a hook that hands a
// transition to another thread and waits for it is not recognised, and may deadlock;
// hooks must not.
class ControlLocks {
 public:
  ControlLocks() = default;
  ~ControlLocks() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    for (auto it = held_.rbegin(); it != held_.rend(); ++it) (*it)->Unlock();
  }
  ControlLocks(const ControlLocks&) = delete;
  ControlLocks& operator=(const ControlLocks&) = delete;
  // `what`: the request, for the message.
  absl::Status Acquire(const std::vector<TagPool*>& pools, int device, const char* what)
      ABSL_NO_THREAD_SAFETY_ANALYSIS;

 private:
  std::vector<Mutex*> held_;
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_HOOKS_H_
