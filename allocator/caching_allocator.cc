#include "allocator/caching_allocator.h"

#include <algorithm>
#include <tuple>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/types/span.h"
#include "allocator/pause_resume.h"
#include "base/bytes.h"
#include "base/log.h"
#include "base/status_macros.h"

namespace vmstash {
absl::StatusOr<std::unique_ptr<CachingAllocator>> CachingAllocator::Create(Driver* driver, int device,
                                                                         AllocatorOptions options) {
  if (driver == nullptr) return absl::InvalidArgumentError("CachingAllocator: driver is null");
  VMSTASH_ASSIGN_OR_RETURN(int count, driver->DeviceCount());
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("CachingAllocator: device ", device, " does not exist (", count,
                                                   " device(s) with driver ", driver->Name(), ")"));
  }
  VMSTASH_RETURN_IF_ERROR(CheckChunkBounds(options));
  ChunkOptions chunk_options;
  chunk_options.shareable_fd = options.share_chunks;
  VMSTASH_ASSIGN_OR_RETURN(std::size_t gran, driver->Granularity(device, GranularityKind::kMinimum, chunk_options));
  VMSTASH_ASSIGN_OR_RETURN(DeviceMemoryInfo info, driver->MemoryInfo(device));
  return std::unique_ptr<CachingAllocator>(new CachingAllocator(driver, device, options, gran, info.total_bytes));
}

CachingAllocator::CachingAllocator(Driver* driver, int device, AllocatorOptions options, std::size_t granularity_bytes,
                                   std::size_t device_total_bytes)
    : TransitionHost(driver, device, options, granularity_bytes),
      device_total_bytes_(device_total_bytes),
      bypass_(driver, device, granularity_bytes) {
  counters_.device = device;
  counters_.driver = std::string(driver->Name());
  counters_.bypass = options.bypass;
  if (options.auto_prepare) {
    preparer_ = std::make_unique<AutoPreparer>(
        [this](TagId tag, std::size_t bytes, bool give_back) {
          absl::Status s = give_back ? GiveBackTag(tag) : absl::OkStatus();
          if (bytes > 0) {
            absl::Status prepared = PrepareTag(tag, bytes, /*background=*/true);
            if (s.ok()) s = prepared;
          }
          return s;
        },
        std::chrono::milliseconds(std::max(options.auto_prepare_settle_ms, 0)),
        [driver] { driver->RelaxStreamCaptureForThisThread(); });
  }
}

CachingAllocator::~CachingAllocator() {
  preparer_.reset();  // its thread calls Prepare(): stop it before anything goes away
  MutexLock lock(&mu_);
  absl::Status sync = driver_->SynchronizeDevice(device_);
  if (!sync.ok()) VMSTASH_LOG(kError, "vmstash: device {} sync at allocator shutdown: {}", device_, sync.ToString());
  if (!live_.empty() || bypass_.size() != 0) {
    VMSTASH_LOG(kWarning, "vmstash: device {} allocator destroyed with {} live block(s); their memory is released",
                device_, live_.size() + bypass_.size());
  }
  for (PendingFree& p : pending_) {
    for (Event e : p.events) idle_events_.push_back(e);
  }
  pending_.clear();
  for (Fence& f : fences_) idle_events_.push_back(f.event);
  fences_.clear();
  for (Event e : idle_events_) {
    absl::Status s = driver_->DestroyEvent(device_, e);
    if (!s.ok()) VMSTASH_LOG(kError, "vmstash: destroying a pooled event: {}", s.ToString());
  }
  live_.clear();
  bypass_.Clear();  // RAII: unmap, release, free VA (errors logged)
  pools_.clear();        // copy streams and events destroyed; heaps give back their chunks and reservations
}

absl::StatusOr<TagPool*> CachingAllocator::FindPoolLocked(TagId tag, const char* what) const {
  if (TagPool* pool = PoolOrNullLocked(tag)) return pool;
  if (tag < 0 || tag >= TagCount()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": unknown tag id ", tag, " (intern the name first)"));
  }
  return absl::NotFoundError(absl::StrCat(what, ": tag '", TagName(tag), "' does not exist on device ", device_,
                                          " (create it or allocate in it first)"));
}

absl::StatusOr<TagPool*> CachingAllocator::FindPool(TagId tag, const char* what) const {
  MutexLock lock(&mu_);
  return FindPoolLocked(tag, what);
}

