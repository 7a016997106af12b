#include "allocator/backup_arena.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"

namespace vmstash {
namespace {

constexpr std::size_t kUnit = std::size_t{2} << 20;

std::string Errno(int err) { return std::strerror(err); }

bool IsNoRoom(int err) { return err == ENOSPC || err == EDQUOT || err == EFBIG; }

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14; older headers lack it
#endif

// posix_fallocate(fd, 0, size) with SIGXFSZ blocked on this thread, the signal a file size
// limit makes the kernel send consumed when the call fails with EFBIG (Note [Disk Backup]).
// Returns the error number (0 on success), as posix_fallocate does.
int GrowFileWithoutSignal(int fd, off_t size) {
  sigset_t xfsz, previous;
  sigemptyset(&xfsz);
  sigaddset(&xfsz, SIGXFSZ);
  if (const int err = pthread_sigmask(SIG_BLOCK, &xfsz, &previous); err != 0) return err;
  const int err = posix_fallocate(fd, 0, size);
  if (err == EFBIG && sigismember(&previous, SIGXFSZ) == 0) {
    const timespec now{0, 0};
    while (sigtimedwait(&xfsz, nullptr, &now) < 0 && errno == EINTR) {
    }
  }
  pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  return err;
}

// "... the process's file size limit (RLIMIT_FSIZE) is N bytes" when one is set.
std::string FileSizeLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_FSIZE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return "";
  return absl::StrCat("; the process's file size limit (RLIMIT_FSIZE, `ulimit -f`) is ", limit.rlim_cur, " bytes");
}

// --- Note [Disk Backup Files]: names, the sweep, the exit handler --------------------------

constexpr char kFilePrefix[] = "vmstash-tms-";

// The start time of process `pid` (field 22 of /proc/<pid>/stat, clock ticks since boot),
// or 0 when it cannot be read.
unsigned long long StartTime(long pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
  std::FILE* f = std::fopen(path, "re");
  if (f == nullptr) return 0;
  char buf[1024];
  const std::size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');  // the command name may hold spaces and parentheses
  if (p == nullptr) return 0;
  // After ")" come " <field 3> <field 4> ...": p at the space before field 22 (starttime).
  for (int field = 3; field <= 22 && p != nullptr; ++field) p = std::strchr(p + 1, ' ');
  return p != nullptr ? std::strtoull(p + 1, nullptr, 10) : 0;
}

// Read again at each call (once per pause): a forked child has its own pid and start time.
unsigned long long OwnStartTime() { return StartTime(static_cast<long>(getpid())); }

// "vmstash-tms-<pid>-<start>-": this process's file name prefix.
std::string OwnFilePrefix() {
  return absl::StrCat(kFilePrefix, static_cast<long>(getpid()), "-", OwnStartTime(), "-");
}

// True for a file of the pattern whose process is gone: its pid is not alive, or is alive
// with another start time (the pid was reused). False for other names and live owners.
bool IsStaleFile(const char* name) {
  if (std::strncmp(name, kFilePrefix, sizeof(kFilePrefix) - 1) != 0) return false;
  char* end = nullptr;
  const long pid = std::strtol(name + sizeof(kFilePrefix) - 1, &end, 10);
  if (end == nullptr || *end != '-' || pid <= 0) return false;
  const unsigned long long start = std::strtoull(end + 1, &end, 10);
  if (end == nullptr || *end != '-') return false;
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return true;
  const unsigned long long now = StartTime(pid);
  return now != 0 && start != 0 && now != start;
}

// Removes the stale files of `directory` (Note [Disk Backup Files]); errors are ignored (a
// file another process removed first, a directory we may not list).
void SweepStaleFiles(const std::string& directory) {
  DIR* dir = opendir(directory.c_str());
  if (dir == nullptr) return;
  while (const dirent* e = readdir(dir)) {
    if (IsStaleFile(e->d_name)) {
      const std::string path = absl::StrCat(directory, "/", e->d_name);
      if (unlink(path.c_str()) == 0) VMSTASH_LOG(kInfo, "vmstash: removed the stale disk backup file '{}'", path);
    }
  }
  closedir(dir);
}

// This process's visible backup files, unlinked at exit if still there (a process that
// ends with a tag paused), each with the pid that made it: a forked child inherits the
// list, and its exit must leave its parent's files alone. Leaked on purpose: the handler
// may run after static destructors.
std::mutex& FilesMu() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::map<std::string, pid_t>& LiveFiles() {
  static auto* files = new std::map<std::string, pid_t>;
  return *files;
}
void UnlinkLiveFilesAtExit() {
  std::lock_guard<std::mutex> lock(FilesMu());
  const pid_t self = getpid();
  for (const auto& [path, owner] : LiveFiles()) {
    if (owner == self) unlink(path.c_str());
  }
  LiveFiles().clear();
}
void NoteLiveFile(const std::string& path, bool live) {
  static const bool registered = [] { return std::atexit(UnlinkLiveFilesAtExit) == 0; }();
  (void)registered;
  std::lock_guard<std::mutex> lock(FilesMu());
  if (live) {
    LiveFiles()[path] = getpid();
  } else {
    LiveFiles().erase(path);
  }
}

// The error of a failed file creation in `directory` (errno `err`).
absl::Status CreateFileError(const std::string& directory, int err) {
  std::string what = absl::StrCat("disk backup directory '", directory, "': cannot create a file: ", Errno(err));
  if (err == ENOENT || err == ENOTDIR) return absl::NotFoundError(what);
  if (IsNoRoom(err) || err == EMFILE || err == ENFILE) return absl::ResourceExhaustedError(what);
  return absl::FailedPreconditionError(what);
}

}  // namespace

