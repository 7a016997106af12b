#include "vmm/driver_ledger.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/bytes.h"
#include "base/status_macros.h"

namespace vmstash {
absl::Status CheckGranularSize(const char* what, std::size_t size_bytes, std::size_t granularity) {
  if (size_bytes == 0) return absl::InvalidArgumentError(absl::StrCat(what, ": size 0 is not allowed"));
  if (granularity == 0 || size_bytes % granularity != 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": size ", size_bytes,
                                                   " is not a multiple of the granularity ", granularity));
  }
  return absl::OkStatus();
}

absl::Status CheckGranularAddress(const char* what, std::uint64_t value, std::size_t granularity) {
  if (granularity == 0 || value % granularity != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": address ", Hex(value), " is not aligned to the granularity ", granularity));
  }
  return absl::OkStatus();
}

absl::Status CheckDeviceIndex(int device, int device_count) {
  if (device < 0 || device >= device_count) {
    return absl::InvalidArgumentError(
        absl::StrCat("device ", device, " does not exist (", device_count, " device(s))"));
  }
  return absl::OkStatus();
}

absl::Status DriverLedger::AddReservation(DevicePtr va, std::size_t size_bytes) {
  MutexLock lock(&mu_);
  if (!reservations_.emplace(va, size_bytes).second) {
    return absl::InternalError(absl::StrCat(driver_name_, ": reservation ", Hex(va), " recorded twice"));
  }
  return absl::OkStatus();
}

absl::Status DriverLedger::TakeReservation(DevicePtr va, std::size_t size_bytes) {
  MutexLock lock(&mu_);
  auto it = reservations_.find(va);
  if (it == reservations_.end() || it->second != size_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("FreeAddress: (", Hex(va), ", ", size_bytes, ") is not a reservation"));
  }
  auto m = mappings_.lower_bound(va);
  if (m != mappings_.end() && m->first < va + size_bytes) {
    return absl::FailedPreconditionError(absl::StrCat("FreeAddress: reservation ", Hex(va),
                                                      " still has a mapping at ", Hex(m->first)));
  }
  reservations_.erase(it);
  return absl::OkStatus();
}

void DriverLedger::AddChunk(ChunkHandle chunk, const ChunkRecord& record) {
  MutexLock lock(&mu_);
  chunks_[chunk] = record;
}

absl::StatusOr<ChunkRecord> DriverLedger::GetChunk(ChunkHandle chunk) const {
  MutexLock lock(&mu_);
  auto it = chunks_.find(chunk);
  if (it == chunks_.end() || it->second.released) {
    return absl::InvalidArgumentError(absl::StrCat("unknown chunk handle ", Hex(chunk)));
  }
  return it->second;
}

absl::StatusOr<std::pair<ChunkRecord, bool>> DriverLedger::ReleaseChunk(ChunkHandle chunk) {
  MutexLock lock(&mu_);
  auto it = chunks_.find(chunk);
  if (it == chunks_.end() || it->second.released) {
    return absl::InvalidArgumentError(absl::StrCat("ReleaseChunk: unknown chunk handle ", Hex(chunk)));
  }
  ChunkRecord record = it->second;
  bool gone = record.map_count == 0;
  if (gone) {
    chunks_.erase(it);
  } else {
    it->second.released = true;
  }
  return std::make_pair(record, gone);
}

void DriverLedger::UnreleaseChunk(ChunkHandle chunk, const ChunkRecord& record) {
  MutexLock lock(&mu_);
  ChunkRecord& r = chunks_[chunk];
  int map_count = r.map_count;
  r = record;
  r.released = false;
  r.map_count = map_count;
}

absl::StatusOr<ChunkRecord> DriverLedger::ClaimMap(DevicePtr va, std::size_t size_bytes, ChunkHandle chunk,
                                                   std::size_t granularity) {
  MutexLock lock(&mu_);
  auto c = chunks_.find(chunk);
  if (c == chunks_.end() || c->second.released) {
    return absl::InvalidArgumentError(absl::StrCat("Map: unknown chunk handle ", Hex(chunk)));
  }
  if (size_bytes != c->second.size_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("Map: size ", size_bytes, " differs from the size ",
                                                   c->second.size_bytes, " of chunk ", Hex(chunk),
                                                   "; chunks are mapped whole"));
  }
  if (va % granularity != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Map: address ", Hex(va), " is not aligned to the granularity ", granularity));
  }
  auto r = reservations_.upper_bound(va);
  if (r == reservations_.begin() || (--r, va + size_bytes > r->first + r->second) || va + size_bytes < va) {
    return absl::InvalidArgumentError(absl::StrCat("Map: range [", Hex(va), ", ", Hex(va + size_bytes),
                                                   ") is not inside one reservation"));
  }
  auto next = mappings_.lower_bound(va);
  if (next != mappings_.end() && next->first < va + size_bytes) {
    return absl::FailedPreconditionError(
        absl::StrCat("Map: range at ", Hex(va), " overlaps the mapping at ", Hex(next->first)));
  }
  if (next != mappings_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.size_bytes > va) {
      return absl::FailedPreconditionError(
          absl::StrCat("Map: range at ", Hex(va), " overlaps the mapping at ", Hex(prev->first)));
    }
  }
  mappings_[va] = MappingRecord{va, size_bytes, chunk, 0};
  ++c->second.map_count;
  return c->second;
}