absl::StatusOr<TagPool*> CachingAllocator::PoolLocked(TagId tag, Policy policy, const char* what) {
  absl::StatusOr<TagPool*> found = FindPoolLocked(tag, what);
  if (!absl::IsNotFound(found.status())) return found;
  std::size_t va = options_.heap_va_bytes != 0 ? options_.heap_va_bytes : 2 * device_total_bytes_;
  va = RoundUp(std::max(va, granularity_bytes_), granularity_bytes_);
  HeapConfig base;
  base.owner_id = tag;
  base.driver = driver_;
  base.device = device_;
  base.granularity_bytes = granularity_bytes_;
  base.va_bytes = va;
  base.chunk_options.shareable_fd = options_.share_chunks;
  HeapConfig small = base;
  small.name = absl::StrCat(TagName(tag), "/small");
  small.small = true;
  small.small_chunk_bytes = RoundUp(std::size_t{2} << 20, granularity_bytes_);
  small.min_split_bytes = kAlignmentBytes;
  HeapConfig large = base;
  large.name = absl::StrCat(TagName(tag), "/large");
  large.min_chunk_bytes = RoundUp(options_.min_chunk_bytes, granularity_bytes_);
  large.max_chunk_bytes = RoundUp(options_.max_chunk_bytes, granularity_bytes_);
  // A remainder no larger than the small limit can never serve a large request.
  large.min_split_bytes = kSmallMaxBytes + 1;
  if (pools_.size() <= static_cast<std::size_t>(tag)) pools_.resize(tag + 1);
  pools_[tag] = std::make_unique<TagPool>(tag, policy, options_.backup_store, driver_, device_, std::move(small),
                                          std::move(large), &mu_, options_.host_leases);
  return pools_[tag].get();
}

absl::Status CachingAllocator::CreateTag(TagId tag, Policy policy) {
  MutexLock lock(&mu_);
  if (const TagPool* existing = PoolOrNullLocked(tag)) {
    if (existing->policy() == policy) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat("tag '", TagName(tag), "' already exists on device ", device_,
                                                      " with policy ", PolicyName(existing->policy())));
  }
  return PoolLocked(tag, policy, "create_tag").status();
}

bool CachingAllocator::DropEmptyTag(TagId tag) {
  MutexLock lock(&mu_);
  TagPool* pool = PoolOrNullLocked(tag);
  if (pool == nullptr || !pool->Empty()) return false;
  // Retired, not freed (caching_allocator.h); a queued background request does nothing.
  pool->auto_prepare().requested_bytes = 0;
  retired_pools_.push_back(std::move(pools_[tag]));
  return true;
}

absl::StatusOr<Policy> CachingAllocator::TagPolicy(TagId tag) const {
  MutexLock lock(&mu_);
  VMSTASH_ASSIGN_OR_RETURN(const TagPool* pool, FindPoolLocked(tag, "policy"));
  return pool->policy();
}

bool CachingAllocator::TagHoldsMemory(TagId tag) const {
  MutexLock lock(&mu_);
  absl::StatusOr<TagPool*> pool = FindPoolLocked(tag, "holds memory");
  return pool.ok() && ((*pool)->stats().reserved_bytes.current > 0 || (*pool)->state() != TagState::kActive);
}

absl::StatusOr<DevicePtr> CachingAllocator::Allocate(std::size_t size_bytes, Stream stream, TagId tag) {
  if (size_bytes == 0) return DevicePtr{0};
  if (size_bytes > kMaxRequestBytes) {
    return absl::InvalidArgumentError(absl::StrCat("allocation of ", size_bytes, " bytes is over the 2^48 limit"));
  }
  const std::size_t rounded = RoundUp(size_bytes, kAlignmentBytes);
  MutexLock lock(&mu_);
  TagPool* pool = PoolOrNullLocked(tag);
  if (pool == nullptr) {
    VMSTASH_ASSIGN_OR_RETURN(pool, PoolLocked(tag, Policy::kDiscard, "allocate"));
  }
  if (pool->state() != TagState::kActive) return pool->NotActiveError("resume it before allocating");
  if (options_.bypass) return AllocateBypassLocked(pool, size_bytes, rounded);
  if (!pending_.empty()) CompletePendingLocked(0, /*in_transition=*/-1);
  Heap* heap = rounded <= kSmallMaxBytes ? pool->small() : pool->large();
  Block* block = heap->AllocateCached(rounded, stream);
  if (block != nullptr) {
    ++counters_.cache_hits;
  } else {
    absl::StatusOr<Block*> slow = AllocateSlowLocked(pool, heap, rounded, stream);
    if (!slow.ok()) return AfterOpLocked(slow.status());
    block = *slow;
  }
  block->requested_bytes = size_bytes;
  live_.emplace(block->address, block);
  pool->NoteAllocated(block->size_bytes, size_bytes);
  if (options_.validate_each_op) VMSTASH_RETURN_IF_ERROR(AfterOpLocked(absl::OkStatus()));
  return block->address;
}

