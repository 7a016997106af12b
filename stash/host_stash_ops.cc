// HostStashOps: the stash operations executed on the host (see stash_ops.h), one call at
// a time, with the kernels' exact decisions: all-or-nothing placement on the device tier,
// else the host tier, else a sticky overflow; pages taken at head and given back at tail
// in page-table order; 64-bit offsets. Streams are ignored: the simulated driver runs
// queued work at once, so running here when called is a legal schedule.
#include <cstring>

#include "stash/stash_ops.h"

namespace vmstash::stash {
namespace {

uint64_t Clamp(int64_t n, uint64_t max_rows) {
  return n < 0 ? 0 : (static_cast<uint64_t>(n) > max_rows ? max_rows : static_cast<uint64_t>(n));
}

// Copies rows [0, n) between a tensor and its pages, a page slot (contiguous on both
// sides) at a time.
void CopySlots(const StashState& s, const StashTier& tier, const uint32_t* table, uint8_t* tensor, uint64_t n,
               bool to_pages) {
  const uint64_t page_bytes = s.page_rows * s.row_bytes;
  for (uint64_t slot = 0; slot * s.page_rows < n; ++slot) {
    const uint64_t rows = (slot + 1) * s.page_rows <= n ? s.page_rows : n - slot * s.page_rows;
    uint8_t* page = tier.pages + static_cast<uint64_t>(table[slot]) * page_bytes;
    uint8_t* row0 = tensor + slot * page_bytes;
    if (to_pages) {
      std::memcpy(page, row0, rows * s.row_bytes);
    } else {
      std::memcpy(row0, page, rows * s.row_bytes);
    }
  }
}

class HostOps final : public StashOps {
 public:
  const char* Name() const override { return "host"; }

  int Reset(CUstream_st*, StashState* state, const StashState& init, uint64_t) const override {
    StashState s = init;
    for (StashTier& t : s.tier) {
      for (uint64_t i = 0; i < t.cap; ++i) t.free_list[i] = static_cast<uint32_t>(i);
      t.head = 0;
      t.tail = t.cap;
    }
    s.peak_pages[0] = s.peak_pages[1] = 0;
    s.overflow = s.host_spill = 0;
    s.overflow_count = s.last_failed_pages = 0;
    s.ticket = 0;
    *state = s;
    return 0;
  }

  int Stash(CUstream_st*, StashState* s, const StashState&, const void* src, const int64_t* n_rows, uint64_t max_rows,
            StashHandleHeader* h) const override {
    const uint64_t n = Clamp(*n_rows, max_rows);
    const uint64_t need = (n + s->page_rows - 1) / s->page_rows;
    h->rows = n;
    if (Overflowed(*s)) {
      h->status = kHandleOverflowed;
      return 0;
    }
    for (int t = 0; t < 2; ++t) {
      StashTier& tier = s->tier[t];
      if (tier.cap == 0 || tier.tail - tier.head < need) continue;
      uint32_t* table = reinterpret_cast<uint32_t*>(h + 1);
      for (uint64_t slot = 0; slot < need; ++slot) table[slot] = tier.free_list[(tier.head + slot) % tier.cap];
      CopySlots(*s, tier, table, static_cast<uint8_t*>(const_cast<void*>(src)), n, /*to_pages=*/true);
      tier.head += need;
      const uint64_t used = tier.cap - (tier.tail - tier.head);
      if (used > s->peak_pages[t]) s->peak_pages[t] = used;
      if (t == 1) {
        s->host_spill = 1;
        if (s->linked_host_spill != nullptr) *s->linked_host_spill = 1;
      }
      h->status = t == 0 ? kHandleDevice : kHandleHost;
      return 0;
    }
    s->overflow = 1;
    s->overflow_count += 1;
    s->last_failed_pages = need;
    if (s->linked_overflow != nullptr) *s->linked_overflow = 1;
    h->status = kHandleOverflowed;
    return 0;
  }

  int Restore(CUstream_st*, StashState* s, const StashState&, StashHandleHeader* h, void* dst, uint64_t max_rows,
              bool zero_tail) const override {
    return Give(s, h, static_cast<uint8_t*>(dst), max_rows, zero_tail, true);
  }

  int Discard(CUstream_st*, StashState* s, const StashState&, StashHandleHeader* h, uint64_t max_rows) const override {
    return Give(s, h, nullptr, max_rows, false, false);
  }

  int ReadFlags(CUstream_st*, const StashState* s, StashFlags* out) const override {
    CopyFlags(*s, out);
    return 0;
  }

 private:
  static int Give(StashState* s, StashHandleHeader* h, uint8_t* dst, uint64_t max_rows, bool zero_tail,
                  bool copy_back) {
    const bool placed = !Overflowed(*s) && (h->status == kHandleDevice || h->status == kHandleHost);
    uint64_t live = 0;
    if (placed) {
      StashTier& tier = s->tier[h->status == kHandleDevice ? 0 : 1];
      const uint64_t need = (h->rows + s->page_rows - 1) / s->page_rows;
      const uint32_t* table = reinterpret_cast<const uint32_t*>(h + 1);
      live = h->rows < max_rows ? h->rows : max_rows;
      if (copy_back) CopySlots(*s, tier, table, dst, live, /*to_pages=*/false);
      for (uint64_t slot = 0; slot < need; ++slot) tier.free_list[(tier.tail + slot) % tier.cap] = table[slot];
      tier.tail += need;
      h->status = kHandleEmpty;
    } else if (!Overflowed(*s)) {
      h->status = kHandleEmpty;  // an overflowed handle after a reset
    }
    if (copy_back && zero_tail && max_rows > live) {
      std::memset(dst + live * s->row_bytes, 0, (max_rows - live) * s->row_bytes);
    }
    return 0;
  }
};

}  // namespace

const StashOps& HostStashOps() {
  static const HostOps ops;
  return ops;
}

}  // namespace vmstash::stash
