// BypassAllocations: see bypass.h.
#include "allocator/bypass.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "base/bytes.h"
#include "base/status_macros.h"

namespace vmstash {

absl::StatusOr<BypassAllocations::Record> BypassAllocations::Allocate(TagId tag, std::size_t requested_bytes,
                                                                      std::size_t rounded,
                                                                      const std::function<absl::Status()>& synchronize,
                                                                      DevicePtr* ptr) {
  const std::size_t bytes = RoundUp(rounded, granularity_bytes_);
  auto a = std::make_unique<Allocation>();
  absl::Status status;
  for (int attempt = 0; attempt < 2; ++attempt) {
    absl::StatusOr<Reservation> r = Reservation::Create(driver_, device_, bytes, 0);
    absl::StatusOr<Chunk> c = r.ok() ? Chunk::Create(driver_, device_, bytes, ChunkOptions{}) : r.status();
    absl::StatusOr<Mapping> m = c.ok() ? Mapping::Create(driver_, device_, r->address(), absl::MakeConstSpan(&*c, 1))
                                       : absl::StatusOr<Mapping>(c.status());
    if (m.ok()) {
      a->reservation = *std::move(r);
      a->chunk = *std::move(c);
      a->mapping = *std::move(m);
      status = absl::OkStatus();
      break;
    }
    status = m.status();
    // Out of memory: wait for frees queued on the device to land, then try once more.
    if (!absl::IsResourceExhausted(status) || attempt == 1) break;
    VMSTASH_RETURN_IF_ERROR(synchronize());
  }
  VMSTASH_RETURN_IF_ERROR(status);
  a->record = Record{tag, bytes, requested_bytes};
  *ptr = a->reservation.address();
  const Record record = a->record;
  live_.emplace(*ptr, std::move(a));
  return record;
}

absl::StatusOr<BypassAllocations::Record> BypassAllocations::Free(DevicePtr ptr) {
  auto it = live_.find(ptr);
  if (it == live_.end()) return absl::InvalidArgumentError(absl::StrCat("bypass free of ", Hex(ptr), ": not held"));
  Allocation& a = *it->second;
  VMSTASH_RETURN_IF_ERROR(driver_->SynchronizeDevice(device_));
  VMSTASH_RETURN_IF_ERROR(a.mapping.Unmap());
  VMSTASH_RETURN_IF_ERROR(a.chunk.Release());
  VMSTASH_RETURN_IF_ERROR(a.reservation.Free());
  const Record record = a.record;
  live_.erase(it);
  return record;
}

std::size_t BypassAllocations::BytesOf(TagId tag) const {
  std::size_t bytes = 0;
  for (const auto& [ptr, a] : live_) {
    if (a->record.tag == tag) bytes += a->record.size_bytes;
  }
  return bytes;
}

std::size_t BypassAllocations::CountOf(TagId tag) const {
  std::size_t count = 0;
  for (const auto& [ptr, a] : live_) count += a->record.tag == tag ? 1 : 0;
  return count;
}

absl::Status BypassAllocations::CheckNoneOf(TagId tag, const std::string& name) const {
  const std::size_t count = CountOf(tag);
  if (count == 0) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "pause of tag '", name, "' on device ", device_, ": it holds ", count, " allocation(s) of ", BytesOf(tag),
      " bytes made under VMSTASH_CONF bypass:1, which go straight to the driver and which no pause copies or "
      "releases; free them first, or run without bypass:1 to pause this tag"));
}

void BypassAllocations::AppendSnapshot(Snapshot* snap) const {
  for (const auto& [ptr, a] : live_) {
    const Record& r = a->record;
    SegmentSnapshot seg;
    seg.tag = std::string(TagName(r.tag));
    seg.heap = "bypass";
    seg.address = ptr;
    seg.va_bytes = seg.mapped_bytes = r.size_bytes;
    seg.chunks.push_back({ptr, r.size_bytes, true});
    seg.blocks.push_back(BlockSnapshot{ptr, r.size_bytes, r.requested_bytes, true, 0});
    snap->segments.push_back(std::move(seg));
  }
}

}  // namespace vmstash
