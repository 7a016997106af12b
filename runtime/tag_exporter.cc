#include "runtime/tag_exporter.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/json_reader.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "control/runtime_dir.h"
#include "node/wire.h"

namespace vmstash::share {
namespace {

// The packets and descriptors of a grant of `memory` (generation `generation`).
void GrantPackets(const ExportedMemory& memory, std::uint64_t generation, std::vector<std::string>* packets,
                  std::vector<std::vector<int>>* fds) {
  ShareMessage grant;
  grant.kind = ShareKind::kGrant;
  grant.generation = generation;
  for (const ExportedMemory::Range& r : memory.reservations) grant.reservations.push_back({r.address, r.size_bytes});
  grant.chunk_count = memory.chunks.size();
  packets->push_back(FormatShare(grant));
  fds->emplace_back();
  for (std::size_t i = 0; i < memory.chunks.size(); i += kChunksPerPacket) {
    ShareMessage part;
    part.kind = ShareKind::kChunks;
    std::vector<int> these;
    for (std::size_t j = i; j < std::min(memory.chunks.size(), i + kChunksPerPacket); ++j) {
      part.chunks.push_back({memory.chunks[j].address, memory.chunks[j].size_bytes});
      these.push_back(memory.chunks[j].fd);
    }
    packets->push_back(FormatShare(part));
    fds->push_back(std::move(these));
  }
}

// The packets of a backup grant of `backup` (generation `generation`), whose arena is at
// `place` in the node pool.
void BackupPackets(const ExportedBackup& backup, const NodeLeases::PoolPlace& place, std::uint64_t generation,
                   std::vector<std::string>* packets) {
  ShareMessage head;
  head.kind = ShareKind::kBackup;
  head.generation = generation;
  head.pool = place.pool;
  head.span_offset = place.offset;
  head.span_bytes = backup.bytes;
  head.extent_count = backup.extents.size();
  packets->push_back(FormatShare(head));
  for (std::size_t i = 0; i < backup.extents.size(); i += kExtentsPerPacket) {
    ShareMessage part;
    part.kind = ShareKind::kExtents;
    for (std::size_t j = i; j < std::min(backup.extents.size(), i + kExtentsPerPacket); ++j) {
      const BackupExtent& e = backup.extents[j];
      part.extents.push_back({e.address, e.size_bytes, e.arena_offset});
    }
    packets->push_back(FormatShare(part));
  }
}

}  // namespace

absl::StatusOr<std::shared_ptr<TagExporter>> TagExporter::Start(Runtime* runtime, ShareOptions options) {
  if (runtime == nullptr) return absl::InvalidArgumentError("tag exporter: no runtime");
  if (options.dir.empty()) options.dir = control::DefaultRuntimeDir();
  if (!options.peer_allowed) {
    const uid_t me = ::getuid();
    options.peer_allowed = [me](uid_t uid) { return uid == me; };
  }
  if (absl::Status s = control::EnsurePrivateDir(options.dir); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("tag exporter: refusing the runtime directory: ", s.message()));
  }
  const std::string path = ShareSocketPath(options.dir, ::getpid());
  if (path.size() >= sizeof(sockaddr_un{}.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("tag exporter: socket path too long: ", path));
  }
  ::unlink(path.c_str());  // an earlier process's with our pid
  const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return control::Errno("tag exporter: socket", errno);
  sockaddr_un addr = control::UnixAddress(path);
  int wake[2] = {-1, -1};
  absl::Status failed;
  if (::fchmod(fd, 0600) != 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::chmod(path.c_str(), 0600) != 0 || ::listen(fd, 16) != 0) {
    failed = control::Errno(absl::StrCat("tag exporter: listen on ", path), errno);
  } else if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    failed = control::Errno("tag exporter: pipe", errno);
  }
  if (!failed.ok()) {
    ::close(fd);
    ::unlink(path.c_str());
    return failed;
  }
  std::shared_ptr<TagExporter> e(new TagExporter(runtime, std::move(options), fd, wake, path));
  e->thread_ = std::thread([raw = e.get()] { raw->Loop(); });
  return e;
}

