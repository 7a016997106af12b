#include "runtime/tag_import.h"

#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "control/runtime_dir.h"
#include "node/wire.h"

namespace vmstash::share {
namespace {

// A connection to the exporter `pid` in `dir`, under the trust rules.
absl::StatusOr<int> ConnectTo(const std::string& dir, pid_t pid) {
  if (pid <= 0) return absl::InvalidArgumentError(absl::StrCat("map_tag: ", pid, " is not a process id"));
  if (::kill(pid, 0) != 0 && errno == ESRCH) return absl::NotFoundError(absl::StrCat("map_tag: no process ", pid));
  if (absl::Status s = control::CheckPrivateDir(dir); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("map_tag: refusing the runtime directory: ", s.message()));
  }
  absl::StatusOr<int> fd = node::Connect(ShareSocketPath(dir, pid));
  if (!fd.ok()) {
    return absl::NotFoundError(absl::StrCat("map_tag: process ", pid, " shares no tag (it has not published one, ",
                                            "or runs another vmstash runtime directory): ", fd.status().message()));
  }
  absl::StatusOr<control::Peer> peer = control::PeerOf(*fd);
  if (!peer.ok() || peer->uid != ::getuid()) {
    ::close(*fd);
    return absl::PermissionDeniedError(absl::StrCat("map_tag: the socket of process ", pid, " is not served by our user"));
  }
  return *fd;
}

// Why a "paused" event grants nothing.
std::string PausedWhy(const ShareMessage& paused) {
  return paused.message.empty()
             ? std::string("the exporting process's tag is paused")
             : absl::StrCat("the exporting process's tag is paused, and its backup cannot be written from here (",
                            paused.message, ")");
}

}  // namespace

absl::StatusOr<std::unique_ptr<MappedTag>> MappedTag::Map(Driver* driver, int device, pid_t pid,
                                                         const std::string& tag, MapOptions options, NodeLeases* pool) {
  if (driver == nullptr) return absl::InvalidArgumentError("map_tag: no driver");
  if (tag.empty()) return absl::InvalidArgumentError("map_tag: no tag name");
  if (options.dir.empty()) options.dir = control::DefaultRuntimeDir();
  absl::StatusOr<std::string> uuid = driver->DeviceUuid(device);
  if (!uuid.ok()) return uuid.status();
  absl::StatusOr<int> fd = ConnectTo(options.dir, pid);
  if (!fd.ok()) return fd.status();
  ShareMessage request;
  request.kind = ShareKind::kMap;
  request.tag = tag;
  request.device = *uuid;
  if (absl::Status s = node::Send(*fd, FormatShare(request)); !s.ok()) {
    ::close(*fd);
    return s;
  }
  std::unique_ptr<MappedTag> m(new MappedTag(driver, device, pid, tag, *fd, pool));
  absl::StatusOr<node::Received> first = node::Receive(*fd, options.timeout_ms, 0);
  absl::StatusOr<ShareMessage> event = first.ok() ? ParseShare(first->message) : first.status();
  if (!event.ok()) {
    return absl::Status(event.status().code(),
                        absl::StrCat("map_tag ", tag, " of process ", pid, ": ", event.status().message()));
  }
  if (event->kind == ShareKind::kError) return StatusOfError(*event);
  if (event->kind == ShareKind::kGrant) {
    absl::Status s = m->TakeGrant(*event);
    m->Ack("grant", s);
    if (!s.ok()) return s;
  } else if (event->kind == ShareKind::kBackup) {
    absl::Status s = m->TakeBackup(*event);
    m->Ack("backup", s);
    if (!s.ok()) return s;
  } else if (event->kind == ShareKind::kPaused) {
    m->generation_ = event->generation;
    m->why_ = PausedWhy(*event);
    m->Ack("paused", absl::OkStatus());
  } else {
    return absl::InternalError("map_tag: the exporting process answered neither a grant nor \"paused\"");
  }
  std::ifstream index(ShareIndexPath(options.dir, pid, tag));
  if (index) m->index_.assign(std::istreambuf_iterator<char>(index), std::istreambuf_iterator<char>());
  m->thread_ = std::thread([raw = m.get()] { raw->Watch(); });
  return m;
}

