// The operations of the Driver interface as data: an enum with stable snake_case names,
// per-operation call counters, and fault-injection rules ("fail the Nth call of op X with
// error E"). Both drivers count their calls here; SimDriver also consults FaultRules.
//
// Thread-safety: OpCounters is lock-free (relaxed atomics); snapshots are not atomic
// across operations, which is fine for statistics and tests.
#ifndef VMSTASH_VMM_DRIVER_OP_H_
#define VMSTASH_VMM_DRIVER_OP_H_

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace vmstash {

enum class DriverOp : int {
  kDeviceCount,
  kGranularity,
  kMemoryInfo,
  kDeviceUuid,
  kReserveAddress,
  kFreeAddress,
  kCreateChunk,
  kReleaseChunk,
  kExportChunkFd,
  kImportChunkFd,
  kMap,
  kUnmap,
  kSetAccess,
  kHostAlloc,
  kHostFree,
  kHostRegister,
  kHostUnregister,
  kCreateStream,
  kDestroyStream,
  kCreateEvent,
  kDestroyEvent,
  kRecordEvent,
  kQueryEvent,
  kSynchronizeEvent,
  kElapsedTime,
  kStreamWaitEvent,
  kSynchronizeStream,
  kSynchronizeDevice,
  kCopyToHost,
  kCopyToDevice,
  kCopyDevice,
  kMemset,
  kCreateIpcEvent,
  kExportIpcEvent,
  kOpenIpcEvent,
  kNumOps,  // not an operation
};

inline constexpr int kNumDriverOps = static_cast<int>(DriverOp::kNumOps);

// "create_chunk" for DriverOp::kCreateChunk.
absl::string_view DriverOpName(DriverOp op);
// Inverse of DriverOpName; InvalidArgument naming `name` and listing the valid names.
absl::StatusOr<DriverOp> DriverOpFromName(absl::string_view name);

// A snapshot of a driver's counters.
struct DriverCounters {
  std::array<std::uint64_t, kNumDriverOps> calls{};  // attempts, failed ones included
  std::uint64_t failed_calls = 0;
  std::uint64_t bytes_to_host = 0;    // completed or queued copy bytes, device -> host
  std::uint64_t bytes_to_device = 0;  // host -> device
  std::uint64_t chunk_bytes_created = 0;

  std::uint64_t Calls(DriverOp op) const { return calls[static_cast<int>(op)]; }
};

class OpCounters {
 public:
  // Counts one call of `op`; returns the number of calls of `op` so far, this one included.
  std::uint64_t Count(DriverOp op) {
    return calls_[static_cast<int>(op)].fetch_add(1, std::memory_order_relaxed) + 1;
  }
  void CountFailure() { failed_.fetch_add(1, std::memory_order_relaxed); }
  void AddBytesToHost(std::size_t n) { to_host_.fetch_add(n, std::memory_order_relaxed); }
  void AddBytesToDevice(std::size_t n) { to_device_.fetch_add(n, std::memory_order_relaxed); }
  void AddChunkBytes(std::size_t n) { chunk_bytes_.fetch_add(n, std::memory_order_relaxed); }
  DriverCounters Snapshot() const;

 private:
  std::array<std::atomic<std::uint64_t>, kNumDriverOps> calls_{};
  std::atomic<std::uint64_t> failed_{0};
  std::atomic<std::uint64_t> to_host_{0};
  std::atomic<std::uint64_t> to_device_{0};
  std::atomic<std::uint64_t> chunk_bytes_{0};
};

// Fail calls number nth .. nth+count-1 (1-based, counted per operation) of `op` with `code`.
struct FaultRule {
  DriverOp op = DriverOp::kCreateChunk;
  int nth = 1;
  int count = 1;
  absl::StatusCode code = absl::StatusCode::kInternal;

  friend bool operator==(const FaultRule& a, const FaultRule& b) {
    return a.op == b.op && a.nth == b.nth && a.count == b.count && a.code == b.code;
  }
};

// Parses "create_chunk@3=resource_exhausted+map@2x4=internal" (rules joined by '+',
// optional "xCOUNT"). Codes: resource_exhausted (or oom), invalid_argument, internal,
// unimplemented, failed_precondition, unavailable. Errors name the offending text.
absl::StatusOr<std::vector<FaultRule>> ParseFaultRules(absl::string_view text);
std::string FaultRulesToString(const std::vector<FaultRule>& rules);

}  // namespace vmstash

#endif  // VMSTASH_VMM_DRIVER_OP_H_
