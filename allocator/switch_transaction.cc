// SwitchTransaction: see switch_transaction.h and Note [Switch Protocol] in switch.h.
#include "allocator/switch_transaction.h"

#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "base/bytes.h"
#include "base/log.h"
#include "base/status_macros.h"

namespace vmstash {

SwitchTransaction::SwitchTransaction(TransitionHost* host, std::vector<std::pair<TagPool*, const ByteRanges*>> out,
                                     std::vector<TagPool*> in, const SwitchAgree* agree, SwitchExchange* exchange)
    : host_(host), driver_(host->driver()), device_(host->device()), agree_(agree), exchange_(exchange) {
  for (const auto& [pool, live] : out) {
    Out& o = out_.emplace_back();
    o.pool = pool;
    o.live = live;
  }
  for (TagPool* pool : in) in_.emplace_back().pool = pool;
}

absl::Status SwitchTransaction::Run(std::string* broken) {
  start_ = Clock::now();
  absl::Status failed = Begin();
  if (failed.ok()) failed = Execute();
  if (agree_ != nullptr) {  // Note [Agreed Switch]: prepared (or failed), not yet committed
    // A part votes only once none of its copies runs (Note [Node Switch Handover]: a
    // giver's rollback waits for its takers' votes before it writes its chunks again).
    if (!failed.ok()) DrainStreams();
    absl::Status decided = (*agree_)(failed);
    if (failed.ok() && !decided.ok()) failed = decided;
  }
  if (failed.ok()) {
    Commit();
    Log();
    DestroyIpcEvents();
    return absl::OkStatus();
  }
  *broken = RollBack(failed);
  DestroyIpcEvents();
  return failed;
}

absl::Status SwitchTransaction::Begin() {
  MutexLock lock(host_->mu());
  // The caller holds the control locks: no other transition moved these pools since it
  // chose them. A resuming pool's backup extents no longer change (its frees wait).
  for (const Out& o : out_) VMSTASH_RETURN_IF_ERROR(host_->CheckPausableLocked(o.pool));
  for (Out& o : out_) VMSTASH_RETURN_IF_ERROR(o.pool->MoveTo(TagState::kPausing));
  for (In& i : in_) {
    VMSTASH_RETURN_IF_ERROR(i.pool->MoveTo(TagState::kResuming));
    i.restore = i.pool->backup() && HasBackedUpBytes(i.pool->backup_extents());
  }
  synced_before_ = host_->PendingSeqLocked();  // Note [Pending Frees and Synchronization]
  return absl::OkStatus();
}

std::size_t SwitchTransaction::GroupBytes() const {
  return std::max(host_->options().switch_group_bytes, host_->granularity_bytes());
}

double SwitchTransaction::MsAt(Step step) const {
  return std::chrono::duration<double, std::milli>(at_[static_cast<std::size_t>(step)] - start_).count();
}

absl::Status SwitchTransaction::Execute() {
  // (2) No queued work may touch the outgoing tags; their live blocks and chunks.
  if (!out_.empty()) VMSTASH_RETURN_IF_ERROR(driver_->SynchronizeDevice(device_));
  VMSTASH_RETURN_IF_ERROR(Plan());
  // (3) Both directions queued; the host waits only in (4).
  // Every piece is created and mapped before the first copy is queued: cuMemMap and
  // cuMemSetAccess of a chunk cost ~1 ms while copies stream on the H200 (~35 us idle).
  // A part of a node switch offers its chunks once its backup copies are queued (a
  // taker's restore copies wait for their events), and takes before it maps; a part that
  // does both queues its backups first (two such parts would otherwise wait for each
  // other's offers).
  VMSTASH_RETURN_IF_ERROR(PrepareBackups());
  const bool offers = exchange_ != nullptr && !out_.empty();
  const bool backups_first = offers && !in_.empty();
  if (offers) PlanOffer();
  if (backups_first) {
    VMSTASH_RETURN_IF_ERROR(QueueBackups());
    OfferChunks();
  }
  if (exchange_ != nullptr) TakeChunks();
  FinishPlan();
  VMSTASH_RETURN_IF_ERROR(MapRecipients());
  Mark(Step::kRecipientsMapped);
  if (!backups_first) {
    VMSTASH_RETURN_IF_ERROR(QueueBackups());
    if (offers) OfferChunks();
  }
  VMSTASH_RETURN_IF_ERROR(QueueRestores());
  Mark(Step::kCopiesQueued);
  // (4) Everything copied; the outgoing tags' own mappings go (handles kept).
  if (d2h_ != nullptr) VMSTASH_RETURN_IF_ERROR(driver_->SynchronizeStream(device_, d2h_));
  if (h2d_ != nullptr) VMSTASH_RETURN_IF_ERROR(driver_->SynchronizeStream(device_, h2d_));
  for (Out& o : out_) {
    o.pool->AssertTransitionHeld();
    if (o.pool->backup() && o.layout.arena_bytes > 0) VMSTASH_RETURN_IF_ERROR(o.pool->arena()->Seal());
  }
  Mark(Step::kCopiesDone);
  for (Out& o : out_) {
    absl::Status s = o.pool->UnmapHeaps(&o.undo_error);  // re-maps this tag itself on failure
    if (!s.ok()) return s;
    o.unmapped = true;
  }
  Mark(Step::kOutgoingUnmapped);
  return absl::OkStatus();
}

absl::Status SwitchTransaction::Plan() {
  {
    MutexLock lock(host_->mu());
    for (Out& o : out_) {
      host_->CompletePendingLocked(synced_before_, o.pool->id());
      if (o.pool->backup()) o.layout = PlanBackupLayout(o.pool->LiveBlocks(), o.live);
    }
  }
  for (std::size_t k = 0; k < out_.size(); ++k) {
    for (Heap* heap : out_[k].pool->heaps()) {
      for (const ChunkView& c : heap->Chunks()) donors_.push_back({c.address, c.chunk, c.chunk->handle(), k});
    }
  }
  std::sort(donors_.begin(), donors_.end(),
            [](const Donor& a, const Donor& b) { return a.address < b.address; });
  local_donors_ = donors_.size();
  written_.assign(donors_.size(), false);
  std::vector<HandoffDonor> donors;
  for (const Donor& d : donors_) donors.push_back({d.chunk->size_bytes(), out_[d.out].pool->backup()});
  std::vector<HandoffRecipient>& recipients = recipients_;
  for (const In& i : in_) {
    for (Heap* heap : i.pool->heaps()) {
      VMSTASH_ASSIGN_OR_RETURN(std::vector<CoverSpan> covers, heap->PlanResume());
      for (std::size_t c = 0; c < covers.size(); ++c) {
        // Unused address space after the cover: up to the next cover of its segment (the
        // heap is paused: nothing else is mapped there) or the segment's end.
        const bool next_here = c + 1 < covers.size() && covers[c + 1].segment == covers[c].segment;
        const DevicePtr limit = next_here ? covers[c + 1].address : heap->SegmentEnd(covers[c].segment);
        const DevicePtr end = covers[c].address + covers[c].size_bytes;
        recipients.push_back({covers[c].size_bytes, i.restore, limit > end ? limit - end : 0});
      }
      covers_.push_back(std::move(covers));
    }
  }
  plan_ = PlanHandoff(donors, recipients, host_->options().resume_first_piece_bytes,
                      host_->options().max_chunk_bytes, host_->granularity_bytes());
  return absl::OkStatus();
}

void SwitchTransaction::FinishPlan() {
  written_.resize(donors_.size(), false);  // the foreign donors
  Mark(Step::kPlanned);
  // A cover whose last donor overhangs it grows by that much (free space of the tag).
  std::size_t r = 0;
  for (std::vector<CoverSpan>& covers : covers_) {
    for (CoverSpan& c : covers) c.size_bytes += plan_.overhang[r++];
  }
}

void SwitchTransaction::PlanOffer() {
  // Chunks of a backup tag may go where restore copies write: an abort restores their
  // bytes from this switch's backup. A restore copy into one must wait for the last
  // backup copy reading it, an event of this process: made interprocess here, recorded in
  // QueueBackups, its handle sent with the offer only then.
  const CopyReadiness readiness(copies_, local_donors_);
  for (int d : plan_.leftover) {
    Offered o;
    o.donor = d;
    o.anywhere = out_[donors_[d].out].pool->backup();
    if (o.anywhere) o.group = readiness.WaitGroup(d, donors_[d].address, donors_[d].chunk->size_bytes());
    if (o.group.has_value()) {
      auto known = std::find_if(ipc_events_.begin(), ipc_events_.end(),
                                [&](const auto& e) { return e.first == *o.group; });
      if (known == ipc_events_.end()) {
        absl::StatusOr<Event> event = driver_->CreateIpcEvent(device_);
        if (event.ok()) {
          ipc_events_.emplace_back(*o.group, *event);
        } else {  // then only where nothing writes it before the commit
          VMSTASH_LOG(kInfo, "vmstash: node switch: no interprocess event ({}); a chunk is offered for discard "
                      "covers only", event.status().ToString());
          o.anywhere = false;
          o.group.reset();
        }
      }
    }
    offered_.push_back(o);
  }
}

void SwitchTransaction::OfferChunks() {
  absl::StatusOr<std::string> device = driver_->DeviceUuid(device_);
  std::vector<SharedChunk> chunks;  // every part that pauses offers, if only nothing: takers wait for it
  for (const Offered& o : offered_) {
    if (!device.ok()) break;
    absl::StatusOr<int> fd = donors_[o.donor].chunk->ExportFd();
    if (!fd.ok()) continue;  // not created exportable (share_chunks): released at the commit
    SharedChunk c{*fd, donors_[o.donor].chunk->size_bytes(), o.anywhere, ""};
    if (o.group.has_value()) {
      const auto e = std::find_if(ipc_events_.begin(), ipc_events_.end(),
                                  [&](const auto& x) { return x.first == *o.group; });
      absl::StatusOr<std::string> handle = driver_->ExportIpcEvent(device_, e->second);
      if (handle.ok()) {
        c.wait_event = *std::move(handle);
      } else {
        c.anywhere = false;
      }
    }
    offered_anywhere_ = offered_anywhere_ || c.anywhere;
    chunks.push_back(std::move(c));
  }
  if (!device.ok()) {
    VMSTASH_LOG(kWarning, "vmstash: node switch: no chunk offered ({})", device.status().ToString());
  }
  if (absl::Status s = exchange_->Offer(device.ok() ? *device : "?", std::move(chunks)); !s.ok()) {
    VMSTASH_LOG(kWarning, "vmstash: node switch: this process's chunks were not offered ({})", s.ToString());
  }
}

void SwitchTransaction::TakeChunks() {
  absl::StatusOr<std::string> device = driver_->DeviceUuid(device_);
  if (!device.ok()) {
    VMSTASH_LOG(kWarning, "vmstash: node switch: no chunk taken ({})", device.status().ToString());
    return;
  }
  // Fresh memory planned where a foreign chunk may go: the gaps another process's chunks
  // may fill, sent so that the daemon gives this part only chunks that fit them. Covers
  // that restore ask only when the device is short of memory for the fresh ones.
  absl::StatusOr<DeviceMemoryInfo> memory = driver_->MemoryInfo(device_);
  const bool restoring = RestoresTakeForeignChunks(
      plan_.fresh_bytes, memory.ok() ? std::optional<std::size_t>(memory->free_bytes) : std::nullopt);
  const HandoffGaps open =
      OpenGaps(plan_, recipients_, host_->granularity_bytes(), exchange_->MaxGaps(), restoring);
  if (open.gaps.empty()) return;
  absl::StatusOr<std::vector<SharedChunk>> taken = exchange_->Take(*device, open.gaps);
  if (!taken.ok()) {
    VMSTASH_LOG(kWarning, "vmstash: node switch: no chunk taken from other processes ({})", taken.status().ToString());
    return;
  }
  foreign_.reserve(taken->size());  // never reallocated after: donors_ point into it
  absl::flat_hash_set<ChunkHandle> held;  // a handle twice would be one chunk in two covers
  for (const Donor& d : donors_) held.insert(d.handle);
  std::vector<Chunk> twice;  // released here, after the loop: an import of a chunk held already
  std::vector<FitChunk> fits;
  std::vector<Event> waits;
  std::vector<std::pair<std::string, Event>> opened;  // by handle: each event opened once
  for (const SharedChunk& c : *taken) {
    absl::StatusOr<Chunk> chunk = Chunk::Import(driver_, device_, c.fd, c.size_bytes);
    ::close(c.fd);
    if (!chunk.ok()) {
      VMSTASH_LOG(kWarning, "vmstash: node switch: a chunk of another process could not be imported ({})",
                  chunk.status().ToString());
      continue;
    }
    if (!held.insert(chunk->handle()).second) {
      VMSTASH_LOG(kWarning, "vmstash: node switch: a chunk offered twice was imported once only");
      twice.push_back(std::move(*chunk));
      continue;
    }
    bool anywhere = c.anywhere;
    Event wait = nullptr;
    if (anywhere && !c.wait_event.empty()) {
      auto known = std::find_if(opened.begin(), opened.end(), [&](const auto& e) { return e.first == c.wait_event; });
      if (known != opened.end()) {
        wait = known->second;
      } else if (absl::StatusOr<Event> e = driver_->OpenIpcEvent(device_, c.wait_event); e.ok()) {
        opened.emplace_back(c.wait_event, *e);
        opened_events_.push_back(*e);
        wait = *e;
      } else {  // nothing to order a restore copy by: only where none writes
        VMSTASH_LOG(kInfo, "vmstash: node switch: another process's event could not be opened ({}); its chunk "
                    "goes where no restore copy writes", e.status().ToString());
        anywhere = false;
      }
    }
    foreign_.push_back(std::move(*chunk));
    fits.push_back({c.size_bytes, anywhere});
    waits.push_back(wait);
  }
  if (foreign_.empty()) return;
  // Placed into the open gaps as the daemon fitted them; the rest of the plan stands.
  const int first = static_cast<int>(donors_.size());
  for (std::size_t f = 0; f < foreign_.size(); ++f) {
    donors_.push_back({0, &foreign_[f], foreign_[f].handle(), kForeign, waits[f]});
  }
  const std::vector<int> unused =
      AddForeignDonors(plan_, open, fits, first, host_->options().resume_first_piece_bytes,
                       host_->options().max_chunk_bytes, host_->granularity_bytes());
  if (!unused.empty()) {
    VMSTASH_LOG(kInfo, "vmstash: node switch: {} of {} chunks taken from other processes fit no gap here", unused.size(),
                fits.size());
  }
}

void SwitchTransaction::SettleOffered() {
  if (!offered_anywhere_) return;
  // A taker writes an offered chunk only until it votes (its copies done): once every
  // taker voted or exited, this part may restore the chunks' bytes from its backup.
  const absl::Status settled = exchange_->AwaitTakers();
  for (const Offered& o : offered_) {
    if (!o.anywhere) continue;
    Out& out = out_[donors_[o.donor].out];
    if (settled.ok()) {
      written_[o.donor] = true;  // conservative: restored whether a taker wrote it or not
    } else if (out.undo_error.ok()) {
      out.undo_error = absl::UnavailableError(absl::StrCat(
          "another process took its memory in the switch and could still write it (", settled.message(), ")"));
    }
  }
}

void SwitchTransaction::DrainStreams() {
  for (Stream s : {d2h_, h2d_}) {
    if (s == nullptr) continue;
    if (!driver_->SynchronizeStream(device_, s).ok()) {
      absl::Status d = driver_->SynchronizeDevice(device_);
      if (!d.ok()) VMSTASH_LOG(kError, "vmstash: switch cannot wait for its copies: {}", d.ToString());
    }
  }
}

void SwitchTransaction::DestroyIpcEvents() {
  for (const auto& [group, event] : ipc_events_) {
    if (absl::Status s = driver_->DestroyEvent(device_, event); !s.ok()) {
      VMSTASH_LOG(kWarning, "vmstash: switch: an interprocess event was not destroyed ({})", s.ToString());
    }
  }
  for (Event event : opened_events_) {
    if (absl::Status s = driver_->DestroyEvent(device_, event); !s.ok()) {
      VMSTASH_LOG(kWarning, "vmstash: switch: another process's event was not closed ({})", s.ToString());
    }
  }
  ipc_events_.clear();
  opened_events_.clear();
}

absl::Status SwitchTransaction::PrepareBackups() {
  // Over the cap, the prepared arenas of active tags outside the switch go first (Note
  // [Host Budget]); this switch's own tags are left alone (their locks are held here).
  std::vector<const TagPool*> mine;
  for (const Out& o : out_) mine.push_back(o.pool);
  for (const In& i : in_) mine.push_back(i.pool);
  const TagPool::Reclaim reclaim = [&](std::size_t wanted) { return host_->ReclaimPreparedArenas(mine, wanted); };
  TagPool* d2h_pool = nullptr;
  for (Out& o : out_) {
    if (!o.pool->backup() || o.layout.arena_bytes == 0) continue;
    o.pool->AssertTransitionHeld();
    o.arena_used = true;  // from here a failure gives back what the reservation added
    VMSTASH_RETURN_IF_ERROR(o.pool->ReserveBackup(o.layout.arena_bytes, BackupPieceBytes(o.layout),
                                                  host_->options().spill_dir, reclaim));
    if (d2h_pool == nullptr) d2h_pool = o.pool;
  }
  if (d2h_pool == nullptr) return absl::OkStatus();
  d2h_pool->AssertTransitionHeld();
  VMSTASH_ASSIGN_OR_RETURN(d2h_, d2h_pool->CopyStream());
  std::vector<ChunkSpan> spans;  // this process's chunks (only they are read)
  for (std::size_t d = 0; d < local_donors_; ++d) spans.push_back({donors_[d].address, donors_[d].chunk->size_bytes()});
  for (Out& o : out_) {
    if (!o.pool->backup()) continue;
    const std::size_t first = copies_.empty() ? 0 : copies_.back().group + 1;
    VMSTASH_ASSIGN_OR_RETURN(std::vector<SwitchCopy> copies,
                             PlanSwitchCopies(o.layout.in_order, spans, GroupBytes(), first));
    copies_.insert(copies_.end(), copies.begin(), copies.end());
  }
  const std::size_t groups = copies_.empty() ? 0 : copies_.back().group + 1;
  VMSTASH_ASSIGN_OR_RETURN(events_, d2h_pool->CopyEvents(groups));
  return absl::OkStatus();
}

absl::Status SwitchTransaction::QueueBackups() {
  for (std::size_t k = 0; k < copies_.size(); ++k) {
    const SwitchCopy& c = copies_[k];
    Out& o = out_[donors_[c.chunk].out];
    o.pool->AssertTransitionHeld();
    VMSTASH_RETURN_IF_ERROR(o.pool->arena()->CopyIn(c.step.arena_offset, c.step.device, c.step.size_bytes, d2h_));
    o.backed_up += c.step.size_bytes;
    if (k + 1 == copies_.size() || copies_[k + 1].group != c.group) {
      VMSTASH_RETURN_IF_ERROR(driver_->RecordEvent(device_, (*events_)[c.group], d2h_));
      for (const auto& [group, event] : ipc_events_) {  // for another process (OfferChunks)
        if (group == c.group) VMSTASH_RETURN_IF_ERROR(driver_->RecordEvent(device_, event, d2h_));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status SwitchTransaction::MapRecipients() {
  for (In& i : in_) {
    if (!i.restore) continue;
    i.pool->AssertTransitionHeld();
    if (i.pool->arena() == nullptr) {
      return absl::InternalError(absl::StrCat("resume of tag '", i.pool->name(), "': its backup arena is gone"));
    }
    // Note [Disk Backup]: a read error, not a SIGBUS; only the backed-up bytes are read.
    VMSTASH_RETURN_IF_ERROR(i.pool->arena()->Load(0, BackedUpArenaEnd(i.pool->backup_extents())));
    if (h2d_ == nullptr) {
      VMSTASH_ASSIGN_OR_RETURN(h2d_, i.pool->CopyStream());
    }
  }
  const CopyReadiness readiness(copies_, donors_.size());
  std::vector<const Chunk*> donor_chunks;
  for (const Donor& d : donors_) donor_chunks.push_back(d.chunk);
  std::size_t recipient = 0;
  for (std::size_t k = 0; k < in_.size(); ++k) {
    In& i = in_[k];
    for (int h = 0; h < 2; ++h) {
      Heap* heap = h == 0 ? i.pool->small() : i.pool->large();
      const std::vector<CoverSpan>& covers = covers_[2 * k + h];
      const std::vector<std::vector<HandoffPiece>> pieces(plan_.pieces.begin() + recipient,
                                                          plan_.pieces.begin() + recipient + covers.size());
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
                deferred_.push_back({std::nullopt, nullptr, kNoDonor, k, c});
                continue;
              }
              if (donors_[d].out == kForeign) {  // another process's: after its giver's event
                deferred_.push_back({std::nullopt, donors_[d].wait, d, k, c});
                continue;
              }
              // Cut like the D2H copies, so each part waits only for the reads it overwrites.
              const std::size_t step = GroupBytes();
              for (std::size_t done = 0; done < c.size_bytes; done += step) {
                const CopyStep part{c.device + done, c.arena_offset + done, std::min(step, c.size_bytes - done)};
                const DevicePtr at = donors_[d].address + (part.device - va);  // the same bytes, outgoing VA
                deferred_.push_back({readiness.WaitGroup(d, at, part.size_bytes), nullptr, d, k, part});
              }
            }
            return absl::OkStatus();
          }));
    }
  }
  return absl::OkStatus();
}

