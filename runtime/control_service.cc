// The control service: see control_service.h.
#include "runtime/control_service.h"

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "base/json_writer.h"
#include "base/status_macros.h"
#include "base/version.h"
#include "node/switch_vote.h"

namespace vmstash {
namespace {

std::string ProcessName() {
  std::ifstream comm("/proc/self/comm");
  std::string name;
  std::getline(comm, name);
  return name;
}

std::string Hello(const Runtime& runtime) {
  JsonWriter w;
  w.BeginObject();
  w.Field("pid", static_cast<int>(::getpid()));
  w.Field("name", ProcessName());
  w.Field("version", kVersion);
  w.Field("protocol", control::kProtocolVersion);
  w.Field("uid", static_cast<std::int64_t>(::getuid()));
  runtime.Describe(w);
  w.EndObject();
  return w.str();
}

// This process's part of a node switch (node/node_switch.h, Note [Node Switch]): an
// agreed switch (Note [Agreed Switch]) whose agreement is the vote to the node daemon.
absl::StatusOr<std::string> NodeSwitchPart(Runtime& runtime, const control::Request& r) {
  node::VoteOptions vote;
  vote.dir = runtime.node().dir();
  vote.txn = r.txn;
  vote.hard_deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(r.timeout_ms) +
                       std::chrono::milliseconds(node::kVoteGraceMs);
  const CachingAllocator::SwitchAgree agree = [&vote](const absl::Status& local) {
    return node::VoteAndWait(vote, local);
  };
  std::vector<TagId> pause, resume;  // a name unknown here is this process's vote too
  for (const auto* names : {&r.pause, &r.resume}) {
    for (const std::string& t : *names) {
      absl::StatusOr<TagId> id = FindTag(t);
      if (!id.ok()) return agree(id.status());
      (names == &r.pause ? pause : resume).push_back(*id);
    }
  }
  VMSTASH_ASSIGN_OR_RETURN(const bool changed, runtime.AgreedSwitch(pause, resume, r.device, nullptr, agree));
  return std::string(changed ? R"({"changed":true})" : R"({"changed":false})");
}

}  // namespace

absl::StatusOr<std::string> HandleControlRequest(Runtime& runtime, const control::Request& r) {
  switch (r.op) {
    case control::Op::kHello:
      return Hello(runtime);
    case control::Op::kStats:
    case control::Op::kTags:  // the per-tag part of stats: the CLI picks what it shows
    case control::Op::kSnapshot:
      if (r.device >= 0 && runtime.AllocatorInUse(r.device) == nullptr) {
        return absl::NotFoundError(absl::StrCat("process ", ::getpid(), " does not use device ", r.device));
      }
      return r.op == control::Op::kSnapshot ? runtime.SnapshotJson(r.device) : runtime.StatsJson(r.device);
    case control::Op::kPause:
    case control::Op::kResume: {
      VMSTASH_ASSIGN_OR_RETURN(const TagId tag, FindTag(r.tag));
      VMSTASH_ASSIGN_OR_RETURN(const bool changed, r.op == control::Op::kPause ? runtime.Pause(tag, r.device)
                                                                               : runtime.Resume(tag, r.device));
      return std::string(changed ? R"({"changed":true})" : R"({"changed":false})");
    }
    case control::Op::kSwitch: {
      if (!r.txn.empty()) return NodeSwitchPart(runtime, r);
      std::vector<TagId> pause, resume;
      for (const std::string& t : r.pause) {
        VMSTASH_ASSIGN_OR_RETURN(const TagId id, FindTag(t));
        pause.push_back(id);
      }
      for (const std::string& t : r.resume) {
        VMSTASH_ASSIGN_OR_RETURN(const TagId id, FindTag(t));
        resume.push_back(id);
      }
      VMSTASH_ASSIGN_OR_RETURN(const bool changed, runtime.Switch(pause, resume, r.device));
      return std::string(changed ? R"({"changed":true})" : R"({"changed":false})");
    }
  }
  return absl::InvalidArgumentError("unknown op");
}

}  // namespace vmstash