absl::StatusOr<DevicePtr> CachingAllocator::AllocateBypassLocked(TagPool* pool, std::size_t size_bytes,
                                                                 std::size_t rounded) {
  DevicePtr ptr = 0;
  absl::StatusOr<BypassAllocations::Record> made =
      bypass_.Allocate(pool->id(), size_bytes, rounded, [this]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return SynchronizeLocked();  // called by Allocate, under mu_
      }, &ptr);
  if (absl::IsResourceExhausted(made.status())) {
    ++counters_.ooms;
    return absl::ResourceExhaustedError(OomMessageLocked(pool, size_bytes, made.status()));
  }
  VMSTASH_RETURN_IF_ERROR(made.status());
  pool->NoteAllocated(made->size_bytes, size_bytes);
  pool->stats().reserved_bytes.Add(static_cast<std::int64_t>(made->size_bytes));
  ++pool->stats().chunks;
  ++counters_.grows;
  return ptr;
}

absl::StatusOr<Block*> CachingAllocator::AllocateSlowLocked(TagPool* pool, Heap* heap, std::size_t size_bytes,
                                                            Stream stream) {
  // Ladder step 2: fenced blocks of other streams.
  if (ReuseFencedLocked(heap, stream)) {
    if (Block* b = heap->AllocateCached(size_bytes, stream)) {
      ++counters_.fence_reuses;
      return b;
    }
  }
  // Step 3: new chunk.
  absl::StatusOr<Block*> grown = GrowLocked(heap, size_bytes, stream);
  if (grown.ok()) {
    ++counters_.grows;
    NoteReservedLocked(pool);
    return grown;
  }
  if (!absl::IsResourceExhausted(grown.status())) return grown.status();
  VMSTASH_LOG(kDebug, "vmstash: device {}: {} for {} bytes, synchronizing and retrying", device_,
              grown.status().ToString(), size_bytes);
  // Step 4: wait for the device; everything free becomes usable by every stream.
  absl::Status sync = SynchronizeLocked();
  if (!sync.ok()) return sync;
  if (Block* b = heap->AllocateCached(size_bytes, stream)) return b;
  // Step 5: give back the free chunks of every tag and retry.
  absl::Status released = ReleaseCachedLocked(-1);
  if (!released.ok()) VMSTASH_LOG(kWarning, "vmstash: releasing cached chunks: {}", released.ToString());
  grown = GrowLocked(heap, size_bytes, stream);
  if (grown.ok()) {
    ++counters_.grows;
    NoteReservedLocked(pool);
    return grown;
  }
  if (!absl::IsResourceExhausted(grown.status())) return grown.status();
  ++counters_.ooms;
  return absl::ResourceExhaustedError(OomMessageLocked(pool, size_bytes, grown.status()));
}

absl::StatusOr<Block*> CachingAllocator::GrowLocked(Heap* heap, std::size_t size_bytes, Stream stream) {
  const std::size_t margin = memory_margin_bytes_.load(std::memory_order_relaxed);
  if (margin != 0) {
    VMSTASH_ASSIGN_OR_RETURN(DeviceMemoryInfo info, driver_->MemoryInfo(device_));
    if (info.free_bytes < size_bytes || info.free_bytes - size_bytes < margin) {
      return absl::ResourceExhaustedError(absl::StrCat("growing by ", size_bytes, " bytes would leave less than the ",
                                                       "memory margin of ", margin, " bytes free (device free: ",
                                                       info.free_bytes, ")"));
    }
  }
  return heap->AllocateGrow(size_bytes, stream);
}

void CachingAllocator::SetMemoryMargin(std::size_t bytes) {
  memory_margin_bytes_.store(bytes, std::memory_order_relaxed);
}

bool CachingAllocator::ReuseFencedLocked(Heap* heap, Stream stream) {
  std::vector<Stream> owners = heap->StreamsWithFreeBlocks();
  bool moved = false;
  for (Stream s : owners) {
    if (s == stream) continue;
    auto it = std::find_if(fences_.begin(), fences_.end(), [&](const Fence& f) { return f.stream == s; });
    if (it == fences_.end()) {
      absl::StatusOr<Event> event = TakeEventLocked();
      if (!event.ok()) continue;
      absl::Status recorded = driver_->RecordEvent(device_, *event, s);
      if (!recorded.ok()) {
        idle_events_.push_back(*event);
        VMSTASH_LOG(kDebug, "vmstash: fence on stream {}: {}", static_cast<void*>(s), recorded.ToString());
        continue;
      }
      fences_.push_back(Fence{s, *event, free_epoch_});
      it = fences_.end() - 1;
    }
    absl::StatusOr<bool> done = driver_->QueryEvent(device_, it->event);
    if (!done.ok() || !*done) continue;
    for (auto& pool : pools_) {
      if (pool == nullptr || pool->frozen()) continue;
      moved |= pool->small()->ShareFreeBlocks(s, it->epoch) != 0;
      moved |= pool->large()->ShareFreeBlocks(s, it->epoch) != 0;
    }
    idle_events_.push_back(it->event);
    fences_.erase(it);
  }
  return moved;
}

