#include "vmm/sim_driver.h"


#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <new>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/bytes.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "vmm/sim_ipc_names.h"

namespace vmstash {
namespace {

struct SimStream {
  int device;
};

// What an interprocess event shares between processes: the layout of its POSIX
// shared-memory object, mapped by the exporter and by every process that opened it.
struct SimIpcShared {
  std::uint64_t magic;
  std::atomic<std::uint64_t> records;  // the exporter's RecordEvent calls so far
  std::int64_t exporter_pid;           // the exporter: its process and SimDriver there
  std::uint64_t exporter_instance;
};
static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "the count is shared between processes");

constexpr std::uint64_t kIpcSharedMagic = 0x31766573696d7376;  // "vsmisev1"

struct SimEvent {
  int device;
  bool timing;
  bool recorded = false;
  std::chrono::steady_clock::time_point at{};
  // Set while the event was recorded on a held stream (guarded by SimDriver::hold_mu_):
  // the event completes when that hold (generation) ends.
  Stream held_stream = nullptr;
  std::uint64_t hold_generation = 0;
  std::uint64_t seq = 0;  // in-flight work of held_stream up to seq is done when this is
  // Interprocess events only: the shared state (mapped), the name of its shared-memory
  // object, and whether this is another's event opened here (OpenIpcEvent) rather than
  // the exporter's own (CreateIpcEvent), which unlinks the name when destroyed.
  SimIpcShared* ipc = nullptr;
  std::string ipc_name{};
  bool opened = false;
};

SimEvent* AsSimEvent(Event event) { return reinterpret_cast<SimEvent*>(event); }

void DeleteSimEvent(SimEvent* e) {
  if (e->ipc != nullptr) {
    ::munmap(e->ipc, sizeof(SimIpcShared));
    if (!e->opened) ::shm_unlink(e->ipc_name.c_str());
  }
  delete e;
}

absl::Status ErrnoStatus(const char* call, int err) {
  std::string message = absl::StrCat("sim: ", call, " failed: ", std::strerror(err));
  if (err == ENOMEM || err == EMFILE || err == ENFILE || err == ENOSPC) {
    return absl::ResourceExhaustedError(message);
  }
  return absl::InternalError(message);
}

void* AsHostPtr(DevicePtr va) { return reinterpret_cast<void*>(static_cast<std::uintptr_t>(va)); }

std::uint64_t NextSimDriverInstance() {
  static std::atomic<std::uint64_t> next{0};
  return ++next;
}

}  // namespace

SimDriverOptions SimDriverOptions::FromOptions(const VmmOptions& options) {
  SimDriverOptions out;
  out.devices = options.sim_devices;
  out.capacity_bytes = options.sim_capacity_bytes;
  out.granularity_bytes = options.sim_granularity_bytes;
  out.faults = options.sim_faults;
  return out;
}

SimDriver::SimDriver(SimDriverOptions options)
    : options_(std::move(options)),
      instance_(NextSimDriverInstance()),
      used_bytes_(new std::atomic<std::size_t>[options_.devices]) {
  for (int d = 0; d < options_.devices; ++d) used_bytes_[d].store(0);
  for (const FaultRule& rule : options_.faults) InjectFault(rule);
}

SimDriver::~SimDriver() {
  absl::Status leaks = ledger_.CheckNoLeaks();
  if (!leaks.ok()) VMSTASH_LOG(kWarning, "SimDriver destroyed with live objects: {}", leaks.message());
  // Like a context teardown: streams and events left alive are freed with the driver.
  for (Stream s : ledger_.TakeAllStreams()) delete reinterpret_cast<SimStream*>(s);
  for (Event e : ledger_.TakeAllEvents()) DeleteSimEvent(AsSimEvent(e));
}

void SimDriver::InjectFault(FaultRule rule) {
  MutexLock lock(&fault_mu_);
  faults_.push_back(ArmedRule{rule, counters_.Snapshot().Calls(rule.op)});
}

void SimDriver::ClearFaults() {
  MutexLock lock(&fault_mu_);
  faults_.clear();
}

std::size_t SimDriver::UsedBytes(int device) const {
  return (device >= 0 && device < options_.devices) ? used_bytes_[device].load() : 0;
}

