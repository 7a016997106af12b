#include "vmm/driver_op.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace vmstash {
namespace {

constexpr std::array<absl::string_view, kNumDriverOps> kOpNames = {
    "device_count",     "granularity",       "memory_info",       "device_uuid",       "reserve_address",
    "free_address",     "create_chunk",      "release_chunk",     "export_chunk_fd",
    "import_chunk_fd",
    "map",              "unmap",             "set_access",        "host_alloc",
    "host_free",        "host_register",     "host_unregister",   "create_stream",
    "destroy_stream",   "create_event",      "destroy_event",     "record_event",
    "query_event",      "synchronize_event", "elapsed_time",      "stream_wait_event",
    "synchronize_stream", "synchronize_device", "copy_to_host",   "copy_to_device",
    "copy_device",      "memset",            "create_ipc_event",  "export_ipc_event",
    "open_ipc_event",
};

struct CodeName {
  absl::string_view name;
  absl::StatusCode code;
};
constexpr CodeName kCodeNames[] = {
    {"resource_exhausted", absl::StatusCode::kResourceExhausted},
    {"oom", absl::StatusCode::kResourceExhausted},
    {"invalid_argument", absl::StatusCode::kInvalidArgument},
    {"internal", absl::StatusCode::kInternal},
    {"unimplemented", absl::StatusCode::kUnimplemented},
    {"failed_precondition", absl::StatusCode::kFailedPrecondition},
    {"unavailable", absl::StatusCode::kUnavailable},
};

absl::string_view CodeToName(absl::StatusCode code) {
  for (const CodeName& c : kCodeNames) {
    if (c.code == code) return c.name;
  }
  return "internal";
}

}  // namespace

absl::string_view DriverOpName(DriverOp op) {
  int i = static_cast<int>(op);
  return (i >= 0 && i < kNumDriverOps) ? kOpNames[i] : absl::string_view("unknown_op");
}

absl::StatusOr<DriverOp> DriverOpFromName(absl::string_view name) {
  for (int i = 0; i < kNumDriverOps; ++i) {
    if (kOpNames[i] == name) return static_cast<DriverOp>(i);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown driver operation '", name, "'; valid: ", absl::StrJoin(kOpNames, ", ")));
}

DriverCounters OpCounters::Snapshot() const {
  DriverCounters out;
  for (int i = 0; i < kNumDriverOps; ++i) out.calls[i] = calls_[i].load(std::memory_order_relaxed);
  out.failed_calls = failed_.load(std::memory_order_relaxed);
  out.bytes_to_host = to_host_.load(std::memory_order_relaxed);
  out.bytes_to_device = to_device_.load(std::memory_order_relaxed);
  out.chunk_bytes_created = chunk_bytes_.load(std::memory_order_relaxed);
  return out;
}

absl::StatusOr<std::vector<FaultRule>> ParseFaultRules(absl::string_view text) {
  std::vector<FaultRule> rules;
  for (absl::string_view item : absl::StrSplit(text, '+', absl::SkipEmpty())) {
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad fault rule '", item, "': ", why, " (expected op@N[xCOUNT]=code)"));
    };
    std::vector<absl::string_view> op_rest = absl::StrSplit(item, absl::MaxSplits('@', 1));
    if (op_rest.size() != 2) return bad("missing '@'");
    std::vector<absl::string_view> when_code = absl::StrSplit(op_rest[1], absl::MaxSplits('=', 1));
    if (when_code.size() != 2) return bad("missing '='");
    FaultRule rule;
    absl::StatusOr<DriverOp> op = DriverOpFromName(op_rest[0]);
    if (!op.ok()) return bad(op.status().message());
    rule.op = *op;
    std::vector<absl::string_view> nth_count = absl::StrSplit(when_code[0], absl::MaxSplits('x', 1));
    if (!absl::SimpleAtoi(nth_count[0], &rule.nth) || rule.nth < 1) return bad("N must be an integer >= 1");
    if (nth_count.size() == 2 && (!absl::SimpleAtoi(nth_count[1], &rule.count) || rule.count < 1)) {
      return bad("COUNT must be an integer >= 1");
    }
    bool found = false;
    for (const CodeName& c : kCodeNames) {
      if (c.name == when_code[1]) {
        rule.code = c.code;
        found = true;
      }
    }
    if (!found) return bad(absl::StrCat("unknown code '", when_code[1], "'"));
    rules.push_back(rule);
  }
  return rules;
}

std::string FaultRulesToString(const std::vector<FaultRule>& rules) {
  return absl::StrJoin(rules, "+", [](std::string* out, const FaultRule& r) {
    absl::StrAppend(out, DriverOpName(r.op), "@", r.nth);
    if (r.count != 1) absl::StrAppend(out, "x", r.count);
    absl::StrAppend(out, "=", CodeToName(r.code));
  });
}

}  // namespace vmstash
