// The process runtime's state: see runtime.h.
#include "runtime/runtime.h"

#include <algorithm>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "allocator/snapshot.h"
#include "allocator/stats.h"
#include "base/status_macros.h"

namespace vmstash {

absl::StatusOr<std::unique_ptr<Runtime>> Runtime::Create(std::unique_ptr<Driver> driver, AllocatorOptions options,
                                                         node::NodeOptions node) {
  if (driver == nullptr) return absl::InvalidArgumentError("Runtime: driver is null");
  VMSTASH_ASSIGN_OR_RETURN(const int count, driver->DeviceCount());
  auto leases = std::make_shared<NodeLeases>(driver.get(), std::move(node));
  options.host_leases = leases;
  return std::unique_ptr<Runtime>(
      new Runtime(std::move(driver), std::min(count, kMaxDevices), std::move(options), std::move(leases)));
}

Runtime::Runtime(std::unique_ptr<Driver> driver, int device_count, AllocatorOptions options,
                 std::shared_ptr<NodeLeases> node)
    : driver_(std::move(driver)), device_count_(device_count), node_(std::move(node)), options_(std::move(options)) {}

Runtime::~Runtime() {
  MutexLock lock(&mu_);
  for (auto& a : allocators_) a.store(nullptr, std::memory_order_release);
  for (auto& a : owned_) a.reset();  // before driver_, which they use
  // Then options_ and node_, the last holders of the node pool's source (its arenas gave
  // their leases back), which unregisters its memory while driver_ lives.
}

absl::Status Runtime::CheckDevice(int device) const {
  if (device < 0 || device >= device_count_) {
    return absl::InvalidArgumentError(absl::StrCat("device ", device, " does not exist (", device_count_,
                                                   " device(s), driver ", driver_->Name(), ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<CachingAllocator*> Runtime::Allocator(int device) {
  if (CachingAllocator* a = AllocatorInUse(device)) return a;
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  MutexLock lock(&mu_);
  if (owned_[device] == nullptr) {
    VMSTASH_ASSIGN_OR_RETURN(std::unique_ptr<CachingAllocator> a,
                             CachingAllocator::Create(driver_.get(), device, options_));
    for (const auto& [tag, policy] : registry_.Declared()) VMSTASH_RETURN_IF_ERROR(a->CreateTag(tag, policy));
    // Checked when it was set (or set ahead of its pauses); a directory gone since fails
    // the pause that writes there, not the device's first use.
    for (const auto& [tag, store] : registry_.Stores()) {
      VMSTASH_RETURN_IF_ERROR(a->SetBackupStore(tag, store, /*directory_must_exist=*/false));
    }
    for (TagId tag : registry_.NotPreparedAhead()) VMSTASH_RETURN_IF_ERROR(a->SetPrepareAhead(tag, false));
    for (const TagHooks& h : registry_.Hooks()) {
      VMSTASH_RETURN_IF_ERROR(a->AddHooks(h.tag, h.before_pause, h.after_resume));
    }
    a->SetMemoryMargin(memory_margin_);
    owned_[device] = std::move(a);
    allocators_[device].store(owned_[device].get(), std::memory_order_release);
  }
  return owned_[device].get();
}

std::vector<CachingAllocator*> Runtime::AllocatorsInUse() const {
  std::vector<CachingAllocator*> out;
  for (int d = 0; d < kMaxDevices; ++d) {
    if (CachingAllocator* a = AllocatorInUse(d)) out.push_back(a);
  }
  return out;
}

absl::StatusOr<std::vector<CachingAllocator*>> Runtime::Targets(int device) {
  if (device == kAllDevices) return AllocatorsInUse();
  VMSTASH_ASSIGN_OR_RETURN(CachingAllocator * a, Allocator(device));
  return std::vector<CachingAllocator*>{a};
}

absl::StatusOr<std::vector<CachingAllocator*>> Runtime::ExistingTargets(int device) const {
  if (device == kAllDevices) return AllocatorsInUse();
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  if (CachingAllocator* a = AllocatorInUse(device)) return std::vector<CachingAllocator*>{a};
  return std::vector<CachingAllocator*>{};  // never used: no tag has memory there
}

absl::Status Runtime::CreateTag(TagId tag, Policy policy) {
  MutexLock lock(&mu_);
  // All or nothing: a device where the tag was used before its declaration has it with
  // policy discard; refuse another policy before any device changes.
  for (auto& a : owned_) {
    if (a == nullptr || registry_.PolicyOf(tag).has_value()) continue;  // declared: the registry answers
    absl::StatusOr<Policy> there = a->TagPolicy(tag);
    if (there.ok() && *there != policy) {
      return absl::FailedPreconditionError(absl::StrCat("tag '", TagName(tag), "' is already in use on device ",
                                                        a->device(), " with policy ", PolicyName(*there),
                                                        " (it was allocated in before being declared); declare "
                                                        "tags before their first allocation"));
    }
  }
  VMSTASH_ASSIGN_OR_RETURN(const bool added, registry_.Declare(tag, policy));
  if (!added) return absl::OkStatus();
  std::vector<CachingAllocator*> created;
  for (auto& a : owned_) {
    if (a == nullptr) continue;
    const bool existed = a->TagPolicy(tag).ok();
    if (absl::Status s = a->CreateTag(tag, policy); !s.ok()) {
      // A concurrent first allocation made the tag here meanwhile: undo this call's pools.
      for (CachingAllocator* c : created) c->DropEmptyTag(tag);
      registry_.Forget(tag);
      return s;
    }
    if (!existed) created.push_back(a.get());
  }
  return absl::OkStatus();
}

std::optional<Policy> Runtime::TagPolicy(TagId tag) const {
  MutexLock lock(&mu_);
  return registry_.PolicyOf(tag);
}

std::vector<std::pair<TagId, Policy>> Runtime::Tags() const {
  MutexLock lock(&mu_);
  return registry_.Declared();
}

absl::Status Runtime::SetBackupStore(TagId tag, const BackupStore& store, bool directory_must_exist) {
  VMSTASH_RETURN_IF_ERROR(CheckBackupStore(store, directory_must_exist));
  // Each allocator waits for the tag's transition (a pause, a switch waiting for its
  // agreement, a background preparation step) before it changes the store: that wait is
  // made without mu_, so every other runtime call goes on meanwhile. store_mu_ keeps two
  // of these calls from interleaving.
  MutexLock serial(&store_mu_);
  BackupStore previous;
  std::vector<CachingAllocator*> present;
  {
    MutexLock lock(&mu_);
    const std::optional<Policy> policy = registry_.PolicyOf(tag);
    if (!policy) {
      return absl::NotFoundError(absl::StrCat("tag '", TagName(tag), "' was never declared; declare it with policy "
                                              "backup before choosing its backup store"));
    }
    if (*policy != Policy::kBackup) {
      return absl::FailedPreconditionError(absl::StrCat("tag '", TagName(tag), "' has policy discard: its pauses keep "
                                                        "no bytes, so it has no backup store"));
    }
    previous = registry_.StoreOf(tag).value_or(options_.backup_store);
    registry_.SetStore(tag, store);  // a device used for the first time from here on gets it
    for (auto& a : owned_) {
      if (a != nullptr) present.push_back(a.get());
    }
  }
  // All or nothing: a device that refuses (the tag is paused there) puts back the others.
  std::vector<std::pair<CachingAllocator*, BackupStore>> changed;
  absl::Status failed;
  for (CachingAllocator* a : present) {
    absl::StatusOr<BackupStore> before = a->TagBackupStore(tag);
    if (!before.ok()) continue;  // declared tags exist on every allocator; defensive
    if (failed = a->SetBackupStore(tag, store, directory_must_exist); !failed.ok()) break;
    changed.emplace_back(a, *before);
  }
  if (failed.ok()) return absl::OkStatus();
  {
    MutexLock lock(&mu_);
    registry_.SetStore(tag, previous);
    for (auto& a : owned_) {  // made meanwhile, with the store now taken back
      if (a != nullptr && std::find(present.begin(), present.end(), a.get()) == present.end()) {
        changed.emplace_back(a.get(), previous);
      }
    }
  }
  for (auto& [c, before] : changed) {
    if (absl::Status undo = c->SetBackupStore(tag, before, /*directory_must_exist=*/false); !undo.ok()) {
      return absl::Status(failed.code(), absl::StrCat(failed.message(), "; putting back the store on device ",
                                                      c->device(), " failed too: ", undo.message()));
    }
  }
  return failed;
}

absl::Status Runtime::SetPrepareAhead(TagId tag, bool ahead) {
  MutexLock lock(&mu_);
  if (!registry_.PolicyOf(tag)) {
    return absl::NotFoundError(absl::StrCat("tag '", TagName(tag), "' was never declared; declare it before choosing "
                                            "whether its backup is prepared ahead"));
  }
  const bool before = std::find(registry_.NotPreparedAhead().begin(), registry_.NotPreparedAhead().end(), tag) ==
                      registry_.NotPreparedAhead().end();
  if (before == ahead) return absl::OkStatus();
  registry_.SetPrepareAhead(tag, ahead);  // a device used for the first time from here on gets it
  // All or nothing: a device that refuses puts the others back.
  for (int i = 0; i < kMaxDevices; ++i) {
    if (owned_[i] == nullptr) continue;
    absl::Status s = owned_[i]->SetPrepareAhead(tag, ahead);
    if (s.ok()) continue;
    registry_.SetPrepareAhead(tag, before);
    for (int j = 0; j < i; ++j) {
      if (owned_[j] != nullptr) (void)owned_[j]->SetPrepareAhead(tag, before);
    }
    return s;
  }
  return absl::OkStatus();
}

BackupStore Runtime::TagBackupStore(TagId tag) const {
  MutexLock lock(&mu_);
  if (std::optional<BackupStore> s = registry_.StoreOf(tag)) return *s;
  return options_.backup_store;
}

absl::StatusOr<int> Runtime::BindSlot(TagId tag) {
  MutexLock lock(&mu_);
  return registry_.BindSlot(tag);
}

absl::Status Runtime::AddHooks(TagId tag, CachingAllocator::TransitionHook before_pause,
                               CachingAllocator::TransitionHook after_resume) {
  MutexLock lock(&mu_);
  for (auto& a : owned_) {
    if (a != nullptr) VMSTASH_RETURN_IF_ERROR(a->AddHooks(tag, before_pause, after_resume));
  }
  registry_.AddHooks(TagHooks{tag, std::move(before_pause), std::move(after_resume)});
  return absl::OkStatus();
}

bool Runtime::TagKnown(TagId tag) const {
  if (TagPolicy(tag).has_value()) return true;
  for (CachingAllocator* a : AllocatorsInUse()) {
    if (a->TagPolicy(tag).ok()) return true;
  }
  return false;
}

namespace {

// A device's error that did not stop the transition (its after-resume hooks failed).
struct HookFailure {
  int device;
  absl::Status status;
};

// The state of `tag` on `a` ("active", "paused", "broken", ...), read from the allocator's
// snapshot (no driver call, so a fault-injected driver does not change the answer).
std::string StateOn(const CachingAllocator& a, TagId tag) {
  const absl::string_view name = TagName(tag);
  for (const TagSnapshot& t : a.TakeSnapshot().tags) {
    if (t.name == name) return t.state;
  }
  return "absent";
}

std::string TagList(const std::vector<TagId>& tags) {
  std::string out = "[";
  for (TagId t : tags) absl::StrAppend(&out, out.size() > 1 ? ", " : "", "'", TagName(t), "'");
  return out + "]";
}

// The hook failure recorded for `device`, if any, as " (its after-resume hook had failed: ...)".
std::string HookNote(const std::vector<HookFailure>& failures, int device) {
  for (const HookFailure& f : failures) {
    if (f.device == device) return absl::StrCat(" (its after-resume hook had failed: ", f.status.message(), ")");
  }
  return "";
}

// Case (2): the transition `what` is done on every device; `failures` lists the hooks.
absl::Status DoneButHooksFailed(absl::string_view what, const std::vector<HookFailure>& failures) {
  std::string message = absl::StrCat(what, " is done on every device it concerns, but after-resume hooks failed on ");
  for (std::size_t i = 0; i < failures.size(); ++i) {
    absl::StrAppend(&message, i == 0 ? "" : "; ", "device ", failures[i].device, ": ", failures[i].status.message());
  }
  return CachingAllocator::MarkTransitionDone(absl::Status(failures.front().status.code(), message));
}

// A switch's change of chunks: it may release the paused tags', map the resumed tags'.
ChunkChange Switching(const std::vector<TagId>& pause, const std::vector<TagId>& resume, int device) {
  ChunkChange c{pause, pause, false, device, resume};
  c.regrant.insert(c.regrant.end(), resume.begin(), resume.end());
  return c;
}

}  // namespace

// Note [Mapped Tags] (tag_share.h): Before at construction (its veto in status()), After
// at destruction, whatever happened between.
class Runtime::Observed {
 public:
  Observed(const Runtime& runtime, ChunkChange change) : observer_(runtime.Observer()), change_(std::move(change)) {
    if (observer_ != nullptr) status_ = observer_->BeforeChunksChange(change_);
  }
  ~Observed() {
    if (observer_ != nullptr) observer_->AfterChunksChange(change_);
  }
  Observed(const Observed&) = delete;
  Observed& operator=(const Observed&) = delete;
  const absl::Status& status() const { return status_; }

 private:
  const std::shared_ptr<TransitionObserver> observer_;
  const ChunkChange change_;
  absl::Status status_;
};

void Runtime::SetTransitionObserver(std::shared_ptr<TransitionObserver> observer) {
  MutexLock lock(&mu_);
  observer_ = std::move(observer);
}

std::shared_ptr<TransitionObserver> Runtime::Observer() const {
  MutexLock lock(&mu_);
  return observer_;
}

bool Runtime::TransitionDone(const absl::Status& status) { return CachingAllocator::TransitionDone(status); }

const CachingAllocator::LiveRanges* Runtime::Hints::For(int device, TagId tag) const {
  if (by_device == nullptr) return all;
  auto d = by_device->find(device);
  if (d == by_device->end()) return nullptr;
  auto t = d->second.find(tag);
  return t == d->second.end() ? nullptr : &t->second;
}

absl::StatusOr<bool> Runtime::Pause(TagId tag, int device, const CachingAllocator::LiveRanges* live) {
  return Transition(tag, device, /*pause=*/true, Hints{live, nullptr});
}

absl::StatusOr<bool> Runtime::Pause(TagId tag, int device, const LiveRangesByDevice& live) {
  return Transition(tag, device, /*pause=*/true, Hints{nullptr, &live});
}

absl::StatusOr<bool> Runtime::Resume(TagId tag, int device) {
  return Transition(tag, device, /*pause=*/false, Hints{});
}

namespace {

// Case (1)'s rollback of a pause or resume: `changed` transitioned back, last first; the
// outcome of each, as "; rolled back: device 0 resumed again, ...".
std::string UndoTransitions(TagId tag, bool pause, const std::vector<CachingAllocator*>& changed,
                            const std::vector<HookFailure>& hook_failures) {
  std::string rollback;
  for (auto it = changed.rbegin(); it != changed.rend(); ++it) {
    CachingAllocator* a = *it;
    absl::StatusOr<CachingAllocator::Transition> undo = pause ? a->Resume(tag) : a->Pause(tag);
    std::string outcome;
    if (undo.ok()) {
      outcome = pause ? "resumed again" : absl::StrCat("paused again", HookNote(hook_failures, a->device()));
    } else if (pause && CachingAllocator::TransitionDone(undo.status())) {  // resumed; an after-resume hook failed
      outcome = absl::StrCat("resumed again (its after-resume hook failed: ", undo.status().message(), ")");
    } else {
      outcome = absl::StrCat("NOT ", pause ? "resumed" : "paused", " again: the tag is ", StateOn(*a, tag),
                             " there (", undo.status().message(), "); ", pause ? "resume" : "pause",
                             " it on device ", a->device(), " to finish the rollback");
    }
    absl::StrAppend(&rollback, rollback.empty() ? "; rolled back: " : ", ", "device ", a->device(), " ", outcome);
  }
  return rollback;
}

}  // namespace

// Note [All-or-Nothing Transitions].
absl::StatusOr<bool> Runtime::Transition(TagId tag, int device, bool pause, const Hints& hints) {
  const Observed observed(*this, ChunkChange{pause ? std::vector<TagId>{tag} : std::vector<TagId>{}, {tag}, false,
                                             device, pause ? std::vector<TagId>{} : std::vector<TagId>{tag}});
  VMSTASH_RETURN_IF_ERROR(observed.status());
  VMSTASH_ASSIGN_OR_RETURN(const std::vector<CachingAllocator*> targets, ExistingTargets(device));
  const char* verb = pause ? "pause" : "resume";
  std::vector<CachingAllocator*> changed;
  std::vector<HookFailure> hook_failures;
  for (CachingAllocator* a : targets) {
    // A device where the tag never had memory has nothing to do. Asked first, so that a
    // NotFound of the transition itself (a disk backup directory that is gone) is an error.
    if (!a->TagPolicy(tag).ok()) continue;
    absl::StatusOr<CachingAllocator::Transition> r =
        pause ? a->Pause(tag, hints.For(a->device(), tag)) : a->Resume(tag);
    if (r.ok()) {
      if (*r == CachingAllocator::Transition::kDone) changed.push_back(a);
      continue;
    }
    if (CachingAllocator::TransitionDone(r.status())) {  // case (2): resumed here, an after-resume hook failed
      changed.push_back(a);
      hook_failures.push_back({a->device(), r.status()});
      continue;
    }
    return absl::Status(r.status().code(),
                        absl::StrCat(verb, " of tag '", TagName(tag), "' failed on device ", a->device(),
                                     " (the tag is ", StateOn(*a, tag), " there): ", r.status().message(),
                                     UndoTransitions(tag, pause, changed, hook_failures)));
  }
  if (!hook_failures.empty()) {
    return DoneButHooksFailed(absl::StrCat(verb, " of tag '", TagName(tag), "'"), hook_failures);
  }
  if (changed.empty() && !TagKnown(tag)) {
    return absl::NotFoundError(absl::StrCat(verb, ": tag '", TagName(tag), "' does not exist in this process"));
  }
  return !changed.empty();
}

namespace {

using SwitchedDevice = std::pair<CachingAllocator*, CachingAllocator::SwitchChanges>;

// Case (1)'s rollback of a switch: each device of `changed` switched back, last first.
std::string UndoSwitches(const std::vector<SwitchedDevice>& changed, const std::vector<HookFailure>& hook_failures) {
  std::string rollback;
  for (auto it = changed.rbegin(); it != changed.rend(); ++it) {
    CachingAllocator* a = it->first;
    const CachingAllocator::SwitchChanges& done = it->second;
    CachingAllocator::SwitchChanges back;
    absl::StatusOr<CachingAllocator::Transition> undo = a->Switch(done.resumed, done.paused, nullptr, &back);
    std::string outcome;
    if (undo.ok()) {
      outcome = absl::StrCat("switched back", HookNote(hook_failures, a->device()));
    } else if (!back.paused.empty() || !back.resumed.empty()) {  // switched back; a hook failed
      outcome = absl::StrCat("switched back (an after-resume hook failed: ", undo.status().message(), ")");
    } else {
      std::string states;
      for (const std::vector<TagId>* tags : {&done.paused, &done.resumed}) {
        for (TagId t : *tags) absl::StrAppend(&states, states.empty() ? "" : ", ", "'", TagName(t), "' ", StateOn(*a, t));
      }
      outcome = absl::StrCat("NOT switched back: ", states, " there (", undo.status().message(), "); switch pause ",
                             TagList(done.resumed), ", resume ", TagList(done.paused), " on device ", a->device(),
                             " to finish the rollback (a broken tag cannot come back: free its blocks)");
    }
    absl::StrAppend(&rollback, rollback.empty() ? "; rolled back: " : ", ", "device ", a->device(), " ", outcome);
  }
  return rollback;
}

// The tags of `tags` that exist on `a` (a switch there covers only those).
std::vector<TagId> TagsOn(const CachingAllocator* a, const std::vector<TagId>& tags) {
  std::vector<TagId> out;
  for (TagId t : tags) {
    if (a->TagPolicy(t).ok()) out.push_back(t);
  }
  return out;
}

const CachingAllocator::LiveRangesByTag* HintFor(const Runtime::LiveRangesByDevice* live, int device) {
  if (live == nullptr) return nullptr;
  auto it = live->find(device);
  return it != live->end() ? &it->second : nullptr;
}

bool HoldsMemory(const CachingAllocator* a, const std::vector<TagId>& tags) {
  for (TagId t : tags) {
    if (a->TagHoldsMemory(t)) return true;
  }
  return false;
}

}  // namespace

absl::Status Runtime::CheckSwitchTags(const std::vector<TagId>& pause, const std::vector<TagId>& resume) const {
  for (const std::vector<TagId>* list : {&pause, &resume}) {
    for (TagId t : *list) {
      if (!TagKnown(t)) {
        return absl::NotFoundError(absl::StrCat("switch: tag '", TagName(t), "' does not exist in this process"));
      }
    }
  }
  if (pause.empty() && resume.empty()) return absl::InvalidArgumentError("switch: no tag to pause and none to resume");
  return absl::OkStatus();
}

absl::StatusOr<bool> Runtime::Switch(const std::vector<TagId>& pause, const std::vector<TagId>& resume, int device,
                                     const LiveRangesByDevice* live) {
  VMSTASH_RETURN_IF_ERROR(CheckSwitchTags(pause, resume));
  const Observed observed(*this, Switching(pause, resume, device));
  VMSTASH_RETURN_IF_ERROR(observed.status());
  VMSTASH_ASSIGN_OR_RETURN(const std::vector<CachingAllocator*> targets, ExistingTargets(device));
  std::vector<SwitchedDevice> changed;
  std::vector<HookFailure> hook_failures;
  for (CachingAllocator* a : targets) {
    const std::vector<TagId> p = TagsOn(a, pause), r = TagsOn(a, resume);
    if (p.empty() && r.empty()) continue;
    CachingAllocator::SwitchChanges changes;
    absl::StatusOr<CachingAllocator::Transition> s = a->Switch(p, r, HintFor(live, a->device()), &changes);
    // `changes` is filled once the switch is committed: a non-empty one with an error is
    // case (2), done here with an after-resume hook failed.
    const bool done = !changes.paused.empty() || !changes.resumed.empty();
    if (done) changed.emplace_back(a, std::move(changes));
    if (s.ok()) continue;
    if (done) {
      hook_failures.push_back({a->device(), s.status()});
      continue;
    }
    return absl::Status(s.status().code(), absl::StrCat("switch failed on device ", a->device(), ": ",
                                                        s.status().message(), UndoSwitches(changed, hook_failures)));
  }
  if (!hook_failures.empty()) {
    return DoneButHooksFailed(absl::StrCat("switch (pause ", TagList(pause), "; resume ", TagList(resume), ")"),
                              hook_failures);
  }
  return !changed.empty();
}

absl::StatusOr<bool> Runtime::AgreedSwitch(const std::vector<TagId>& pause, const std::vector<TagId>& resume,
                                           int device, const LiveRangesByDevice* live,
                                           const CachingAllocator::SwitchAgree& agree, SwitchExchange* exchange) {
  // Note [Agreed Switch]: a refusal here is this process's outcome too.
  auto refuse = [&agree](absl::Status s) {
    (void)agree(s);
    return s;
  };
  if (absl::Status s = CheckSwitchTags(pause, resume); !s.ok()) return refuse(s);
  const Observed observed(*this, Switching(pause, resume, device));
  if (!observed.status().ok()) return refuse(observed.status());
  absl::StatusOr<std::vector<CachingAllocator*>> targets = ExistingTargets(device);
  if (!targets.ok()) return refuse(targets.status());
  // The one device of the switch: where its tags hold memory. Every declared tag exists
  // on every allocator in use, so a process that used a second device for anything else
  // has them there too, holding nothing; where no device holds any, the one allocator.
  std::vector<CachingAllocator*> declared, holding;
  for (CachingAllocator* a : *targets) {
    std::vector<TagId> tags = TagsOn(a, pause);
    for (TagId t : TagsOn(a, resume)) tags.push_back(t);
    if (tags.empty()) continue;
    declared.push_back(a);
    if (HoldsMemory(a, tags)) holding.push_back(a);
  }
  const std::vector<CachingAllocator*>& chosen = holding.empty() ? declared : holding;
  if (chosen.size() > 1) {
    return refuse(absl::InvalidArgumentError(absl::StrCat(
        "agreed switch (pause ", TagList(pause), "; resume ", TagList(resume), "): its tags ",
        holding.empty() ? "exist" : "have memory", " on devices ", chosen[0]->device(), " and ", chosen[1]->device(),
        "; an agreed switch covers one device per process (one rank per GPU): pass the device")));
  }
  if (chosen.empty()) {  // nothing of these tags on this device: nothing moves
    absl::Status decided = agree(absl::OkStatus());
    if (!decided.ok()) return decided;
    return false;
  }
  CachingAllocator* here = chosen[0];
  CachingAllocator::SwitchChanges changes;
  absl::StatusOr<CachingAllocator::Transition> s =
      here->Switch(TagsOn(here, pause), TagsOn(here, resume), HintFor(live, here->device()), &changes, &agree,
                   exchange);
  const bool done = !changes.paused.empty() || !changes.resumed.empty();
  if (s.ok()) return done;
  if (done) {  // committed; after-resume hooks failed
    return DoneButHooksFailed(absl::StrCat("switch (pause ", TagList(pause), "; resume ", TagList(resume), ")"),
                              {HookFailure{here->device(), s.status()}});
  }
  return absl::Status(s.status().code(),
                      absl::StrCat("switch failed on device ", here->device(), ": ", s.status().message()));
}

absl::Status Runtime::Prepare(TagId tag, int device, std::size_t bytes) {
  VMSTASH_ASSIGN_OR_RETURN(const std::vector<CachingAllocator*> targets, Targets(device));
  for (CachingAllocator* a : targets) VMSTASH_RETURN_IF_ERROR(a->Prepare(tag, bytes));
  return absl::OkStatus();
}

absl::Status Runtime::ReleaseBackup(TagId tag, int device) {
  VMSTASH_ASSIGN_OR_RETURN(const std::vector<CachingAllocator*> targets, Targets(device));
  for (CachingAllocator* a : targets) {
    absl::Status s = a->ReleaseBackup(tag);
    if (!s.ok() && !absl::IsNotFound(s)) return s;  // NotFound: never used there, nothing to release
  }
  return absl::OkStatus();
}

absl::Status Runtime::SetBackupRetention(TagId tag, BackupRetention retention) {
  for (CachingAllocator* a : AllocatorsInUse()) {
    absl::Status s = a->SetBackupRetention(tag, retention);
    if (!s.ok() && !absl::IsNotFound(s)) return s;  // NotFound: no memory of the tag there
  }
  return absl::OkStatus();
}

absl::Status Runtime::EmptyCache(int device, std::optional<TagId> tag) {
  VMSTASH_ASSIGN_OR_RETURN(const std::vector<CachingAllocator*> targets, Targets(device));
  ChunkChange change{{}, {}, !tag.has_value(), device, {}};
  if (tag) change.revoke = change.regrant = {*tag};
  const Observed observed(*this, std::move(change));
  VMSTASH_RETURN_IF_ERROR(observed.status());
  for (CachingAllocator* a : targets) VMSTASH_RETURN_IF_ERROR(tag ? a->EmptyCache(*tag) : a->EmptyCache());
  return absl::OkStatus();
}

void Runtime::SetMemoryMargin(std::size_t bytes) {
  MutexLock lock(&mu_);
  memory_margin_ = bytes;
  for (auto& a : owned_) {
    if (a != nullptr) a->SetMemoryMargin(bytes);
  }
}

absl::StatusOr<std::string> Runtime::JsonOf(int device, bool snapshot) {
  // A query creates nothing: a device this process never used (no allocator, no CUDA
  // context there; a rank asking about another rank's GPU) reads as empty.
  VMSTASH_ASSIGN_OR_RETURN(const std::vector<CachingAllocator*> targets, ExistingTargets(device));
  if (device != kAllDevices && targets.empty()) {
    if (snapshot) return SnapshotToJson(Snapshot{.device = device, .driver = std::string(driver_->Name())});
    AllocatorStats none{.device = device, .driver = std::string(driver_->Name())};
    none.total.name = "total";
    return StatsToJson(none);
  }
  std::string json;
  for (CachingAllocator* a : targets) {
    if (!json.empty()) json += ",";
    json += snapshot ? SnapshotToJson(a->TakeSnapshot()) : StatsToJson(a->Stats());
  }
  if (device == kAllDevices) json = "[" + json + "]";
  return json;
}

absl::StatusOr<std::string> Runtime::StatsJson(int device) { return JsonOf(device, /*snapshot=*/false); }
absl::StatusOr<std::string> Runtime::SnapshotJson(int device) { return JsonOf(device, /*snapshot=*/true); }

int Runtime::OwnerDevice(DevicePtr ptr) const {
  for (CachingAllocator* a : AllocatorsInUse()) {
    if (a->Owns(ptr)) return a->device();
  }
  return -1;
}

void Runtime::Describe(JsonWriter& w) const {
  w.Field("driver", driver_->Name());
  w.Field("device_count", device_count_);
  w.Key("devices_in_use");
  w.BeginArray();
  for (CachingAllocator* a : AllocatorsInUse()) w.Int(a->device());
  w.EndArray();
}

void Runtime::StopBackgroundWork() {
  for (CachingAllocator* a : AllocatorsInUse()) a->StopBackgroundWork();
  node_->StopPinning();
}

}  // namespace vmstash