void DriverLedger::AbortMap(DevicePtr va) {
  MutexLock lock(&mu_);
  auto it = mappings_.find(va);
  if (it == mappings_.end()) return;
  auto c = chunks_.find(it->second.chunk);
  if (c != chunks_.end()) --c->second.map_count;
  mappings_.erase(it);
}

absl::StatusOr<MappingRecord> DriverLedger::ClaimUnmap(DevicePtr va, std::size_t size_bytes) {
  MutexLock lock(&mu_);
  auto it = mappings_.find(va);
  if (it == mappings_.end() || it->second.size_bytes != size_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("Unmap: (", Hex(va), ", ", size_bytes, ") is not exactly one mapping"));
  }
  MappingRecord record = it->second;
  mappings_.erase(it);
  return record;
}

void DriverLedger::AbortUnmap(const MappingRecord& record) {
  MutexLock lock(&mu_);
  mappings_[record.va] = record;
}

std::pair<bool, ChunkRecord> DriverLedger::CommitUnmap(const MappingRecord& record) {
  MutexLock lock(&mu_);
  auto c = chunks_.find(record.chunk);
  if (c == chunks_.end()) return {false, ChunkRecord{}};
  --c->second.map_count;
  if (c->second.released && c->second.map_count == 0) {
    ChunkRecord gone = c->second;
    chunks_.erase(c);
    return {true, gone};
  }
  return {false, c->second};
}

absl::Status DriverLedger::CheckMappedLocked(DevicePtr va, std::size_t size_bytes, int device) const {
  if (size_bytes == 0) return absl::OkStatus();
  DevicePtr cursor = va;
  const DevicePtr end = va + size_bytes;
  auto it = mappings_.upper_bound(va);
  if (it == mappings_.begin()) {
    return absl::InvalidArgumentError(absl::StrCat("address ", Hex(va), " is not mapped"));
  }
  --it;
  while (cursor < end) {
    if (it == mappings_.end() || it->first > cursor || it->first + it->second.size_bytes <= cursor) {
      return absl::InvalidArgumentError(absl::StrCat("address ", Hex(cursor), " (in range [", Hex(va), ", ",
                                                     Hex(end), ")) is not mapped"));
    }
    if (device >= 0 && (it->second.access_mask & (std::uint64_t{1} << device)) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("address ", Hex(cursor),
                                                     " is mapped but device ", device, " has no access"));
    }
    cursor = it->first + it->second.size_bytes;
    ++it;
  }
  return absl::OkStatus();
}

absl::Status DriverLedger::CheckMapped(DevicePtr va, std::size_t size_bytes) const {
  MutexLock lock(&mu_);
  return CheckMappedLocked(va, size_bytes, -1);
}

absl::Status DriverLedger::GrantAccess(DevicePtr va, std::size_t size_bytes, int device) {
  MutexLock lock(&mu_);
  absl::Status status = CheckMappedLocked(va, size_bytes, -1);
  if (!status.ok()) return absl::InvalidArgumentError(absl::StrCat("SetAccess: ", status.message()));
  for (auto it = mappings_.find(va); it != mappings_.end() && it->first < va + size_bytes; ++it) {
    it->second.access_mask |= std::uint64_t{1} << device;
  }
  return absl::OkStatus();
}

absl::Status DriverLedger::CheckAccessible(DevicePtr va, std::size_t size_bytes, int device) const {
  MutexLock lock(&mu_);
  return CheckMappedLocked(va, size_bytes, device);
}

void DriverLedger::AddHostAlloc(void* ptr, std::size_t size_bytes) {
  MutexLock lock(&mu_);
  host_allocs_[ptr] = size_bytes;
}

absl::StatusOr<std::size_t> DriverLedger::TakeHostAlloc(void* ptr) {
  MutexLock lock(&mu_);
  auto it = host_allocs_.find(ptr);
  if (it == host_allocs_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("HostFree: ", Hex(reinterpret_cast<std::uintptr_t>(ptr)),
                                                   " was not allocated by HostAlloc"));
  }
  std::size_t size = it->second;
  host_allocs_.erase(it);
  return size;
}

absl::Status DriverLedger::AddHostRegistration(void* ptr, std::size_t size_bytes) {
  MutexLock lock(&mu_);
  if (!host_registrations_.emplace(ptr, size_bytes).second) {
    return absl::FailedPreconditionError(absl::StrCat(
        "HostRegister: ", Hex(reinterpret_cast<std::uintptr_t>(ptr)), " is already registered"));
  }
  return absl::OkStatus();
}

