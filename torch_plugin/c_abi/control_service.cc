// The control endpoint's handler over the C ABI: see control_service.h.
#include "torch_plugin/c_abi/control_service.h"

#include <unistd.h>

#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "allocator/json_writer.h"
#include "torch_plugin/c_abi/runtime_access.h"
#include "torch_plugin/include/vmstash/vmstash.h"
#include "vmm/log.h"

namespace vmstash {
namespace {

absl::StatusOr<std::string> TakeJson(char* json) {
  if (json == nullptr) return absl::InternalError(vmstash_last_error());
  std::string out(json);
  vmstash_string_free(json);
  return out;
}

std::string ProcessName() {
  std::ifstream comm("/proc/self/comm");
  std::string name;
  std::getline(comm, name);
  return name;
}

absl::StatusOr<std::string> Handle(const std::function<void(JsonWriter&)>& describe, const control::Request& r) {
  switch (r.op) {
    case control::Op::kHello: {
      JsonWriter w;
      w.BeginObject();
      w.Field("pid", static_cast<int>(::getpid()));
      w.Field("name", ProcessName());
      w.Field("version", vmstash_version());
      w.Field("protocol", control::kProtocolVersion);
      w.Field("uid", static_cast<std::int64_t>(::getuid()));
      if (describe) describe(w);
      w.EndObject();
      return w.str();
    }
    case control::Op::kStats:
    case control::Op::kTags:  // the per-tag part of stats: the CLI picks what it shows
    case control::Op::kSnapshot:
      // A remote request must not create an allocator (and a CUDA context) on a device
      // this process never used (pause/resume never do: vmstash_pause/resume).
      if (r.device >= 0 && !c_abi::DeviceInUse(r.device)) {
        return absl::NotFoundError(absl::StrCat("process ", ::getpid(), " does not use device ", r.device));
      }
      return TakeJson(r.op == control::Op::kSnapshot ? vmstash_snapshot_json(r.device)
                                                     : vmstash_stats_json(r.device));
    case control::Op::kPause:
    case control::Op::kResume: {
      const int code = r.op == control::Op::kPause ? vmstash_pause(r.tag.c_str(), r.device)
                                                   : vmstash_resume(r.tag.c_str(), r.device);
      if (code != VMSTASH_OK && code != VMSTASH_NOOP) {
        return absl::Status(static_cast<absl::StatusCode>(code), vmstash_last_error());
      }
      return std::string(code == VMSTASH_OK ? R"({"changed":true})" : R"({"changed":false})");
    }
  }
  return absl::InvalidArgumentError("unknown op");
}

}  // namespace

std::unique_ptr<control::ControlServer> StartControlService(std::function<void(JsonWriter&)> describe) {
  absl::StatusOr<std::unique_ptr<control::ControlServer>> server = control::ControlServer::Start(
      control::ServerOptions{}, [describe](const control::Request& r) { return Handle(describe, r); });
  if (!server.ok()) {
    VMSTASH_LOG(kWarning, "vmstash: control endpoint not started ({}); the CLI cannot see this process",
                server.status().ToString());
    return nullptr;
  }
  VMSTASH_LOG(kDebug, "vmstash: control endpoint at {}", (*server)->socket_path());
  return *std::move(server);
}

}  // namespace vmstash