absl::Status SimDriver::Enter(DriverOp op) {
  if (has_before_call_.load(std::memory_order_acquire)) {
    std::function<void(DriverOp)> before;
    {
      MutexLock lock(&hook_mu_);
      before = before_call_;
    }
    if (before) before(op);
  }
  std::uint64_t n = counters_.Count(op);
  MutexLock lock(&fault_mu_);
  for (const ArmedRule& armed : faults_) {
    if (armed.rule.op != op) continue;
    std::uint64_t k = n - armed.base;
    if (k >= static_cast<std::uint64_t>(armed.rule.nth) &&
        k < static_cast<std::uint64_t>(armed.rule.nth) + static_cast<std::uint64_t>(armed.rule.count)) {
      counters_.CountFailure();
      return absl::Status(armed.rule.code,
                          absl::StrCat("sim: injected failure of ", DriverOpName(op), " (call ", k, ")"));
    }
  }
  return absl::OkStatus();
}

void SimDriver::FreeChunkMemory(const ChunkRecord& record) {
  if (record.physical == 0) return;  // imported from another process: its memory, not ours
  MutexLock lock(&physical_mu_);
  auto it = physical_.find(record.physical);
  if (it == physical_.end() || --it->second.holders > 0) return;  // an import of it (or the chunk) still holds it
  used_bytes_[it->second.device].fetch_sub(it->second.size_bytes);
  physical_.erase(it);
}

absl::StatusOr<int> SimDriver::DeviceCount() {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kDeviceCount));
  return options_.devices;
}

absl::StatusOr<std::size_t> SimDriver::Granularity(int device, GranularityKind kind, ChunkOptions options) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kGranularity));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  return options_.granularity_bytes;
}

absl::StatusOr<std::string> SimDriver::DeviceUuid(int device) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kDeviceUuid));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  return absl::StrCat("sim-", device);
}

absl::StatusOr<DeviceMemoryInfo> SimDriver::MemoryInfo(int device) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kMemoryInfo));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  std::size_t used = used_bytes_[device].load();
  return DeviceMemoryInfo{options_.capacity_bytes - std::min(used, options_.capacity_bytes),
                          options_.capacity_bytes};
}

absl::StatusOr<DevicePtr> SimDriver::ReserveAddress(int device, std::size_t size_bytes,
                                                    std::size_t alignment_bytes) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kReserveAddress));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  const std::size_t g = options_.granularity_bytes;
  VMSTASH_RETURN_IF_ERROR(CheckGranularSize("ReserveAddress", size_bytes, g));
  std::size_t align = alignment_bytes == 0 ? g : alignment_bytes;
  if ((align & (align - 1)) != 0 || align % g != 0) {
    return absl::InvalidArgumentError(absl::StrCat("ReserveAddress: alignment ", alignment_bytes,
                                                   " is not a power-of-two multiple of the granularity ", g));
  }
  if (size_bytes > (std::size_t{1} << 46)) {
    return absl::ResourceExhaustedError(absl::StrCat("sim: ReserveAddress of ", size_bytes, " bytes: too large"));
  }
  const std::size_t span = size_bytes + align;
  void* raw = ::mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return ErrnoStatus("mmap(reserve)", errno);
  auto base = reinterpret_cast<std::uintptr_t>(raw);
  std::uintptr_t aligned = (base + align - 1) & ~(std::uintptr_t{align} - 1);
  if (aligned > base) ::munmap(raw, aligned - base);
  std::uintptr_t tail = base + span - (aligned + size_bytes);
  if (tail > 0) ::munmap(reinterpret_cast<void*>(aligned + size_bytes), tail);
  absl::Status recorded = ledger_.AddReservation(aligned, size_bytes);
  if (!recorded.ok()) {
    ::munmap(reinterpret_cast<void*>(aligned), size_bytes);
    return recorded;
  }
  return static_cast<DevicePtr>(aligned);
}

