// vmstash_trace_replay: replays an allocation trace on vmstash's caching allocator and
// prints peak allocated, peak reserved and their ratio.
//   vmstash_trace_replay FILE.csv
//   vmstash_trace_replay --generate SEED STEPS LAYERS SCALE_MIB [--write FILE.csv]
// The driver comes from VMSTASH_CONF / VMSTASH_DRIVER (GPU if present, else simulator).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "allocator/caching_allocator.h"
#include "tests/replay/caching_allocator_target.h"
#include "tests/replay/trace.h"
#include "vmm/driver_factory.h"
#include "runtime/runtime_options.h"

namespace vmstash {
namespace {

int Run(int argc, char** argv) {
  std::vector<TraceOp> ops;
  std::string write;
  if (argc >= 6 && std::string(argv[1]) == "--generate") {
    ops = GenerateTrainingTrace(std::strtoull(argv[2], nullptr, 10), std::atoi(argv[3]), std::atoi(argv[4]),
                                std::strtoull(argv[5], nullptr, 10) << 20);
    if (argc == 8 && std::string(argv[6]) == "--write") write = argv[7];
  } else if (argc == 2) {
    std::ifstream in(argv[1]);
    if (!in.good()) {
      std::fprintf(stderr, "vmstash_trace_replay: cannot read %s\n", argv[1]);
      return 2;
    }
    std::stringstream text;
    text << in.rdbuf();
    absl::StatusOr<std::vector<TraceOp>> parsed = ParseTraceCsv(text.str());
    if (!parsed.ok()) {
      std::fprintf(stderr, "vmstash_trace_replay: %s\n", parsed.status().ToString().c_str());
      return 2;
    }
    ops = *std::move(parsed);
  } else {
    std::fprintf(stderr, "usage: vmstash_trace_replay FILE.csv | --generate SEED STEPS LAYERS SCALE_MIB [--write F]\n");
    return 2;
  }
  if (!write.empty()) std::ofstream(write) << TraceToCsv(ops);
  absl::StatusOr<RuntimeOptions> options = RuntimeOptionsFromEnvironment();
  if (!options.ok()) {
    std::fprintf(stderr, "vmstash_trace_replay: %s\n", options.status().ToString().c_str());
    return 2;
  }
  absl::StatusOr<std::unique_ptr<Driver>> driver = CreateDriver(options->vmm);
  if (!driver.ok()) {
    std::fprintf(stderr, "vmstash_trace_replay: %s\n", driver.status().ToString().c_str());
    return 1;
  }
  auto alloc = CachingAllocator::Create(driver->get(), 0, options->allocator);
  if (!alloc.ok()) {
    std::fprintf(stderr, "vmstash_trace_replay: %s\n", alloc.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<ReplayResult> r;
  {
    CachingAllocatorTarget target(alloc->get());
    r = Replay(ops, target);
  }
  if (!r.ok()) {
    std::fprintf(stderr, "vmstash_trace_replay: %s\n", r.status().ToString().c_str());
    return 1;
  }
  std::printf("{\"driver\":\"%s\",\"operations\":%llu,\"peak_allocated_bytes\":%llu,\"peak_reserved_bytes\":%llu,"
              "\"ratio\":%.4f,\"seconds\":%.3f}\n",
              std::string((*driver)->Name()).c_str(), static_cast<unsigned long long>(r->operations),
              static_cast<unsigned long long>(r->peak_allocated_bytes),
              static_cast<unsigned long long>(r->peak_reserved_bytes), r->ratio(), r->seconds);
  return 0;
}

}  // namespace
}  // namespace vmstash

int main(int argc, char** argv) { return vmstash::Run(argc, argv); }
