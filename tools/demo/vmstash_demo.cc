// vmstash_demo: reserve, map, write, pause with backup, resume at the same address and
// verify - on the GPU when one is usable, else on the simulated driver.
//
//   vmstash_demo [--size=256M] [--chunk=32M] [--device=0] [--serve[=SECONDS]]
//   VMSTASH_DRIVER=sim|cuda|auto, VMSTASH_CONF="..." (see runtime/runtime_options.h)
// --serve: afterwards, keep running as a process that uses the vmstash process runtime
// (tag "weights", backup, 64 MiB; tag "kv_cache", discard, 128 MiB) and serves the control
// endpoint, so the `vmstash` CLI can be tried anywhere; until SIGINT/SIGTERM or SECONDS.
// On the way out it checks that the weights survived whatever pauses/resumes came in.
// Exit status: 0 on success, 1 on any failure (with the reason on stderr), 2 on bad usage.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "control/endpoint.h"
#include "tools/demo/pause_resume_cycle.h"
#include "base/conf.h"
#include "runtime/process.h"
#include "runtime/runtime.h"
#include "runtime/runtime_options.h"
#include "vmm/driver_factory.h"

namespace {

int Usage(const char* why) {
  std::fprintf(stderr,
               "vmstash_demo: %s\nusage: vmstash_demo [--size=SIZE] [--chunk=SIZE] [--device=N] [--serve[=SECONDS]]\n",
               why);
  return 2;
}

volatile sig_atomic_t stop = 0;
void OnSignal(int) { stop = 1; }

void Report(const absl::Status& s) { std::fprintf(stderr, "vmstash_demo: %s\n", s.ToString().c_str()); }

// Two tagged allocations on the process runtime (runtime/process.h), serving its control
// endpoint until a signal or the time is up; then the weights must be intact once resumed.
int Serve(int device, int seconds) {
  vmstash::process::Call call;
  absl::StatusOr<vmstash::Runtime*> rt = call.runtime();
  if (!rt.ok()) return Report(rt.status()), 1;
  absl::StatusOr<vmstash::TagId> weights_tag = vmstash::InternTag("weights");
  absl::StatusOr<vmstash::TagId> kv_tag = vmstash::InternTag("kv_cache");
  absl::StatusOr<vmstash::CachingAllocator*> a = (*rt)->Allocator(device);
  if (!a.ok()) return Report(a.status()), 1;
  for (absl::Status s : {(*rt)->CreateTag(*weights_tag, vmstash::Policy::kBackup),
                         (*rt)->CreateTag(*kv_tag, vmstash::Policy::kDiscard)}) {
    if (!s.ok()) return Report(s), 1;
  }
  const size_t weights_bytes = size_t{64} << 20, kv_bytes = size_t{128} << 20;
  absl::StatusOr<vmstash::DevicePtr> weights = (*a)->Allocate(weights_bytes, vmstash::Stream{}, *weights_tag);
  absl::StatusOr<vmstash::DevicePtr> kv = (*a)->Allocate(kv_bytes, vmstash::Stream{}, *kv_tag);
  if (!weights.ok() || !kv.ok()) return Report(weights.ok() ? kv.status() : weights.status()), 1;
  // A pattern the demo can check at the end: through the simulator's host-visible memory,
  // or nothing to check on a GPU (no kernels here).
  const bool host_visible = (*rt)->driver().Name() == "sim";
  char* w = reinterpret_cast<char*>(*weights);
  if (host_visible) std::memset(w, 0x5a, weights_bytes);
  signal(SIGINT, OnSignal);
  signal(SIGTERM, OnSignal);
  std::printf("vmstash_demo: pid %d serving %s/%d.sock (tags weights, kv_cache)\n", static_cast<int>(getpid()),
              vmstash::control::DefaultRuntimeDir().c_str(), static_cast<int>(getpid()));
  std::fflush(stdout);
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(seconds > 0 ? seconds : 1 << 30);
  while (!stop && std::chrono::steady_clock::now() < end) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // Whatever came in, the weights must be readable and intact once resumed.
  if (absl::StatusOr<bool> r = (*rt)->Resume(*weights_tag, vmstash::Runtime::kAllDevices); !r.ok()) Report(r.status());
  bool intact = true;
  if (host_visible) {
    for (size_t i = 0; i < weights_bytes; i += 4096) intact = intact && w[i] == 0x5a;
  }
  std::printf("vmstash_demo: stopping; weights %s\n", intact ? "intact" : "CORRUPTED");
  (void)(*a)->Free(*weights);
  (void)(*rt)->Resume(*kv_tag, vmstash::Runtime::kAllDevices);
  (void)(*a)->Free(*kv);
  return intact ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  vmstash::CycleOptions cycle;
  int serve_seconds = -1;  // -1: no --serve
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (absl::StartsWith(arg, "--size=") || absl::StartsWith(arg, "--chunk=")) {
      bool is_size = absl::StartsWith(arg, "--size=");
      absl::StatusOr<std::uint64_t> v = vmstash::ParseSize(arg.substr(arg.find('=') + 1));
      if (!v.ok() || *v == 0) return Usage(std::string(v.ok() ? "size must be > 0" : v.status().message()).c_str());
      (is_size ? cycle.size_bytes : cycle.chunk_bytes) = *v;
    } else if (arg == "--serve") {
      serve_seconds = 0;
    } else if (absl::StartsWith(arg, "--serve=")) {
      if (!absl::SimpleAtoi(arg.substr(8), &serve_seconds) || serve_seconds <= 0) return Usage("bad --serve");
    } else if (absl::StartsWith(arg, "--device=")) {
      if (!absl::SimpleAtoi(arg.substr(9), &cycle.device) || cycle.device < 0) return Usage("bad --device");
    } else {
      return Usage(("unknown argument " + std::string(arg)).c_str());
    }
  }
  absl::StatusOr<vmstash::RuntimeOptions> options = vmstash::RuntimeOptionsFromEnvironment();
  if (!options.ok()) {
    std::fprintf(stderr, "vmstash_demo: %s\n", options.status().ToString().c_str());
    return 1;
  }
  vmstash::SetLogLevel(options->vmm.log_level);
  absl::StatusOr<std::unique_ptr<vmstash::Driver>> driver = vmstash::CreateDriver(options->vmm);
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
  std::fflush(stdout);
  return serve_seconds >= 0 ? Serve(cycle.device, serve_seconds) : 0;
}