absl::StatusOr<Event> CachingAllocator::TakeEventLocked() {
  if (!idle_events_.empty()) {
    Event e = idle_events_.back();
    idle_events_.pop_back();
    return e;
  }
  return driver_->CreateEvent(device_, false);
}

void CachingAllocator::CompletePendingLocked(std::uint64_t synced_before, TagId in_transition) {
  for (auto it = pending_.begin(); it != pending_.end();) {
    TagPool* owner = PoolOf(it->block);
    if (owner->busy() && owner->id() != in_transition) {
      ++it;
      continue;
    }
    bool done = it->seq < synced_before;
    if (!done && !it->needs_device_sync) {
      done = true;
      for (Event e : it->events) {
        absl::StatusOr<bool> q = driver_->QueryEvent(device_, e);
        if (!q.ok() || !*q) {
          done = false;
          break;
        }
      }
    }
    if (!done) {
      ++it;
      continue;
    }
    for (Event e : it->events) idle_events_.push_back(e);
    it->block->heap->Free(it->block, ++free_epoch_);
    it = pending_.erase(it);
  }
}

absl::Status CachingAllocator::SynchronizeLocked() {
  ++counters_.device_syncs;
  VMSTASH_RETURN_IF_ERROR(driver_->SynchronizeDevice(device_));
  CompletePendingLocked(pending_seq_, /*in_transition=*/-1);  // mu_ was held throughout: every pending free is older
  for (Fence& f : fences_) idle_events_.push_back(f.event);
  fences_.clear();
  for (auto& pool : pools_) {
    if (pool == nullptr || pool->frozen()) continue;
    for (Heap* heap : pool->heaps()) {
      for (Stream s : heap->StreamsWithFreeBlocks()) heap->ShareFreeBlocks(s, ~std::uint64_t{0});
    }
  }
  return absl::OkStatus();
}

absl::Status CachingAllocator::ReleaseCachedLocked(TagId tag) {
  absl::Status first;
  for (auto& pool : pools_) {
    if (pool == nullptr || pool->frozen() || (tag >= 0 && pool->id() != tag)) continue;
    for (Heap* heap : pool->heaps()) {
      absl::Status error;
      counters_.released_bytes += heap->ReleaseFreeChunks(&error);
      if (first.ok()) first = error;
    }
    NoteReservedLocked(pool.get());
  }
  return first;
}

void CachingAllocator::NoteReservedLocked(TagPool* pool) {
  pool->NoteReserved();
  // A `backup` tag outgrowing its prepared arena: pin ahead of the first pause, with 25%
  // headroom (see auto_preparer.h).
  const std::size_t bytes = pool->mapped_bytes();
  // Only pinned arenas: the others cost nothing to make at pause time (and a disk arena
  // made early would take the disk before it is needed).
  if (preparer_ != nullptr && pool->auto_prepare().ahead && pool->policy() == Policy::kBackup &&
      pool->state() == TagState::kActive && pool->store().kind == BackupStore::Kind::kPinned &&
      bytes > pool->auto_prepare().requested_bytes &&
      bytes > pool->auto_prepare().floor_bytes) {
    pool->auto_prepare().requested_bytes = RoundUp(bytes + bytes / 4, std::size_t{64} << 20);
    preparer_->Request(pool->id(), pool->auto_prepare().requested_bytes);
  }
  if (preparer_ != nullptr && pool->give_back_pending()) preparer_->RequestGiveBack(pool->id());
}

void CachingAllocator::StopBackgroundWork() {
  if (preparer_ != nullptr) preparer_->Stop();
}

void CachingAllocator::WaitForBackgroundPrepare() {
  if (preparer_ != nullptr) preparer_->WaitIdle();
}

