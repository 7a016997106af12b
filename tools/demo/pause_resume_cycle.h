// One pause/resume cycle on the bare vmm primitives: the foundation's end-to-end check and
// the body of the `vmstash_demo` program.
//
//   reserve VA -> create chunks -> map -> write a pattern (H2D) -> pause with backup
//   (D2H into pinned memory, unmap, release: device memory goes back) -> resume (one
//   fresh chunk for the whole run, map at the SAME address, H2D) -> verify (D2H).
//
// Every driver failure is returned as its status with nothing leaked (the RAII types
// unwind); tools/demo/pause_resume_cycle_test.cc injects a failure at every driver call.
#ifndef VMSTASH_TOOLS_DEMO_PAUSE_RESUME_CYCLE_H_
#define VMSTASH_TOOLS_DEMO_PAUSE_RESUME_CYCLE_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "vmm/driver.h"

namespace vmstash {

struct CycleOptions {
  int device = 0;
  std::size_t size_bytes = std::size_t{256} << 20;  // rounded up to the granularity
  std::size_t chunk_bytes = std::size_t{32} << 20;  // ditto
};

struct CycleReport {
  DevicePtr address = 0;          // where the data lived before and after
  std::size_t size_bytes = 0;
  std::size_t chunks_before = 0;  // chunks mapped before the pause
  std::size_t chunks_after = 0;   // chunks mapped after the resume
  std::size_t free_before_pause = 0;
  std::size_t free_while_paused = 0;
  std::size_t free_after_resume = 0;
  double pause_ms = 0;
  double resume_ms = 0;
  std::size_t bytes_verified = 0;
};

absl::StatusOr<CycleReport> RunPauseResumeCycle(Driver& driver, const CycleOptions& options);
std::string FormatCycleReport(absl::string_view driver_name, const CycleReport& report);

}  // namespace vmstash

#endif  // VMSTASH_TOOLS_DEMO_PAUSE_RESUME_CYCLE_H_