MappedTag::MappedTag(Driver* driver, int device, pid_t pid, std::string tag, int fd, NodeLeases* pool)
    : driver_(driver), pool_(pool), device_(device), pid_(pid), tag_(std::move(tag)), fd_(fd) {}

MappedTag::~MappedTag() {
  ::shutdown(fd_, SHUT_RDWR);  // wakes the watch thread: it unmaps and ends
  if (thread_.joinable()) thread_.join();
  Unmap(State::kGone, "closed");
  ::close(fd_);
  std::lock_guard<std::mutex> lock(mu_);
  regions_.clear();  // frees our reservations (nothing is mapped in them now)
}

MappedTag::Use::~Use() {
  if (owner_ == nullptr) return;
  std::lock_guard<std::mutex> lock(owner_->mu_);
  if (--owner_->users_ == 0) owner_->idle_.notify_all();
}

absl::StatusOr<MappedTag::Use> MappedTag::Acquire(bool backup, UseInfo* info) {
  std::lock_guard<std::mutex> lock(mu_);
  if ((state_ != State::kMapped && (state_ != State::kBackup || !backup)) || revoking_) {
    return absl::FailedPreconditionError(absl::StrCat("tag '", tag_, "' of process ", pid_, " is not mapped here: ",
                                                      revoking_ ? "the exporting process is pausing it" : why_));
  }
  ++users_;
  if (info != nullptr) *info = UseInfo{state_, generation_, grants_};
  return Use(this);
}

absl::StatusOr<DevicePtr> MappedTag::Local(DevicePtr remote, std::size_t size_bytes) const {
  std::lock_guard<std::mutex> lock(mu_);
  return LocalLocked(remote, size_bytes);
}

absl::Status MappedTag::LocalAll(const std::vector<ShareRange>& ranges, std::vector<DevicePtr>* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  out->clear();
  out->reserve(ranges.size());
  for (const ShareRange& r : ranges) {
    absl::StatusOr<DevicePtr> p = LocalLocked(r.address, r.size_bytes);
    if (!p.ok()) return p.status();
    out->push_back(*p);
  }
  return absl::OkStatus();
}

absl::Status MappedTag::Covers(const std::vector<ShareRange>& ranges, const std::vector<DevicePtr>* locals) const {
  if (locals != nullptr && locals->size() != ranges.size()) {
    return absl::InvalidArgumentError("Covers: as many local addresses as ranges are needed");
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    absl::StatusOr<DevicePtr> p = LocalLocked(ranges[i].address, ranges[i].size_bytes);
    if (!p.ok()) return absl::FailedPreconditionError(p.status().message());
    if (locals != nullptr && *p != (*locals)[i]) {
      return absl::FailedPreconditionError(absl::StrCat(
          "0x", absl::Hex(ranges[i].address), " of tag '", tag_, "' of process ", pid_, " is mapped at another "
          "address here than when it was first used (the exporting process's reservation there changed): map the "
          "tag again"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<DevicePtr> MappedTag::LocalLocked(DevicePtr remote, std::size_t size_bytes) const {
  const Region* region = nullptr;
  for (const Region& r : regions_) {
    if (remote >= r.remote.address && size_bytes <= r.remote.size_bytes &&
        remote - r.remote.address <= r.remote.size_bytes - size_bytes) {
      region = &r;
    }
  }
  if (region == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("0x", absl::Hex(remote), " (+", size_bytes, " bytes) is not in tag '",
                                                   tag_, "' of process ", pid_));
  }
  if (state_ != State::kMapped) {
    return absl::FailedPreconditionError(absl::StrCat("tag '", tag_, "' of process ", pid_, " is not mapped here: ", why_));
  }
  // Inside the mapped pieces: contiguous ones from the piece holding `remote` on.
  DevicePtr cursor = remote;
  const DevicePtr end = remote + size_bytes;
  auto it = std::partition_point(pieces_.begin(), pieces_.end(), [&](const Piece& p) {
    return p.remote.address + p.remote.size_bytes <= remote;
  });
  for (; it != pieces_.end() && cursor < end && it->remote.address <= cursor; ++it) {
    cursor = it->remote.address + it->remote.size_bytes;
  }
  if (cursor < end && size_bytes > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "0x", absl::Hex(remote), " (+", size_bytes, " bytes) of tag '", tag_, "' of process ", pid_,
        " is not in the memory it maps now: that memory was freed or re-created, or the tag grew since it was "
        "mapped (publish the index again and map again)"));
  }
  return region->local.address() + (remote - region->remote.address);
}

MappedTag::State MappedTag::state() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_;
}

std::uint64_t MappedTag::generation() const {
  std::lock_guard<std::mutex> lock(mu_);
  return generation_;
}

std::vector<ShareRange> MappedTag::Mapped() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ShareRange> out;
  for (const Piece& p : pieces_) out.push_back(p.remote);
  return out;
}