absl::Status CachingAllocator::Free(DevicePtr ptr) {
  if (ptr == 0) return absl::OkStatus();
  for (;;) {
    Mutex* wait_for = nullptr;
    TagPool* orphaned = nullptr;  // Note [Retained Backups]: its arena goes with its last backed-up block
    absl::Status freed_status;
    {
      MutexLock lock(&mu_);
      auto it = live_.find(ptr);  // the one lookup of the free path
      if (it == live_.end()) {
        if (bypass_.Contains(ptr)) {
          ++counters_.device_syncs;
          absl::StatusOr<BypassAllocations::Record> freed = bypass_.Free(ptr);
          if (!freed.ok()) return AfterOpLocked(freed.status());
          TagPool* pool = pools_[freed->tag].get();
          pool->NoteFreed(freed->size_bytes, freed->requested_bytes);
          pool->stats().reserved_bytes.Add(-static_cast<std::int64_t>(freed->size_bytes));
          --pool->stats().chunks;
          counters_.released_bytes += freed->size_bytes;
          return AfterOpLocked(absl::OkStatus());
        }
        return absl::InvalidArgumentError(
            absl::StrCat("free of ", Hex(ptr), ": not a live allocation of vmstash on device ", device_));
      }
      TagPool* pool = PoolOf(it->second);
      if (!pool->busy()) {
        Block* block = it->second;
        live_.erase(it);
        if (!pool->holds_backup_records()) return FreeBlockLocked(pool, block);  // the usual case
        if (pool->DropBackupOf(block)) orphaned = pool;
        freed_status = FreeBlockLocked(pool, block);
      } else {
        wait_for = pool->transition_mu();
      }
    }
    if (wait_for == nullptr) {
      // Pools are never destroyed while they hold an arena (TagPool::Empty), so `orphaned`
      // outlives the owner's mu.
      if (orphaned != nullptr) orphaned->ReleaseOrphanedArena();
      return freed_status;
    }
    MutexLock wait(wait_for);  // the pause or resume of the block's tag finishes first
  }
}

absl::Status CachingAllocator::FreeBlockLocked(TagPool* pool, Block* block) {
  Heap* heap = block->heap;
  if (pool->state() == TagState::kPaused) {
    // Its bytes were released with the pause; its backup bytes are dropped (the caller's
    // TagPool::DropBackupOf, which also drops a retained backup of an active tag).
    block->other_streams.clear();
  }
  pool->NoteFreed(block->size_bytes, block->requested_bytes);
  if (block->other_streams.empty()) {
    heap->Free(block, ++free_epoch_);
  } else {
    PendingFree pending;
    pending.block = block;
    pending.seq = pending_seq_++;
    block->allocated = false;
    for (Stream other : block->other_streams) {
      absl::StatusOr<Event> event = TakeEventLocked();
      absl::Status recorded = event.ok() ? driver_->RecordEvent(device_, *event, other) : event.status();
      if (!recorded.ok()) {
        if (event.ok()) idle_events_.push_back(*event);
        VMSTASH_LOG(kWarning, "vmstash: free of {}: no event on a recorded stream ({}); the block is reused "
                    "only after the next device synchronization", Hex(block->address), recorded.ToString());
        pending.needs_device_sync = true;
        continue;
      }
      pending.events.push_back(*event);
    }
    block->other_streams.clear();
    pending_.push_back(std::move(pending));
  }
  if (options_.validate_each_op) return AfterOpLocked(absl::OkStatus());
  return absl::OkStatus();
}

bool CachingAllocator::Owns(DevicePtr ptr) const {
  MutexLock lock(&mu_);
  return live_.contains(ptr) || bypass_.Contains(ptr);
}

absl::Status CachingAllocator::RecordStream(DevicePtr ptr, Stream stream) {
  MutexLock lock(&mu_);
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    if (bypass_.Contains(ptr)) return absl::OkStatus();  // bypass frees synchronize the device
    return absl::InvalidArgumentError(
        absl::StrCat("record_stream on ", Hex(ptr), ": not a live allocation of vmstash on device ", device_));
  }
  Block* block = it->second;
  if (stream == block->stream) return absl::OkStatus();
  if (std::find(block->other_streams.begin(), block->other_streams.end(), stream) == block->other_streams.end()) {
    block->other_streams.push_back(stream);
  }
  return absl::OkStatus();
}

absl::Status CachingAllocator::EmptyCache() { return EmptyCache(-1); }

absl::Status CachingAllocator::EmptyCache(TagId tag) {
  MutexLock lock(&mu_);
  ++counters_.empty_cache_calls;
  if (tag >= 0) {
    absl::StatusOr<TagPool*> pool = FindPoolLocked(tag, "empty_cache");
    if (absl::IsNotFound(pool.status())) return absl::OkStatus();  // nothing cached for a tag never used here
    VMSTASH_RETURN_IF_ERROR(pool.status());
  }
  bool anything = !pending_.empty();
  for (auto& pool : pools_) {
    if (pool == nullptr || pool->frozen() || (tag >= 0 && pool->id() != tag)) continue;
    anything = anything || pool->small()->free_bytes() != 0 || pool->large()->free_bytes() != 0 ||
               pool->small()->va_bytes() != 0 || pool->large()->va_bytes() != 0;
  }
  if (!anything) return absl::OkStatus();
  VMSTASH_RETURN_IF_ERROR(SynchronizeLocked());
  return AfterOpLocked(ReleaseCachedLocked(tag));
}