TagExporter::TagExporter(Runtime* runtime, ShareOptions options, int listen_fd, int wake[2], std::string path)
    : runtime_(runtime),
      options_(std::move(options)),
      listen_fd_(listen_fd),
      wake_read_(wake[0]),
      wake_write_(wake[1]),
      path_(std::move(path)),
      owner_pid_(::getpid()) {}

TagExporter::~TagExporter() {
  Stop();
  ::close(wake_read_);
  ::close(wake_write_);
}

void TagExporter::Stop() {
  {
    MutexLock lock(&ops_mu_);
    if (stopped_) return;
    stopped_ = true;
    for (auto& [tag, shared] : shared_) {
      // Writers of a paused tag's backup let go first (its memory goes back with this
      // process's runtime); one that does not within the deadline is logged.
      if (::getpid() == owner_pid_) LetGo(tag, shared, "the process stops sharing");
      for (Importer& i : shared.importers) Close(i);
      shared.importers.clear();
      if (::getpid() == owner_pid_) ::unlink(ShareIndexPath(options_.dir, owner_pid_, shared.name).c_str());
    }
    std::vector<TagId> fenced_tags;
    for (const auto& [tag, writers] : fenced_) fenced_tags.push_back(tag);
    for (TagId tag : fenced_tags) {  // WaitFenced erases the tags it clears
      if (::getpid() == owner_pid_ && !WaitFenced(tag, -1).ok()) {
        VMSTASH_LOG(kError, "tag exporter: stopping while a process may still write the backup of tag '{}'",
                    TagName(tag));
      }
    }
    for (auto& [tag, writers] : fenced_) {
      for (Importer& i : writers) Close(i);
    }
    fenced_.clear();
    any_fenced_.store(false);
  }
  if (::getpid() != owner_pid_) return;  // a forked child's copy: the thread and socket are the parent's
  const char one = 1;
  (void)!::write(wake_write_, &one, 1);
  if (thread_.joinable()) thread_.join();
  ::close(listen_fd_);
  ::unlink(path_.c_str());
}

void TagExporter::Close(Importer& importer) {
  if (importer.fd < 0) return;
  ::shutdown(importer.fd, SHUT_RDWR);
  {
    std::lock_guard<std::mutex> lock(fds_mu_);
    fds_.erase(importer.fd);
    ::close(importer.fd);
  }
  importer.fd = -1;
}

void TagExporter::Track(int fd) {
  std::lock_guard<std::mutex> lock(fds_mu_);
  fds_.insert(fd);
}

void TagExporter::CloseInForkedChild() {
  for (int fd : fds_) ::close(fd);  // fds_mu_ is held since the fork's prepare
  ::close(listen_fd_);
}