absl::Status SimDriver::FreeAddress(int device, DevicePtr va, std::size_t size_bytes) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kFreeAddress));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  VMSTASH_RETURN_IF_ERROR(ledger_.TakeReservation(va, size_bytes));
  if (::munmap(AsHostPtr(va), size_bytes) != 0) {
    int err = errno;
    (void)ledger_.AddReservation(va, size_bytes);
    return ErrnoStatus("munmap(reservation)", err);
  }
  return absl::OkStatus();
}

absl::StatusOr<ChunkHandle> SimDriver::CreateChunk(int device, std::size_t size_bytes, ChunkOptions options) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kCreateChunk));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  VMSTASH_RETURN_IF_ERROR(CheckGranularSize("CreateChunk", size_bytes, options_.granularity_bytes));
  std::atomic<std::size_t>& used = used_bytes_[device];
  std::size_t before = used.load();
  do {
    if (size_bytes > options_.capacity_bytes - std::min(before, options_.capacity_bytes)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "sim: CreateChunk of ", size_bytes, " bytes on device ", device, ": out of memory (",
          options_.capacity_bytes - std::min(before, options_.capacity_bytes), " of ",
          options_.capacity_bytes, " bytes free)"));
    }
  } while (!used.compare_exchange_weak(before, before + size_bytes));
  int fd = ::memfd_create("vmstash-sim-chunk", MFD_CLOEXEC);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(size_bytes)) != 0) {
    int err = errno;
    if (fd >= 0) ::close(fd);
    used.fetch_sub(size_bytes);
    return ErrnoStatus("memfd_create/ftruncate", err);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    used.fetch_sub(size_bytes);
    return ErrnoStatus("fstat(memfd)", err);
  }
  ChunkHandle handle = next_chunk_.fetch_add(1);
  ChunkRecord record;
  record.device = device;
  record.size_bytes = size_bytes;
  record.options = options;
  record.backend = fd;
  record.physical = static_cast<std::uint64_t>(st.st_ino);
  {
    MutexLock lock(&physical_mu_);
    physical_[record.physical] = Physical{device, size_bytes, 1};
  }
  ledger_.AddChunk(handle, record);
  counters_.AddChunkBytes(size_bytes);
  return handle;
}

absl::Status SimDriver::ReleaseChunk(ChunkHandle chunk) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kReleaseChunk));
  VMSTASH_ASSIGN_OR_RETURN(auto released, ledger_.ReleaseChunk(chunk));
  // Mappings hold their own reference to the memfd; the handle's descriptor goes now.
  ::close(static_cast<int>(released.first.backend));
  if (released.second) FreeChunkMemory(released.first);
  return absl::OkStatus();
}

absl::StatusOr<int> SimDriver::ExportChunkFd(ChunkHandle chunk) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kExportChunkFd));
  VMSTASH_ASSIGN_OR_RETURN(ChunkRecord record, ledger_.GetChunk(chunk));
  if (!record.options.shareable_fd) {
    return absl::FailedPreconditionError(
        absl::StrCat("ExportChunkFd: chunk ", Hex(chunk), " was created without shareable_fd"));
  }
  int fd = ::fcntl(static_cast<int>(record.backend), F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus("fcntl(F_DUPFD_CLOEXEC)", errno);
  return fd;
}

absl::StatusOr<ChunkHandle> SimDriver::ImportChunkFd(int device, int fd, std::size_t size_bytes) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kImportChunkFd));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  VMSTASH_RETURN_IF_ERROR(CheckGranularSize("ImportChunkFd", size_bytes, options_.granularity_bytes));
  if (fd < 0) return absl::InvalidArgumentError(absl::StrCat("ImportChunkFd: descriptor ", fd));
  // An exported chunk of the simulator is its memfd: a shared-memory file (the only kind
  // F_GET_SEALS accepts) open for reading and writing, of at least the chunk's size.
  struct stat st;
  const int mode = ::fcntl(fd, F_GETFL);
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || static_cast<std::size_t>(st.st_size) < size_bytes ||
      ::fcntl(fd, F_GET_SEALS) < 0 || mode < 0 || (mode & O_ACCMODE) != O_RDWR) {
    return absl::InvalidArgumentError(absl::StrCat("ImportChunkFd: descriptor ", fd, " is not an exported chunk of ",
                                                   size_bytes, " bytes"));
  }
  const int own = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0) return ErrnoStatus("fcntl(F_DUPFD_CLOEXEC)", errno);
  ChunkHandle handle = next_chunk_.fetch_add(1);
  ChunkRecord record;
  record.device = device;
  record.size_bytes = size_bytes;
  record.options.shareable_fd = true;
  record.backend = own;
  record.imported = true;
  {
    // A chunk of this driver imported back: its memory is held until this handle goes too.
    MutexLock lock(&physical_mu_);
    auto it = physical_.find(static_cast<std::uint64_t>(st.st_ino));
    if (it != physical_.end()) {
      ++it->second.holders;
      record.physical = it->first;
    }
  }
  ledger_.AddChunk(handle, record);
  return handle;
}

