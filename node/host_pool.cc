// HostPoolLedger: see host_pool.h.
#include "node/host_pool.h"

#include <algorithm>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"

namespace vmstash::node {

HostPoolLedger::HostPoolLedger(std::size_t capacity_bytes) : capacity_(capacity_bytes / kUnitBytes * kUnitBytes) {
  if (capacity_ > 0) free_.emplace(0, capacity_);
}

absl::StatusOr<PoolLease> HostPoolLedger::Take(ClientId client, std::size_t bytes, std::string tag) {
  if (bytes == 0) return absl::InvalidArgumentError("node pool: a lease of 0 bytes");
  if (bytes > capacity_) {
    ++refused_;
    return absl::InvalidArgumentError(
        absl::StrCat("node pool: a lease of ", bytes, " bytes is more than the pool holds (", capacity_, ")"));
  }
  const std::size_t want = (bytes + kUnitBytes - 1) / kUnitBytes * kUnitBytes;
  auto run = std::find_if(free_.begin(), free_.end(), [&](const auto& r) { return r.second >= want; });
  if (run == free_.end()) {
    ++refused_;
    const PoolStats s = stats();
    return absl::ResourceExhaustedError(absl::StrCat("node pool: no free run of ", want, " bytes (", capacity_ - leased_,
                                                     " of ", capacity_, " free, the largest run ",
                                                     s.largest_free_bytes, ")"));
  }
  const std::size_t offset = run->first;
  const std::size_t left = run->second - want;
  free_.erase(run);
  if (left > 0) free_.emplace(offset + want, left);
  PoolLease lease{client, offset, want, std::move(tag)};
  leases_.emplace(offset, lease);
  by_client_[client].insert(offset);
  leased_ += want;
  peak_ = std::max(peak_, leased_);
  return lease;
}

void HostPoolLedger::Free(std::size_t offset, std::size_t bytes) {
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && offset + bytes == next->first) {  // merge with the run after
    bytes += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {  // merge with the run before
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      prev->second += bytes;
      return;
    }
  }
  free_.emplace(offset, bytes);
}

absl::Status HostPoolLedger::Give(ClientId client, std::size_t offset) {
  auto it = leases_.find(offset);
  if (it == leases_.end()) return absl::NotFoundError(absl::StrCat("node pool: no lease at offset ", offset));
  if (it->second.client != client) {
    return absl::PermissionDeniedError(absl::StrCat("node pool: the lease at offset ", offset, " is client ",
                                                    it->second.client, "'s, not client ", client, "'s"));
  }
  const std::size_t bytes = it->second.bytes;
  leases_.erase(it);
  auto held = by_client_.find(client);
  held->second.erase(offset);
  if (held->second.empty()) by_client_.erase(held);
  leased_ -= bytes;
  Free(offset, bytes);
  return absl::OkStatus();
}

std::size_t HostPoolLedger::GiveAll(ClientId client) {
  auto held = by_client_.find(client);
  if (held == by_client_.end()) return 0;
  const std::set<std::size_t> offsets = held->second;
  std::size_t bytes = 0;
  for (std::size_t offset : offsets) {
    bytes += leases_.at(offset).bytes;
    (void)Give(client, offset);
  }
  return bytes;
}

std::vector<PoolLease> HostPoolLedger::LeasesOf(ClientId client) const {
  std::vector<PoolLease> out;
  auto held = by_client_.find(client);
  if (held == by_client_.end()) return out;
  for (std::size_t offset : held->second) out.push_back(leases_.at(offset));
  return out;
}

PoolStats HostPoolLedger::stats() const {
  PoolStats s;
  s.capacity_bytes = capacity_;
  s.leased_bytes = leased_;
  s.peak_bytes = peak_;
  for (const auto& [offset, bytes] : free_) s.largest_free_bytes = std::max(s.largest_free_bytes, bytes);
  s.leases = leases_.size();
  s.clients = by_client_.size();
  s.refused = refused_;
  return s;
}

absl::Status HostPoolLedger::Validate() const {
  auto fail = [](const std::string& what) { return absl::InternalError(absl::StrCat("node pool ledger: ", what)); };
  // Walk free runs and leases together in offset order: they must tile [0, capacity).
  std::size_t cursor = 0, leased = 0;
  auto f = free_.begin();
  auto l = leases_.begin();
  bool last_free = false;
  while (f != free_.end() || l != leases_.end()) {
    const bool take_free = l == leases_.end() || (f != free_.end() && f->first < l->first);
    const std::size_t offset = take_free ? f->first : l->first;
    const std::size_t bytes = take_free ? f->second : l->second.bytes;
    if (offset != cursor) return fail(absl::StrCat("a gap or an overlap at offset ", cursor, " (next run at ", offset, ")"));
    if (bytes == 0 || bytes % kUnitBytes != 0 || offset % kUnitBytes != 0) {
      return fail(absl::StrCat("a run of ", bytes, " bytes at ", offset, " is not in whole units"));
    }
    if (take_free && last_free) return fail(absl::StrCat("two free runs touch at offset ", offset));
    if (!take_free) {
      leased += bytes;
      auto held = by_client_.find(l->second.client);
      if (held == by_client_.end() || held->second.count(offset) == 0) {
        return fail(absl::StrCat("the lease at ", offset, " is not listed under client ", l->second.client));
      }
    }
    last_free = take_free;
    cursor = offset + bytes;
    if (take_free) ++f; else ++l;
  }
  if (cursor != capacity_) return fail(absl::StrCat("the runs end at ", cursor, ", the capacity is ", capacity_));
  if (leased != leased_) return fail(absl::StrCat("leased ", leased_, " but the leases hold ", leased));
  if (leased_ > peak_) return fail("leased more than the peak");
  std::size_t listed = 0;
  for (const auto& [client, offsets] : by_client_) {
    if (offsets.empty()) return fail(absl::StrCat("client ", client, " is listed with no lease"));
    listed += offsets.size();
  }
  if (listed != leases_.size()) return fail("the clients' lists and the leases differ");
  return absl::OkStatus();
}

}  // namespace vmstash::node