absl::Status DriverLedger::CheckHostCopy(const void* ptr, std::size_t size_bytes) const {
  MutexLock lock(&mu_);
  const auto begin = reinterpret_cast<std::uintptr_t>(ptr), end = begin + size_bytes;
  auto check = [&](void* p, std::size_t n) -> absl::Status {
    const auto b = reinterpret_cast<std::uintptr_t>(p), e = b + n;
    const bool overlaps = begin < e && b < end, inside = b <= begin && end <= e;
    if (!overlaps || inside) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("copy of host bytes [", Hex(begin), ", ", Hex(end),
                                                   ") crosses the bound of the page-locked range [", Hex(b), ", ",
                                                   Hex(e), "): a copy must lie inside one registration"));
  };
  for (const auto& [p, n] : host_registrations_) VMSTASH_RETURN_IF_ERROR(check(p, n));
  for (const auto& [p, n] : host_allocs_) VMSTASH_RETURN_IF_ERROR(check(p, n));
  return absl::OkStatus();
}

bool DriverLedger::HostPageLocked(const void* ptr) const {
  MutexLock lock(&mu_);
  const auto at = reinterpret_cast<std::uintptr_t>(ptr);
  auto inside = [at](void* p, std::size_t n) {
    const auto b = reinterpret_cast<std::uintptr_t>(p);
    return b <= at && at < b + n;
  };
  for (const auto& [p, n] : host_registrations_) {
    if (inside(p, n)) return true;
  }
  for (const auto& [p, n] : host_allocs_) {
    if (inside(p, n)) return true;
  }
  return false;
}

absl::StatusOr<std::size_t> DriverLedger::TakeHostRegistration(void* ptr) {
  MutexLock lock(&mu_);
  auto it = host_registrations_.find(ptr);
  if (it == host_registrations_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("HostUnregister: ", Hex(reinterpret_cast<std::uintptr_t>(ptr)), " is not registered"));
  }
  std::size_t size = it->second;
  host_registrations_.erase(it);
  return size;
}

void DriverLedger::AddStream(Stream stream, int device) {
  MutexLock lock(&mu_);
  streams_[stream] = device;
}

absl::Status DriverLedger::TakeStream(Stream stream, int device) {
  MutexLock lock(&mu_);
  auto it = streams_.find(stream);
  if (it == streams_.end() || it->second != device) {
    return absl::InvalidArgumentError(absl::StrCat("DestroyStream: unknown stream ",
                                                   Hex(reinterpret_cast<std::uintptr_t>(stream)),
                                                   " on device ", device));
  }
  streams_.erase(it);
  return absl::OkStatus();
}

absl::Status DriverLedger::CheckStream(Stream stream, int device) const {
  if (stream == nullptr) return absl::OkStatus();
  MutexLock lock(&mu_);
  auto it = streams_.find(stream);
  if (it == streams_.end() || it->second != device) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown stream ", Hex(reinterpret_cast<std::uintptr_t>(stream)), " on device ", device));
  }
  return absl::OkStatus();
}

void DriverLedger::AddEvent(Event event, int device) {
  MutexLock lock(&mu_);
  events_[event] = device;
}

absl::Status DriverLedger::TakeEvent(Event event, int device) {
  MutexLock lock(&mu_);
  auto it = events_.find(event);
  if (it == events_.end() || it->second != device) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DestroyEvent: unknown event ", Hex(reinterpret_cast<std::uintptr_t>(event)), " on device ", device));
  }
  events_.erase(it);
  return absl::OkStatus();
}

absl::Status DriverLedger::CheckEvent(Event event, int device) const {
  MutexLock lock(&mu_);
  auto it = events_.find(event);
  if (it == events_.end() || it->second != device) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown event ", Hex(reinterpret_cast<std::uintptr_t>(event)), " on device ", device));
  }
  return absl::OkStatus();
}

std::vector<Stream> DriverLedger::TakeAllStreams() {
  MutexLock lock(&mu_);
  std::vector<Stream> out;
  for (const auto& [s, device] : streams_) out.push_back(s);
  streams_.clear();
  return out;
}

std::vector<Event> DriverLedger::TakeAllEvents() {
  MutexLock lock(&mu_);
  std::vector<Event> out;
  for (const auto& [e, device] : events_) out.push_back(e);
  events_.clear();
  return out;
}

absl::Status DriverLedger::CheckNoLeaks() const {
  MutexLock lock(&mu_);
  std::string report;
  auto add = [&](absl::string_view what, std::size_t n) {
    if (n != 0) absl::StrAppend(&report, report.empty() ? "" : ", ", n, " ", what);
  };
  add("reservation(s)", reservations_.size());
  add("mapping(s)", mappings_.size());
  add("chunk(s)", chunks_.size());
  add("pinned host allocation(s)", host_allocs_.size());
  add("host registration(s)", host_registrations_.size());
  add("stream(s)", streams_.size());
  add("event(s)", events_.size());
  if (report.empty()) return absl::OkStatus();
  if (!mappings_.empty()) absl::StrAppend(&report, "; first mapping at ", Hex(mappings_.begin()->first));
  if (!reservations_.empty()) absl::StrAppend(&report, "; first reservation at ", Hex(reservations_.begin()->first));
  return absl::FailedPreconditionError(absl::StrCat(driver_name_, " driver: still alive: ", report));
}

}  // namespace vmstash