absl::StatusOr<BackupStore::Kind> ParseBackupStoreKind(absl::string_view text) {
  if (text == "pinned") return BackupStore::Kind::kPinned;
  if (text == "pageable") return BackupStore::Kind::kPageable;
  if (text == "disk") return BackupStore::Kind::kDisk;
  if (text == "disk_files") return BackupStore::Kind::kDiskFiles;
  return absl::InvalidArgumentError(
      absl::StrCat("backup store '", text, "' is not one of pinned, pageable, disk, disk_files"));
}

absl::string_view BackupStoreKindName(BackupStore::Kind kind) {
  switch (kind) {
    case BackupStore::Kind::kPinned: return "pinned";
    case BackupStore::Kind::kPageable: return "pageable";
    case BackupStore::Kind::kDisk: return "disk";
    case BackupStore::Kind::kDiskFiles: return "disk_files";
  }
  return "?";
}

std::string DescribeBackupStore(const BackupStore& store) {
  if (!store.on_disk()) return std::string(BackupStoreKindName(store.kind));
  return absl::StrCat(BackupStoreKindName(store.kind), ":", store.directory);
}

absl::Status CheckBackupStore(const BackupStore& store, bool directory_must_exist) {
  if (!store.on_disk()) {
    if (store.directory.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("backup store ", BackupStoreKindName(store.kind),
                                                   " takes no directory (got '", store.directory, "')"));
  }
  if (store.directory.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("backup store ", BackupStoreKindName(store.kind),
                                                   " needs a directory"));
  }
  if (!directory_must_exist) return absl::OkStatus();
  struct stat st;
  if (stat(store.directory.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("disk backup directory '", store.directory, "': ", Errno(errno)));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::NotFoundError(absl::StrCat("disk backup directory '", store.directory, "' is not a directory"));
  }
  return absl::OkStatus();
}

BackupArena::~BackupArena() {
  absl::Status s = Release();
  if (s.ok()) return;
  // What was not given back stays held with nobody tracking it: so does its charge (Note
  // [Host Budget]), rather than the account undercounting.
  VMSTASH_LOG(kError, "vmstash: releasing {}: {}; its {} bytes stay charged to the host account", owner_,
              s.ToString(), charge_.bytes() + ring_charge_.bytes());
  charge_.Abandon();
  ring_charge_.Abandon();
}

BackupArena::Holding BackupArena::holding() const {
  return Holding{capacity_bytes_, held_bytes(), PinnedPrefixBytes(), ring_ != nullptr};
}

