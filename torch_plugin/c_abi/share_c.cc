// Mapped tags from the C ABI (vmstash.h: vmstash_share_tag ... vmstash_mapped_close):
// thin shims over the process runtime's exporter and mapped tags (runtime/process.h;
// Note [Mapped Tags] in runtime/tag_share.h). The uses acquired through the C ABI are
// kept here, by handle, until released (a C caller has no object to hold).
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/json_writer.h"
#include "runtime/process.h"
#include "runtime/runtime.h"
#include "runtime/tag_import.h"
#include "torch_plugin/c_abi/shim.h"
#include "torch_plugin/include/vmstash/vmstash.h"

using vmstash::JsonWriter;
using vmstash::Runtime;
using vmstash::c_abi::Code;
using vmstash::c_abi::CopyOut;
using vmstash::c_abi::Fail;
using vmstash::c_abi::Guard;
using vmstash::c_abi::WithRuntime;
using vmstash::share::MappedTag;

namespace {

// Uses acquired through the C ABI and not released yet, by handle.
std::mutex uses_mu;
std::map<unsigned long long, std::vector<MappedTag::Use>>& Uses() {
  static auto* uses = new std::map<unsigned long long, std::vector<MappedTag::Use>>();
  return *uses;
}


const char* StateName(MappedTag::State s) {
  switch (s) {
    case MappedTag::State::kMapped: return "mapped";
    case MappedTag::State::kPaused: return "paused";
    case MappedTag::State::kGone: return "gone";
    case MappedTag::State::kBackup: return "backup";
  }
  return "?";
}

}  // namespace