absl::Status SimDriver::Map(DevicePtr va, std::size_t size_bytes, ChunkHandle chunk) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kMap));
  VMSTASH_RETURN_IF_ERROR(CheckGranularSize("Map", size_bytes, options_.granularity_bytes));
  VMSTASH_ASSIGN_OR_RETURN(ChunkRecord record, ledger_.ClaimMap(va, size_bytes, chunk, options_.granularity_bytes));
  void* got = ::mmap(AsHostPtr(va), size_bytes, PROT_NONE, MAP_SHARED | MAP_FIXED,
                     static_cast<int>(record.backend), 0);
  if (got == MAP_FAILED) {
    int err = errno;
    ledger_.AbortMap(va);
    return ErrnoStatus("mmap(map)", err);
  }
  return absl::OkStatus();
}

absl::Status SimDriver::Unmap(int device, DevicePtr va, std::size_t size_bytes) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kUnmap));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  VMSTASH_ASSIGN_OR_RETURN(MappingRecord mapping, ledger_.ClaimUnmap(va, size_bytes));
  {
    MutexLock lock(&hold_mu_);
    for (const auto& [key, work] : in_flight_) {
      if (key.first != device) continue;
      for (const InFlight& f : work) {
        if (f.va < va + size_bytes && va < f.va + f.size_bytes) {
          ordering_violations_.push_back(absl::StrCat("Unmap(", Hex(va), ", ", size_bytes, ") while ",
                                                      f.size_bytes, " bytes at ", Hex(f.va),
                                                      " are in flight on stream ", Hex(reinterpret_cast<std::uintptr_t>(key.second))));
          break;
        }
      }
    }
  }
  void* got = ::mmap(AsHostPtr(va), size_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
                     -1, 0);
  if (got == MAP_FAILED) {
    int err = errno;
    ledger_.AbortUnmap(mapping);
    return ErrnoStatus("mmap(unmap)", err);
  }
  auto [gone, record] = ledger_.CommitUnmap(mapping);
  if (gone) FreeChunkMemory(record);
  return absl::OkStatus();
}

absl::Status SimDriver::SetAccess(DevicePtr va, std::size_t size_bytes, int device) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kSetAccess));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  VMSTASH_RETURN_IF_ERROR(CheckGranularSize("SetAccess", size_bytes, options_.granularity_bytes));
  VMSTASH_RETURN_IF_ERROR(ledger_.CheckMapped(va, size_bytes));
  if (::mprotect(AsHostPtr(va), size_bytes, PROT_READ | PROT_WRITE) != 0) return ErrnoStatus("mprotect", errno);
  return ledger_.GrantAccess(va, size_bytes, device);
}

absl::StatusOr<void*> SimDriver::HostAlloc(int device, std::size_t size_bytes) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kHostAlloc));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  if (size_bytes == 0) return absl::InvalidArgumentError("HostAlloc: size 0 is not allowed");
  void* p = ::mmap(nullptr, size_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return ErrnoStatus("mmap(host)", errno);
  ledger_.AddHostAlloc(p, size_bytes);
  return p;
}

absl::Status SimDriver::HostFree(int device, void* ptr) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kHostFree));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  VMSTASH_ASSIGN_OR_RETURN(std::size_t size, ledger_.TakeHostAlloc(ptr));
  ::munmap(ptr, size);
  return absl::OkStatus();
}

