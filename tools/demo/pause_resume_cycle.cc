#include "tools/demo/pause_resume_cycle.h"

#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/bytes.h"
#include "vmm/chunk.h"
#include "base/log.h"
#include "vmm/mapping.h"
#include "vmm/pinned_host_buffer.h"
#include "vmm/reservation.h"
#include "base/status_macros.h"

namespace vmstash {
namespace {


double MsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

std::uint64_t PatternWord(std::size_t i) { return 0x9e3779b97f4a7c15ull * (i + 1); }

// Owns a stream for the cycle; destroys it on every exit path.
class ScopedStream {
 public:
  ScopedStream(Driver& driver, int device) : driver_(driver), device_(device) {}
  ~ScopedStream() {
    absl::Status status = Destroy();
    if (!status.ok()) VMSTASH_LOG(kError, "demo stream not destroyed: {}", status.ToString());
  }
  absl::Status Create() {
    VMSTASH_ASSIGN_OR_RETURN(stream_, driver_.CreateStream(device_));
    return absl::OkStatus();
  }
  absl::Status Destroy() {
    if (stream_ != nullptr) VMSTASH_RETURN_IF_ERROR(driver_.DestroyStream(device_, stream_));
    stream_ = nullptr;
    return absl::OkStatus();
  }
  Stream get() const { return stream_; }

