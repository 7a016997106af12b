// SwitchExecutor: see switch.h and Note [Switch Protocol].
#include "allocator/switch.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "allocator/hooks.h"
#include "allocator/switch_transaction.h"
#include "base/log.h"
#include "base/status_macros.h"

namespace vmstash {
namespace {

// Locks mutexes in the given order and unlocks them in reverse (the caller sorted them by
// tag id: Note [Switch Protocol]'s lock order).
class OrderedLocks {
 public:
  explicit OrderedLocks(std::vector<Mutex*> mus) ABSL_NO_THREAD_SAFETY_ANALYSIS : mus_(std::move(mus)) {
    for (Mutex* m : mus_) m->Lock();
  }
  ~OrderedLocks() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    for (auto it = mus_.rbegin(); it != mus_.rend(); ++it) (*it)->Unlock();
  }
  OrderedLocks(const OrderedLocks&) = delete;
  OrderedLocks& operator=(const OrderedLocks&) = delete;

 private:
  std::vector<Mutex*> mus_;
};

std::string TagList(const std::vector<TagPool*>& pools) {
  std::string out;
  for (const TagPool* p : pools) absl::StrAppend(&out, out.empty() ? "" : ",", p->name());
  return out.empty() ? "-" : out;
}

std::vector<TagPool*> ByTagId(std::vector<TagPool*> pools) {
  std::sort(pools.begin(), pools.end(), [](TagPool* a, TagPool* b) { return a->id() < b->id(); });
  return pools;
}

}  // namespace

absl::StatusOr<TransitionResult> SwitchExecutor::Run(SwitchChanges* changed) {
  absl::StatusOr<TransitionResult> done = RunLocked(changed);
  if (agree_ == nullptr || agreed_) return done;
  // Note [Agreed Switch]: no transaction ran (refused, vetoed, or nothing to move); the
  // control locks are released, nothing changed.
  absl::Status decided = (*agree_)(done.status());
  if (done.ok() && !decided.ok()) return decided;
  return done;
}

absl::StatusOr<TransitionResult> SwitchExecutor::RunLocked(SwitchChanges* changed) {
  std::vector<TagPool*> all = out_;
  all.insert(all.end(), in_.begin(), in_.end());
  ControlLocks control_locks;
  VMSTASH_RETURN_IF_ERROR(control_locks.Acquire(ByTagId(std::move(all)), host_->device(), "switch"));
  VMSTASH_RETURN_IF_ERROR(Choose());
  if (moving_out_.empty() && moving_in_.empty()) return TransitionResult::kAlreadyInState;
  VMSTASH_RETURN_IF_ERROR(RunBeforePauseHooks());
  VMSTASH_RETURN_IF_ERROR(Transact());
  if (changed != nullptr) {
    for (const TagPool* p : moving_out_) changed->paused.push_back(p->id());
    for (const TagPool* p : moving_in_) changed->resumed.push_back(p->id());
  }
  VMSTASH_RETURN_IF_ERROR(RunAfterResumeHooks());
  return TransitionResult::kDone;
}

absl::Status SwitchExecutor::Choose() {
  MutexLock lock(host_->mu());
  for (const std::vector<TagPool*>* pools : {&out_, &in_}) {
    for (TagPool* p : *pools) {
      if (p->state() == TagState::kBroken) return absl::FailedPreconditionError(p->broken_reason());
    }
  }
  for (TagPool* p : out_) {
    if (p->state() == TagState::kPaused) continue;  // already in its requested state
    VMSTASH_RETURN_IF_ERROR(host_->CheckPausableLocked(p));  // again at Begin: a hook may allocate
    moving_out_.push_back(p);
    out_hooks_.push_back(p->hooks());
    tags_.push_back(p->id());
  }
  for (TagPool* p : in_) {
    if (p->state() == TagState::kActive) continue;
    moving_in_.push_back(p);
    in_hooks_.push_back(p->hooks());
    tags_.push_back(p->id());
  }
  return absl::OkStatus();
}

absl::Status SwitchExecutor::RunBeforePauseHooks() {
  for (std::size_t k = 0; k < moving_out_.size(); ++k) {
    absl::Status s =
        RunHooks(host_, host_->device(), moving_out_[k]->id(), out_hooks_[k], /*before_pause=*/true, tags_);
    if (!s.ok()) {
      UndoBeforePauseHooks(k);
      return s;
    }
  }
  return absl::OkStatus();
}

void SwitchExecutor::UndoBeforePauseHooks(std::size_t n) {
  for (std::size_t k = 0; k < n; ++k) {
    absl::Status s =
        RunHooks(host_, host_->device(), moving_out_[k]->id(), out_hooks_[k], /*before_pause=*/false, tags_);
    if (!s.ok()) VMSTASH_LOG(kWarning, "vmstash: switch undone: {}", s.ToString());
  }
}

absl::Status SwitchExecutor::Transact() {
  std::vector<Mutex*> transition;
  std::vector<TagPool*> moving = moving_out_;
  moving.insert(moving.end(), moving_in_.begin(), moving_in_.end());
  for (TagPool* p : ByTagId(std::move(moving))) transition.push_back(p->transition_mu());
  std::vector<std::pair<TagPool*, const ByteRanges*>> out;
  for (TagPool* p : moving_out_) {
    const ByteRanges* live = nullptr;
    if (live_ != nullptr) {
      auto it = live_->find(p->id());
      if (it != live_->end()) live = &it->second;
    }
    out.emplace_back(p, live);
  }
  absl::Status failed;
  std::string broken;  // the rollback's tags it could not restore, for the message
  {
    for (TagPool* p : moving_out_) p->AnnounceTransition();  // Note [Background Steps Yield]
    for (TagPool* p : moving_in_) p->AnnounceTransition();
    OrderedLocks transition_locks(std::move(transition));
    for (TagPool* p : moving_out_) p->WithdrawTransition();
    for (TagPool* p : moving_in_) p->WithdrawTransition();
    SwitchTransaction transaction(host_, std::move(out), moving_in_, agree_, exchange_);
    agreed_ = agree_ != nullptr;
    failed = transaction.Run(&broken);
  }
  if (failed.ok()) return absl::OkStatus();
  UndoBeforePauseHooks(moving_out_.size());
  return absl::Status(failed.code(),
                      absl::StrCat("switch (pause ", TagList(out_), "; resume ", TagList(in_), ") on device ",
                                   host_->device(), " failed, ",
                                   broken.empty() ? "every tag is as it was: "
                                                  : absl::StrCat(broken, "; every other tag is as it was: "),
                                   failed.message()));
}

absl::Status SwitchExecutor::RunAfterResumeHooks() {
  // Every incoming tag's after-resume hooks run; the first failure is returned, marked done.
  absl::Status first;
  for (std::size_t k = 0; k < moving_in_.size(); ++k) {
    absl::Status s =
        RunHooks(host_, host_->device(), moving_in_[k]->id(), in_hooks_[k], /*before_pause=*/false, tags_);
    if (!s.ok() && first.ok()) {
      first = MarkTransitionDone(absl::Status(s.code(), absl::StrCat("switch done, but ", s.message())));
    }
  }
  return first;
}

}  // namespace vmstash