absl::Status SwitchTransaction::QueueRestores() {
  // Into fresh memory first, then into donors in the order their D2H copies complete,
  // then into other processes' chunks. Rank 0: no wait; rank g + 1: after D2H group g;
  // last: after a giver's event (each waited for once).
  constexpr std::size_t kAfterForeign = static_cast<std::size_t>(-1);
  auto rank = [&](const Deferred& q) {
    if (q.donor != kNoDonor && donors_[q.donor].out == kForeign) return kAfterForeign;
    return q.wait.has_value() ? *q.wait + 1 : 0;
  };
  std::stable_sort(deferred_.begin(), deferred_.end(),
                   [&](const Deferred& a, const Deferred& b) { return rank(a) < rank(b); });
  std::optional<std::size_t> waited;
  absl::flat_hash_set<Event> waited_foreign;
  for (const Deferred& q : deferred_) {
    if (q.wait.has_value() && (!waited.has_value() || *q.wait > *waited)) {
      VMSTASH_RETURN_IF_ERROR(driver_->StreamWaitEvent(device_, h2d_, (*events_)[*q.wait]));
      waited = q.wait;
    }
    if (q.foreign_wait != nullptr && waited_foreign.insert(q.foreign_wait).second) {
      VMSTASH_RETURN_IF_ERROR(driver_->StreamWaitEvent(device_, h2d_, q.foreign_wait));
    }
    In& i = in_[q.in];
    i.pool->AssertTransitionHeld();
    if (q.donor != kNoDonor) written_[q.donor] = true;  // before the call: conservative
    VMSTASH_RETURN_IF_ERROR(i.pool->arena()->CopyOut(q.step.device, q.step.arena_offset, q.step.size_bytes, h2d_));
    i.restored += q.step.size_bytes;
  }
  return absl::OkStatus();
}

