// TorchSnapshotPickle: see torch_snapshot.h.
#include "tools/cli/torch_snapshot.h"


#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tools/cli/per_device.h"

namespace vmstash::cli {
namespace {

// A pickle (protocol 2) writer for built-in types.
class Pickler {
 public:
  Pickler() { out_ = "\x80\x02"; }
  void Dict() { out_ += '}'; }
  void List() { out_ += ']'; }
  void Mark() { out_ += '('; }
  void SetItems() { out_ += 'u'; }
  void Appends() { out_ += 'e'; }
  void Tuple2() { out_ += '\x86'; }
  void None() { out_ += 'N'; }
  void Bool(bool b) { out_ += b ? '\x88' : '\x89'; }
  void Str(const std::string& s) {
    out_ += 'X';
    Le(s.size(), 4);
    out_ += s;
  }
  void Int(std::int64_t v) {
    if (v >= INT32_MIN && v <= INT32_MAX) {
      out_ += 'J';
      Le(static_cast<std::uint64_t>(static_cast<std::uint32_t>(v)), 4);
      return;
    }
    // LONG1: little-endian two's complement, as few bytes as keep the sign.
    std::string bytes;
    std::uint64_t u = static_cast<std::uint64_t>(v);
    for (int i = 0; i < 8; ++i) bytes += static_cast<char>((u >> (8 * i)) & 0xff);
    while (bytes.size() > 1) {
      const char last = bytes.back(), prev = bytes[bytes.size() - 2];
      if ((last == 0 && (prev & 0x80) == 0) || (last == '\xff' && (prev & 0x80) != 0)) bytes.pop_back();
      else break;
    }
    out_ += '\x8a';
    out_ += static_cast<char>(bytes.size());
    out_ += bytes;
  }
  std::string Finish() { return out_ + '.'; }

 private:
  void Le(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xff);
  }
  std::string out_;
};

struct TorchBlock {
  std::int64_t address, size, requested;
  bool live;
};
struct TorchSegment {
  int device;
  std::int64_t address, size;
  std::string tag, heap;
  std::vector<TorchBlock> blocks;
};
struct Unmapped {
  int device;
  std::int64_t address, size;
  std::string tag;
};

void Frames(Pickler& p, const std::string& tag, const std::string& heap) {
  p.List();
  p.Mark();
  p.Dict();
  p.Mark();
  p.Str("filename");
  p.Str("vmstash");
  p.Str("line");
  p.Int(0);
  p.Str("name");
  p.Str(absl::StrCat("tag ", tag, " (", heap, ")"));
  p.SetItems();
  p.Appends();
}

void CollectDevice(const JsonValue& dev, std::vector<TorchSegment>* segments, std::vector<Unmapped>* unmapped) {
  const int device = static_cast<int>(dev["device"].Int());
  for (const JsonValue& seg : dev["segments"].items()) {
    const std::string tag = seg["tag"].String(), heap = seg["heap"].String();
    // Runs of adjacent mapped chunks.
    std::vector<TorchSegment> runs;
    for (const JsonValue& c : seg["chunks"].items()) {
      if (!c["mapped"].Bool(true)) continue;
      const std::int64_t a = c["address"].Int(), n = c["size"].Int();
      if (!runs.empty() && runs.back().address + runs.back().size == a) {
        runs.back().size += n;
      } else {
        runs.push_back({device, a, n, tag, heap, {}});
      }
    }
    for (const JsonValue& b : seg["blocks"].items()) {
      const std::int64_t a = b["address"].Int();
      bool placed = false;
      for (TorchSegment& r : runs) {
        if (a >= r.address && a < r.address + r.size) {
          r.blocks.push_back({a, b["size"].Int(), b["requested"].Int(), b["live"].Bool()});
          placed = true;
          break;
        }
      }
      if (!placed && b["live"].Bool()) unmapped->push_back({device, a, b["requested"].Int(), tag});
    }
    for (TorchSegment& r : runs) segments->push_back(std::move(r));
  }
}

}  // namespace

absl::StatusOr<std::string> TorchSnapshotPickle(const JsonValue& snapshot) {
  absl::StatusOr<std::vector<const JsonValue*>> devices = PerDevice(snapshot, "snapshot");
  if (!devices.ok()) return devices.status();
  std::vector<TorchSegment> segments;
  std::vector<Unmapped> unmapped;
  int max_device = 0;
  for (const JsonValue* d : *devices) {
    if ((*d)["segments"].type() != JsonValue::Type::kArray) {
      return absl::InvalidArgumentError("snapshot: a device entry has no \"segments\" list");
    }
    CollectDevice(*d, &segments, &unmapped);
    max_device = std::max(max_device, static_cast<int>((*d)["device"].Int()));
  }
  Pickler p;
  p.Dict();
  p.Mark();
  p.Str("segments");
  p.List();
  if (!segments.empty()) {
    p.Mark();
    for (const TorchSegment& s : segments) {
      std::int64_t allocated = 0, requested = 0;
      for (const TorchBlock& b : s.blocks) {
        if (b.live) allocated += b.size, requested += b.requested;
      }
      p.Dict();
      p.Mark();
      p.Str("device"); p.Int(s.device);
      p.Str("address"); p.Int(s.address);
      p.Str("total_size"); p.Int(s.size);
      p.Str("allocated_size"); p.Int(allocated);
      p.Str("active_size"); p.Int(allocated);
      p.Str("requested_size"); p.Int(requested);
      p.Str("stream"); p.Int(0);
      p.Str("segment_type"); p.Str(s.heap == "small" ? "small" : "large");
      p.Str("segment_pool_id"); p.Int(0); p.Int(0); p.Tuple2();
      p.Str("is_expandable"); p.Bool(true);
      p.Str("frames"); Frames(p, s.tag, s.heap);
      p.Str("blocks");
      p.List();
      if (!s.blocks.empty()) {
        p.Mark();
        for (const TorchBlock& b : s.blocks) {
          p.Dict();
          p.Mark();
          p.Str("address"); p.Int(b.address);
          p.Str("size"); p.Int(b.size);
          p.Str("requested_size"); p.Int(b.live ? b.requested : b.size);
          p.Str("state"); p.Str(b.live ? "active_allocated" : "inactive");
          p.Str("frames"); Frames(p, s.tag, s.heap);
          p.SetItems();
        }
        p.Appends();
      }
      p.SetItems();
    }
    p.Appends();
  }
  p.Str("device_traces");
  p.List();
  p.Mark();
  for (int d = 0; d <= max_device; ++d) {
    p.List();
    bool any = false;
    for (const Unmapped& u : unmapped) {
      if (u.device != d) continue;
      if (!any) p.Mark(), any = true;
      p.Dict();
      p.Mark();
      p.Str("action"); p.Str("segment_unmap");
      p.Str("addr"); p.Int(u.address);
      p.Str("size"); p.Int(u.size);
      p.Str("stream"); p.Int(0);
      p.Str("time_us"); p.Int(0);
      p.Str("compile_context"); p.Str("");
      p.Str("user_metadata"); p.Str(absl::StrCat("vmstash: tag ", u.tag, " paused"));
      p.Str("frames"); Frames(p, u.tag, "paused");
      p.SetItems();
    }
    if (any) p.Appends();
  }
  p.Appends();
  p.Str("allocator_settings"); p.Dict();
  p.Str("external_annotations"); p.List();
  p.SetItems();
  return p.Finish();
}

}  // namespace vmstash::cli
