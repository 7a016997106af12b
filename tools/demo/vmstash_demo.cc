// vmstash_demo: reserve, map, write, pause with backup, resume at the same address and
// verify - on the GPU when one is usable, else on the simulated driver.
//
//   vmstash_demo [--size=256M] [--chunk=32M] [--device=0]
//   VMSTASH_DRIVER=sim|cuda|auto, VMSTASH_CONF="..." (see vmm/options.h)
// Exit status: 0 on success, 1 on any failure (with the reason on stderr), 2 on bad usage.
#include <cstdio>
#include <cstring>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "tools/demo/pause_resume_cycle.h"
#include "vmm/driver_factory.h"
#include "vmm/options.h"

namespace {

int Usage(const char* why) {
  std::fprintf(stderr, "vmstash_demo: %s\nusage: vmstash_demo [--size=SIZE] [--chunk=SIZE] [--device=N]\n", why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  vmstash::CycleOptions cycle;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (absl::StartsWith(arg, "--size=") || absl::StartsWith(arg, "--chunk=")) {
      bool is_size = absl::StartsWith(arg, "--size=");
      absl::StatusOr<std::uint64_t> v = vmstash::ParseSize(arg.substr(arg.find('=') + 1));
      if (!v.ok() || *v == 0) return Usage(std::string(v.ok() ? "size must be > 0" : v.status().message()).c_str());
      (is_size ? cycle.size_bytes : cycle.chunk_bytes) = *v;
    } else if (absl::StartsWith(arg, "--device=")) {
      if (!absl::SimpleAtoi(arg.substr(9), &cycle.device) || cycle.device < 0) return Usage("bad --device");
    } else {
      return Usage(("unknown argument " + std::string(arg)).c_str());
    }
  }
  absl::StatusOr<vmstash::Options> options = vmstash::OptionsFromEnvironment();
  if (!options.ok()) {
    std::fprintf(stderr, "vmstash_demo: %s\n", options.status().ToString().c_str());
    return 1;
  }
  vmstash::SetLogLevel(options->log_level);
  absl::StatusOr<std::unique_ptr<vmstash::Driver>> driver = vmstash::CreateDriver(*options);
  if (!driver.ok()) {
    std::fprintf(stderr, "vmstash_demo: no driver: %s\n", driver.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<vmstash::CycleReport> report = vmstash::RunPauseResumeCycle(**driver, cycle);
  if (!report.ok()) {
    std::fprintf(stderr, "vmstash_demo: FAILED: %s\n", report.status().ToString().c_str());
    return 1;
  }
  std::fputs(vmstash::FormatCycleReport((*driver)->Name(), *report).c_str(), stdout);
  absl::Status leaks = (*driver)->CheckNoLeaks();
  if (!leaks.ok()) {
    std::fprintf(stderr, "vmstash_demo: %s\n", leaks.ToString().c_str());
    return 1;
  }
  std::puts("  OK");
  return 0;
}