extern "C" {

int vmstash_share_tag(const char* tag, const char* name, const char* index_json,
                      unsigned long long* generation) noexcept {
  return WithRuntime([&](Runtime& rt) {
    if (tag == nullptr) return Fail(absl::InvalidArgumentError("vmstash_share_tag: tag must not be NULL"));
    absl::StatusOr<vmstash::TagId> id = vmstash::FindTag(tag);
    if (!id.ok()) return Fail(id.status());
    absl::StatusOr<std::uint64_t> g = vmstash::process::ShareTag(rt, *id, index_json == nullptr ? "[]" : index_json, name == nullptr ? "" : name);
    if (!g.ok()) return Fail(g.status());
    if (generation != nullptr) *generation = *g;
    return 0;
  });
}

int vmstash_unshare_tag(const char* tag) noexcept {
  return Guard([&](vmstash::process::Call&) {
    if (tag == nullptr) return Fail(absl::InvalidArgumentError("vmstash_unshare_tag: tag must not be NULL"));
    absl::StatusOr<vmstash::TagId> id = vmstash::FindTag(tag);
    if (!id.ok()) return Fail(id.status());
    return Code(vmstash::process::UnshareTag(*id));
  });
}

int vmstash_map_tag(int pid, const char* tag, int device, int timeout_ms, unsigned long long* handle) noexcept {
  return WithRuntime([&](Runtime& rt) {
    if (tag == nullptr || handle == nullptr) {
      return Fail(absl::InvalidArgumentError("vmstash_map_tag: tag and handle must not be NULL"));
    }
    absl::StatusOr<std::uint64_t> h = vmstash::process::MapTag(rt, pid, tag, device, timeout_ms);
    if (!h.ok()) return Fail(h.status());
    *handle = *h;
    return 0;
  });
}

// uses_mu is held across the lookup, the acquire and the record, and across a close's
// check and removal: an acquire is recorded before a close looks, or finds no handle.
int vmstash_mapped_acquire(unsigned long long handle) noexcept {
  return vmstash_mapped_acquire_any(handle, 0, nullptr, nullptr, nullptr);
}

int vmstash_mapped_acquire_any(unsigned long long handle, int backup, int* state, unsigned long long* generation,
                               unsigned long long* grants) noexcept {
  return Guard([&](vmstash::process::Call&) {
    std::lock_guard<std::mutex> lock(uses_mu);
    absl::StatusOr<std::shared_ptr<MappedTag>> m = vmstash::process::Mapped(handle);
    if (!m.ok()) return Fail(m.status());
    MappedTag::UseInfo info;
    absl::StatusOr<MappedTag::Use> use = (*m)->Acquire(backup != 0, &info);
    if (!use.ok()) return Fail(use.status());
    Uses()[handle].push_back(std::move(*use));
    if (state != nullptr) *state = static_cast<int>(info.state);
    if (generation != nullptr) *generation = info.generation;
    if (grants != nullptr) *grants = info.grants;
    return 0;
  });
}

// Outside any process Call: a release is never refused by a shutdown in progress (the
// shutdown waits for no use, and refuses while one is held), so a use always ends.
int vmstash_mapped_release(unsigned long long handle) noexcept {
  try {
    std::vector<MappedTag::Use> done;  // released outside the lock
    std::lock_guard<std::mutex> lock(uses_mu);
    auto it = Uses().find(handle);
    if (it == Uses().end() || it->second.empty()) {
      return Fail(absl::FailedPreconditionError(absl::StrCat("vmstash_mapped_release: handle ", handle,
                                                             " has no use acquired")));
    }
    done.push_back(std::move(it->second.back()));
    it->second.pop_back();
    if (it->second.empty()) Uses().erase(it);
    return 0;
  } catch (...) {
    return Fail(absl::InternalError("vmstash_mapped_release: unexpected exception"));
  }
}

int vmstash_mapped_local(unsigned long long handle, unsigned long long remote, unsigned long long bytes,
                         unsigned long long* local) noexcept {
  return Guard([&](vmstash::process::Call&) {
    if (local == nullptr) return Fail(absl::InvalidArgumentError("vmstash_mapped_local: local must not be NULL"));
    absl::StatusOr<std::shared_ptr<MappedTag>> m = vmstash::process::Mapped(handle);
    if (!m.ok()) return Fail(m.status());
    absl::StatusOr<vmstash::DevicePtr> p = (*m)->Local(remote, bytes);
    if (!p.ok()) return Fail(p.status());
    *local = *p;
    return 0;
  });
}

int vmstash_mapped_check(unsigned long long handle, const unsigned long long* remotes,
                         const unsigned long long* bytes, const unsigned long long* locals, size_t n) noexcept {
  return Guard([&](vmstash::process::Call&) {
    if (n > 0 && (remotes == nullptr || bytes == nullptr)) {
      return Fail(absl::InvalidArgumentError("vmstash_mapped_check: NULL arrays"));
    }
    absl::StatusOr<std::shared_ptr<MappedTag>> m = vmstash::process::Mapped(handle);
    if (!m.ok()) return Fail(m.status());
    std::vector<vmstash::share::ShareRange> ranges(n);
    for (size_t i = 0; i < n; ++i) ranges[i] = {remotes[i], static_cast<std::size_t>(bytes[i])};
    if (locals == nullptr) return Code((*m)->Covers(ranges));
    const std::vector<vmstash::DevicePtr> at(locals, locals + n);
    return Code((*m)->Covers(ranges, &at));
  });
}

int vmstash_mapped_locals(unsigned long long handle, const unsigned long long* remotes,
                          const unsigned long long* bytes, unsigned long long* out, size_t n) noexcept {
  return Guard([&](vmstash::process::Call&) {
    if (n > 0 && (remotes == nullptr || bytes == nullptr || out == nullptr)) {
      return Fail(absl::InvalidArgumentError("vmstash_mapped_locals: NULL arrays"));
    }
    absl::StatusOr<std::shared_ptr<MappedTag>> m = vmstash::process::Mapped(handle);
    if (!m.ok()) return Fail(m.status());
    std::vector<vmstash::share::ShareRange> ranges(n);
    for (size_t i = 0; i < n; ++i) ranges[i] = {remotes[i], static_cast<std::size_t>(bytes[i])};
    std::vector<vmstash::DevicePtr> at;
    if (absl::Status s = (*m)->LocalAll(ranges, &at); !s.ok()) return Fail(s);
    for (size_t i = 0; i < n; ++i) out[i] = at[i];
    return 0;
  });
}

int vmstash_mapped_write_backup(unsigned long long handle, const unsigned long long* remotes,
                                const unsigned long long* srcs, const unsigned long long* bytes, size_t n,
                                cudaStream_t stream) noexcept {
  return Guard([&](vmstash::process::Call&) {
    if (n > 0 && (remotes == nullptr || srcs == nullptr || bytes == nullptr)) {
      return Fail(absl::InvalidArgumentError("vmstash_mapped_write_backup: NULL arrays"));
    }
    absl::StatusOr<std::shared_ptr<MappedTag>> m = vmstash::process::Mapped(handle);
    if (!m.ok()) return Fail(m.status());
    std::vector<MappedTag::BackupWrite> writes(n);
    for (size_t i = 0; i < n; ++i) writes[i] = {remotes[i], srcs[i], static_cast<std::size_t>(bytes[i])};
    return Code((*m)->WriteBackup(writes, reinterpret_cast<vmstash::Stream>(stream)));
  });
}

int vmstash_mapped_state(unsigned long long handle, int* state, unsigned long long* generation) noexcept {
  return Guard([&](vmstash::process::Call&) {
    absl::StatusOr<std::shared_ptr<MappedTag>> m = vmstash::process::Mapped(handle);
    if (!m.ok()) return Fail(m.status());
    if (state != nullptr) *state = static_cast<int>((*m)->state());
    if (generation != nullptr) *generation = (*m)->generation();
    return 0;
  });
}

char* vmstash_mapped_info_json(unsigned long long handle) noexcept {
  char* out = nullptr;
  Guard([&](vmstash::process::Call&) {
    absl::StatusOr<std::shared_ptr<MappedTag>> m = vmstash::process::Mapped(handle);
    if (!m.ok()) return Fail(m.status());
    std::uint64_t mapped_bytes = 0;
    for (const vmstash::share::ShareRange& r : (*m)->Mapped()) mapped_bytes += r.size_bytes;
    JsonWriter w;
    w.BeginObject();
    w.Field("state", StateName((*m)->state()));
    w.Field("generation", static_cast<std::uint64_t>((*m)->generation()));
    w.Field("grants", static_cast<std::uint64_t>((*m)->grants()));
    w.Field("revokes", static_cast<std::uint64_t>((*m)->revokes()));
    w.Field("pid", static_cast<std::int64_t>((*m)->pid()));
    w.Field("tag", (*m)->tag());
    w.Field("device", (*m)->device());
    w.Field("mapped_bytes", mapped_bytes);
    w.Field("backup_bytes", static_cast<std::uint64_t>((*m)->backup_bytes()));
    w.EndObject();
    out = CopyOut(w.str());
    if (out == nullptr) return Fail(absl::ResourceExhaustedError("vmstash: host out of memory"));
    return 0;
  });
  return out;
}

char* vmstash_mapped_index_json(unsigned long long handle) noexcept {
  char* out = nullptr;
  Guard([&](vmstash::process::Call&) {
    absl::StatusOr<std::shared_ptr<MappedTag>> m = vmstash::process::Mapped(handle);
    if (!m.ok()) return Fail(m.status());
    const std::string& index = (*m)->index();
    if (index.empty()) {
      return Fail(absl::NotFoundError(absl::StrCat("process ", (*m)->pid(), " published no index of tag '",
                                                   (*m)->tag(), "'")));
    }
    out = CopyOut(index);
    if (out == nullptr) return Fail(absl::ResourceExhaustedError("vmstash: host out of memory"));
    return 0;
  });
  return out;
}

int vmstash_mapped_close(unsigned long long handle) noexcept {
  return Guard([&](vmstash::process::Call&) {
    absl::StatusOr<std::shared_ptr<MappedTag>> m;
    {
      // A use in progress (in any thread) keeps the memory mapped: closing under it would
      // unmap what it writes, and waiting for it would hang the thread that holds it.
      std::lock_guard<std::mutex> lock(uses_mu);
      auto it = Uses().find(handle);
      if (it != Uses().end() && !it->second.empty()) {
        return Fail(absl::FailedPreconditionError(absl::StrCat(
            "vmstash_mapped_close: handle ", handle, " has ", it->second.size(),
            " use(s) in progress; release them first (vmstash_mapped_release)")));
      }
      m = vmstash::process::TakeMapped(handle);
    }
    if (!m.ok()) return Fail(m.status());
    m->reset();  // unmaps here, outside the lock (or where another call drops its copy)
    return 0;
  });
}

}  // extern "C"