absl::Status SimDriver::HostRegister(int device, void* ptr, std::size_t size_bytes) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kHostRegister));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  if (ptr == nullptr || size_bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat("HostRegister: bad range (", Hex(reinterpret_cast<std::uintptr_t>(ptr)), ", ", size_bytes, ")"));
  }
  return ledger_.AddHostRegistration(ptr, size_bytes);
}

absl::Status SimDriver::HostUnregister(int device, void* ptr) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kHostUnregister));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  return ledger_.TakeHostRegistration(ptr).status();
}

absl::StatusOr<Stream> SimDriver::CreateStream(int device) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kCreateStream));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  Stream stream = reinterpret_cast<Stream>(new SimStream{device});
  ledger_.AddStream(stream, device);
  return stream;
}

absl::Status SimDriver::DestroyStream(int device, Stream stream) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kDestroyStream));
  VMSTASH_RETURN_IF_ERROR(ledger_.TakeStream(stream, device));
  delete reinterpret_cast<SimStream*>(stream);
  return absl::OkStatus();
}

absl::StatusOr<Event> SimDriver::CreateEvent(int device, bool timing) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kCreateEvent));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  Event event = reinterpret_cast<Event>(new SimEvent{device, timing});
  ledger_.AddEvent(event, device);
  return event;
}

absl::Status SimDriver::DestroyEvent(int device, Event event) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kDestroyEvent));
  VMSTASH_RETURN_IF_ERROR(ledger_.TakeEvent(event, device));
  DeleteSimEvent(AsSimEvent(event));
  return absl::OkStatus();
}

absl::Status SimDriver::RecordEvent(int device, Event event, Stream stream) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kRecordEvent));
  VMSTASH_RETURN_IF_ERROR(ledger_.CheckEvent(event, device));
  VMSTASH_RETURN_IF_ERROR(ledger_.CheckStream(stream, device));
  SimEvent* e = AsSimEvent(event);
  if (e->opened) {
    return absl::InvalidArgumentError(absl::StrCat("RecordEvent: event ", Hex(reinterpret_cast<std::uintptr_t>(event)),
                                                   " was opened from another's handle (OpenIpcEvent): only its "
                                                   "exporter records it"));
  }
  e->recorded = true;
  e->at = std::chrono::steady_clock::now();
  {
    MutexLock lock(&hold_mu_);
    auto it = held_.find({device, stream});
    e->held_stream = stream;
    e->hold_generation = it == held_.end() ? 0 : it->second;
    e->seq = seq_;
  }
  // Released: what this process did before the record is visible to an opener that sees it.
  if (e->ipc != nullptr) e->ipc->records.fetch_add(1, std::memory_order_release);
  return absl::OkStatus();
}

void SimDriver::NoteInFlight(int device, Stream stream, DevicePtr va, std::size_t size_bytes) {
  if (size_bytes == 0) return;
  MutexLock lock(&hold_mu_);
  in_flight_[{device, stream}].push_back({va, size_bytes, ++seq_});
}

void SimDriver::Synchronized(int device, Stream stream, std::uint64_t up_to_seq) {
  auto it = in_flight_.find({device, stream});
  if (it == in_flight_.end()) return;
  auto& v = it->second;
  v.erase(std::remove_if(v.begin(), v.end(), [&](const InFlight& f) { return f.seq <= up_to_seq; }), v.end());
  if (v.empty()) in_flight_.erase(it);
}

absl::Status SimDriver::CheckNoLeaks() const {
  VMSTASH_RETURN_IF_ERROR(ledger_.CheckNoLeaks());
  return CheckOrdering();
}

absl::Status SimDriver::CheckOrdering() const {
  MutexLock lock(&hold_mu_);
  if (ordering_violations_.empty()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("sim: ", ordering_violations_.size(),
                                          " unmap(s) of memory with unsynchronized async work; first: ",
                                          ordering_violations_.front()));
}

void SimDriver::HoldStream(int device, Stream stream) {
  MutexLock lock(&hold_mu_);
  held_.try_emplace({device, stream}, ++hold_generation_);
}

void SimDriver::ReleaseStream(int device, Stream stream) {
  MutexLock lock(&hold_mu_);
  held_.erase({device, stream});
}