void BackupArena::AfterFailedPause(const Holding& before, bool give_back) {
  DropContents(give_back);
  if (ring_ != nullptr && !before.ring) {  // made by this pause
    absl::Status s = ReleaseRing();
    if (!s.ok()) VMSTASH_LOG(kError, "vmstash: {}: after a failed pause: {}", owner_, s.ToString());
  }
  if (store_.kind != BackupStore::Kind::kPinned || give_back) return;
  if (pinned_.resident_bytes() <= before.resident_bytes) {
    RefundPinned();  // charged for the whole layout, failed before its copies warmed any of it
    return;
  }
  // The pause warmed (and pinned) more than the arena held: all of it goes back, then what
  // was pinned ahead of the pause is pinned again (not when the pause replaced the arena).
  absl::Status s = pinned_.HandBack(/*lazily=*/true);
  RefundPinned();
  if (s.ok() && capacity_bytes_ == before.capacity_bytes && before.pinned_prefix_bytes > 0) {
    s = Pin(before.pinned_prefix_bytes);
  }
  if (!s.ok()) VMSTASH_LOG(kError, "vmstash: {}: giving back what a failed pause pinned: {}", owner_, s.ToString());
}

absl::Status BackupArena::Reserve(std::size_t size_bytes) {
  if (store_.kind == BackupStore::Kind::kDiskFiles) return absl::OkStatus();  // see ReserveLayout
  dropped_ = false;  // a pause writes it again
  if (size_bytes <= capacity_bytes_) return absl::OkStatus();
  if (size_bytes > std::numeric_limits<std::size_t>::max() - kUnit) {
    return absl::InvalidArgumentError(absl::StrCat("backup arena: ", size_bytes, " bytes is not a size"));
  }
  const std::size_t want = (size_bytes + kUnit - 1) / kUnit * kUnit;
  VMSTASH_RETURN_IF_ERROR(ReleaseStore());  // the staging ring stays
  switch (store_.kind) {
    case BackupStore::Kind::kPinned:
      VMSTASH_RETURN_IF_ERROR(pinned_.Reserve(want));
      break;
    case BackupStore::Kind::kPageable: {
      void* p = mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) {
        return absl::ResourceExhaustedError(
            absl::StrCat("backup arena: mmap of ", want, " bytes failed: ", Errno(errno)));
      }
      // Huge pages: a pause faults the pages in again after each resume gave them back,
      // and 2 MiB pages fault in (and go back) far faster than 4 KiB ones.
      madvise(p, want, MADV_HUGEPAGE);
      mapped_ = p;
      break;
    }
    case BackupStore::Kind::kDisk:
      VMSTASH_RETURN_IF_ERROR(ReserveDisk(want));
      break;
    case BackupStore::Kind::kDiskFiles:
      return absl::OkStatus();  // Note [Disk Backup Files]: nothing to make ahead
  }
  capacity_bytes_ = want;
  return absl::OkStatus();
}

absl::Status BackupArena::ReserveLayout(std::size_t size_bytes, const std::vector<std::size_t>& piece_bytes) {
  if (pool_backed() && TryLease(size_bytes)) return absl::OkStatus();  // Note [Pool-Backed Backups]
  if (store_.kind == BackupStore::Kind::kDiskFiles) {
    VMSTASH_RETURN_IF_ERROR(ReserveFiles(size_bytes, piece_bytes));
  } else {
    // Reserve maps address space only (a replaced arena's pages and charge go back first);
    // the pages are charged before the pause touches them (Note [Host Budget]). Huge
    // pages: touching the last byte may fault in up to 2 MiB past it (within capacity).
    VMSTASH_RETURN_IF_ERROR(Reserve(size_bytes));
    if (store_.kind == BackupStore::Kind::kPageable) {
      const std::size_t pages = std::min(capacity_bytes_, size_bytes + kUnit);
      VMSTASH_RETURN_IF_ERROR(charge_.Resize(std::max(charge_.bytes(), pages), owner_));
    }
  }
  if (store_.kind != BackupStore::Kind::kPinned) {
    // The ring after the arena's own charge: only room left over goes to it (a refused
    // ring never fails or spills a pause). Tried once per pause.
    ring_refused_ = false;
    TryRing();
    return absl::OkStatus();
  }
  VMSTASH_RETURN_IF_ERROR(ChargePinned(size_bytes));
  if (pinned_.pinned_prefix_bytes() > 0) {
    // Partly pinned (a preparation cut short): the copies into the pinned part run while
    // the first copy past it warms the rest (Note [Pinned Pieces], WarmAheadWithin). A
    // host that refuses those pages then fails the pause (ResourceExhausted, every tag as
    // it was) instead of spilling it to disk.
    pinned_.WarmAheadWithin(size_bytes);
    return absl::OkStatus();
  }
  // Nothing pinned, nothing to copy meanwhile: warmed here, before the device is touched,
  // so that a host refusing the pages spills the pause (TagPool::ReserveBackup).
  absl::Status warmed = pinned_.Warm(size_bytes);
  if (!warmed.ok()) RefundPinned();
  return warmed;
}

