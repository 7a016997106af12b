#include "tests/replay/trace.h"

#include <algorithm>
#include <chrono>
#include <random>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace vmstash {

absl::StatusOr<std::vector<TraceOp>> ParseTraceCsv(absl::string_view text) {
  std::vector<TraceOp> ops;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> f = absl::StrSplit(line, ',');
    for (auto& x : f) x = absl::StripAsciiWhitespace(x);
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("trace line ", line_number, " '", line, "': ", why));
    };
    TraceOp op;
    if (f[0] == "a") {
      if (f.size() != 4) return bad("an allocation is a,<id>,<size_bytes>,<stream>");
      if (!absl::SimpleAtoi(f[1], &op.id)) return bad("bad id");
      if (!absl::SimpleAtoi(f[2], &op.size_bytes) || op.size_bytes == 0) return bad("bad size");
      if (!absl::SimpleAtoi(f[3], &op.stream) || op.stream < 0 || op.stream > 1023) return bad("bad stream");
    } else if (f[0] == "f") {
      if (f.size() != 2) return bad("a free is f,<id>");
      op.allocate = false;
      if (!absl::SimpleAtoi(f[1], &op.id)) return bad("bad id");
    } else {
      return bad("the first field must be 'a' or 'f'");
    }
    ops.push_back(op);
  }
  return ops;
}

std::string TraceToCsv(const std::vector<TraceOp>& ops) {
  std::string out = "# vmstash allocation trace: a,<id>,<size_bytes>,<stream> | f,<id>\n";
  for (const TraceOp& op : ops) {
    if (op.allocate) absl::StrAppend(&out, "a,", op.id, ",", op.size_bytes, ",", op.stream, "\n");
    else absl::StrAppend(&out, "f,", op.id, "\n");
  }
  return out;
}

std::vector<TraceOp> GenerateTrainingTrace(std::uint64_t seed, int steps, int layers, std::uint64_t scale_bytes) {
  std::mt19937_64 rng(seed);
  std::vector<TraceOp> ops;
  std::uint64_t next_id = 1;
  auto alloc = [&](std::uint64_t size, int stream = 0) {
    std::uint64_t id = next_id++;
    ops.push_back(TraceOp{true, id, std::max<std::uint64_t>(size, 1), stream});
    return id;
  };
  auto release = [&](std::uint64_t id) { ops.push_back(TraceOp{false, id, 0, 0}); };
  // Weights and optimizer state live for the whole trace.
  std::vector<std::uint64_t> persistent;
  for (int l = 0; l < layers; ++l) {
    persistent.push_back(alloc(scale_bytes * 3));      // attention + MLP weights
    persistent.push_back(alloc(scale_bytes / 64 + 4096));  // norms, biases
  }
  for (int step = 0; step < steps; ++step) {
    // Token count varies per step (packed variable-length sequences).
    double frac = 0.3 + 0.7 * std::uniform_real_distribution<double>(0, 1)(rng);
    std::uint64_t act = static_cast<std::uint64_t>(scale_bytes * frac) / 512 * 512 + 512;
    std::vector<std::vector<std::uint64_t>> saved(layers);
    for (int l = 0; l < layers; ++l) {
      std::uint64_t qkv = alloc(act * 3);
      std::uint64_t scores = alloc(act / 2 + rng() % 4096);
      saved[l].push_back(alloc(act));  // attention output
      release(scores);
      std::uint64_t mlp = alloc(act * 4);
      saved[l].push_back(alloc(act));  // layer output
      saved[l].push_back(qkv);
      saved[l].push_back(mlp);
      for (int t = 0; t < 3; ++t) release(alloc(256 + rng() % 65536, t % 2));  // small temporaries
    }
    std::uint64_t logits = alloc(act * 8);
    std::uint64_t loss_grad = alloc(act * 8);
    release(logits);
    std::vector<std::uint64_t> grads;
    for (int l = layers - 1; l >= 0; --l) {
      std::uint64_t g1 = alloc(act * 4);
      std::uint64_t g2 = alloc(act);
      for (auto it = saved[l].rbegin(); it != saved[l].rend(); ++it) release(*it);
      release(g1);
      grads.push_back(alloc(scale_bytes * 3));  // weight gradient
      release(g2);
    }
    release(loss_grad);
    if (step % 2 == 1) {
      std::uint64_t scratch = alloc(scale_bytes * 2);
      release(scratch);
    }
    for (std::uint64_t g : grads) release(g);
  }
  for (std::uint64_t p : persistent) release(p);
  return ops;
}

absl::StatusOr<ReplayResult> Replay(const std::vector<TraceOp>& ops, ReplayTarget& target) {
  struct LiveBlock {
    std::uint64_t ptr;
    std::uint64_t size;
  };
  absl::flat_hash_map<std::uint64_t, LiveBlock> live;
  ReplayResult result;
  std::uint64_t allocated = 0;
  auto start = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const TraceOp& op = ops[i];
    if (op.allocate) {
      if (live.contains(op.id)) return absl::InvalidArgumentError(absl::StrCat("op ", i, ": id ", op.id, " is live"));
      absl::StatusOr<std::uint64_t> p = target.Allocate(op.size_bytes, op.stream);
      if (!p.ok()) return absl::Status(p.status().code(), absl::StrCat("op ", i, ": ", p.status().message()));
      live.emplace(op.id, LiveBlock{*p, op.size_bytes});
      allocated += op.size_bytes;
      result.peak_allocated_bytes = std::max(result.peak_allocated_bytes, allocated);
    } else {
      auto it = live.find(op.id);
      if (it == live.end()) return absl::InvalidArgumentError(absl::StrCat("op ", i, ": free of unknown id ", op.id));
      absl::Status s = target.Free(it->second.ptr);
      if (!s.ok()) return absl::Status(s.code(), absl::StrCat("op ", i, ": ", s.message()));
      allocated -= it->second.size;
      live.erase(it);
    }
    ++result.operations;
  }
  for (auto& [id, b] : live) {
    absl::Status s = target.Free(b.ptr);
    if (!s.ok()) return s;
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.peak_reserved_bytes = target.PeakReservedBytes();
  return result;
}

}  // namespace vmstash