int MappedTag::users() const {
  std::lock_guard<std::mutex> lock(mu_);
  return users_;
}

std::uint64_t MappedTag::grants() const {
  std::lock_guard<std::mutex> lock(mu_);
  return grants_;
}

std::uint64_t MappedTag::revokes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return revokes_;
}

void MappedTag::Ack(const std::string& what, const absl::Status& status) {
  ShareMessage ack;
  ack.kind = ShareKind::kAck;
  ack.ack = what;
  ack.ok = status.ok();
  ack.message = std::string(status.message());
  (void)node::Send(fd_, FormatShare(ack));  // a closed connection is seen by the next receive
}

absl::Status MappedTag::TakeGrant(const ShareMessage& grant) {
  std::vector<ShareRange> chunks;
  std::vector<int> fds;
  auto close_fds = [&fds] {
    for (int fd : fds) ::close(fd);
  };
  while (chunks.size() < grant.chunk_count) {
    absl::StatusOr<node::Received> got = node::Receive(fd_, 10000, kChunksPerPacket);
    if (!got.ok()) {
      close_fds();
      return got.status();
    }
    for (int fd : got->fds) fds.push_back(fd);
    absl::StatusOr<ShareMessage> part = ParseShare(got->message);
    if (!part.ok() || part->kind != ShareKind::kChunks || part->chunks.size() != got->fds.size()) {
      close_fds();
      return absl::InternalError("tag share protocol: a grant's chunks came without one descriptor each");
    }
    chunks.insert(chunks.end(), part->chunks.begin(), part->chunks.end());
  }
  std::lock_guard<std::mutex> lock(mu_);
  // Nothing is mapped here now (a grant follows a revoke, or Unmap): our reservations
  // become exactly the grant's — the same one (the same address here) for a reservation of
  // the exporter seen before, a new one for a new one; those the exporter freed are freed.
  absl::Status failed = pieces_.empty() ? absl::OkStatus()
                                        : absl::InternalError("a grant came while chunks were mapped");
  std::vector<Region> next;
  for (std::size_t k = 0; failed.ok() && k < grant.reservations.size(); ++k) {
    const ShareRange& r = grant.reservations[k];
    auto known = std::find_if(regions_.begin(), regions_.end(), [&](const Region& g) {
      return g.local.valid() && g.remote.address == r.address && g.remote.size_bytes == r.size_bytes;
    });
    if (known != regions_.end()) {
      next.push_back(std::move(*known));
      continue;
    }
    absl::StatusOr<Reservation> local = Reservation::Create(driver_, device_, r.size_bytes);
    if (!local.ok()) {
      failed = local.status();
      break;
    }
    next.push_back({r, std::move(*local)});
  }
  for (Region& r : regions_) {  // those not moved to `next` are kept when this grant fails
    if (r.local.valid()) next.push_back(std::move(r));
  }
  if (failed.ok()) next.resize(grant.reservations.size());  // the grant's alone
  regions_ = std::move(next);
  std::sort(regions_.begin(), regions_.end(),
            [](const Region& a, const Region& b) { return a.remote.address < b.remote.address; });
  for (std::size_t k = 1; failed.ok() && k < regions_.size(); ++k) {
    if (regions_[k].remote.address < regions_[k - 1].remote.address + regions_[k - 1].remote.size_bytes) {
      failed = absl::InternalError("tag share protocol: a grant's reservations overlap");
    }
  }
  std::vector<Piece> mapped;
  for (std::size_t i = 0; failed.ok() && i < chunks.size(); ++i) {
    const ShareRange& c = chunks[i];
    auto region = std::find_if(regions_.begin(), regions_.end(), [&](const Region& g) {
      return c.address >= g.remote.address && c.size_bytes <= g.remote.size_bytes &&
             c.address - g.remote.address <= g.remote.size_bytes - c.size_bytes;
    });
    if (region == regions_.end()) {
      failed = absl::InternalError("tag share protocol: a granted chunk lies in no granted reservation");
      break;
    }
    absl::StatusOr<Chunk> chunk = Chunk::Import(driver_, device_, fds[i], c.size_bytes);
    if (!chunk.ok()) {
      failed = chunk.status();
      break;
    }
    const DevicePtr at = region->local.address() + (c.address - region->remote.address);
    absl::StatusOr<Mapping> mapping = Mapping::Create(driver_, device_, at, absl::MakeConstSpan(&*chunk, 1));
    if (!mapping.ok()) {
      failed = mapping.status();
      break;
    }
    mapped.push_back({c, std::move(*chunk), std::move(*mapping)});
  }
  close_fds();
  if (!failed.ok()) {  // `mapped` is unmapped and released as it goes; the reservations stay for the next grant
    state_ = State::kPaused;
    why_ = absl::StrCat("its last grant could not be mapped (", failed.message(), ")");
    return failed;
  }
  pieces_ = std::move(mapped);
  std::sort(pieces_.begin(), pieces_.end(),
            [](const Piece& a, const Piece& b) { return a.remote.address < b.remote.address; });
  state_ = State::kMapped;
  generation_ = grant.generation;
  grants_ += 1;
  why_.clear();
  return absl::OkStatus();
}

