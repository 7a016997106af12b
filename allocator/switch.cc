// CachingAllocator: Switch, a pause of some tags and a resume of others in one
// transaction, with physical chunks handed from the outgoing tags to the incoming ones and
// both copy directions at once. See Note [Switch Protocol] in caching_allocator.h; the
// decisions are made in handoff_plan.h.
#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "allocator/caching_allocator.h"
#include "allocator/handoff_plan.h"
#include "base/bytes.h"
#include "base/log.h"
#include "base/status_macros.h"

namespace vmstash {
namespace {

using Clock = std::chrono::steady_clock;

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

std::string TagList(const std::vector<TagId>& tags) {
  std::string out;
  for (TagId t : tags) absl::StrAppend(&out, out.empty() ? "" : ",", TagName(t));
  return out.empty() ? "-" : out;
}

}  // namespace

// Everything one switch decided and made, for the commit or the rollback.
struct CachingAllocator::SwitchRun {
  struct Out {
    TagPool* pool = nullptr;
    bool backup = false;
    const LiveRanges* live = nullptr;
    BackupLayout layout;
    std::size_t backed_up = 0;
    bool unmapped = false;     // its own mappings are gone (handles kept)
    absl::Status undo_error;   // a rollback step for this tag failed
  };
  struct In {
    TagPool* pool = nullptr;
    bool restore = false;
    std::unique_ptr<Heap::ResumeTxn> txn[2];  // small, large
    std::size_t restored = 0;
    // Bytes of donor pieces mapped here that no restore copy writes (all of them for a
    // tag that restores nothing): zeroed before the tag is active (switch_zero).
    std::vector<std::pair<DevicePtr, std::size_t>> unwritten;
  };
  struct Donor {
    DevicePtr address = 0;
    const Chunk* chunk = nullptr;  // valid until the commit hands it over
    ChunkHandle handle = 0;        // its handle, which stays valid through the commit
    std::size_t out = 0;           // index into `out`
  };
  // A restore copy, queued once every piece is mapped and every D2H copy queued.
  struct Deferred {
    std::optional<std::size_t> wait;
    int donor = kNoDonor;  // the donor it writes into (kNoDonor: fresh memory)
    std::size_t in = 0;
    CopyStep step;
  };