// Note [Host Budget]: the whole pieces holding [0, end) plus what is resident already,
// charged before anything is touched.
absl::Status BackupArena::ChargePinned(std::size_t end) {
  return charge_.Resize(pinned_.resident_bytes_with(std::min(end, capacity_bytes_)), owner_);
}

void BackupArena::RefundPinned() {
  (void)charge_.Resize(pinned_.resident_bytes(), owner_);  // a decrease: never refused
}

absl::Status BackupArena::Pin(std::size_t end) {
  if (store_.kind != BackupStore::Kind::kPinned || lease_.has_value()) return absl::OkStatus();
  VMSTASH_RETURN_IF_ERROR(ChargePinned(end));
  absl::Status s = pinned_.Warm(end);
  if (s.ok()) s = pinned_.Pin(0, end);
  if (!s.ok()) RefundPinned();
  return s;
}

absl::Status BackupArena::Warm(std::size_t end, const std::function<bool()>& stop) {
  if (store_.kind != BackupStore::Kind::kPinned || lease_.has_value()) return absl::OkStatus();
  VMSTASH_RETURN_IF_ERROR(ChargePinned(end));
  absl::Status s = pinned_.Warm(end, stop);
  RefundPinned();  // charged: what is resident (all of [0, end) unless it ended early or failed)
  return s;
}

std::size_t BackupArena::PinnedPrefixBytes() const {
  if (lease_.has_value()) return capacity_bytes_;
  return store_.kind == BackupStore::Kind::kPinned ? pinned_.pinned_prefix_bytes() : capacity_bytes_;
}

absl::Status BackupArena::CopyIn(std::size_t offset, DevicePtr src, std::size_t size_bytes, Stream stream) {
  if (lease_.has_value()) return LeasedCopy(/*to_host=*/true, offset, src, size_bytes, stream);
  if (store_.kind == BackupStore::Kind::kPinned) return pinned_.CopyIn(offset, src, size_bytes, stream);
  if (offset > capacity_bytes_ || size_bytes > capacity_bytes_ - offset) {
    return absl::InternalError(absl::StrCat("backup arena: a copy into bytes ", offset, "+", size_bytes,
                                            " outside its ", capacity_bytes_, " bytes"));
  }
  if (ring_ != nullptr) return ring_->ToHost(data() + offset, src, size_bytes, stream);
  return driver_->CopyToHostAsync(device_, data() + offset, src, size_bytes, stream);
}

void BackupArena::TryRing() {
  if (ring_ != nullptr || ring_refused_) return;
  absl::Status s = ring_charge_.Resize(StagingRing::kSlotBytes * StagingRing::kSlots,
                                       absl::StrCat(owner_, " (its staging ring)"));
  if (s.ok()) {
    ring_ = std::make_unique<StagingRing>(driver_, device_);
    s = ring_->Ready();
  }
  if (!s.ok()) {
    ring_.reset();
    ring_charge_.Reset();
    ring_refused_ = true;  // until the next pause
    VMSTASH_LOG(kInfo, "vmstash: {}: no staging ring, copies go through the driver directly: {}", owner_, s.ToString());
  }
}

absl::Status BackupArena::CopyOut(DevicePtr dst, std::size_t offset, std::size_t size_bytes, Stream stream) {
  if (lease_.has_value()) return LeasedCopy(/*to_host=*/false, offset, dst, size_bytes, stream);
  if (store_.kind == BackupStore::Kind::kPinned) return pinned_.CopyOut(dst, offset, size_bytes, stream);
  if (offset > capacity_bytes_ || size_bytes > capacity_bytes_ - offset) {
    return absl::InternalError(absl::StrCat("backup arena: a copy out of bytes ", offset, "+", size_bytes,
                                            " outside its ", capacity_bytes_, " bytes"));
  }
  TryRing();  // the arena may have been made before its store had a ring
  if (ring_ != nullptr) return ring_->ToDevice(dst, data() + offset, size_bytes, stream);
  return driver_->CopyToDeviceAsync(device_, dst, data() + offset, size_bytes, stream);
}