absl::Status MappedTag::TakeBackup(const ShareMessage& head) {
  Backup b;
  b.pool = head.pool;
  b.span_offset = head.span_offset;
  b.span_bytes = head.span_bytes;
  while (b.extents.size() < head.extent_count) {
    absl::StatusOr<node::Received> got = node::Receive(fd_, 10000, 0);
    if (!got.ok()) return got.status();
    absl::StatusOr<ShareMessage> part = ParseShare(got->message);
    if (!part.ok() || part->kind != ShareKind::kExtents || part->extents.empty()) {
      return absl::InternalError("tag share protocol: a backup grant's extents did not follow it");
    }
    b.extents.insert(b.extents.end(), part->extents.begin(), part->extents.end());
  }
  std::sort(b.extents.begin(), b.extents.end(),
            [](const BackupRange& x, const BackupRange& y) { return x.address < y.address; });
  absl::Status failed = b.extents.size() == head.extent_count
                            ? absl::OkStatus()
                            : absl::InternalError("tag share protocol: more extents than the backup grant named");
  for (std::size_t i = 0; failed.ok() && i < b.extents.size(); ++i) {
    const BackupRange& e = b.extents[i];
    if (e.offset > b.span_bytes || e.size_bytes > b.span_bytes - e.offset ||
        (i > 0 && e.address < b.extents[i - 1].address + b.extents[i - 1].size_bytes)) {
      failed = absl::InternalError("tag share protocol: a backup extent overlaps another or lies outside its span");
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!failed.ok()) {
    state_ = State::kPaused;
    why_ = absl::StrCat("the exporting process's tag is paused, and its last backup grant was bad (", failed.message(),
                        ")");
    return failed;
  }
  backup_ = std::move(b);
  state_ = State::kBackup;
  generation_ = head.generation;
  grants_ += 1;
  why_ = "the exporting process's tag is paused: its backup is writable from here (vmstash.weights.sync), not its "
         "device memory";
  return absl::OkStatus();
}

absl::Status MappedTag::WriteBackup(const std::vector<BackupWrite>& writes, Stream stream) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto refused = [&] {
    return absl::FailedPreconditionError(absl::StrCat(
        "tag '", tag_, "' of process ", pid_, ": no backup to write (",
        revoking_ ? "the exporting process is resuming or changing it" : state_ == State::kMapped ? "it is mapped" : why_,
        ")"));
  };
  if (state_ != State::kBackup || revoking_) return refused();
  const std::uint64_t serial = grants_;  // the grant these writes are checked against
  if (users_ == 0) return absl::FailedPreconditionError("WriteBackup: hold a use (Acquire) until the copies complete");
  // Every write checked first: one not inside one extent writes nothing at all.
  std::vector<std::size_t> at(writes.size());
  for (std::size_t i = 0; i < writes.size(); ++i) {
    const BackupWrite& w = writes[i];
    if (w.size_bytes == 0) continue;
    auto e = std::partition_point(backup_.extents.begin(), backup_.extents.end(), [&](const BackupRange& x) {
      return x.address + x.size_bytes <= w.remote;
    });
    if (e == backup_.extents.end() || w.remote < e->address || w.size_bytes > e->size_bytes ||
        w.remote - e->address > e->size_bytes - w.size_bytes) {
      return absl::FailedPreconditionError(absl::StrCat(
          "0x", absl::Hex(w.remote), " (+", w.size_bytes, " bytes) of tag '", tag_, "' of process ", pid_,
          " is not in its backup: the pause backed up only the bytes live then (that memory was freed, or "
          "re-created: publish the index again and map again)"));
    }
    at[i] = e->offset + (w.remote - e->address);
  }
  if (!borrowed_.has_value()) {
    // Borrowed outside mu_ (registering a large span takes seconds; the watch thread and
    // the other users' ends need mu_ meanwhile). The grant cannot change: this caller's
    // Use holds any revoke.
    if (pool_ == nullptr) return absl::FailedPreconditionError("this process has no node pool to reach the backup");
    const Backup grant{backup_.pool, backup_.span_offset, backup_.span_bytes, {}};
    lock.unlock();
    std::lock_guard<std::mutex> one(borrow_mu_);
    lock.lock();
    if (!borrowed_.has_value()) {
      lock.unlock();
      absl::StatusOr<HostLease> lease = pool_->Borrow(grant.pool, grant.span_offset, grant.span_bytes, device_);
      lock.lock();
      if (!lease.ok()) {
        return absl::Status(lease.status().code(), absl::StrCat("tag '", tag_, "' of process ", pid_,
                                                                ": reaching its backup: ", lease.status().message()));
      }
      // Meanwhile a revoke may have come (it waits for the Uses: nothing more is written),
      // or, for a caller without a Use, another grant: the lease is not kept then.
      if (state_ != State::kBackup || revoking_ || grants_ != serial) {
        pool_->Give(*lease);
        return refused();
      }
      borrowed_ = *lease;
    }
  }
  // mu_ was let go above: the same grant, and no revoke waiting, or nothing is written.
  if (state_ != State::kBackup || revoking_ || grants_ != serial) return refused();
  const HostLease& h = *borrowed_;
  for (std::size_t i = 0; i < writes.size(); ++i) {
    // Cut where the pool's registrations are (a copy may not span two).
    std::size_t done = 0;
    while (done < writes[i].size_bytes) {
      char* dst = h.data + at[i] + done;
      const std::size_t in_segment =
          h.segment_bytes - static_cast<std::size_t>(dst - h.segment_base) % h.segment_bytes;
      const std::size_t n = std::min(in_segment, writes[i].size_bytes - done);
      if (absl::Status s = driver_->CopyToHostAsync(device_, dst, writes[i].src + done, n, stream); !s.ok()) {
        return s;
      }
      done += n;
    }
  }
  return absl::OkStatus();
}