bool SimDriver::StreamHeld(int device, Stream stream) const {
  MutexLock lock(&hold_mu_);
  return held_.contains({device, stream});
}

void SimDriver::SetBeforeCall(std::function<void(DriverOp op)> fn) {
  MutexLock lock(&hook_mu_);
  has_before_call_.store(fn != nullptr, std::memory_order_release);
  before_call_ = std::move(fn);
}

void SimDriver::SetAfterSynchronizeDevice(std::function<void(int device)> fn) {
  MutexLock lock(&hook_mu_);
  after_sync_ = std::move(fn);
}

bool SimDriver::EventPending(int device, const void* event_ptr) const {
  const SimEvent* e = static_cast<const SimEvent*>(event_ptr);
  if (e->hold_generation == 0) return false;
  auto it = held_.find({device, e->held_stream});
  return it != held_.end() && it->second == e->hold_generation;
}

absl::StatusOr<bool> SimDriver::QueryEvent(int device, Event event) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kQueryEvent));
  VMSTASH_RETURN_IF_ERROR(ledger_.CheckEvent(event, device));
  // Eager execution: recorded work is complete, unless it was recorded on a held stream.
  MutexLock lock(&hold_mu_);
  if (EventPending(device, event)) return false;
  Synchronized(device, AsSimEvent(event)->held_stream, AsSimEvent(event)->seq);
  return true;
}

absl::Status SimDriver::SynchronizeEvent(int device, Event event) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kSynchronizeEvent));
  VMSTASH_RETURN_IF_ERROR(ledger_.CheckEvent(event, device));
  // Waiting lets the held work finish: the hold that kept the event pending ends.
  MutexLock lock(&hold_mu_);
  if (EventPending(device, event)) held_.erase({device, AsSimEvent(event)->held_stream});
  Synchronized(device, AsSimEvent(event)->held_stream, AsSimEvent(event)->seq);
  return absl::OkStatus();
}

absl::StatusOr<float> SimDriver::ElapsedMs(int device, Event start, Event end) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kElapsedTime));
  VMSTASH_RETURN_IF_ERROR(ledger_.CheckEvent(start, device));
  VMSTASH_RETURN_IF_ERROR(ledger_.CheckEvent(end, device));
  SimEvent* a = AsSimEvent(start);
  SimEvent* b = AsSimEvent(end);
  if (!a->timing || !b->timing) return absl::InvalidArgumentError("ElapsedMs: events were created without timing");
  if (!a->recorded || !b->recorded) return absl::FailedPreconditionError("ElapsedMs: event not recorded");
  return std::chrono::duration<float, std::milli>(b->at - a->at).count();
}

absl::Status SimDriver::StreamWaitEvent(int device, Stream stream, Event event) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kStreamWaitEvent));
  VMSTASH_RETURN_IF_ERROR(ledger_.CheckStream(stream, device));
  VMSTASH_RETURN_IF_ERROR(ledger_.CheckEvent(event, device));
  // On a GPU such a wait passes at once, ordering nothing: the handle crossed before the
  // record it was meant to carry (Driver::OpenIpcEvent). The simulator refuses it.
  const SimEvent* e = AsSimEvent(event);
  if (e->opened && e->ipc->records.load(std::memory_order_acquire) == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "StreamWaitEvent: stream ", Hex(reinterpret_cast<std::uintptr_t>(stream)), " on device ", device,
        " waits for an interprocess event that was never recorded: the wait orders nothing (",
        e->ipc_name, "; send an event's handle only after its RecordEvent)"));
  }
  return absl::OkStatus();
}

absl::Status SimDriver::SynchronizeStream(int device, Stream stream) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kSynchronizeStream));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  VMSTASH_RETURN_IF_ERROR(ledger_.CheckStream(stream, device));
  ReleaseStream(device, stream);
  MutexLock lock(&hold_mu_);
  in_flight_.erase({device, stream});
  return absl::OkStatus();
}