absl::Status BackupArena::GiveBackSome(std::size_t max_pinned_bytes, bool* more) {
  *more = false;
  if (lease_.has_value()) GiveLease();  // Note [Pool-Backed Backups]: no longer needed
  if (store_.kind != BackupStore::Kind::kPinned) return absl::OkStatus();
  absl::Status s = pinned_.HandBackSome(max_pinned_bytes, /*lazily=*/true, more);
  RefundPinned();
  return s;
}

absl::Status BackupArena::ReserveDisk(std::size_t want) {
  VMSTASH_RETURN_IF_ERROR(CheckBackupStore(store_));
  std::string path = absl::StrCat(store_.directory, "/vmstash-backup-", getpid(), "-XXXXXX");
  std::vector<char> name(path.begin(), path.end());
  name.push_back('\0');
  const int fd = mkostemp(name.data(), O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    std::string what = absl::StrCat("disk backup directory '", store_.directory, "': cannot create a file: ", Errno(err));
    if (err == ENOENT || err == ENOTDIR) return absl::NotFoundError(what);
    if (IsNoRoom(err)) return absl::ResourceExhaustedError(what);
    return absl::FailedPreconditionError(what);
  }
  unlink(name.data());  // Note [Disk Backup]: nothing is left behind
  const std::string file(name.data());
  if (const int err = GrowFileWithoutSignal(fd, static_cast<off_t>(want)); err != 0) {
    close(fd);
    std::string what = absl::StrCat("disk backup file '", file, "' (unlinked) has no room for ", want,
                                    " bytes: ", Errno(err), err == EFBIG ? FileSizeLimit() : "");
    return IsNoRoom(err) ? absl::ResourceExhaustedError(what) : absl::FailedPreconditionError(what);
  }
  void* p = mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return absl::ResourceExhaustedError(absl::StrCat("disk backup in '", store_.directory, "': mmap of ", want,
                                                     " bytes failed: ", Errno(err)));
  }
  fd_ = fd;
  mapped_ = p;
  path_ = file;
  return absl::OkStatus();
}

absl::Status BackupArena::Release() {
  absl::Status ring = ReleaseRing();  // nothing is queued on it any more (the owner waited for its copies)
  absl::Status store = ReleaseStore();
  return ring.ok() ? store : ring;
}

absl::Status BackupArena::ReleaseRing() {
  if (ring_ == nullptr) return absl::OkStatus();
  VMSTASH_RETURN_IF_ERROR(ring_->Free());  // refused: still held, still charged (Note [Host Budget])
  ring_.reset();
  ring_charge_.Reset();
  return absl::OkStatus();
}

absl::Status BackupArena::ReleaseStore() {
  if (store_.kind == BackupStore::Kind::kDiskFiles) return ReleaseFiles();
  if (lease_.has_value()) GiveLease();
  if (store_.kind == BackupStore::Kind::kPinned) {
    VMSTASH_RETURN_IF_ERROR(pinned_.Release());
  } else if (mapped_ != nullptr) {
    if (munmap(mapped_, capacity_bytes_) != 0) {
      return absl::InternalError(absl::StrCat("backup arena: munmap failed: ", Errno(errno)));
    }
    mapped_ = nullptr;
  }
  if (fd_ >= 0) {
    close(fd_);  // the file was unlinked at creation: its blocks are freed now
    fd_ = -1;
    path_.clear();
  }
  capacity_bytes_ = 0;
  charge_.Reset();  // Note [Host Budget]
  return absl::OkStatus();
}

absl::Status BackupArena::Seal() {
  if (ring_ != nullptr) VMSTASH_RETURN_IF_ERROR(ring_->Finish());  // Note [Staging Ring]
  if (store_.on_disk() && mapped_ != nullptr) {
    if (msync(mapped_, capacity_bytes_, MS_SYNC) != 0) {
      const int err = errno;
      std::string what = absl::StrCat(FileWhat(), ": writing ", capacity_bytes_, " bytes back failed: ", Errno(err));
      return IsNoRoom(err) ? absl::ResourceExhaustedError(what) : absl::DataLossError(what);
    }
    DropPages();
  }
  // Note [Host Budget]: a paused tag holds no ring (every slot is empty after Finish); the
  // resume's first CopyOut makes one again. A free the driver refuses keeps it, charged.
  if (absl::Status s = ReleaseRing(); !s.ok()) {
    VMSTASH_LOG(kWarning, "vmstash: {}: freeing its staging ring after the pause: {}", owner_, s.ToString());
  }
  ring_refused_ = false;
  return absl::OkStatus();
}