std::size_t MappedTag::backup_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::size_t n = 0;
  for (const BackupRange& e : backup_.extents) n += e.size_bytes;
  return n;
}

void MappedTag::Unmap(State next, const std::string& why) {
  std::unique_lock<std::mutex> lock(mu_);
  revoking_ = true;
  idle_.wait(lock, [this] { return users_ == 0; });
  pieces_.clear();  // each mapping is unmapped, then its chunk released
  backup_ = Backup{};
  if (borrowed_.has_value()) {  // every write into it is complete (the Uses ended)
    pool_->Give(*borrowed_);
    borrowed_.reset();
  }
  if (state_ != State::kGone) {
    state_ = next;
    if (!why.empty()) why_ = why;
  }
  revoking_ = false;
}

void MappedTag::Watch() {
  for (;;) {
    absl::StatusOr<node::Received> got = node::Receive(fd_, -1, 0);
    absl::StatusOr<ShareMessage> event = got.ok() ? ParseShare(got->message) : got.status();
    if (!event.ok() || event->kind == ShareKind::kError) {
      // Closed (the exporter exited, stopped sharing, or dropped us) or broken: let go.
      const std::string why = !got.ok() ? "the exporting process exited, stopped sharing the tag, or dropped this "
                                          "mapping"
                                        : absl::StrCat("the exporting process sent what this one cannot read (",
                                                       event.ok() ? event->message : event.status().message(), ")");
      Unmap(State::kGone, why);
      return;
    }
    switch (event->kind) {
      case ShareKind::kRevoke: {
        Unmap(State::kPaused, "the exporting process paused the tag (or is changing its memory)");
        {
          std::lock_guard<std::mutex> lock(mu_);
          revokes_ += 1;
        }
        Ack("revoke", absl::OkStatus());
        break;
      }
      case ShareKind::kBackup: {
        if (state() == State::kMapped || state() == State::kBackup) Unmap(State::kPaused, "granted again");
        absl::Status s = TakeBackup(*event);
        if (!s.ok()) VMSTASH_LOG(kWarning, "map_tag {} of process {}: {}", tag_, pid_, s.ToString());
        Ack("backup", s);
        break;
      }
      case ShareKind::kGrant: {
        if (state() == State::kMapped || state() == State::kBackup) Unmap(State::kPaused, "granted again");
        absl::Status s = TakeGrant(*event);
        if (!s.ok()) VMSTASH_LOG(kWarning, "map_tag {} of process {}: {}", tag_, pid_, s.ToString());
        Ack("grant", s);
        break;
      }
      case ShareKind::kPaused: {
        {
          std::lock_guard<std::mutex> lock(mu_);
          generation_ = event->generation;
          if (state_ == State::kMapped || state_ == State::kBackup) {
            Ack("paused", absl::InternalError("\"paused\" while mapped"));
            break;
          }
          why_ = PausedWhy(*event);
        }
        Ack("paused", absl::OkStatus());
        break;
      }
      default:
        Unmap(State::kGone, "the exporting process broke the protocol");
        return;
    }
  }
}

}  // namespace vmstash::share