  std::vector<Out> out;
  std::vector<In> in;
  std::vector<TagId> tags;  // all of them, for the hooks
  std::vector<Donor> donors;  // every mapped chunk of the outgoing tags, by address
  std::vector<SwitchCopy> copies;  // D2H, in queue order
  std::vector<std::vector<CoverSpan>> covers;  // per (in, heap): index 2 * in + heap
  HandoffPlan plan;
  std::vector<Deferred> deferred;
  std::vector<bool> written;  // per donor: restore copies were queued into it
  Stream d2h = nullptr;
  Stream h2d = nullptr;
  std::vector<Event>* events = nullptr;  // the D2H pool's copy events: one per group
  std::uint64_t synced_before = 0;
  Clock::time_point start;
  // When each step ended (the debug log's timeline): planned, recipients mapped, copies
  // queued, copies done, outgoing unmapped, committed, zeroed.
  Clock::time_point at[7];
};

absl::StatusOr<std::vector<TagPool*>> CachingAllocator::SwitchPools(const std::vector<TagId>& tags,
                                                                                    const char* what) {
  std::vector<TagPool*> pools;
  for (TagId t : tags) {
    VMSTASH_ASSIGN_OR_RETURN(TagPool * p, TransitionPool(t, what));
    pools.push_back(p);
  }
  return pools;
}

absl::StatusOr<CachingAllocator::Transition> CachingAllocator::Switch(const std::vector<TagId>& pause,
                                                                     const std::vector<TagId>& resume,
                                                                     const LiveRangesByTag* live,
                                                                     SwitchChanges* changed) {
  if (changed != nullptr) *changed = SwitchChanges();
  if (pause.empty() && resume.empty()) {
    return absl::InvalidArgumentError("switch: no tag to pause and none to resume");
  }
  absl::flat_hash_set<TagId> seen;
  for (TagId t : pause) {
    if (!seen.insert(t).second) {
      return absl::InvalidArgumentError(absl::StrCat("switch: tag '", TagName(t), "' is listed twice"));
    }
  }
  for (TagId t : resume) {
    if (!seen.insert(t).second) {
      return absl::InvalidArgumentError(absl::StrCat("switch: tag '", TagName(t), "' is listed twice or both paused "
                                                     "and resumed"));
    }
  }
  VMSTASH_ASSIGN_OR_RETURN(std::vector<TagPool*> out_pools, SwitchPools(pause, "switch (pause)"));
  VMSTASH_ASSIGN_OR_RETURN(std::vector<TagPool*> in_pools, SwitchPools(resume, "switch (resume)"));
  std::vector<TagPool*> all = out_pools;
  all.insert(all.end(), in_pools.begin(), in_pools.end());
  std::sort(all.begin(), all.end(), [](TagPool* a, TagPool* b) { return a->id() < b->id(); });
  std::vector<Mutex*> transition;
  for (TagPool* p : all) transition.push_back(p->transition_mu());
  ControlLocks control_locks;
  VMSTASH_RETURN_IF_ERROR(control_locks.Acquire(all, device_, "switch"));

  SwitchRun run;
  std::vector<TransitionHooks> out_hooks, in_hooks;
  {
    MutexLock lock(&mu_);
    for (TagPool* p : all) {
      if (p->state() == TagState::kBroken) return absl::FailedPreconditionError(p->broken_reason());
    }
    for (TagPool* p : out_pools) {
      if (p->state() == TagState::kPaused) continue;  // already in its requested state
      SwitchRun::Out& o = run.out.emplace_back();
      o.pool = p;
      o.backup = p->policy() == Policy::kBackup;
      if (live != nullptr) {
        auto it = live->find(p->id());
        if (it != live->end()) o.live = &it->second;
      }
      out_hooks.push_back(p->hooks());
    }
    for (TagPool* p : in_pools) {
      if (p->state() == TagState::kActive) continue;
      SwitchRun::In& i = run.in.emplace_back();
      i.pool = p;
      i.restore = p->policy() == Policy::kBackup && HasBackedUpBytes(p->backup_extents());
      in_hooks.push_back(p->hooks());
    }
  }
  if (run.out.empty() && run.in.empty()) return Transition::kAlreadyInState;
  for (const SwitchRun::Out& o : run.out) run.tags.push_back(o.pool->id());
  for (const SwitchRun::In& i : run.in) run.tags.push_back(i.pool->id());

  // Compensates the before-pause hooks of the first `n` outgoing tags (they stay active).
  auto undo_hooks = [&](std::size_t n) {
    for (std::size_t k = 0; k < n; ++k) {
      absl::Status s = RunHooks(run.out[k].pool->id(), out_hooks[k], /*before_pause=*/false, run.tags);
      if (!s.ok()) VMSTASH_LOG(kWarning, "vmstash: switch undone: {}", s.ToString());
    }
  };
  for (std::size_t k = 0; k < run.out.size(); ++k) {
    absl::Status s = RunHooks(run.out[k].pool->id(), out_hooks[k], /*before_pause=*/true, run.tags);
    if (!s.ok()) {
      undo_hooks(k);
      return s;
    }
  }

  absl::Status failed;
  std::string broken;  // the rollback's tags it could not restore, for the message
  {
    OrderedLocks transition_locks(std::move(transition));
    run.start = Clock::now();
    {
      MutexLock lock(&mu_);
      // The control locks are held: no other transition moved these pools since they were read.
      for (SwitchRun::Out& o : run.out) {
        if (failed.ok()) failed = o.pool->MoveTo(TagState::kPausing);
      }
      for (SwitchRun::In& i : run.in) {
        if (failed.ok()) failed = i.pool->MoveTo(TagState::kResuming);
      }
      run.synced_before = pending_seq_;  // Note [Pending Frees and Synchronization]
    }
    if (failed.ok()) failed = SwitchTransition(run);
    if (failed.ok()) {
      CommitSwitch(run);
      LogSwitch(run);
    } else {
      broken = RollBackSwitch(run, failed);
    }
  }
  if (!failed.ok()) {
    undo_hooks(run.out.size());
    return absl::Status(failed.code(),
                        absl::StrCat("switch (pause ", TagList(pause), "; resume ", TagList(resume), ") on device ",
                                     device_, " failed, ",
                                     broken.empty() ? "every tag is as it was: "
                                                    : absl::StrCat(broken, "; every other tag is as it was: "),
                                     failed.message()));
  }
  if (changed != nullptr) {
    for (const SwitchRun::Out& o : run.out) changed->paused.push_back(o.pool->id());
    for (const SwitchRun::In& i : run.in) changed->resumed.push_back(i.pool->id());
  }
  // Every incoming tag's after-resume hooks run; the first failure is returned, marked done.
  absl::Status hooks_failed;
  for (std::size_t k = 0; k < run.in.size(); ++k) {
    absl::Status s = RunHooks(run.in[k].pool->id(), in_hooks[k], /*before_pause=*/false, run.tags);
    if (!s.ok() && hooks_failed.ok()) {
      hooks_failed = MarkTransitionDone(absl::Status(s.code(), absl::StrCat("switch done, but ", s.message())));
    }
  }
  if (!hooks_failed.ok()) return hooks_failed;
  return Transition::kDone;
}

absl::Status CachingAllocator::SwitchTransition(SwitchRun& run) {
  // (2) No queued work may touch the outgoing tags; their live blocks and chunks.
  if (!run.out.empty()) VMSTASH_RETURN_IF_ERROR(driver_->SynchronizeDevice(device_));
  {
    MutexLock lock(&mu_);
    for (SwitchRun::Out& o : run.out) {
      ProcessPendingLocked(run.synced_before, o.pool->id());
      if (o.backup) o.layout = PlanBackupLayout(o.pool->LiveBlocks(), o.live);
    }
  }
  for (std::size_t k = 0; k < run.out.size(); ++k) {
    for (Heap* heap : {run.out[k].pool->small(), run.out[k].pool->large()}) {
      for (const ChunkView& c : heap->Chunks()) run.donors.push_back({c.address, c.chunk, c.chunk->handle(), k});
    }
  }
  std::sort(run.donors.begin(), run.donors.end(),
            [](const SwitchRun::Donor& a, const SwitchRun::Donor& b) { return a.address < b.address; });
  run.written.assign(run.donors.size(), false);
  std::vector<HandoffDonor> donors;
  for (const SwitchRun::Donor& d : run.donors) donors.push_back({d.chunk->size_bytes(), run.out[d.out].backup});
  std::vector<HandoffRecipient> recipients;
  for (const SwitchRun::In& i : run.in) {
    for (Heap* heap : {i.pool->small(), i.pool->large()}) {
      VMSTASH_ASSIGN_OR_RETURN(std::vector<CoverSpan> covers, heap->PlanResume());
      for (std::size_t c = 0; c < covers.size(); ++c) {
        // Unused address space after the cover: up to the next cover of its segment (the
        // heap is paused: nothing else is mapped there) or the segment's end.
        const bool next_here = c + 1 < covers.size() && covers[c + 1].segment == covers[c].segment;
        const DevicePtr limit = next_here ? covers[c + 1].address : heap->SegmentEnd(covers[c].segment);
        const DevicePtr end = covers[c].address + covers[c].size_bytes;
        recipients.push_back({covers[c].size_bytes, i.restore, limit > end ? limit - end : 0});
      }
      run.covers.push_back(std::move(covers));
    }
  }
  run.plan = PlanHandoff(donors, recipients, options_.resume_first_piece_bytes, options_.max_chunk_bytes,
                         granularity_bytes_);
  run.at[0] = Clock::now();
  // A cover whose last donor overhangs it grows by that much (free space of the tag).
  std::size_t r = 0;
  for (std::vector<CoverSpan>& covers : run.covers) {
    for (CoverSpan& c : covers) c.size_bytes += run.plan.overhang[r++];
  }
  // (3) Both directions queued; the host waits only in (4).
  // Every piece is created and mapped before the first copy is queued: cuMemMap and
  // cuMemSetAccess of a chunk cost ~1 ms while copies stream on the H200 (~35 us idle).
  VMSTASH_RETURN_IF_ERROR(PrepareSwitchBackups(run));
  VMSTASH_RETURN_IF_ERROR(MapSwitchRecipients(run));
  run.at[1] = Clock::now();
  VMSTASH_RETURN_IF_ERROR(QueueSwitchBackups(run));
  VMSTASH_RETURN_IF_ERROR(QueueSwitchRestores(run));
  run.at[2] = Clock::now();
  // (4) Everything copied; the outgoing tags' own mappings go (handles kept).
  if (run.d2h != nullptr) VMSTASH_RETURN_IF_ERROR(driver_->SynchronizeStream(device_, run.d2h));
  if (run.h2d != nullptr) VMSTASH_RETURN_IF_ERROR(driver_->SynchronizeStream(device_, run.h2d));
  for (SwitchRun::Out& o : run.out) {
    o.pool->AssertTransitionHeld();
    if (o.backup && o.layout.arena_bytes > 0) VMSTASH_RETURN_IF_ERROR(o.pool->arena()->Seal());
  }
  run.at[3] = Clock::now();
  for (SwitchRun::Out& o : run.out) {
    absl::Status s = o.pool->UnmapHeaps(&o.undo_error);  // re-maps this tag itself on failure
    if (!s.ok()) return s;
    o.unmapped = true;
  }
  run.at[4] = Clock::now();
  return absl::OkStatus();
}

absl::Status CachingAllocator::PrepareSwitchBackups(SwitchRun& run) {
  TagPool* d2h_pool = nullptr;
  for (SwitchRun::Out& o : run.out) {
    if (!o.backup || o.layout.arena_bytes == 0) continue;
    o.pool->AssertTransitionHeld();
    VMSTASH_RETURN_IF_ERROR(o.pool->EnsureArena()->Reserve(o.layout.arena_bytes));
    if (d2h_pool == nullptr) d2h_pool = o.pool;
  }
  if (d2h_pool == nullptr) return absl::OkStatus();
  d2h_pool->AssertTransitionHeld();
  VMSTASH_ASSIGN_OR_RETURN(run.d2h, d2h_pool->CopyStream());
  std::vector<ChunkSpan> spans;
  for (const SwitchRun::Donor& d : run.donors) spans.push_back({d.address, d.chunk->size_bytes()});
  for (SwitchRun::Out& o : run.out) {
    if (!o.backup) continue;
    const std::size_t first = run.copies.empty() ? 0 : run.copies.back().group + 1;
    VMSTASH_ASSIGN_OR_RETURN(std::vector<SwitchCopy> copies,
                             PlanSwitchCopies(o.layout.in_order, spans, GroupBytes(), first));
    run.copies.insert(run.copies.end(), copies.begin(), copies.end());
  }
  const std::size_t groups = run.copies.empty() ? 0 : run.copies.back().group + 1;
  VMSTASH_ASSIGN_OR_RETURN(run.events, d2h_pool->CopyEvents(groups));
  return absl::OkStatus();
}

absl::Status CachingAllocator::QueueSwitchBackups(SwitchRun& run) {
  for (std::size_t k = 0; k < run.copies.size(); ++k) {
    const SwitchCopy& c = run.copies[k];
    SwitchRun::Out& o = run.out[run.donors[c.chunk].out];
    o.pool->AssertTransitionHeld();
    VMSTASH_RETURN_IF_ERROR(driver_->CopyToHostAsync(device_, o.pool->arena()->data() + c.step.arena_offset,
                                                     c.step.device, c.step.size_bytes, run.d2h));
    o.backed_up += c.step.size_bytes;
    if (k + 1 == run.copies.size() || run.copies[k + 1].group != c.group) {
      VMSTASH_RETURN_IF_ERROR(driver_->RecordEvent(device_, (*run.events)[c.group], run.d2h));
    }
  }
  return absl::OkStatus();
}

absl::Status CachingAllocator::MapSwitchRecipients(SwitchRun& run) {
  for (SwitchRun::In& i : run.in) {
    if (!i.restore) continue;
    i.pool->AssertTransitionHeld();
    if (i.pool->arena() == nullptr) {
      return absl::InternalError(absl::StrCat("resume of tag '", i.pool->name(), "': its backup arena is gone"));
    }
    // Note [Disk Backup]: a read error, not a SIGBUS; only the backed-up bytes are read.
    VMSTASH_RETURN_IF_ERROR(i.pool->arena()->Load(0, BackedUpArenaEnd(i.pool->backup_extents())));
    if (run.h2d == nullptr) {
      VMSTASH_ASSIGN_OR_RETURN(run.h2d, i.pool->CopyStream());
    }
  }
  const CopyReadiness readiness(run.copies, run.donors.size());
  std::vector<const Chunk*> donor_chunks;
  for (const SwitchRun::Donor& d : run.donors) donor_chunks.push_back(d.chunk);
  std::size_t recipient = 0;
  for (std::size_t k = 0; k < run.in.size(); ++k) {
    SwitchRun::In& i = run.in[k];
    for (int h = 0; h < 2; ++h) {
      Heap* heap = h == 0 ? i.pool->small() : i.pool->large();
      const std::vector<CoverSpan>& covers = run.covers[2 * k + h];
      const std::vector<std::vector<HandoffPiece>> pieces(run.plan.pieces.begin() + recipient,
                                                          run.plan.pieces.begin() + recipient + covers.size());
      recipient += covers.size();
      const std::vector<Block*> live = heap->LiveBlocks();
      RestorePlanner planner(std::vector<const Block*>(live.begin(), live.end()), covers, &i.pool->backup_extents());
      i.txn[h] = std::make_unique<Heap::ResumeTxn>();
      VMSTASH_RETURN_IF_ERROR(heap->PrepareHandoff(
          i.txn[h].get(), covers, pieces, donor_chunks, [&](DevicePtr va, std::size_t size, int d) -> absl::Status {
            if (!i.restore) {
              if (d != kNoDonor) i.unwritten.emplace_back(va, size);
              return absl::OkStatus();
            }
            VMSTASH_ASSIGN_OR_RETURN(std::vector<CopyStep> steps, planner.CopiesInto(va, size));
            if (d != kNoDonor) NoteUnwritten(va, size, steps, &i.unwritten);
            for (const CopyStep& c : steps) {
              if (d == kNoDonor) {  // fresh memory: nothing to wait for
                run.deferred.push_back({std::nullopt, kNoDonor, k, c});
                continue;
              }
              // Cut like the D2H copies, so each part waits only for the reads it overwrites.
              const std::size_t step = GroupBytes();
              for (std::size_t done = 0; done < c.size_bytes; done += step) {
                const CopyStep part{c.device + done, c.arena_offset + done, std::min(step, c.size_bytes - done)};
                const DevicePtr at = run.donors[d].address + (part.device - va);  // the same bytes, outgoing VA
                run.deferred.push_back({readiness.WaitGroup(d, at, part.size_bytes), d, k, part});
              }
            }
            return absl::OkStatus();
          }));
    }
  }
  return absl::OkStatus();
}

absl::Status CachingAllocator::QueueSwitchRestores(SwitchRun& run) {
  // Into fresh memory first, then into donors in the order their D2H copies complete.
  // Rank 0: no wait; rank g + 1: after D2H group g.
  auto rank = [](const SwitchRun::Deferred& q) { return q.wait.has_value() ? *q.wait + 1 : 0; };
  std::stable_sort(run.deferred.begin(), run.deferred.end(),
                   [&](const SwitchRun::Deferred& a, const SwitchRun::Deferred& b) { return rank(a) < rank(b); });
  std::optional<std::size_t> waited;
  for (const SwitchRun::Deferred& q : run.deferred) {
    if (q.wait.has_value() && (!waited.has_value() || *q.wait > *waited)) {
      VMSTASH_RETURN_IF_ERROR(driver_->StreamWaitEvent(device_, run.h2d, (*run.events)[*q.wait]));
      waited = q.wait;
    }
    SwitchRun::In& i = run.in[q.in];
    i.pool->AssertTransitionHeld();
    if (q.donor != kNoDonor) run.written[q.donor] = true;  // before the call: conservative
    VMSTASH_RETURN_IF_ERROR(driver_->CopyToDeviceAsync(device_, q.step.device,
                                                       i.pool->arena()->data() + q.step.arena_offset,
                                                       q.step.size_bytes, run.h2d));
    i.restored += q.step.size_bytes;
  }
  return absl::OkStatus();
}

std::string CachingAllocator::RollBackSwitch(SwitchRun& run, const absl::Status& cause) {
  // Nothing may still copy into memory about to be unmapped or restored.
  for (Stream s : {run.d2h, run.h2d}) {
    if (s == nullptr) continue;
    if (!driver_->SynchronizeStream(device_, s).ok()) {
      absl::Status d = driver_->SynchronizeDevice(device_);
      if (!d.ok()) VMSTASH_LOG(kError, "vmstash: switch rollback cannot wait for its copies: {}", d.ToString());
    }
  }
  for (SwitchRun::In& i : run.in) {
    i.txn[0].reset();  // unmaps the incoming mappings; releases the fresh chunks
    i.txn[1].reset();
  }
  for (SwitchRun::Out& o : run.out) {
    if (o.unmapped && o.undo_error.ok()) o.undo_error = o.pool->RemapHeaps();
  }
  // Donors that restore copies wrote into get their tag's bytes back from the backup made
  // by this very switch (only `backup` donors are ever written: handoff_plan.h).
  bool restoring = false;
  std::vector<bool> loaded(run.out.size(), false);
  for (const SwitchCopy& c : run.copies) {
    if (!run.written[c.chunk]) continue;
    const std::size_t k = run.donors[c.chunk].out;
    SwitchRun::Out& o = run.out[k];
    if (!o.undo_error.ok()) continue;
    o.pool->AssertTransitionHeld();
    if (!loaded[k]) {  // a sealed disk backup is read in first (Note [Disk Backup])
      loaded[k] = true;
      o.undo_error = o.pool->arena()->Load(0, o.layout.arena_bytes);
      if (!o.undo_error.ok()) continue;
    }
    absl::Status s = driver_->CopyToDeviceAsync(device_, c.step.device, o.pool->arena()->data() + c.step.arena_offset,
                                                c.step.size_bytes, run.h2d);
    if (!s.ok()) o.undo_error = s;
    restoring = true;
  }
  if (restoring) {
    absl::Status s = driver_->SynchronizeStream(device_, run.h2d);
    if (!s.ok()) {
      for (std::size_t d = 0; d < run.donors.size(); ++d) {
        if (run.written[d] && run.out[run.donors[d].out].undo_error.ok()) run.out[run.donors[d].out].undo_error = s;
      }
    }
  }
  std::string broken;
  for (SwitchRun::Out& o : run.out) {
    o.pool->AssertTransitionHeld();
    if (o.backup && o.pool->arena() != nullptr) o.pool->arena()->DropContents();
    (void)FailTransition(o.pool, TagState::kActive, cause, o.undo_error);
    if (!o.undo_error.ok()) {
      absl::StrAppend(&broken, broken.empty() ? "" : "; ", "tag '", TagName(o.pool->id()), "' is broken: its memory "
                      "could not be restored (", o.undo_error.message(), "), its contents are lost; free its blocks "
                      "and use another tag");
    }
  }
  MutexLock lock(&mu_);
  for (SwitchRun::In& i : run.in) {
    if (i.pool->state() == TagState::kPaused) continue;  // not moved (the switch failed before)
    absl::Status s = i.pool->MoveTo(TagState::kPaused);
    if (!s.ok()) VMSTASH_LOG(kError, "vmstash: switch rollback: {}", s.ToString());
  }
  return broken;
}

void CachingAllocator::CommitSwitch(SwitchRun& run) {
  // (5) Cannot fail: handles change owners, leftovers are released, handed-over bytes
  // zeroed; only then are the tags' new states published (Note [Switch Protocol]).
  absl::flat_hash_set<ChunkHandle> handed_set;
  for (const auto& pieces : run.plan.pieces) {
    for (const HandoffPiece& p : pieces) {
      if (p.donor != kNoDonor) handed_set.insert(run.donors[p.donor].handle);
    }
  }
  auto hand_over = [&](ChunkHandle h) { return handed_set.contains(h); };
  std::vector<Chunk> handed;
  std::vector<std::size_t> released(run.out.size(), 0);
  absl::Status release_error;
  for (std::size_t k = 0; k < run.out.size(); ++k) {
    TagPool* pool = run.out[k].pool;
    released[k] = pool->small()->ReleaseAllAndPause(&release_error, hand_over, &handed);
    released[k] += pool->large()->ReleaseAllAndPause(&release_error, hand_over, &handed);
  }
  if (!release_error.ok()) {
    VMSTASH_LOG(kWarning, "vmstash: switch: a chunk release was refused ({}); it is retried later",
                release_error.ToString());
  }
  absl::flat_hash_map<ChunkHandle, Chunk*> by_handle;
  for (Chunk& c : handed) by_handle[c.handle()] = &c;
  for (SwitchRun::In& i : run.in) {
    for (auto& txn : i.txn) {
      for (auto& cover : txn->covers) {
        for (auto& piece : cover.pieces) {
          if (piece.donor != kNoDonor) piece.chunk = std::move(*by_handle.at(run.donors[piece.donor].handle));
        }
      }
    }
    i.pool->small()->CommitResume(std::move(i.txn[0]));
    i.pool->large()->CommitResume(std::move(i.txn[1]));
    i.pool->AssertTransitionHeld();
    if (i.pool->arena() != nullptr) i.pool->arena()->DropContents();
  }
  run.at[5] = Clock::now();
  // The incoming tags are still "resuming": nobody else allocates in them, frees their
  // blocks or releases their chunks until the zeroing has completed.
  if (options_.switch_zero) ZeroHandedOver(run);
  run.at[6] = Clock::now();
  // Each tag's pause or resume took the whole switch (both ran at once).
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - run.start).count();
  MutexLock lock(&mu_);
  for (std::size_t k = 0; k < run.out.size(); ++k) {
    SwitchRun::Out& o = run.out[k];
    o.pool->AssertTransitionHeld();
    absl::Status s = o.pool->NotePaused(std::move(o.layout.by_block), released[k], o.backed_up, ms);
    if (!s.ok()) VMSTASH_LOG(kError, "vmstash: switch commit: {}", s.ToString());
    ++o.pool->stats().switches;
  }
  for (SwitchRun::In& i : run.in) {
    absl::Status s = NoteResumedLocked(i.pool, i.restored, ms);
    if (!s.ok()) VMSTASH_LOG(kError, "vmstash: switch commit: {}", s.ToString());
    ++i.pool->stats().switches;
  }
  counters_.switches += 1;
  counters_.handed_over_bytes += run.plan.handed_bytes;
}