std::string SwitchTransaction::RollBack(const absl::Status& cause) {
  // Nothing may still copy into memory about to be unmapped or restored: neither this
  // process's copies nor another process's into the chunks it offered.
  DrainStreams();
  SettleOffered();
  for (In& i : in_) {
    i.txn[0].reset();  // unmaps the incoming mappings; releases the fresh chunks
    i.txn[1].reset();
  }
  foreign_.clear();  // unmapped above: the other process's memory is its own again
  for (Out& o : out_) {
    if (o.unmapped && o.undo_error.ok()) o.undo_error = o.pool->RemapHeaps();
  }
  // Donors that restore copies wrote into get their tag's bytes back from the backup made
  // by this very switch (only `backup` donors are ever written: handoff_plan.h).
  bool restoring = false;
  std::vector<bool> loaded(out_.size(), false);
  for (const SwitchCopy& c : copies_) {
    if (!written_[c.chunk]) continue;
    const std::size_t k = donors_[c.chunk].out;
    Out& o = out_[k];
    if (!o.undo_error.ok()) continue;
    o.pool->AssertTransitionHeld();
    if (!loaded[k]) {
      // The bytes still in a staging ring reach the arena first (Note [Staging Ring]: a
      // switch failing before its Seal), then a sealed disk backup is read in (Note [Disk
      // Backup]). Sealing twice is harmless; a failure leaves the tag broken, not wrong.
      loaded[k] = true;
      o.undo_error = o.pool->arena()->Seal();
      if (!o.undo_error.ok()) continue;
      o.undo_error = o.pool->arena()->Load(0, o.layout.arena_bytes);
      if (!o.undo_error.ok()) continue;
    }
    absl::Status s = o.pool->arena()->CopyOut(c.step.device, c.step.arena_offset, c.step.size_bytes, h2d_);
    if (!s.ok()) o.undo_error = s;
    restoring = true;
  }
  if (restoring) {
    absl::Status s = driver_->SynchronizeStream(device_, h2d_);
    if (!s.ok()) {
      for (std::size_t d = 0; d < donors_.size(); ++d) {
        if (written_[d] && donors_[d].out != kForeign && out_[donors_[d].out].undo_error.ok()) {
          out_[donors_[d].out].undo_error = s;
        }
      }
    }
  }
  std::string broken;
  for (Out& o : out_) {
    o.pool->AssertTransitionHeld();
    // An arena this switch did not touch keeps what it holds (a retained backup).
    if (o.arena_used) o.pool->ArenaAfterFailedPause();
    {
      MutexLock lock(host_->mu());
      (void)o.pool->FailPause(cause, o.undo_error);
    }
    if (!o.undo_error.ok()) {
      absl::StrAppend(&broken, broken.empty() ? "" : "; ", "tag '", TagName(o.pool->id()), "' is broken: its memory "
                      "could not be restored (", o.undo_error.message(), "), its contents are lost; free its blocks "
                      "and use another tag");
    }
  }
  for (In& i : in_) {
    i.pool->AssertTransitionHeld();
    i.pool->ArenaAfterFailedResume();  // its ring goes (backup_arena.h, Note [Host Budget])
  }
  MutexLock lock(host_->mu());
  for (In& i : in_) {
    if (i.pool->state() == TagState::kPaused) continue;  // not moved (the switch failed before)
    absl::Status s = i.pool->MoveTo(TagState::kPaused);
    if (!s.ok()) VMSTASH_LOG(kError, "vmstash: switch rollback: {}", s.ToString());
  }
  return broken;
}