std::string BackupArena::FileWhat() const {
  if (store_.kind == BackupStore::Kind::kDisk) return absl::StrCat("disk backup file '", path_, "' (unlinked)");
  return absl::StrCat("disk backup files in '", store_.directory, "'");
}

// Note [Disk Backup]: every page of the file read in, or an error instead of a SIGBUS.
absl::Status BackupArena::Load(std::size_t offset, std::size_t size_bytes) {
  if (!store_.on_disk() || mapped_ == nullptr || size_bytes == 0) return absl::OkStatus();
  if (offset > capacity_bytes_ || size_bytes > capacity_bytes_ - offset) {
    return absl::InvalidArgumentError(absl::StrCat(FileWhat(), ": bytes ", offset, "+", size_bytes,
                                                   " lie outside its ", capacity_bytes_, " bytes"));
  }
  // Whole pages around the range (the mapping is page-aligned, its size a page multiple).
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::size_t begin = offset / page * page;
  const std::size_t end = std::min(capacity_bytes_, (offset + size_bytes + page - 1) / page * page);
  VMSTASH_RETURN_IF_ERROR(CheckFileSizes(begin, end));
  absl::Status status;
  if (madvise(static_cast<char*>(mapped_) + begin, end - begin, MADV_POPULATE_READ) != 0) {
    const int err = errno;
    if (err == EINVAL) {
      status = ReadFileThrough(begin, end);
    } else {
      status = absl::DataLossError(
          absl::StrCat(FileWhat(), ": reading ", end - begin, " bytes back failed: ", Errno(err)));
    }
  }
  if (!status.ok()) DropPages();
  return status;
}

absl::Status BackupArena::CheckFileSizes(std::size_t begin, std::size_t end) const {
  auto check = [&](int fd, const std::string& what, std::size_t expected) -> absl::Status {
    struct stat st;
    if (fstat(fd, &st) != 0) return absl::DataLossError(absl::StrCat(what, ": cannot stat it: ", Errno(errno)));
    if (static_cast<std::size_t>(st.st_size) < expected) {
      return absl::DataLossError(absl::StrCat(what, " is ", st.st_size, " bytes, ", expected,
                                              " expected: it was shortened while the tag was paused"));
    }
    return absl::OkStatus();
  };
  if (store_.kind == BackupStore::Kind::kDisk) return check(fd_, FileWhat(), capacity_bytes_);
  for (const File& f : files_) {
    if (f.offset >= end || f.offset + f.size_bytes <= begin) continue;
    VMSTASH_RETURN_IF_ERROR(check(f.fd, absl::StrCat("disk backup file '", f.path, "'"), f.size_bytes));
  }
  return absl::OkStatus();
}

absl::Status BackupArena::ReadFileThrough(std::size_t begin, std::size_t end) {
  constexpr std::size_t kStep = std::size_t{1} << 20;
  std::vector<char> buffer(kStep);
  // (fd, file offset of arena byte 0 of that file, the file's arena range, its name)
  auto read = [&](int fd, std::size_t file_begin, std::size_t from, std::size_t to,
                  const std::string& what) -> absl::Status {
    for (std::size_t at = from; at < to;) {
      const ssize_t n = pread(fd, buffer.data(), std::min(kStep, to - at), static_cast<off_t>(at - file_begin));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        return absl::DataLossError(absl::StrCat(what, ": reading at byte ", at - file_begin, " failed: ",
                                                n == 0 ? "end of file" : Errno(errno)));
      }
      at += static_cast<std::size_t>(n);
    }
    return absl::OkStatus();
  };
  if (store_.kind == BackupStore::Kind::kDisk) return read(fd_, 0, begin, end, FileWhat());
  for (const File& f : files_) {
    const std::size_t from = std::max(begin, f.offset), to = std::min(end, f.offset + f.size_bytes);
    if (from >= to) continue;
    VMSTASH_RETURN_IF_ERROR(read(f.fd, f.offset, from, to, absl::StrCat("disk backup file '", f.path, "'")));
  }
  return absl::OkStatus();
}