absl::StatusOr<std::uint64_t> TagExporter::Share(TagId tag, const std::string& index, const std::string& name) {
  if (!runtime_->TagPolicy(tag).has_value()) {
    return absl::NotFoundError(absl::StrCat("share tag '", TagName(tag), "': this process never declared it"));
  }
  if (!runtime_->allocator_options().share_chunks) {
    return absl::FailedPreconditionError(absl::StrCat(
        "share tag '", TagName(tag), "': this process's chunks cannot be exported: start it with VMSTASH_CONF "
        "share_chunks:1 (or node:1)"));
  }
  const std::string public_name = name.empty() ? std::string(TagName(tag)) : name;
  if (!JsonValue::Parse(index).ok()) {
    return absl::InvalidArgumentError(absl::StrCat("share tag '", TagName(tag), "': its index is not JSON"));
  }
  MutexLock lock(&ops_mu_);
  if (stopped_) return absl::FailedPreconditionError("share tag: the tag exporter is stopped");
  for (const auto& [other, s] : shared_) {
    if (other != tag && s.name == public_name) {
      return absl::FailedPreconditionError(absl::StrCat("share tag '", TagName(tag), "' as '", public_name,
                                                        "': tag '", TagName(other), "' is shared by that name"));
    }
  }
  auto found = shared_.find(tag);
  const std::uint64_t generation = (found == shared_.end() ? 0 : found->second.generation) + 1;
  // The index first: a Share that fails leaves the tag as it was (unshared, or its old index).
  VMSTASH_RETURN_IF_ERROR(WriteIndex(public_name, generation, index));
  if (found == shared_.end()) {
    found = shared_.emplace(tag, SharedTag{}).first;
    shared_count_.fetch_add(1);
  }
  SharedTag& shared = found->second;
  if (!shared.name.empty() && shared.name != public_name) {  // renamed: the old name's index goes
    ::unlink(ShareIndexPath(options_.dir, ::getpid(), shared.name).c_str());
  }
  shared.name = public_name;
  shared.generation = generation;
  // Importers learn the new generation now (their index is stale): a revoke, then a grant.
  if (absl::Status s = Revoke(tag, shared, -1, /*mapped=*/true, /*backup=*/true); !s.ok()) {
    VMSTASH_LOG(kWarning, "tag exporter: at the new index of tag '{}': {}", TagName(tag), s.ToString());
  }
  if (!Changing(tag)) {  // else the call changing it grants them
    for (Importer& i : shared.importers) {
      if (i.granted) continue;
      if (absl::Status s = Grant(tag, shared, i); !s.ok()) {
        VMSTASH_LOG(kWarning, "tag exporter: process {} lost its mapping of tag '{}' at its new index: {}", i.pid,
                    TagName(tag), s.ToString());
        Close(i);
      }
    }
  }
  shared.importers.erase(std::remove_if(shared.importers.begin(), shared.importers.end(),
                                        [](const Importer& i) { return i.fd < 0; }),
                         shared.importers.end());
  return shared.generation;
}

absl::Status TagExporter::WriteIndex(const std::string& name, std::uint64_t generation, const std::string& index) const {
  const std::string path = ShareIndexPath(options_.dir, ::getpid(), name);
  const std::string tmp = absl::StrCat(path, ".tmp");
  const std::string text = absl::StrCat("{\"generation\":", generation, ",\"index\":", index, "}\n");
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return control::Errno(absl::StrCat("share tag: write ", tmp), errno);
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return control::Errno(absl::StrCat("share tag: write ", tmp), err);
    }
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return control::Errno(absl::StrCat("share tag: rename to ", path), err);
  }
  return absl::OkStatus();
}

absl::Status TagExporter::Unshare(TagId tag) {
  MutexLock lock(&ops_mu_);
  auto it = shared_.find(tag);
  if (it == shared_.end()) return absl::NotFoundError(absl::StrCat("tag '", TagName(tag), "' is not shared"));
  LetGo(tag, it->second, "unshared");  // a backup writer still writing stays fenced (Revoke)
  for (Importer& i : it->second.importers) Close(i);
  ::unlink(ShareIndexPath(options_.dir, ::getpid(), it->second.name).c_str());
  shared_.erase(it);
  shared_count_.fetch_sub(1);
  return absl::OkStatus();
}

std::size_t TagExporter::importers(TagId tag) const {
  MutexLock lock(&ops_mu_);
  auto it = shared_.find(tag);
  return it == shared_.end() ? 0 : it->second.importers.size();
}

void TagExporter::Loop() {
  for (;;) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {wake_read_, POLLIN, 0}};
    const int n = ::poll(p, 2, -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 || (p[1].revents & POLLIN) != 0) return;
    if ((p[0].revents & POLLIN) == 0) continue;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        VMSTASH_LOG(kWarning, "tag exporter: accept: {}; retrying in 100 ms", std::strerror(errno));
        pollfd w{wake_read_, POLLIN, 0};
        if (::poll(&w, 1, 100) > 0) return;
      }
      continue;
    }
    Admit(fd);
  }
}