absl::Status SimDriver::SynchronizeDevice(int device) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kSynchronizeDevice));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  {
    MutexLock lock(&hold_mu_);
    for (auto it = held_.begin(); it != held_.end();) {
      if (it->first.first == device) held_.erase(it++);
      else ++it;
    }
    for (auto it = in_flight_.begin(); it != in_flight_.end();) {
      if (it->first.first == device) in_flight_.erase(it++);
      else ++it;
    }
  }
  std::function<void(int)> after;
  {
    MutexLock lock(&hook_mu_);
    after = after_sync_;
  }
  if (after) after(device);
  return absl::OkStatus();
}

absl::StatusOr<Event> SimDriver::CreateIpcEvent(int device) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kCreateIpcEvent));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  static std::once_flag swept;
  std::call_once(swept, SweepDeadSimIpcNames);
  std::string name;
  int fd = -1;
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {  // EEXIST: a name left behind; take another
    name = NewSimIpcName();
    fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST) return ErrnoStatus("shm_open(ipc event)", errno);
  }
  if (fd < 0) return ErrnoStatus("shm_open(ipc event)", EEXIST);
  void* mapped = MAP_FAILED;
  int err = 0;
  if (::ftruncate(fd, sizeof(SimIpcShared)) != 0) {
    err = errno;
  } else {
    mapped = ::mmap(nullptr, sizeof(SimIpcShared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (mapped == MAP_FAILED) err = errno;
  }
  ::close(fd);  // the mapping holds the object
  if (mapped == MAP_FAILED) {
    ::shm_unlink(name.c_str());
    return ErrnoStatus("ftruncate/mmap(ipc event)", err);
  }
  auto* shared = new (mapped) SimIpcShared{kIpcSharedMagic, {0}, ::getpid(), instance_};
  auto* e = new SimEvent{device, /*timing=*/false};
  e->ipc = shared;
  e->ipc_name = std::move(name);
  Event event = reinterpret_cast<Event>(e);
  ledger_.AddEvent(event, device);
  return event;
}

absl::StatusOr<std::string> SimDriver::ExportIpcEvent(int device, Event event) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kExportIpcEvent));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  VMSTASH_RETURN_IF_ERROR(ledger_.CheckEvent(event, device));
  const SimEvent* e = AsSimEvent(event);
  if (e->ipc == nullptr || e->opened) {
    return absl::InvalidArgumentError(absl::StrCat("ExportIpcEvent: event ", Hex(reinterpret_cast<std::uintptr_t>(event)),
                                                   " on device ", device, " was not made by CreateIpcEvent",
                                                   e->opened ? " (it was opened from another's handle)" : ""));
  }
  return SimIpcHandle(e->ipc_name);
}

absl::StatusOr<Event> SimDriver::OpenIpcEvent(int device, const std::string& handle) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kOpenIpcEvent));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  VMSTASH_ASSIGN_OR_RETURN(const std::string path, SimIpcNameOf(handle));
  const int fd = ::shm_open(path.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    const int err = errno;
    if (err == EMFILE || err == ENFILE || err == ENOMEM) return ErrnoStatus("shm_open(ipc event)", err);
    return absl::InvalidArgumentError(absl::StrCat("OpenIpcEvent: no interprocess event ", path,
                                                   " (its exporter destroyed it?): ", std::strerror(err)));
  }
  struct stat st;
  void* mapped = MAP_FAILED;
  int err = 0;
  if (::fstat(fd, &st) == 0 && static_cast<std::size_t>(st.st_size) >= sizeof(SimIpcShared)) {
    mapped = ::mmap(nullptr, sizeof(SimIpcShared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (mapped == MAP_FAILED) err = errno;
  }
  ::close(fd);
  if (mapped == MAP_FAILED && err != 0) return ErrnoStatus("mmap(ipc event)", err);
  auto* shared = static_cast<SimIpcShared*>(mapped);
  if (mapped == MAP_FAILED || shared->magic != kIpcSharedMagic) {
    if (mapped != MAP_FAILED) ::munmap(mapped, sizeof(SimIpcShared));
    return absl::InvalidArgumentError(absl::StrCat("OpenIpcEvent: ", path, " is not an interprocess event"));
  }
  if (shared->exporter_pid == ::getpid() && shared->exporter_instance == instance_) {
    ::munmap(mapped, sizeof(SimIpcShared));
    return absl::FailedPreconditionError(absl::StrCat(
        "OpenIpcEvent: ", path, " was exported by this driver: an interprocess event opens in another process "
        "only (CUDA: CUDA_ERROR_INVALID_CONTEXT); wait for the event itself here"));
  }
  auto* e = new SimEvent{device, /*timing=*/false};
  e->ipc = shared;
  e->ipc_name = path;
  e->opened = true;
  Event event = reinterpret_cast<Event>(e);
  ledger_.AddEvent(event, device);
  return event;
}

absl::Status SimDriver::CopyToHostAsync(int device, void* dst, DevicePtr src, std::size_t size_bytes,
                                        Stream stream) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kCopyToHost));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  VMSTASH_RETURN_IF_ERROR(ledger_.CheckStream(stream, device));
  if (dst == nullptr && size_bytes != 0) return absl::InvalidArgumentError("CopyToHostAsync: null destination");
  VMSTASH_RETURN_IF_ERROR(ledger_.CheckHostCopy(dst, size_bytes));
  absl::Status ok = ledger_.CheckAccessible(src, size_bytes, device);
  if (!ok.ok()) return absl::InvalidArgumentError(absl::StrCat("CopyToHostAsync: source ", ok.message()));
  std::memcpy(dst, AsHostPtr(src), size_bytes);
  NoteInFlight(device, stream, src, size_bytes);
  counters_.AddBytesToHost(size_bytes);
  return absl::OkStatus();
}

