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
#include "node/chunk_trade.h"
#include "node/switch_vote.h"
#include "node/wire.h"

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

// The chunks of a node switch traded through the node daemon (Note [Node Switch
// Handover], node/node_switch.h; allocator/switch_exchange.h).
class NodeExchange final : public SwitchExchange {
 public:
  // `deadline`: Take waits no longer; `settle_deadline`: AwaitTakers waits no longer.
  NodeExchange(std::string dir, std::string txn, std::chrono::steady_clock::time_point deadline,
               std::chrono::steady_clock::time_point settle_deadline)
      : settle_deadline_(settle_deadline) {
    options_.dir = std::move(dir);
    options_.txn = std::move(txn);
    options_.deadline = deadline;
  }
  absl::Status Offer(const std::string& device, std::vector<SharedChunk> chunks) override {
    node::TradeOptions o = options_;
    o.device = device;
    std::vector<node::TradedChunk> traded;
    for (SharedChunk& c : chunks) traded.push_back({c.fd, c.size_bytes, {c.anywhere, std::move(c.wait_event)}});
    return node::OfferChunks(o, std::move(traded)).status();
  }
  absl::Status AwaitTakers() override {
    node::TradeOptions o = options_;
    o.deadline = settle_deadline_;
    return node::AwaitTakers(o);
  }
  absl::StatusOr<std::vector<SharedChunk>> Take(const std::string& device, const std::vector<FitGap>& gaps) override {
    node::TradeOptions o = options_;
    o.device = device;
    o.gaps = gaps;
    VMSTASH_ASSIGN_OR_RETURN(std::vector<node::TradedChunk> traded, node::TakeChunks(o));
    std::vector<SharedChunk> chunks;
    for (node::TradedChunk& c : traded) chunks.push_back({c.fd, c.size_bytes, c.use.anywhere, std::move(c.use.wait_event)});
    return chunks;
  }
  std::size_t MaxGaps() const override { return node::kMaxTakeGaps; }

 private:
  node::TradeOptions options_;
  const std::chrono::steady_clock::time_point settle_deadline_;
};

// This process's part of a node switch (node/node_switch.h, Note [Node Switch]): an
// agreed switch (Note [Agreed Switch]) whose agreement is the vote to the node daemon,
// trading chunks with the other parts (Note [Node Switch Handover]).
absl::StatusOr<std::string> NodeSwitchPart(Runtime& runtime, const control::Request& r) {
  node::VoteOptions vote;
  vote.dir = runtime.node().dir();
  vote.txn = r.txn;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(r.timeout_ms);
  vote.hard_deadline = deadline + std::chrono::milliseconds(node::kVoteGraceMs);
  const CachingAllocator::SwitchAgree agree = [&vote](const absl::Status& local) {
    return node::VoteAndWait(vote, local);
  };
  // A giver's rollback waits for its takers' votes until their own last deadline (a taker
  // silent by then is hung, or lost the daemon): within the initiator's wait for answers.
  // A taker waits for the offers half the timeout at most, then goes on with fresh memory:
  // a donor that hangs is then the one process named for not voting in time.
  const auto take_deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(r.timeout_ms / 2);
  NodeExchange exchange(vote.dir, r.txn, take_deadline, vote.hard_deadline);
  std::vector<TagId> pause, resume;  // a name unknown here is this process's vote too
  for (const auto* names : {&r.pause, &r.resume}) {
    for (const std::string& t : *names) {
      absl::StatusOr<TagId> id = FindTag(t);
      if (!id.ok()) return agree(id.status());
      (names == &r.pause ? pause : resume).push_back(*id);
    }
  }
  VMSTASH_ASSIGN_OR_RETURN(const bool changed, runtime.AgreedSwitch(pause, resume, r.device, nullptr, agree, &exchange));
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
