#include "allocator/snapshot.h"

#include "base/json_writer.h"

namespace vmstash {

std::string SnapshotToJson(const Snapshot& s) {
  JsonWriter w;
  w.BeginObject();
  w.Field("version", 1);
  w.Field("device", s.device);
  w.Field("driver", s.driver);
  w.Field("granularity", s.granularity_bytes);
  w.Key("tags");
  w.BeginArray();
  for (const TagSnapshot& t : s.tags) {
    w.BeginObject();
    w.Field("name", t.name);
    w.Field("policy", PolicyName(t.policy));
    w.Field("state", t.state);
    w.EndObject();
  }
  w.EndArray();
  w.Key("segments");
  w.BeginArray();
  for (const SegmentSnapshot& seg : s.segments) {
    w.BeginObject();
    w.Field("tag", seg.tag);
    w.Field("heap", seg.heap);
    w.Field("address", seg.address);
    w.Field("va_bytes", seg.va_bytes);
    w.Field("mapped_bytes", seg.mapped_bytes);
    w.Key("chunks");
    w.BeginArray();
    for (const ChunkSnapshot& c : seg.chunks) {
      w.BeginObject();
      w.Field("address", c.address);
      w.Field("size", c.size_bytes);
      w.Field("mapped", c.mapped);
      w.EndObject();
    }
    w.EndArray();
    w.Key("blocks");
    w.BeginArray();
    for (const BlockSnapshot& b : seg.blocks) {
      w.BeginObject();
      w.Field("address", b.address);
      w.Field("size", b.size_bytes);
      w.Field("requested", b.requested_bytes);
      w.Field("live", b.live);
      w.Field("stream", b.stream);
      w.EndObject();
    }
    w.EndArray();
    w.EndObject();
  }
  w.EndArray();
  w.EndObject();
  return w.str();
}

}  // namespace vmstash
