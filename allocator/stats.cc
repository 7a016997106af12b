#include "allocator/stats.h"

#include "absl/strings/str_format.h"
#include "base/json_writer.h"

namespace vmstash {
namespace {

void WriteStat(JsonWriter& w, absl::string_view key, const Stat& stat) {
  w.Key(key);
  w.BeginObject();
  w.Field("current", stat.current);
  w.Field("peak", stat.peak);
  w.EndObject();
}

void WriteTag(JsonWriter& w, const TagStats& t) {
  w.BeginObject();
  w.Field("name", t.name);
  w.Field("policy", PolicyName(t.policy));
  WriteStat(w, "allocated_bytes", t.allocated_bytes);
  WriteStat(w, "requested_bytes", t.requested_bytes);
  WriteStat(w, "reserved_bytes", t.reserved_bytes);
  WriteStat(w, "active_blocks", t.active_blocks);
  w.Field("allocations", t.allocations);
  w.Field("frees", t.frees);
  w.Field("chunks", t.chunks);
  w.Field("cached_bytes", t.cached_bytes);
  w.Field("paused_bytes", t.paused_bytes);
  w.Field("backed_up_bytes", t.backed_up_bytes);
  w.Field("state", t.state);
  w.Field("backup_arena_bytes", t.backup_arena_bytes);
  if (t.policy == Policy::kBackup) w.Field("backup_store", t.backup_store);
  w.Field("pauses", t.pauses);
  w.Field("resumes", t.resumes);
  w.Field("switches", t.switches);
  w.Field("last_pause_ms", t.last_pause_ms);
  w.Field("last_resume_ms", t.last_resume_ms);
  w.Field("last_pause_gib_per_s", t.last_pause_gib_per_s);
  w.Field("last_resume_gib_per_s", t.last_resume_gib_per_s);
  w.EndObject();
}

}  // namespace

void AddToTotal(const TagStats& t, TagStats* sum) {
  sum->allocated_bytes.current += t.allocated_bytes.current;
  sum->allocated_bytes.peak += t.allocated_bytes.peak;
  sum->requested_bytes.current += t.requested_bytes.current;
  sum->requested_bytes.peak += t.requested_bytes.peak;
  sum->reserved_bytes.current += t.reserved_bytes.current;
  sum->reserved_bytes.peak += t.reserved_bytes.peak;
  sum->active_blocks.current += t.active_blocks.current;
  sum->active_blocks.peak += t.active_blocks.peak;
  sum->allocations += t.allocations;
  sum->frees += t.frees;
  sum->chunks += t.chunks;
  sum->cached_bytes += t.cached_bytes;
  sum->paused_bytes += t.paused_bytes;
  sum->backed_up_bytes += t.backed_up_bytes;
}

std::string StatsToJson(const AllocatorStats& s) {
  JsonWriter w;
  w.BeginObject();
  w.Field("device", s.device);
  w.Field("driver", s.driver);
  w.Field("bypass", s.bypass);
  w.Field("device_free_bytes", s.device_free_bytes);
  w.Field("device_total_bytes", s.device_total_bytes);
  w.Key("total");
  WriteTag(w, s.total);
  w.Key("tags");
  w.BeginArray();
  for (const TagStats& t : s.tags) WriteTag(w, t);
  w.EndArray();
  w.Field("cache_hits", s.cache_hits);
  w.Field("grows", s.grows);
  w.Field("fence_reuses", s.fence_reuses);
  w.Field("device_syncs", s.device_syncs);
  w.Field("empty_cache_calls", s.empty_cache_calls);
  w.Field("released_bytes", s.released_bytes);
  w.Field("ooms", s.ooms);
  w.Field("switches", s.switches);
  w.Field("handed_over_bytes", s.handed_over_bytes);
  w.Field("pending_frees", s.pending_frees);
  w.Key("driver_calls");
  w.BeginObject();
  for (int i = 0; i < kNumDriverOps; ++i) {
    if (s.driver_calls.calls[i] != 0) w.Field(DriverOpName(static_cast<DriverOp>(i)), s.driver_calls.calls[i]);
  }
  w.Field("failed", s.driver_calls.failed_calls);
  w.EndObject();
  w.EndObject();
  return w.str();
}

}  // namespace vmstash