absl::StatusOr<int> TagExporter::DeviceOf(const std::string& uuid) const {
  for (int d = 0; d < runtime_->device_count(); ++d) {
    absl::StatusOr<std::string> mine = runtime_->driver().DeviceUuid(d);
    if (!mine.ok() || *mine != uuid) continue;
    if (runtime_->AllocatorInUse(d) == nullptr) {
      return absl::NotFoundError(absl::StrCat("process ", ::getpid(), " has no memory on device ", uuid));
    }
    return d;
  }
  return absl::NotFoundError(absl::StrCat("process ", ::getpid(), " does not see device ", uuid,
                                          ": the two processes must share a GPU"));
}

void TagExporter::Admit(int fd) {
  Track(fd);
  Importer importer{fd, 0, 0, false};
  // A send to an importer that does not read gives up after request_timeout_ms instead of
  // blocking the exporter's lock (BeforeChunksChange: a veto; elsewhere it is dropped).
  const timeval send_limit{options_.request_timeout_ms / 1000, (options_.request_timeout_ms % 1000) * 1000};
  (void)::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &send_limit, sizeof(send_limit));
  absl::StatusOr<control::Peer> peer = control::PeerOf(fd);
  if (!peer.ok() || !options_.peer_allowed(peer->uid)) {
    (void)node::Send(fd, FormatShare(ShareError(absl::PermissionDeniedError(
                             "tag exporter: a process of another user may not map this process's memory"))));
    Close(importer);
    return;
  }
  importer.pid = peer->pid;
  absl::StatusOr<node::Received> got = node::Receive(fd, options_.request_timeout_ms, 0);
  absl::StatusOr<ShareMessage> request = got.ok() ? ParseShare(got->message) : got.status();
  if (request.ok() && request->kind != ShareKind::kMap) {
    request = absl::InvalidArgumentError("tag share protocol: the first message must be a map request");
  }
  absl::StatusOr<int> device = request.ok() ? DeviceOf(request->device) : request.status();
  MutexLock lock(&ops_mu_);
  auto it = shared_.begin();  // the tag shared by the name asked for
  while (request.ok() && it != shared_.end() && it->second.name != request->tag) ++it;
  if (!request.ok()) it = shared_.end();
  absl::Status refused = device.status();
  if (refused.ok() && stopped_) refused = absl::UnavailableError("tag exporter: stopping");
  if (refused.ok() && it == shared_.end()) {
    refused = absl::NotFoundError(absl::StrCat("process ", ::getpid(), " does not share tag '", request->tag,
                                               "' (the exporting process shares it first: vmstash.weights.publish)"));
  }
  if (!refused.ok()) {
    if (!absl::IsUnavailable(refused) || got.ok()) (void)node::Send(fd, FormatShare(ShareError(refused)));
    Close(importer);
    return;
  }
  importer.device = *device;
  if (absl::Status s = Grant(it->first, it->second, importer); !s.ok()) {
    VMSTASH_LOG(kWarning, "tag exporter: process {} could not map tag '{}': {}", importer.pid, request->tag,
                s.ToString());
    Close(importer);
    return;
  }
  it->second.importers.push_back(importer);
}

absl::Status TagExporter::Exchange(Importer& importer, const std::string& ack, int timeout_ms,
                                   const std::vector<std::string>& packets, const std::vector<std::vector<int>>& fds) {
  for (std::size_t i = 0; i < packets.size(); ++i) {
    if (absl::Status s = node::SendFds(importer.fd, packets[i], fds[i]); !s.ok()) return s;
  }
  absl::StatusOr<node::Received> got = node::Receive(importer.fd, timeout_ms, 0);
  if (!got.ok()) return got.status();
  absl::StatusOr<ShareMessage> m = ParseShare(got->message);
  if (!m.ok()) return m.status();
  if (m->kind != ShareKind::kAck || m->ack != ack) {
    return absl::InternalError(absl::StrCat("tag share protocol: process ", importer.pid, " answered a ", ack,
                                            " with something else"));
  }
  if (!m->ok) return absl::InternalError(absl::StrCat("process ", importer.pid, ": ", m->message));
  return absl::OkStatus();
}