void CachingAllocator::LogSwitch(const SwitchRun& run) const {
  if (!LogEnabled(LogLevel::kDebug)) return;
  auto ms = [&](int k) { return std::chrono::duration<double, std::milli>(run.at[k] - run.start).count(); };
  std::size_t overhang = 0, deferred_waits = 0;
  for (std::size_t o : run.plan.overhang) overhang += o;
  for (const SwitchRun::Deferred& q : run.deferred) deferred_waits += q.wait.has_value();
  VMSTASH_LOG(kDebug,
              "vmstash: switch on device {}: {} donors, {} handed over ({} overhanging), {} fresh, {} released; "
              "{} D2H copies in {} groups, {} restore copies into donors ({} waiting); at ms: planned {:.2f}, mapped "
              "{:.2f}, copies queued {:.2f}, copies done {:.2f}, unmapped {:.2f}, committed {:.2f}, "
              "zeroed {:.2f}",
              device_, run.donors.size(), HumanBytes(run.plan.handed_bytes), HumanBytes(overhang),
              HumanBytes(run.plan.fresh_bytes), HumanBytes(run.plan.leftover_bytes), run.copies.size(),
              run.copies.empty() ? 0 : run.copies.back().group + 1, run.deferred.size(), deferred_waits, ms(0), ms(1),
              ms(2), ms(3), ms(4), ms(5), ms(6));
}