std::string CachingAllocator::OomMessageLocked(const TagPool* pool, std::size_t size_bytes,
                                               const absl::Status& cause) {
  std::uint64_t free_bytes = 0, total_bytes = 0;
  absl::StatusOr<DeviceMemoryInfo> info = driver_->MemoryInfo(device_);
  if (info.ok()) {
    free_bytes = info->free_bytes;
    total_bytes = info->total_bytes;
  }
  std::int64_t reserved = 0, paused = 0;
  std::string per_tag;
  for (const auto& p : pools_) {
    if (p == nullptr) continue;
    reserved += p->stats().reserved_bytes.current;
    paused += p->stats().paused_bytes;
    absl::StrAppend(&per_tag, per_tag.empty() ? "" : "; ", p->name(), " (", PolicyName(p->policy()),
                    "): allocated ", HumanBytes(p->stats().allocated_bytes.current), ", reserved ",
                    HumanBytes(p->stats().reserved_bytes.current), ", paused ", HumanBytes(p->stats().paused_bytes));
  }
  return absl::StrCat("vmstash: out of memory on device ", device_, ": tried to allocate ", HumanBytes(size_bytes),
                      " in tag '", pool->name(), "'; device has ", HumanBytes(free_bytes), " free of ",
                      HumanBytes(total_bytes), "; vmstash reserves ", HumanBytes(reserved), " (paused ",
                      HumanBytes(paused), "); per tag: ", per_tag, ". Driver said: ", cause.message());
}

AllocatorStats CachingAllocator::Stats() const {
  AllocatorStats out;
  {
    MutexLock lock(&mu_);
    out = counters_;
    out.total = TagStats();
    out.total.name = "total";
    for (const auto& pool : pools_) {
      if (pool == nullptr) continue;
      TagStats t;
      pool->FillStats(&t);
      AddToTotal(t, &out.total);
      out.tags.push_back(std::move(t));
    }
    out.pending_frees = pending_.size();
  }
  out.driver_calls = driver_->Counters();
  absl::StatusOr<DeviceMemoryInfo> info = driver_->MemoryInfo(device_);
  if (info.ok()) {
    out.device_free_bytes = info->free_bytes;
    out.device_total_bytes = info->total_bytes;
  }
  return out;
}

void CachingAllocator::ResetPeaks() {
  MutexLock lock(&mu_);
  for (auto& pool : pools_) {
    if (pool != nullptr) pool->stats().ResetPeaks();
  }
}

Snapshot CachingAllocator::TakeSnapshot() const {
  MutexLock lock(&mu_);
  Snapshot snap;
  snap.device = device_;
  snap.driver = std::string(driver_->Name());
  snap.granularity_bytes = granularity_bytes_;
  for (const auto& pool : pools_) {
    if (pool == nullptr) continue;
    pool->AppendSnapshot(&snap);
  }
  bypass_.AppendSnapshot(&snap);
  return snap;
}

absl::StatusOr<TagPool*> CachingAllocator::TransitionPool(TagId tag, const char* what) {
  if (InOwnHook(static_cast<const TransitionHost*>(this), tag)) {
    return absl::FailedPreconditionError(absl::StrCat(what, " of tag '", TagName(tag), "' on device ", device_,
                                                      " from a hook of that tag (or of a switch moving it): a hook "
                                                      "may allocate and free, but not pause, resume or switch the "
                                                      "tags it runs for"));
  }
  MutexLock lock(&mu_);
  return FindPoolLocked(tag, what);
}

absl::StatusOr<CachingAllocator::Transition> CachingAllocator::Pause(TagId tag, const LiveRanges* live_ranges) {
  VMSTASH_ASSIGN_OR_RETURN(TagPool * pool, TransitionPool(tag, "pause"));
  return PauseExecutor(this, pool, live_ranges).Run();
}

absl::StatusOr<CachingAllocator::Transition> CachingAllocator::Resume(TagId tag) {
  VMSTASH_ASSIGN_OR_RETURN(TagPool * pool, TransitionPool(tag, "resume"));
  return ResumeExecutor(this, pool).Run();
}