 private:
  Driver& driver_;
  int device_;
  Stream stream_ = nullptr;
};

// Waits for the stream's copies. If that wait fails, waits for the whole device before
// returning the error: the early return then destroys Mappings, and unmapping memory a
// copy may still touch would fault on a GPU.
absl::Status SyncOrDrain(Driver& driver, int device, Stream stream) {
  absl::Status s = driver.SynchronizeStream(device, stream);
  if (!s.ok()) (void)driver.SynchronizeDevice(device);
  return s;
}

}  // namespace

absl::StatusOr<CycleReport> RunPauseResumeCycle(Driver& driver, const CycleOptions& options) {
  const int dev = options.device;
  VMSTASH_ASSIGN_OR_RETURN(std::size_t g, driver.Granularity(dev, GranularityKind::kMinimum, {}));
  const std::size_t chunk_bytes = RoundUp(options.chunk_bytes == 0 ? g : options.chunk_bytes, g);
  const std::size_t size = RoundUp(options.size_bytes == 0 ? g : options.size_bytes, chunk_bytes);
  CycleReport report;
  report.size_bytes = size;

  VMSTASH_ASSIGN_OR_RETURN(Reservation reservation, Reservation::Create(&driver, dev, size));
  report.address = reservation.address();
  ScopedStream stream(driver, dev);
  VMSTASH_RETURN_IF_ERROR(stream.Create());
  VMSTASH_ASSIGN_OR_RETURN(PinnedHostBuffer staging, PinnedHostBuffer::Allocate(&driver, dev, size));
  VMSTASH_ASSIGN_OR_RETURN(PinnedHostBuffer backup, PinnedHostBuffer::Allocate(&driver, dev, size));

  std::vector<Chunk> chunks;
  for (std::size_t off = 0; off < size; off += chunk_bytes) {
    VMSTASH_ASSIGN_OR_RETURN(Chunk chunk, Chunk::Create(&driver, dev, chunk_bytes));
    chunks.push_back(std::move(chunk));
  }
  VMSTASH_ASSIGN_OR_RETURN(Mapping mapping, Mapping::Create(&driver, dev, report.address, chunks));
  report.chunks_before = mapping.pieces().size();

  auto* words = static_cast<std::uint64_t*>(staging.data());
  for (std::size_t i = 0; i < size / 8; ++i) words[i] = PatternWord(i);
  VMSTASH_RETURN_IF_ERROR(driver.CopyToDeviceAsync(dev, report.address, staging.data(), size, stream.get()));
  VMSTASH_RETURN_IF_ERROR(SyncOrDrain(driver, dev, stream.get()));
  VMSTASH_ASSIGN_OR_RETURN(DeviceMemoryInfo before, driver.MemoryInfo(dev));
  report.free_before_pause = before.free_bytes;

  // Pause with backup: copy out, and only once the copy is complete give the memory back.
  auto start = std::chrono::steady_clock::now();
  VMSTASH_RETURN_IF_ERROR(driver.CopyToHostAsync(dev, backup.data(), report.address, size, stream.get()));
  VMSTASH_RETURN_IF_ERROR(SyncOrDrain(driver, dev, stream.get()));
  VMSTASH_RETURN_IF_ERROR(mapping.Unmap());
  for (Chunk& chunk : chunks) VMSTASH_RETURN_IF_ERROR(chunk.Release());
  chunks.clear();
  report.pause_ms = MsSince(start);
  VMSTASH_ASSIGN_OR_RETURN(DeviceMemoryInfo paused, driver.MemoryInfo(dev));
  report.free_while_paused = paused.free_bytes;

  // Resume: one chunk for the whole run, mapped at the same address, then restore.
  start = std::chrono::steady_clock::now();
  VMSTASH_ASSIGN_OR_RETURN(Chunk whole, Chunk::Create(&driver, dev, size));
  chunks.push_back(std::move(whole));
  VMSTASH_ASSIGN_OR_RETURN(Mapping resumed, Mapping::Create(&driver, dev, report.address, chunks));
  VMSTASH_RETURN_IF_ERROR(driver.CopyToDeviceAsync(dev, report.address, backup.data(), size, stream.get()));
  VMSTASH_RETURN_IF_ERROR(SyncOrDrain(driver, dev, stream.get()));
  report.resume_ms = MsSince(start);
  report.chunks_after = resumed.pieces().size();
  VMSTASH_ASSIGN_OR_RETURN(DeviceMemoryInfo after, driver.MemoryInfo(dev));
  report.free_after_resume = after.free_bytes;

  // Verify through a fresh read of the device.
  std::memset(staging.data(), 0, size);
  VMSTASH_RETURN_IF_ERROR(driver.CopyToHostAsync(dev, staging.data(), report.address, size, stream.get()));
  VMSTASH_RETURN_IF_ERROR(SyncOrDrain(driver, dev, stream.get()));
  for (std::size_t i = 0; i < size / 8; ++i) {
    if (words[i] != PatternWord(i)) {
      return absl::DataLossError(absl::StrFormat("byte %d at %#x differs after resume: got %#x, want %#x", i * 8,
                                                 report.address + i * 8, words[i], PatternWord(i)));
    }
  }
  report.bytes_verified = size;
  // Explicit teardown, so a refused call is reported; the owners keep what was refused
  // and their destructors try again.
  VMSTASH_RETURN_IF_ERROR(resumed.Unmap());
  for (Chunk& chunk : chunks) VMSTASH_RETURN_IF_ERROR(chunk.Release());
  VMSTASH_RETURN_IF_ERROR(stream.Destroy());
  VMSTASH_RETURN_IF_ERROR(backup.Release());
  VMSTASH_RETURN_IF_ERROR(staging.Release());
  VMSTASH_RETURN_IF_ERROR(reservation.Free());
  return report;
}

std::string FormatCycleReport(absl::string_view driver_name, const CycleReport& r) {
  auto mib = [](std::size_t b) { return absl::StrFormat("%.1f MiB", b / 1048576.0); };
  auto gbps = [&](double ms) { return ms > 0 ? absl::StrFormat("%.1f GB/s", r.size_bytes / (ms * 1e6)) : "-"; };
  const std::size_t released = r.free_while_paused > r.free_before_pause ? r.free_while_paused - r.free_before_pause : 0;
  return absl::StrCat(
      "vmstash demo (", driver_name, " driver)\n",
      absl::StrFormat("  region    %s at %#x, %d chunk(s)\n", mib(r.size_bytes), r.address, r.chunks_before),
      absl::StrFormat("  pause     backup + unmap + release in %.2f ms (%s); device memory released: %s\n",
                      r.pause_ms, gbps(r.pause_ms), mib(released)),
      absl::StrFormat("  resume    %d chunk(s) mapped at %#x (same address), restored in %.2f ms (%s)\n",
                      r.chunks_after, r.address, r.resume_ms, gbps(r.resume_ms)),
      absl::StrFormat("  verified  %s identical after resume\n", mib(r.bytes_verified)),
      driver_name == "sim" ? "  note      simulated driver: its device memory is host memory, so these times are not "
                             "GPU figures\n"
                           : "");
}

}  // namespace vmstash