void CachingAllocator::NoteUnwritten(DevicePtr va, std::size_t size_bytes, std::vector<CopyStep> written,
                                     std::vector<std::pair<DevicePtr, std::size_t>>* out) {
  std::sort(written.begin(), written.end(), [](const CopyStep& a, const CopyStep& b) { return a.device < b.device; });
  DevicePtr at = va;
  for (const CopyStep& c : written) {
    if (c.device > at) out->emplace_back(at, c.device - at);
    at = std::max<DevicePtr>(at, c.device + c.size_bytes);
  }
  if (va + size_bytes > at) out->emplace_back(at, va + size_bytes - at);
}

void CachingAllocator::ZeroHandedOver(SwitchRun& run) {
  // In the commit, before the incoming tags are published active (Note [Switch
  // Protocol]): the outgoing mappings are gone, every copy has completed, and the
  // incoming tags are still resuming, so nothing else touches these bytes. A failure
  // leaves them undefined, which the contract allows (discard tags' bytes, and a backup
  // tag's bytes outside its live ranges): logged, not returned. Either way the host
  // waits until nothing of the memset can still be running.
  Stream stream = nullptr;
  absl::Status s;
  for (SwitchRun::In& i : run.in) {
    if (i.unwritten.empty()) continue;
    if (stream == nullptr) {
      i.pool->AssertTransitionHeld();
      absl::StatusOr<Stream> made = i.pool->CopyStream();
      s = made.status();
      if (!s.ok()) break;
      stream = *made;
    }
    for (auto [va, size] : i.unwritten) {
      s = driver_->MemsetAsync(device_, va, 0, size, stream);
      if (!s.ok()) break;
    }
    if (!s.ok()) break;
  }
  if (stream != nullptr) {
    absl::Status waited = driver_->SynchronizeStream(device_, stream);
    if (!waited.ok()) waited = driver_->SynchronizeDevice(device_);
    if (s.ok()) s = waited;
  }
  if (!s.ok()) {
    VMSTASH_LOG(kWarning, "vmstash: switch: zeroing the memory handed over failed ({}); the bytes that no restore "
                "wrote are undefined (as the policies allow)", s.ToString());
  }
}

}  // namespace vmstash