absl::Status TagExporter::Grant(TagId tag, SharedTag& shared, Importer& importer) {
  CachingAllocator* a = runtime_->AllocatorInUse(importer.device);
  const bool changing = Changing(tag);
  absl::StatusOr<ExportedMemory> memory =
      changing || a == nullptr ? absl::FailedPreconditionError("changing") : a->ExportTag(tag);
  std::vector<std::string> packets;
  std::vector<std::vector<int>> fds;
  const char* ack = "grant";
  if (memory.ok()) {
    GrantPackets(*memory, shared.generation, &packets, &fds);
  } else if (absl::IsFailedPrecondition(memory.status()) || absl::IsNotFound(memory.status())) {
    // Paused, in a transition, or no memory here yet. Paused with its backup in the node
    // pool: the backup is granted; else the importer waits for a grant (told why there is
    // no backup to write, when the tag is paused).
    absl::Status why = changing || a == nullptr ? absl::UnavailableError("not now")
                                                : BackupGrant(*a, tag, shared.generation, &packets);
    if (why.ok()) {
      ack = "backup";
    } else {
      packets.clear();
      ShareMessage paused;
      paused.kind = ShareKind::kPaused;
      paused.generation = shared.generation;
      if (!absl::IsUnavailable(why)) paused.message = std::string(why.message());
      packets.push_back(FormatShare(paused));
      ack = "paused";
    }
    fds.assign(packets.size(), {});
  } else {
    (void)node::Send(importer.fd, FormatShare(ShareError(memory.status())));
    return memory.status();
  }
  absl::Status s = Exchange(importer, ack, options_.request_timeout_ms, packets, fds);
  if (s.ok()) {
    importer.granted = std::string(ack) != "paused";
    importer.backup = std::string(ack) == "backup";
  }
  return s;  // the descriptors of `memory` are closed with it: the importer has its copies
}

absl::Status TagExporter::BackupGrant(CachingAllocator& allocator, TagId tag, std::uint64_t generation,
                                      std::vector<std::string>* packets) {
  absl::StatusOr<ExportedBackup> backup = allocator.ExportTagBackup(tag);
  if (!backup.ok()) return backup.status();
  if (backup->extents.empty()) return absl::FailedPreconditionError("its pause backed nothing up");
  absl::StatusOr<NodeLeases::PoolPlace> place = runtime_->node().Locate(backup->data, backup->bytes);
  if (!place.ok()) return absl::FailedPreconditionError(place.status().message());
  BackupPackets(*backup, *place, generation, packets);
  return absl::OkStatus();
}

std::vector<TagId> TagExporter::Concerned(const ChunkChange& change, bool regrant) const {
  std::vector<TagId> out;
  for (const auto& [tag, shared] : shared_) {
    const std::vector<TagId>& list = regrant ? change.regrant : change.revoke;
    const bool named = std::find(list.begin(), list.end(), tag) != list.end() ||
                       (regrant && std::find(change.revoke.begin(), change.revoke.end(), tag) != change.revoke.end());
    if (change.all || named) out.push_back(tag);
  }
  return out;
}

void TagExporter::Mark(const ChunkChange& change, int delta) {
  std::lock_guard<std::mutex> lock(changing_mu_);
  if (change.all) {
    changing_all_ += delta;
    return;
  }
  // The tags it may release and those it may resume (whose backup it reads), once each.
  std::set<TagId> tags(change.revoke.begin(), change.revoke.end());
  tags.insert(change.regrant.begin(), change.regrant.end());
  for (TagId tag : tags) {
    if ((changing_[tag] += delta) == 0) changing_.erase(tag);
  }
}