bool BackupArena::DropPages() {
  if (mapped_ == nullptr || store_.kind == BackupStore::Kind::kPinned) return true;
  // Disk stores: clean shared pages, dropping them loses nothing (the files have the bytes).
  const bool dropped = madvise(mapped_, capacity_bytes_, MADV_DONTNEED) == 0;
  if (store_.kind == BackupStore::Kind::kDisk) {
    posix_fadvise(fd_, 0, static_cast<off_t>(capacity_bytes_), POSIX_FADV_DONTNEED);
  } else if (store_.kind == BackupStore::Kind::kDiskFiles) {
    for (const File& f : files_) posix_fadvise(f.fd, 0, static_cast<off_t>(f.size_bytes), POSIX_FADV_DONTNEED);
  }
  return dropped;
}

void BackupArena::FreeRingAfterResume() {
  if (absl::Status s = ReleaseRing(); !s.ok()) {
    VMSTASH_LOG(kWarning, "vmstash: {}: freeing its staging ring after the resume: {}", owner_, s.ToString());
  }
  ring_refused_ = false;
}

void BackupArena::DropContents(bool give_back) {
  if (ring_ != nullptr) ring_->Abandon();  // a failed pause's bytes still in the ring
  if (lease_.has_value()) {  // Note [Pool-Backed Backups]: back to the pool, whatever give_back says
    GiveLease();
    return;
  }
  if (store_.kind == BackupStore::Kind::kPinned) {
    if (!give_back) return;
    absl::Status s = pinned_.HandBack(/*lazily=*/true);
    RefundPinned();
    if (!s.ok()) VMSTASH_LOG(kError, "vmstash: giving a backup arena's host memory back: {}", s.ToString());
    return;
  }
  if (store_.kind != BackupStore::Kind::kDiskFiles) {
    if (!DropPages()) {  // the pages stay, and their charge (Note [Host Budget])
      VMSTASH_LOG(kError, "vmstash: {}: giving its pages back failed: {}", owner_, Errno(errno));
      return;
    }
    dropped_ = true;
    if (store_.kind == BackupStore::Kind::kPageable) charge_.Reset();  // Note [Host Budget]
    return;
  }
  absl::Status s = ReleaseFiles();  // Note [Disk Backup Files]: removed once not needed
  if (!s.ok()) VMSTASH_LOG(kError, "vmstash: removing the disk backup files in '{}': {}", store_.directory, s.ToString());
}

bool BackupArena::TryLease(std::size_t size_bytes) {
  if (lease_.has_value() && lease_->bytes >= size_bytes) return true;
  if (lease_.has_value()) GiveLease();  // too small: a bigger one, or the own memory
  absl::StatusOr<HostLease> got = leases_->Take(device_, size_bytes, owner_);
  absl::Status s = got.status();
  if (s.ok() && (got->data == nullptr || got->bytes < size_bytes)) {
    leases_->Give(*got);
    s = absl::InternalError(absl::StrCat("a lease of ", got->bytes, " bytes for ", size_bytes, " asked"));
  }
  if (s.ok()) s = ReleaseStore();  // the own pinned memory (held from before the pool) goes back
  if (!s.ok()) {
    if (got.ok() && got->data != nullptr && got->bytes >= size_bytes) leases_->Give(*got);
    std::string why = s.ToString();
    constexpr const char* kFallback = "vmstash: {}: {} cannot hold its {} bytes ({}); this pause backs it up in "
                                      "the process's own pinned memory";
    if (why == last_refusal_) {  // said once at warning level; again only at info
      VMSTASH_LOG(kInfo, kFallback, owner_, leases_->Describe(), size_bytes, why);
    } else {
      VMSTASH_LOG(kWarning, kFallback, owner_, leases_->Describe(), size_bytes, why);
    }
    last_refusal_ = std::move(why);
    return false;
  }
  last_refusal_.clear();
  lease_ = *got;
  capacity_bytes_ = got->bytes;
  dropped_ = false;
  return true;
}

void BackupArena::GiveLease() {
  leases_->Give(*lease_);
  lease_.reset();
  capacity_bytes_ = 0;
}

absl::Status BackupArena::LeasedCopy(bool to_host, std::size_t offset, DevicePtr device_ptr, std::size_t size_bytes,
                                     Stream stream) {
  if (offset > capacity_bytes_ || size_bytes > capacity_bytes_ - offset) {
    return absl::InternalError(absl::StrCat("backup arena: a copy of bytes ", offset, "+", size_bytes,
                                            " outside its lease of ", capacity_bytes_, " bytes"));
  }
  char* host = lease_->data + offset;
  while (size_bytes > 0) {
    std::size_t step = size_bytes;
    if (lease_->segment_bytes > 0) {  // never across two registrations (host_lease.h)
      const auto into = static_cast<std::size_t>(host - lease_->segment_base) % lease_->segment_bytes;
      step = std::min(size_bytes, lease_->segment_bytes - into);
    }
    VMSTASH_RETURN_IF_ERROR(to_host ? driver_->CopyToHostAsync(device_, host, device_ptr, step, stream)
                                    : driver_->CopyToDeviceAsync(device_, device_ptr, host, step, stream));
    host += step;
    device_ptr += step;
    size_bytes -= step;
  }
  return absl::OkStatus();
}

