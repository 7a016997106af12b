// Snapshot: a point-in-time picture of one device's allocator — tags, segments, chunks
// and blocks — that tests, tools and the CLI render. Plain data; JSON via SnapshotToJson.
//
// JSON shape (version 1):
//   {"version":1,"device":0,"driver":"sim","granularity":2097152,
//    "tags":[{"name","policy","state"}],
//    "segments":[{"tag","heap":"small"|"large","address","va_bytes","mapped_bytes",
//                 "chunks":[{"address","size","mapped"}],
//                 "blocks":[{"address","size","requested","live","stream"}]}]}
// Addresses and stream handles are integers.
#ifndef VMSTASH_ALLOCATOR_SNAPSHOT_H_
#define VMSTASH_ALLOCATOR_SNAPSHOT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "allocator/tag.h"
#include "vmm/driver.h"

namespace vmstash {

struct ChunkSnapshot {
  DevicePtr address = 0;
  std::uint64_t size_bytes = 0;
  bool mapped = true;
};

struct BlockSnapshot {
  DevicePtr address = 0;
  std::uint64_t size_bytes = 0;
  std::uint64_t requested_bytes = 0;
  bool live = false;
  std::uint64_t stream = 0;  // allocation stream (live) or owner stream (free; 0 = any)
};

struct SegmentSnapshot {
  std::string tag;
  std::string heap;  // "small" or "large"
  DevicePtr address = 0;
  std::uint64_t va_bytes = 0;
  std::uint64_t mapped_bytes = 0;
  std::vector<ChunkSnapshot> chunks;  // mapped chunks, and the unmapped holes between them
  std::vector<BlockSnapshot> blocks;
};

struct TagSnapshot {
  std::string name;
  Policy policy = Policy::kDiscard;
  std::string state = "active";
};

struct Snapshot {
  int device = 0;
  std::string driver;
  std::uint64_t granularity_bytes = 0;
  std::vector<TagSnapshot> tags;
  std::vector<SegmentSnapshot> segments;
};

std::string SnapshotToJson(const Snapshot& snapshot);

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_SNAPSHOT_H_