absl::StatusOr<CachingAllocator::Transition> CachingAllocator::Switch(const std::vector<TagId>& pause,
                                                                     const std::vector<TagId>& resume,
                                                                     const LiveRangesByTag* live,
                                                                     SwitchChanges* changed, const SwitchAgree* agree,
                                                                     SwitchExchange* exchange) {
  if (changed != nullptr) *changed = SwitchChanges();
  // Note [Agreed Switch]: a request refused here is this process's outcome too.
  auto refuse = [agree](absl::Status s) {
    if (agree != nullptr) (void)(*agree)(s);
    return s;
  };
  if (pause.empty() && resume.empty()) {
    return refuse(absl::InvalidArgumentError("switch: no tag to pause and none to resume"));
  }
  absl::flat_hash_set<TagId> seen;
  std::vector<TagPool*> out, in;
  for (TagId t : pause) {
    if (!seen.insert(t).second) {
      return refuse(absl::InvalidArgumentError(absl::StrCat("switch: tag '", TagName(t), "' is listed twice")));
    }
  }
  for (TagId t : resume) {
    if (!seen.insert(t).second) {
      return refuse(absl::InvalidArgumentError(
          absl::StrCat("switch: tag '", TagName(t), "' is listed twice or both paused and resumed")));
    }
  }
  for (auto [tags, pools, what] : {std::tuple{&pause, &out, "switch (pause)"}, std::tuple{&resume, &in, "switch (resume)"}}) {
    for (TagId t : *tags) {
      absl::StatusOr<TagPool*> p = TransitionPool(t, what);
      if (!p.ok()) return refuse(p.status());
      pools->push_back(*p);
    }
  }
  return SwitchExecutor(this, std::move(out), std::move(in), live, agree, exchange).Run(changed);
}

std::size_t CachingAllocator::ReclaimPreparedArenas(const std::vector<const TagPool*>& transition,
                                                   std::size_t wanted) {
  std::size_t reclaimed = 0;
  for (std::size_t t = 0; reclaimed < wanted; ++t) {
    TagPool* pool = nullptr;
    {
      MutexLock lock(&mu_);
      if (t >= pools_.size()) break;
      pool = pools_[t].get();
      if (pool == nullptr || !pool->backup() ||
          std::find(transition.begin(), transition.end(), pool) != transition.end()) {
        continue;
      }
      // Tried, never waited for (Note [Host Budget]); once held, the pool stays (Empty).
      if (!pool->transition_mu()->TryLock()) continue;
    }
    reclaimed += pool->ReclaimPrepared();  // releases the transition lock
  }
  return reclaimed;
}

absl::Status CachingAllocator::AddHooks(TagId tag, TransitionHook before_pause, TransitionHook after_resume) {
  MutexLock lock(&mu_);
  VMSTASH_ASSIGN_OR_RETURN(TagPool * pool, PoolLocked(tag, Policy::kDiscard, "add_hooks"));
  pool->AddHooks(std::move(before_pause), std::move(after_resume));
  return absl::OkStatus();
}

absl::Status CachingAllocator::Prepare(TagId tag, std::size_t bytes) { return PrepareTag(tag, bytes, false); }

absl::Status CachingAllocator::GiveBackTag(TagId tag) {
  VMSTASH_ASSIGN_OR_RETURN(TagPool * pool, FindPool(tag, "give back"));
  return pool->GiveBack();
}

absl::Status CachingAllocator::PrepareTag(TagId tag, std::size_t bytes, bool background) {
  VMSTASH_ASSIGN_OR_RETURN(TagPool * pool, FindPool(tag, "prepare"));
  return pool->Prepare(bytes, background);
}

absl::Status CachingAllocator::ReleaseBackup(TagId tag) {
  VMSTASH_ASSIGN_OR_RETURN(TagPool * pool, FindPool(tag, "release_backup"));
  return pool->ReleaseBackup();
}

absl::Status CachingAllocator::SetPrepareAhead(TagId tag, bool ahead) {
  MutexLock lock(&mu_);
  VMSTASH_ASSIGN_OR_RETURN(TagPool * pool, FindPoolLocked(tag, "set_prepare_ahead"));
  if (pool->auto_prepare().ahead == ahead) return absl::OkStatus();
  pool->auto_prepare().ahead = ahead;
  // Off: a queued request finds nothing asked and does nothing. On: asked again from zero,
  // a release's floor forgotten (the caller asks for the tag's present size).
  pool->auto_prepare().requested_bytes = 0;
  if (ahead) {
    pool->auto_prepare().floor_bytes = 0;
    NoteReservedLocked(pool);
  }
  return absl::OkStatus();
}

absl::Status CachingAllocator::SetBackupStore(TagId tag, const BackupStore& store, bool directory_must_exist) {
  VMSTASH_RETURN_IF_ERROR(CheckBackupStore(store, directory_must_exist));
  VMSTASH_ASSIGN_OR_RETURN(TagPool * pool, FindPool(tag, "set_backup_store"));
  std::unique_ptr<BackupArena> dropped;  // freed after the locks are released
  return pool->SetStore(store, &dropped);
}

absl::Status CachingAllocator::SetBackupRetention(TagId tag, BackupRetention retention) {
  VMSTASH_ASSIGN_OR_RETURN(TagPool * pool, FindPool(tag, "set_backup_retention"));
  pool->SetRetention(retention);
  return absl::OkStatus();
}