bool TagExporter::Changing(TagId tag) {
  std::lock_guard<std::mutex> lock(changing_mu_);
  return changing_all_ > 0 || changing_.count(tag) > 0;
}


absl::Status TagExporter::BeforeChunksChange(const ChunkChange& change) {
  Mark(change, +1);  // undone by AfterChunksChange, which runs whatever happens here
  if (shared_count_.load() == 0 && !any_fenced_.load()) return absl::OkStatus();
  MutexLock lock(&ops_mu_);
  absl::Status veto;
  // The tags it may release, and those it may resume: an importer writing a paused tag's
  // backup lets go before the resume reads it.
  const auto in = [](const std::vector<TagId>& list, TagId tag) {
    return std::find(list.begin(), list.end(), tag) != list.end();
  };
  // Writers of a backup dropped earlier without letting go (Revoke) fence their tag's
  // resume (nothing else reads or gives back a paused tag's backup).
  for (auto it = fenced_.begin(); it != fenced_.end();) {
    const TagId tag = it->first;
    ++it;  // WaitFenced may erase tag's entry
    if (!in(change.resume, tag)) continue;
    absl::Status s = WaitFenced(tag, change.device);
    if (veto.ok()) veto = s;
  }
  for (TagId tag : Concerned(change, /*regrant=*/true)) {
    // Its mappings when it may release the tag's chunks; its backup's writers when it may
    // resume it (a pause of a paused tag, a resume of an active one: neither).
    const bool mapped = change.all || in(change.revoke, tag);
    const bool backup = in(change.resume, tag);
    if (!mapped && !backup) continue;
    absl::Status s = Revoke(tag, shared_[tag], change.device, mapped, backup);
    if (veto.ok()) veto = s;
  }
  return veto;
}

void TagExporter::LetGo(TagId tag, SharedTag& shared, const char* why) {
  if (absl::Status s = Revoke(tag, shared, -1, /*mapped=*/false, /*backup=*/true); !s.ok()) {
    VMSTASH_LOG(kError, "tag exporter: tag '{}' {}: {}", TagName(tag), why, s.ToString());
  }
}

absl::Status TagExporter::AwaitRevokeAck(const Importer& i, std::chrono::steady_clock::time_point deadline) {
  // Waited for in slices: a process that dies meanwhile (a forked child of it holding the
  // connection open) is seen gone within a slice.
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    absl::StatusOr<node::Received> got = node::Receive(i.fd, std::clamp<int>(static_cast<int>(left.count()), 0, 200), 0);
    if (absl::IsDeadlineExceeded(got.status())) {
      if (control::ProcessGone(i.pid)) return absl::UnavailableError("its process is gone");
      if (left.count() > 200) continue;
    }
    if (!got.ok()) return got.status();
    absl::StatusOr<ShareMessage> m = ParseShare(got->message);
    if (!m.ok()) return m.status();
    if (m->kind == ShareKind::kAck && m->ack == "revoke" && m->ok) return absl::OkStatus();
    return absl::InternalError(m->ok ? "it answered something else" : m->message);
  }
}

absl::Status TagExporter::WaitFenced(TagId tag, int device) {
  auto it = fenced_.find(tag);
  if (it == fenced_.end()) return absl::OkStatus();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(options_.revoke_timeout_ms);
  std::vector<pid_t> still;
  for (Importer& f : it->second) {
    if (device >= 0 && f.device != device) continue;
    // Its revoke was sent: the acknowledgement comes once its copies are complete.
    const absl::Status s = AwaitRevokeAck(f, deadline);
    if (s.ok() || absl::IsUnavailable(s)) {
      Close(f);  // let go, or gone (the kernel closed its connection with the process)
    } else {
      still.push_back(f.pid);
    }
  }
  it->second.erase(std::remove_if(it->second.begin(), it->second.end(), [](const Importer& i) { return i.fd < 0; }),
                   it->second.end());
  if (it->second.empty()) fenced_.erase(it);
  any_fenced_.store(!fenced_.empty());
  if (still.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "process ", still.front(), " was writing the backup of tag '", TagName(tag), "' (vmstash.weights.sync) and "
      "has not let go of it: the tag stays paused until that process lets go or exits"));
}

