#include "runtime/tag_share.h"

#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "base/json_reader.h"
#include "base/status_code.h"
#include "base/json_writer.h"

namespace vmstash::share {
namespace {

const char* KindName(ShareKind k) {
  switch (k) {
    case ShareKind::kMap: return "map";
    case ShareKind::kAck: return "ack";
    case ShareKind::kGrant: return "grant";
    case ShareKind::kChunks: return "chunks";
    case ShareKind::kRevoke: return "revoke";
    case ShareKind::kPaused: return "paused";
    case ShareKind::kError: return "error";
    case ShareKind::kBackup: return "backup";
    case ShareKind::kExtents: return "extents";
  }
  return "?";
}

void WriteRanges(JsonWriter& w, const char* key, const std::vector<ShareRange>& ranges) {
  w.Key(key);
  w.BeginArray();
  for (const ShareRange& r : ranges) {
    w.BeginArray();
    w.Uint(r.address);
    w.Uint(r.size_bytes);
    w.EndArray();
  }
  w.EndArray();
}

absl::Status Bad(absl::string_view what) { return absl::InvalidArgumentError(absl::StrCat("tag share protocol: ", what)); }

absl::StatusOr<std::string> Text(const JsonValue& doc, const char* key) {
  if (doc[key].type() != JsonValue::Type::kString) return Bad(absl::StrCat("\"", key, "\" must be a string"));
  return doc[key].String();
}

absl::StatusOr<std::uint64_t> Count(const JsonValue& doc, const char* key) {
  const JsonValue& v = doc[key];
  if (v.type() != JsonValue::Type::kNumber || v.Int() < 0 || static_cast<double>(v.Int()) != v.Number()) {
    return Bad(absl::StrCat("\"", key, "\" must be a whole number >= 0"));
  }
  return static_cast<std::uint64_t>(v.Int());
}

absl::StatusOr<std::vector<ShareRange>> Ranges(const JsonValue& doc, const char* key, std::size_t max) {
  const JsonValue& v = doc[key];
  if (!v.is_array()) return Bad(absl::StrCat("\"", key, "\" must be an array"));
  if (v.items().size() > max) return Bad(absl::StrCat("\"", key, "\" holds ", v.items().size(), ", over ", max));
  std::vector<ShareRange> out;
  for (const JsonValue& item : v.items()) {
    if (!item.is_array() || item.items().size() != 2) return Bad(absl::StrCat("\"", key, "\" holds a non-pair"));
    const JsonValue& a = item.items()[0];
    const JsonValue& n = item.items()[1];
    if (a.type() != JsonValue::Type::kNumber || n.type() != JsonValue::Type::kNumber || a.Int() <= 0 ||
        n.Int() <= 0 || static_cast<double>(a.Int()) != a.Number() || static_cast<double>(n.Int()) != n.Number() ||
        static_cast<std::uint64_t>(a.Int()) + static_cast<std::uint64_t>(n.Int()) < static_cast<std::uint64_t>(a.Int())) {
      return Bad(absl::StrCat("\"", key, "\" holds a range that is not [address > 0, bytes > 0]"));
    }
    out.push_back({static_cast<DevicePtr>(a.Int()), static_cast<std::size_t>(n.Int())});
  }
  return out;
}

// [[address > 0, bytes > 0, offset], ...]: at most `max`.
absl::StatusOr<std::vector<BackupRange>> Extents(const JsonValue& doc, std::size_t max) {
  const JsonValue& v = doc["extents"];
  if (!v.is_array()) return Bad("\"extents\" must be an array");
  if (v.items().size() > max) return Bad(absl::StrCat("\"extents\" holds ", v.items().size(), ", over ", max));
  std::vector<BackupRange> out;
  for (const JsonValue& item : v.items()) {
    bool good = item.is_array() && item.items().size() == 3;
    std::uint64_t n[3] = {0, 0, 0};
    for (std::size_t i = 0; good && i < 3; ++i) {
      const JsonValue& x = item.items()[i];
      good = x.type() == JsonValue::Type::kNumber && x.Int() >= 0 && static_cast<double>(x.Int()) == x.Number();
      if (good) n[i] = static_cast<std::uint64_t>(x.Int());
    }
    if (!good || n[0] == 0 || n[1] == 0 || n[0] + n[1] < n[0] || n[2] + n[1] < n[2]) {
      return Bad("\"extents\" holds one that is not [address > 0, bytes > 0, offset >= 0]");
    }
    out.push_back({static_cast<DevicePtr>(n[0]), static_cast<std::size_t>(n[1]), static_cast<std::size_t>(n[2])});
  }
  return out;
}

}  // namespace

std::string FormatShare(const ShareMessage& m) {
  JsonWriter w;
  w.BeginObject();
  w.Field("v", kShareVersion);
  switch (m.kind) {
    case ShareKind::kMap:
      w.Field("op", "map");
      w.Field("tag", m.tag);
      w.Field("device", m.device);
      break;
    case ShareKind::kAck:
      w.Field("ack", m.ack);
      w.Field("ok", m.ok);
      if (!m.ok) w.Field("message", m.message);
      break;
    case ShareKind::kGrant:
      w.Field("ev", "grant");
      w.Field("generation", static_cast<std::uint64_t>(m.generation));
      WriteRanges(w, "reservations", m.reservations);
      w.Field("chunks", static_cast<std::uint64_t>(m.chunk_count));
      break;
    case ShareKind::kChunks:
      w.Field("ev", "chunks");
      WriteRanges(w, "chunks", m.chunks);
      break;
    case ShareKind::kRevoke:
      w.Field("ev", "revoke");
      break;
    case ShareKind::kPaused:
      w.Field("ev", "paused");
      w.Field("generation", static_cast<std::uint64_t>(m.generation));
      if (!m.message.empty()) w.Field("message", m.message);
      break;
    case ShareKind::kBackup:
      w.Field("ev", "backup");
      w.Field("generation", static_cast<std::uint64_t>(m.generation));
      w.Field("pool", m.pool);
      WriteRanges(w, "span", {{m.span_offset, m.span_bytes}});
      w.Field("extents", static_cast<std::uint64_t>(m.extent_count));
      break;
    case ShareKind::kExtents:
      w.Field("ev", "extents");
      w.Key("extents");
      w.BeginArray();
      for (const BackupRange& e : m.extents) {
        w.BeginArray();
        w.Uint(e.address);
        w.Uint(e.size_bytes);
        w.Uint(e.offset);
        w.EndArray();
      }
      w.EndArray();
      break;
    case ShareKind::kError:
      w.Field("ok", false);
      w.Field("code", m.code);
      w.Field("message", m.message);
      break;
  }
  w.EndObject();
  return w.str();
}

absl::StatusOr<ShareMessage> ParseShare(absl::string_view text) {
  absl::StatusOr<JsonValue> doc = JsonValue::Parse(text);
  if (!doc.ok() || !doc->is_object()) return Bad("a message that is not a JSON object");
  if ((*doc)["v"].type() != JsonValue::Type::kNumber || (*doc)["v"].Number() != kShareVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "tag share protocol: the other process speaks another version (this one speaks ", kShareVersion,
        "): both processes must use the same vmstash release"));
  }
  ShareMessage m;
  std::set<std::string> allowed = {"v"};
  if ((*doc)["op"].type() != JsonValue::Type::kNull) {
    if ((*doc)["op"].String() != "map") return Bad(absl::StrCat("unknown op \"", (*doc)["op"].String(), "\""));
    m.kind = ShareKind::kMap;
    allowed.insert({"op", "tag", "device"});
    absl::StatusOr<std::string> tag = Text(*doc, "tag");
    absl::StatusOr<std::string> device = Text(*doc, "device");
    if (!tag.ok()) return tag.status();
    if (!device.ok()) return device.status();
    if (tag->empty()) return Bad("an empty tag name");
    m.tag = *tag;
    m.device = *device;
  } else if ((*doc)["ack"].type() != JsonValue::Type::kNull) {
    m.kind = ShareKind::kAck;
    allowed.insert({"ack", "ok", "message"});
    absl::StatusOr<std::string> ack = Text(*doc, "ack");
    if (!ack.ok()) return ack.status();
    if (*ack != "grant" && *ack != "revoke" && *ack != "paused" && *ack != "backup") return Bad(absl::StrCat("unknown ack \"", *ack, "\""));
    if ((*doc)["ok"].type() != JsonValue::Type::kBool) return Bad("\"ok\" must be a boolean");
    m.ack = *ack;
    m.ok = (*doc)["ok"].Bool();
    m.message = (*doc)["message"].String();
  } else if ((*doc)["ev"].type() != JsonValue::Type::kNull) {
    absl::StatusOr<std::string> ev = Text(*doc, "ev");
    if (!ev.ok()) return ev.status();
    allowed.insert("ev");
    if (*ev == "grant") {
      m.kind = ShareKind::kGrant;
      allowed.insert({"generation", "reservations", "chunks"});
      absl::StatusOr<std::uint64_t> g = Count(*doc, "generation");
      absl::StatusOr<std::vector<ShareRange>> r = Ranges(*doc, "reservations", kMaxReservations);
      absl::StatusOr<std::uint64_t> k = Count(*doc, "chunks");
      if (!g.ok()) return g.status();
      if (!r.ok()) return r.status();
      if (!k.ok()) return k.status();
      m.generation = *g;
      m.reservations = std::move(*r);
      m.chunk_count = static_cast<std::size_t>(*k);
    } else if (*ev == "chunks") {
      m.kind = ShareKind::kChunks;
      allowed.insert("chunks");
      absl::StatusOr<std::vector<ShareRange>> c = Ranges(*doc, "chunks", kChunksPerPacket);
      if (!c.ok()) return c.status();
      m.chunks = std::move(*c);
    } else if (*ev == "revoke") {
      m.kind = ShareKind::kRevoke;
    } else if (*ev == "paused") {
      m.kind = ShareKind::kPaused;
      allowed.insert({"generation", "message"});
      absl::StatusOr<std::uint64_t> g = Count(*doc, "generation");
      if (!g.ok()) return g.status();
      m.generation = *g;
      m.message = (*doc)["message"].String();
    } else if (*ev == "backup") {
      m.kind = ShareKind::kBackup;
      allowed.insert({"generation", "pool", "span", "extents"});
      absl::StatusOr<std::uint64_t> g = Count(*doc, "generation");
      absl::StatusOr<std::string> pool = Text(*doc, "pool");
      absl::StatusOr<std::uint64_t> k = Count(*doc, "extents");
      if (!g.ok()) return g.status();
      if (!pool.ok()) return pool.status();
      if (!k.ok()) return k.status();
      // The span [offset, +bytes): offset 0 is a pool's first byte (Ranges wants > 0).
      const JsonValue& span = (*doc)["span"];
      const bool pair = span.is_array() && span.items().size() == 1 && span.items()[0].is_array() &&
                        span.items()[0].items().size() == 2;
      const JsonValue* o = pair ? &span.items()[0].items()[0] : nullptr;
      const JsonValue* n = pair ? &span.items()[0].items()[1] : nullptr;
      if (!pair || o->type() != JsonValue::Type::kNumber || n->type() != JsonValue::Type::kNumber || o->Int() < 0 ||
          n->Int() <= 0 || static_cast<double>(o->Int()) != o->Number() ||
          static_cast<double>(n->Int()) != n->Number()) {
        return Bad("\"span\" must be [[offset >= 0, bytes > 0]]");
      }
      m.generation = *g;
      m.pool = *pool;
      m.span_offset = static_cast<std::size_t>(o->Int());
      m.span_bytes = static_cast<std::size_t>(n->Int());
      m.extent_count = static_cast<std::size_t>(*k);
    } else if (*ev == "extents") {
      m.kind = ShareKind::kExtents;
      allowed.insert("extents");
      absl::StatusOr<std::vector<BackupRange>> e = Extents(*doc, kExtentsPerPacket);
      if (!e.ok()) return e.status();
      m.extents = std::move(*e);
    } else {
      return Bad(absl::StrCat("unknown event \"", *ev, "\""));
    }
  } else if ((*doc)["ok"].type() == JsonValue::Type::kBool && !(*doc)["ok"].Bool()) {
    m.kind = ShareKind::kError;
    allowed.insert({"ok", "code", "message"});
    m.code = (*doc)["code"].String();
    m.message = (*doc)["message"].String();
  } else {
    return Bad("a message with neither \"op\", \"ack\", \"ev\" nor an error");
  }
  for (const auto& [key, value] : doc->members()) {
    if (allowed.count(key) == 0) return Bad(absl::StrCat("unknown key \"", key, "\" in a ", KindName(m.kind)));
  }
  return m;
}

ShareMessage ShareError(const absl::Status& status) {
  ShareMessage m;
  m.kind = ShareKind::kError;
  m.code = absl::StatusCodeToString(status.code());
  m.message = std::string(status.message());
  return m;
}

absl::Status StatusOfError(const ShareMessage& m) {
  return absl::Status(ErrorCodeNamed(m.code), m.message);
}

std::string ShareSocketPath(const std::string& dir, pid_t pid) { return absl::StrCat(dir, "/", pid, ".tags.sock"); }

std::string ShareIndexPath(const std::string& dir, pid_t pid, const std::string& tag) {
  return absl::StrCat(dir, "/", pid, ".tags.", absl::BytesToHexString(tag), ".json");
}

}  // namespace vmstash::share