absl::StatusOr<BackupStore> CachingAllocator::TagBackupStore(TagId tag) const {
  MutexLock lock(&mu_);
  VMSTASH_ASSIGN_OR_RETURN(const TagPool* pool, FindPoolLocked(tag, "backup store"));
  return pool->store();
}

absl::Status CachingAllocator::WithBackup(DevicePtr ptr, std::size_t size_bytes,
                                          const std::function<void(const char*)>& use) {
  if (size_bytes > ~DevicePtr{0} - ptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("backup read: ", size_bytes, " bytes at ", Hex(ptr), " run past the end of the address space"));
  }
  std::vector<TagPool*> paused;
  {
    MutexLock lock(&mu_);
    for (auto& pool : pools_) {
      // Paused backups, and the backups an active tag retained (Note [Retained Backups]).
      if (pool != nullptr && pool->backup() &&
          (pool->state() == TagState::kPaused || (pool->state() == TagState::kActive && pool->has_retained()))) {
        paused.push_back(pool.get());
      }
    }
  }
  for (TagPool* pool : paused) {
    VMSTASH_ASSIGN_OR_RETURN(bool found, pool->WithBackup(ptr, size_bytes, use));
    if (found) return absl::OkStatus();
  }
  return absl::NotFoundError(
      absl::StrCat("no paused (or retained) backup holds ", size_bytes, " bytes at ", Hex(ptr)));
}

absl::Status CachingAllocator::ReadBackup(DevicePtr ptr, std::size_t size_bytes, void* dst) {
  if (dst == nullptr && size_bytes != 0) return absl::InvalidArgumentError("ReadBackup: null destination");
  return WithBackup(ptr, size_bytes, [&](const char* src) { std::memcpy(dst, src, size_bytes); });
}

absl::StatusOr<const void*> CachingAllocator::BackupAddress(DevicePtr ptr, std::size_t size_bytes) {
  const void* found = nullptr;
  VMSTASH_RETURN_IF_ERROR(WithBackup(ptr, size_bytes, [&](const char* src) { found = src; }));
  return found;
}

absl::Status CachingAllocator::Validate() const {
  std::vector<TagPool*> pools;
  {
    MutexLock lock(&mu_);
    VMSTASH_RETURN_IF_ERROR(ValidateLocked());
    for (const auto& pool : pools_) {
      if (pool != nullptr) pools.push_back(pool.get());
    }
  }
  // Each backup with its arena, under the tag's transition lock (taken before mu_): a pool
  // dropped meanwhile is retired, not freed (DropEmptyTag).
  for (TagPool* pool : pools) VMSTASH_RETURN_IF_ERROR(pool->ValidateBackup());
  return absl::OkStatus();
}

absl::Status CachingAllocator::AfterOpLocked(absl::Status status) const {
  if (!options_.validate_each_op) return status;
  absl::Status valid = ValidateLocked();
  if (!valid.ok()) {
    VMSTASH_LOG(kError, "vmstash: {}", valid.ToString());
    return valid;
  }
  return status;
}

absl::Status CachingAllocator::ValidateLocked() const {
  std::size_t live_bytes_in_heaps = 0, pending = 0;
  std::size_t busy_live_bytes = 0;
  for (const auto& pool : pools_) {
    if (pool == nullptr) continue;
    if (pool->frozen()) busy_live_bytes += static_cast<std::size_t>(pool->stats().allocated_bytes.current);
    VMSTASH_RETURN_IF_ERROR(pool->Validate(bypass_.BytesOf(pool->id()), &live_bytes_in_heaps, &pending));
  }
  std::size_t live_bytes = 0;
  for (const auto& [ptr, b] : live_) {
    if (!b->allocated || b->address != ptr) return absl::InternalError(absl::StrCat("live map entry ", Hex(ptr)));
    live_bytes += b->size_bytes;
  }
  if (live_bytes != live_bytes_in_heaps + busy_live_bytes) {
    return absl::InternalError(absl::StrCat("live map holds ", live_bytes, " bytes, heaps ", live_bytes_in_heaps));
  }
  std::size_t busy_pending = 0;
  for (const PendingFree& p : pending_) busy_pending += pools_[p.block->heap->config().owner_id]->frozen() ? 1 : 0;
  if (pending + busy_pending != pending_.size()) {
    return absl::InternalError(absl::StrCat(pending, " blocks neither free nor live, ", pending_.size(), " pending"));
  }
  std::size_t records = 0, live_here = 0;
  for (const auto& pool : pools_) records += pool == nullptr || pool->frozen() ? 0 : pool->block_records();
  for (const auto& [ptr, b] : live_) live_here += PoolOf(b)->frozen() ? 0 : 1;
  if (records < live_here) return absl::InternalError("block records fewer than live blocks");
  return absl::OkStatus();
}

}  // namespace vmstash