void SwitchTransaction::Commit() {
  // (5) Cannot fail: handles change owners, leftovers are released, handed-over bytes
  // zeroed; only then are the tags' new states published (Note [Switch Protocol]).
  absl::flat_hash_set<ChunkHandle> handed_set;
  for (const auto& pieces : plan_.pieces) {
    for (const HandoffPiece& p : pieces) {
      if (p.donor != kNoDonor) handed_set.insert(donors_[p.donor].handle);
    }
  }
  auto hand_over = [&](ChunkHandle h) { return handed_set.contains(h); };
  std::vector<Chunk> handed;
  std::vector<std::size_t> released(out_.size(), 0);
  absl::Status release_error;
  for (std::size_t k = 0; k < out_.size(); ++k) {
    TagPool* pool = out_[k].pool;
    released[k] = pool->small()->ReleaseAllAndPause(&release_error, hand_over, &handed);
    released[k] += pool->large()->ReleaseAllAndPause(&release_error, hand_over, &handed);
  }
  if (!release_error.ok()) {
    VMSTASH_LOG(kWarning, "vmstash: switch: a chunk release was refused ({}); it is retried later",
                release_error.ToString());
  }
  for (Chunk& c : foreign_) {
    if (hand_over(c.handle())) handed.push_back(std::move(c));
  }
  foreign_.clear();  // those no cover took (the other process releases its own handle)
  absl::flat_hash_map<ChunkHandle, Chunk*> by_handle;
  for (Chunk& c : handed) by_handle[c.handle()] = &c;
  for (In& i : in_) {
    for (auto& txn : i.txn) {
      for (auto& cover : txn->covers) {
        for (auto& piece : cover.pieces) {
          if (piece.donor != kNoDonor) piece.chunk = std::move(*by_handle.at(donors_[piece.donor].handle));
        }
      }
    }
    i.pool->small()->CommitResume(std::move(i.txn[0]));
    i.pool->large()->CommitResume(std::move(i.txn[1]));
    i.pool->AssertTransitionHeld();
    // Pages given back, unless retained (Note [Retained Backups]).
    i.pool->ArenaAfterResume(host_->GivesBackInBackground());
  }
  Mark(Step::kCommitted);
  // The incoming tags are still "resuming": nobody else allocates in them, frees their
  // blocks or releases their chunks until the zeroing has completed.
  if (host_->options().switch_zero) ZeroHandedOver();
  Mark(Step::kZeroed);
  // Each tag's pause or resume took the whole switch (both ran at once).
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start_).count();
  MutexLock lock(host_->mu());
  for (std::size_t k = 0; k < out_.size(); ++k) {
    Out& o = out_[k];
    o.pool->AssertTransitionHeld();
    absl::Status s = o.pool->NotePaused(std::move(o.layout.by_block), released[k], o.backed_up, ms);
    if (!s.ok()) VMSTASH_LOG(kError, "vmstash: switch commit: {}", s.ToString());
    ++o.pool->stats().switches;
  }
  for (In& i : in_) {
    i.pool->AssertTransitionHeld();
    absl::Status s = i.pool->NoteResumed(i.restored, ms);
    if (!s.ok()) VMSTASH_LOG(kError, "vmstash: switch commit: {}", s.ToString());
    host_->NoteReservedLocked(i.pool);
    ++i.pool->stats().switches;
  }
  host_->NoteSwitchLocked(plan_.handed_bytes);
}