std::vector<std::string> BackupArena::FilePaths() const {
  std::vector<std::string> out;
  for (const File& f : files_) out.push_back(f.path);
  return out;
}

// Note [Disk Backup Files]: one file per piece, mapped side by side into one range.
absl::Status BackupArena::ReserveFiles(std::size_t size_bytes, const std::vector<std::size_t>& piece_bytes) {
  VMSTASH_RETURN_IF_ERROR(ReleaseFiles());
  VMSTASH_RETURN_IF_ERROR(CheckBackupStore(store_));
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  std::size_t total = 0;
  for (std::size_t n : piece_bytes) {
    if (n == 0 || n % page != 0) {
      return absl::InternalError(absl::StrCat("disk backup files: a piece of ", n, " bytes is not a page multiple"));
    }
    total += n;
  }
  if (total != size_bytes || total == 0) {
    return absl::InternalError(absl::StrCat("disk backup files: pieces of ", total, " bytes for an arena of ",
                                            size_bytes));
  }
  SweepStaleFiles(store_.directory);
  void* base = mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("disk backup files: reserving ", total,
                                                     " bytes of address space failed: ", Errno(errno)));
  }
  mapped_ = base;
  capacity_bytes_ = total;
  const std::string prefix = absl::StrCat(store_.directory, "/", OwnFilePrefix());
  std::size_t offset = 0;
  for (std::size_t n : piece_bytes) {
    absl::Status made = AddFile(prefix, offset, n);
    if (!made.ok()) {
      absl::Status undo = ReleaseFiles();
      if (!undo.ok()) VMSTASH_LOG(kError, "vmstash: {}", undo.ToString());
      return made;
    }
    offset += n;
  }
  return absl::OkStatus();
}

absl::Status BackupArena::AddFile(const std::string& prefix, std::size_t offset, std::size_t size_bytes) {
  std::vector<char> name(prefix.begin(), prefix.end());
  const char suffix[] = "XXXXXX";
  name.insert(name.end(), suffix, suffix + sizeof(suffix));  // with the terminating NUL
  const int fd = mkostemp(name.data(), O_CLOEXEC);
  if (fd < 0) return CreateFileError(store_.directory, errno);
  File file{fd, std::string(name.data()), offset, size_bytes};
  NoteLiveFile(file.path, true);
  files_.push_back(file);  // from here on ReleaseFiles removes it
  if (const int err = GrowFileWithoutSignal(fd, static_cast<off_t>(size_bytes)); err != 0) {
    std::string what = absl::StrCat("disk backup file '", file.path, "' has no room for ", size_bytes, " bytes: ",
                                    Errno(err), err == EFBIG ? FileSizeLimit() : "");
    return IsNoRoom(err) ? absl::ResourceExhaustedError(what) : absl::FailedPreconditionError(what);
  }
  void* at = static_cast<char*>(mapped_) + offset;
  if (mmap(at, size_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("disk backup file '", file.path, "': mmap of ", size_bytes, " bytes failed: ", Errno(errno)));
  }
  return absl::OkStatus();
}

absl::Status BackupArena::ReleaseFiles() {
  absl::Status status;
  if (mapped_ != nullptr && munmap(mapped_, capacity_bytes_) != 0) {
    status = absl::InternalError(absl::StrCat("disk backup files: munmap failed: ", Errno(errno)));
  }
  mapped_ = nullptr;
  capacity_bytes_ = 0;
  for (const File& f : files_) {
    close(f.fd);
    if (unlink(f.path.c_str()) != 0 && errno != ENOENT && status.ok()) {
      status = absl::InternalError(absl::StrCat("disk backup file '", f.path, "': unlink failed: ", Errno(errno)));
    }
    NoteLiveFile(f.path, false);
  }
  files_.clear();
  return status;
}

}  // namespace vmstash