absl::Status SimDriver::CopyToDeviceAsync(int device, DevicePtr dst, const void* src, std::size_t size_bytes,
                                          Stream stream) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kCopyToDevice));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  VMSTASH_RETURN_IF_ERROR(ledger_.CheckStream(stream, device));
  if (src == nullptr && size_bytes != 0) return absl::InvalidArgumentError("CopyToDeviceAsync: null source");
  VMSTASH_RETURN_IF_ERROR(ledger_.CheckHostCopy(src, size_bytes));
  absl::Status ok = ledger_.CheckAccessible(dst, size_bytes, device);
  if (!ok.ok()) return absl::InvalidArgumentError(absl::StrCat("CopyToDeviceAsync: destination ", ok.message()));
  std::memcpy(AsHostPtr(dst), src, size_bytes);
  NoteInFlight(device, stream, dst, size_bytes);
  counters_.AddBytesToDevice(size_bytes);
  return absl::OkStatus();
}

absl::Status SimDriver::CopyDeviceAsync(int device, DevicePtr dst, DevicePtr src, std::size_t size_bytes,
                                        Stream stream) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kCopyDevice));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  VMSTASH_RETURN_IF_ERROR(ledger_.CheckStream(stream, device));
  absl::Status ok = ledger_.CheckAccessible(src, size_bytes, device);
  if (!ok.ok()) return absl::InvalidArgumentError(absl::StrCat("CopyDeviceAsync: source ", ok.message()));
  ok = ledger_.CheckAccessible(dst, size_bytes, device);
  if (!ok.ok()) return absl::InvalidArgumentError(absl::StrCat("CopyDeviceAsync: destination ", ok.message()));
  std::memmove(AsHostPtr(dst), AsHostPtr(src), size_bytes);
  NoteInFlight(device, stream, src, size_bytes);
  NoteInFlight(device, stream, dst, size_bytes);
  return absl::OkStatus();
}

absl::Status SimDriver::MemsetAsync(int device, DevicePtr dst, std::uint8_t value, std::size_t size_bytes,
                                    Stream stream) {
  VMSTASH_RETURN_IF_ERROR(Enter(DriverOp::kMemset));
  VMSTASH_RETURN_IF_ERROR(CheckDevice(device));
  VMSTASH_RETURN_IF_ERROR(ledger_.CheckStream(stream, device));
  absl::Status ok = ledger_.CheckAccessible(dst, size_bytes, device);
  if (!ok.ok()) return absl::InvalidArgumentError(absl::StrCat("MemsetAsync: destination ", ok.message()));
  std::memset(AsHostPtr(dst), value, size_bytes);
  NoteInFlight(device, stream, dst, size_bytes);
  return absl::OkStatus();
}

}  // namespace vmstash
