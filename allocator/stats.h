// Statistics: counters the allocator keeps per tag and per device, and their JSON form.
//
// A Stat is a current value with its peak since creation (or the last ResetPeaks). The
// allocator updates them under its mutex; Stats() returns a copy, so readers never hold
// allocator state. Byte meanings:
//   allocated  bytes of live blocks (rounded sizes); requested: what users asked for
//   reserved   bytes of mapped chunks (physical memory this tag holds)
//   cached     reserved bytes in free blocks (what EmptyCache can give back)
//   paused / backed_up  bytes released by pause / held in the backup arena (pause/resume)
//
// Thread-safety: plain values; copy freely.
#ifndef VMSTASH_ALLOCATOR_STATS_H_
#define VMSTASH_ALLOCATOR_STATS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "allocator/tag.h"
#include "vmm/driver_op.h"

namespace vmstash {

struct Stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  void Add(std::int64_t delta) {
    current += delta;
    if (current > peak) peak = current;
  }
  void ResetPeak() { peak = current; }
};

struct TagStats {
  // The tag's identity and state, reported from its TagPool (TagPool::FillStats); the
  // allocator never reads them back.
  std::string name;
  Policy policy = Policy::kDiscard;
  std::string backup_store;  // a `backup` tag's BackupStore (DescribeBackupStore)
  Stat allocated_bytes;
  Stat requested_bytes;
  Stat reserved_bytes;
  Stat active_blocks;
  std::uint64_t allocations = 0;
  std::uint64_t frees = 0;
  std::int64_t chunks = 0;
  std::int64_t cached_bytes = 0;  // filled in by Stats()
  std::int64_t paused_bytes = 0;
  std::int64_t backed_up_bytes = 0;
  // Pause/resume (see Note [Pause/Resume Protocol] in pause_resume.h).
  std::string state = "active";  // active | pausing | paused | resuming | broken
  std::int64_t backup_arena_bytes = 0;
  std::uint64_t pauses = 0;
  std::uint64_t resumes = 0;
  std::uint64_t switches = 0;  // pauses and resumes made by Switch (counted in both too)
  double last_pause_ms = 0;
  double last_resume_ms = 0;
  double last_pause_gib_per_s = 0;   // backed-up bytes / pause time (0 for discard)
  double last_resume_gib_per_s = 0;  // restored bytes / resume time
  // The peaks of the Stats (allocated, requested, reserved, active) to the current values.
  void ResetPeaks() {
    allocated_bytes.ResetPeak();
    requested_bytes.ResetPeak();
    reserved_bytes.ResetPeak();
    active_blocks.ResetPeak();
  }
};

// Adds one tag's counters into a total (the "total" of AllocatorStats): current values and
// counts add up; a peak adds the tags' peaks (an upper bound of the total's peak).
void AddToTotal(const TagStats& tag, TagStats* total);

struct AllocatorStats {
  int device = 0;
  std::string driver;
  bool bypass = false;
  TagStats total;  // name "total"
  std::vector<TagStats> tags;
  std::uint64_t cache_hits = 0;      // served from free blocks
  std::uint64_t grows = 0;           // served by mapping new chunks
  std::uint64_t fence_reuses = 0;    // blocks of other streams reused after an event
  std::uint64_t device_syncs = 0;    // OOM ladder / EmptyCache synchronizations
  std::uint64_t empty_cache_calls = 0;
  std::uint64_t released_bytes = 0;  // given back by EmptyCache and the OOM ladder
  std::uint64_t ooms = 0;            // ResourceExhausted returned to a caller
  std::uint64_t switches = 0;           // Switch transactions committed
  std::uint64_t handed_over_bytes = 0;  // chunks mapped from outgoing to incoming tags by them
  std::uint64_t pending_frees = 0;   // blocks waiting for RecordStream events
  DriverCounters driver_calls;
  std::uint64_t device_free_bytes = 0;
  std::uint64_t device_total_bytes = 0;
};

std::string StatsToJson(const AllocatorStats& stats);

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_STATS_H_