absl::Status TagExporter::Revoke(TagId tag, SharedTag& shared, int device, bool mapped, bool backup) {
  ShareMessage revoke_message;
  revoke_message.kind = ShareKind::kRevoke;
  const std::string revoke = FormatShare(revoke_message);
  absl::Status veto;
  // Every importer is told at once; their acknowledgements are read in turn, all within
  // one revoke_timeout_ms. An importer that is gone (its connection closed, or its
  // process dead while a forked child of it holds the connection) let go with its exit;
  // one alive that does not let go in time vetoes the call and is dropped.
  std::vector<std::pair<Importer*, absl::Status>> asked;
  for (Importer& i : shared.importers) {
    if (!i.granted || !(i.backup ? backup : mapped) || (device >= 0 && i.device != device)) continue;
    asked.emplace_back(&i, node::Send(i.fd, revoke));
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(options_.revoke_timeout_ms);
  for (auto& [i, sent] : asked) {
    const absl::Status failed = sent.ok() ? AwaitRevokeAck(*i, deadline) : sent;
    if (failed.ok()) {
      i->granted = i->backup = false;
      continue;
    }
    const bool alive = !absl::IsUnavailable(failed) && !control::ProcessGone(i->pid);
    if (alive && veto.ok()) {
      veto = absl::FailedPreconditionError(absl::StrCat(
          "process ", i->pid, " maps tag '", TagName(tag), "' (vmstash.weights.map_tag) and did not let go of it "
          "within ", options_.revoke_timeout_ms, " ms (", failed.message(), "); its mapping is dropped: try again"));
    }
    if (alive && i->backup) {
      // A writer of the backup may still have copies in flight: its connection stays open
      // (fenced) until it acknowledges or exits, and no call resumes the tag meanwhile
      // (WaitFenced), so the resume never reads, nor gives back, bytes being written.
      fenced_[tag].push_back(*i);
      any_fenced_.store(true);
      i->fd = -1;
      continue;
    }
    Close(*i);
  }
  shared.importers.erase(std::remove_if(shared.importers.begin(), shared.importers.end(),
                                        [](const Importer& i) { return i.fd < 0; }),
                         shared.importers.end());
  return veto;
}

void TagExporter::AfterChunksChange(const ChunkChange& change) {
  // Unmarked first: an importer admitted from now on is granted by Admit itself, one
  // admitted before (told "paused") by the grants below — even when the tag was shared
  // after the check of shared_count_ in Before.
  Mark(change, -1);
  if (shared_count_.load() == 0) return;
  MutexLock lock(&ops_mu_);
  for (TagId tag : Concerned(change, /*regrant=*/true)) {
    if (Changing(tag)) continue;  // another call changes it still: its After grants
    SharedTag& shared = shared_[tag];
    for (Importer& i : shared.importers) {
      if (i.granted) continue;
      if (absl::Status s = Grant(tag, shared, i); !s.ok()) {
        VMSTASH_LOG(kWarning, "tag exporter: process {} lost its mapping of tag '{}': {}", i.pid, TagName(tag),
                    s.ToString());
        Close(i);
      }
    }
    shared.importers.erase(std::remove_if(shared.importers.begin(), shared.importers.end(),
                                          [](const Importer& i) { return i.fd < 0; }),
                           shared.importers.end());
  }
}

}  // namespace vmstash::share