void SwitchTransaction::Log() const {
  if (!LogEnabled(LogLevel::kDebug)) return;
  std::size_t overhang = 0, deferred_waits = 0;
  for (std::size_t o : plan_.overhang) overhang += o;
  for (const Deferred& q : deferred_) deferred_waits += q.wait.has_value();
  const std::size_t foreign = donors_.size() - local_donors_;
  VMSTASH_LOG(kDebug,
              "vmstash: switch on device {}: {} donors ({} of other processes), {} handed over ({} overhanging), {} fresh, {} released; "
              "{} D2H copies in {} groups, {} restore copies into donors ({} waiting); at ms: planned {:.2f}, mapped "
              "{:.2f}, copies queued {:.2f}, copies done {:.2f}, unmapped {:.2f}, committed {:.2f}, "
              "zeroed {:.2f}",
              device_, donors_.size(), foreign, HumanBytes(plan_.handed_bytes), HumanBytes(overhang),
              HumanBytes(plan_.fresh_bytes), HumanBytes(plan_.leftover_bytes), copies_.size(),
              copies_.empty() ? 0 : copies_.back().group + 1, deferred_.size(), deferred_waits, MsAt(Step::kPlanned),
              MsAt(Step::kRecipientsMapped), MsAt(Step::kCopiesQueued), MsAt(Step::kCopiesDone),
              MsAt(Step::kOutgoingUnmapped), MsAt(Step::kCommitted), MsAt(Step::kZeroed));
}

void SwitchTransaction::NoteUnwritten(DevicePtr va, std::size_t size_bytes, std::vector<CopyStep> written,
                                     std::vector<std::pair<DevicePtr, std::size_t>>* out) {
  std::sort(written.begin(), written.end(), [](const CopyStep& a, const CopyStep& b) { return a.device < b.device; });
  DevicePtr at = va;
  for (const CopyStep& c : written) {
    if (c.device > at) out->emplace_back(at, c.device - at);
    at = std::max<DevicePtr>(at, c.device + c.size_bytes);
  }
  if (va + size_bytes > at) out->emplace_back(at, va + size_bytes - at);
}

void SwitchTransaction::ZeroHandedOver() {
  // In the commit, before the incoming tags are published active (Note [Switch
  // Protocol]): the outgoing mappings are gone, every copy has completed, and the
  // incoming tags are still resuming, so nothing else touches these bytes. A failure
  // leaves them undefined, which the contract allows (discard tags' bytes, and a backup
  // tag's bytes outside its live ranges): logged, not returned. Either way the host
  // waits until nothing of the memset can still be running.
  Stream stream = nullptr;
  absl::Status s;
  for (In& i : in_) {
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
