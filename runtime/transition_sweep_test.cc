// Fault injection at every driver call of the Runtime's pause, resume and switch over two
// simulated devices, with hooks that succeed and hooks that fail: the invariant of Note
// [All-or-Nothing Transitions] (runtime.h) — after any failed transition, every device
// and tag is as before, or the error says exactly which device is in which state — and,
// after success, the new state everywhere. Backup tags' bytes (cookie patterns) are
// checked after every case, live ones at once, paused ones once resumed.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "allocator/testing.h"
#include "base/byte_pattern.h"
#include "gtest/gtest.h"
#include "runtime/runtime.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

constexpr int kDevices = 2;

struct Block {
  int device = 0;
  TagId tag = 0;
  DevicePtr address = 0;
  std::vector<std::uint8_t> bytes;  // what it must hold
};

// Two devices, each with an outgoing backup and discard tag (active, a freed block cached
// too) and an incoming backup and discard tag (paused). Hooks on every tag: a before-pause
// veto and an after-resume failure on the devices whose bit is set.
struct World {
  SimDriver* sim = nullptr;  // owned by rt
  std::unique_ptr<Runtime> rt;
  TagId out_b = 0, out_d = 0, in_b = 0, in_d = 0;
  std::vector<Block> blocks;
  int veto_mask = 0, fail_mask = 0;
  std::vector<TagId> tags() const { return {out_b, out_d, in_b, in_d}; }
};

using States = std::map<std::pair<int, TagId>, std::string>;

std::string StateOf(Runtime& rt, int device, TagId tag) {
  for (const TagStats& t : rt.AllocatorInUse(device)->Stats().tags) {
    if (t.name == TagName(tag)) return t.state;
  }
  return "absent";
}

States StatesOf(World& w) {
  States s;
  for (int d = 0; d < kDevices; ++d) {
    for (TagId t : w.tags()) s[{d, t}] = StateOf(*w.rt, d, t);
  }
  return s;
}

void Fill(World& w, int device, TagId tag, const std::vector<std::size_t>& sizes, std::uint8_t seed) {
  CachingAllocator* a = w.rt->Allocator(device).value();
  for (std::size_t n : sizes) {
    Block b{device, tag, a->Allocate(n, Stream{}, tag).value(), std::vector<std::uint8_t>(n)};
    FillPattern(b.bytes.data(), n, seed);
    std::memcpy(reinterpret_cast<void*>(b.address), b.bytes.data(), n);
    w.blocks.push_back(std::move(b));
    seed = static_cast<std::uint8_t>(seed + 29);
  }
}

std::unique_ptr<World> Make() {
  auto w = std::make_unique<World>();
  auto sim = std::make_unique<SimDriver>(SimDriverOptions{kDevices, 128 * kMiB, 2 * kMiB, {}});
  w->sim = sim.get();
  AllocatorOptions options;
  options.validate_each_op = true;
  options.auto_prepare = false;  // the sweep counts driver calls
  options.pause_stage_bytes = 2 * kMiB;
  options.switch_group_bytes = 2 * kMiB;
  options.resume_first_piece_bytes = 2 * kMiB;
  options.min_chunk_bytes = 4 * kMiB;
  w->rt = Runtime::Create(std::move(sim), options).value();
  w->out_b = InternTag("sweep_out_backup").value();
  w->out_d = InternTag("sweep_out_discard").value();
  w->in_b = InternTag("sweep_in_backup").value();
  w->in_d = InternTag("sweep_in_discard").value();
  World* raw = w.get();
  for (TagId t : w->tags()) {
    EXPECT_TRUE(w->rt->CreateTag(t, t == w->out_b || t == w->in_b ? Policy::kBackup : Policy::kDiscard).ok());
    EXPECT_TRUE(w->rt
                    ->AddHooks(
                        t,
                        [raw](TagId, int d) {
                          return (raw->veto_mask >> d) & 1 ? absl::AbortedError("veto") : absl::OkStatus();
                        },
                        [raw](TagId, int d) {
                          return (raw->fail_mask >> d) & 1 ? absl::DataLossError("hook failed") : absl::OkStatus();
                        })
                    .ok());
  }
  const std::vector<std::size_t> sizes = {4 * kKiB, 600 * kKiB, 3 * kMiB / 2};
  for (int d = 0; d < kDevices; ++d) {
    Fill(*w, d, w->in_b, sizes, static_cast<std::uint8_t>(10 + d));
    Fill(*w, d, w->in_d, {3 * kMiB / 2}, static_cast<std::uint8_t>(20 + d));
  }
  EXPECT_TRUE(w->rt->Pause(w->in_b, Runtime::kAllDevices).value());
  EXPECT_TRUE(w->rt->Pause(w->in_d, Runtime::kAllDevices).value());
  for (int d = 0; d < kDevices; ++d) {
    Fill(*w, d, w->out_b, sizes, static_cast<std::uint8_t>(30 + d));
    CachingAllocator* a = w->rt->AllocatorInUse(d);
    EXPECT_TRUE(a->Free(a->Allocate(2 * kMiB, Stream{}, w->out_b).value()).ok());  // a cached block
    Fill(*w, d, w->out_d, {3 * kMiB / 2}, static_cast<std::uint8_t>(40 + d));
  }
  return w;
}

// Bytes of the backup tags' blocks (in `active` state now) that differ from their cookies.
std::size_t WrongLiveBackupBytes(World& w) {
  std::size_t wrong = 0;
  for (const Block& b : w.blocks) {
    if ((b.tag != w.out_b && b.tag != w.in_b) || StateOf(*w.rt, b.device, b.tag) != "active") continue;
    wrong += std::memcmp(reinterpret_cast<const void*>(b.address), b.bytes.data(), b.bytes.size()) != 0;
  }
  return wrong;
}

// Resumes every tag everywhere, checks every backup block, frees everything and checks
// that every byte of device memory went back.
void Finish(World& w) {
  w.veto_mask = w.fail_mask = 0;
  for (TagId t : w.tags()) ASSERT_TRUE(w.rt->Resume(t, Runtime::kAllDevices).ok());
  EXPECT_EQ(WrongLiveBackupBytes(w), 0u) << "a backup tag lost bytes";
  for (const Block& b : w.blocks) ASSERT_TRUE(w.rt->AllocatorInUse(b.device)->Free(b.address).ok());
  ASSERT_TRUE(w.rt->EmptyCache(Runtime::kAllDevices, std::nullopt).ok());
  for (int d = 0; d < kDevices; ++d) EXPECT_EQ(w.sim->UsedBytes(d), 0u) << "device " << d;
  absl::Status ordering = w.sim->CheckOrdering();
  EXPECT_TRUE(ordering.ok()) << ordering;
}

struct Scenario {
  std::string name;
  std::function<absl::StatusOr<bool>(World&)> run;
  std::vector<std::pair<TagId World::*, std::string>> after;  // each tag's state once done
};

std::vector<Scenario> Scenarios() {
  return {
      {"pause", [](World& w) { return w.rt->Pause(w.out_b, Runtime::kAllDevices); }, {{&World::out_b, "paused"}}},
      {"resume", [](World& w) { return w.rt->Resume(w.in_b, Runtime::kAllDevices); }, {{&World::in_b, "active"}}},
      {"switch",
       [](World& w) { return w.rt->Switch({w.out_b, w.out_d}, {w.in_b, w.in_d}, Runtime::kAllDevices); },
       {{&World::out_b, "paused"}, {&World::out_d, "paused"}, {&World::in_b, "active"}, {&World::in_d, "active"}}},
  };
}

States Expected(World& w, const States& before, const Scenario& sc) {
  States s = before;
  for (const auto& [member, state] : sc.after) {
    for (int d = 0; d < kDevices; ++d) s[{d, w.*member}] = state;
  }
  return s;
}

struct Tally {
  int cases = 0, ok = 0, done_hooks_failed = 0, rolled_back = 0, named_states = 0;
};

// One case: runs `sc` (with `fault` armed, if any) and checks the invariant.
void RunCase(const Scenario& sc, const FaultRule* fault, int veto_mask, int fail_mask, Tally* tally) {
  std::unique_ptr<World> w = Make();
  const States before = StatesOf(*w);
  w->veto_mask = veto_mask;
  w->fail_mask = fail_mask;
  if (fault != nullptr) w->sim->InjectFault(*fault);
  const absl::StatusOr<bool> r = sc.run(*w);
  w->sim->ClearFaults();
  w->veto_mask = w->fail_mask = 0;
  ++tally->cases;
  for (int d = 0; d < kDevices; ++d) {
    absl::Status valid = w->rt->AllocatorInUse(d)->Validate();
    ASSERT_TRUE(valid.ok()) << valid;
  }
  const States now = StatesOf(*w), after = Expected(*w, before, sc);
  const std::string message(r.status().message());
  if (r.ok() || Runtime::TransitionDone(r.status())) {
    // Done: the new state on every device. A hook failure is the only way to be done with an error.
    EXPECT_TRUE(r.ok() || fail_mask != 0) << r.status();
    EXPECT_EQ(now, after) << r.status();
    if (r.ok()) {
      EXPECT_TRUE(*r);
      ++tally->ok;
    } else {
      EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
      for (int d = 0; d < kDevices; ++d) {
        if ((fail_mask >> d) & 1) {
          EXPECT_NE(message.find(absl::StrCat("device ", d, ":")), std::string::npos) << message;
        }
      }
      ++tally->done_hooks_failed;
    }
  } else {
    // Failed: every tag as before, or the error names the device and what is left there.
    EXPECT_NE(message.find("failed on device "), std::string::npos) << message;
    if (fault != nullptr && veto_mask == 0) {
      EXPECT_EQ(r.status().code(), fault->code) << r.status();
    }
    bool named = false;
    for (const auto& [key, state] : now) {
      if (state == before.at(key)) continue;
      named = true;
      EXPECT_NE(message.find(absl::StrCat("device ", key.first)), std::string::npos) << message;
      EXPECT_TRUE(message.find("NOT ") != std::string::npos || message.find("broken") != std::string::npos)
          << "tag '" << TagName(key.second) << "' on device " << key.first << " is " << state << ", was "
          << before.at(key) << ", and the error does not say so: " << message;
    }
    ++(named ? tally->named_states : tally->rolled_back);
  }
  EXPECT_EQ(WrongLiveBackupBytes(*w), 0u) << "a live backup tag lost bytes: " << r.status();
  Finish(*w);
}

// The driver calls `sc` makes on a clean run, per operation.
DriverCounters CleanCalls(const Scenario& sc, int fail_mask) {
  std::unique_ptr<World> w = Make();
  const DriverCounters before = w->sim->Counters();
  w->fail_mask = fail_mask;
  absl::StatusOr<bool> r = sc.run(*w);
  EXPECT_TRUE(r.ok() || Runtime::TransitionDone(r.status())) << r.status();
  DriverCounters calls = w->sim->Counters();
  for (int i = 0; i < kNumDriverOps; ++i) calls.calls[i] -= before.calls[i];
  Finish(*w);
  return calls;
}

// Every call index of every driver operation a clean run makes fails once.
void Sweep(int fail_mask, Tally* tally) {
  for (const Scenario& sc : Scenarios()) {
    const DriverCounters clean = CleanCalls(sc, fail_mask);
    for (int op_index = 0; op_index < kNumDriverOps; ++op_index) {
      const DriverOp op = static_cast<DriverOp>(op_index);
      for (std::uint64_t nth = 1; nth <= clean.Calls(op); ++nth) {
        SCOPED_TRACE(absl::StrCat(sc.name, " ", DriverOpName(op), "@", nth, " fail_mask ", fail_mask));
        const FaultRule fault{op, static_cast<int>(nth), 1, absl::StatusCode::kInternal};
        RunCase(sc, &fault, 0, fail_mask, tally);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

TEST(TransitionSweepTest, EveryDriverCallOfEveryTransitionFailsCleanlyOnTwoDevices) {
  Tally tally;
  Sweep(/*fail_mask=*/0, &tally);
  std::printf("runtime sweep without hook failures: %d cases, %d done, %d rolled back, %d with named states\n",
              tally.cases, tally.ok, tally.rolled_back, tally.named_states);
  EXPECT_GT(tally.rolled_back, tally.cases / 2);
  EXPECT_EQ(tally.done_hooks_failed, 0);
}

// Device 0's after-resume hooks fail in every case: a fault on device 1 rolls device 0
// back; a fault nowhere, or one tolerated, leaves the transition done with the hook named.
TEST(TransitionSweepTest, EveryDriverCallFailsCleanlyWhileDevice0sHooksFail) {
  Tally tally;
  Sweep(/*fail_mask=*/1, &tally);
  std::printf("runtime sweep with device 0's hooks failing: %d cases, %d done, %d done with hook errors, %d rolled "
              "back, %d with named states\n",
              tally.cases, tally.ok, tally.done_hooks_failed, tally.rolled_back, tally.named_states);
  EXPECT_GT(tally.rolled_back, tally.cases / 2);
}

TEST(TransitionSweepTest, HooksThatFailWithoutDriverFaults) {
  for (const Scenario& sc : Scenarios()) {
    SCOPED_TRACE(sc.name);
    for (int fail_mask : {1, 2, 3}) {
      Tally tally;
      RunCase(sc, nullptr, 0, fail_mask, &tally);
      // A pause runs no after-resume hook: it is done without error.
      EXPECT_EQ(tally.done_hooks_failed, sc.name == "pause" ? 0 : 1) << "fail_mask " << fail_mask;
    }
    Tally veto;
    RunCase(sc, nullptr, /*veto_mask=*/2, 0, &veto);  // device 1 vetoes: device 0 rolled back
    EXPECT_EQ(veto.rolled_back, sc.name == "resume" ? 0 : 1);
    EXPECT_EQ(veto.ok, sc.name == "resume" ? 1 : 0) << "a resume runs no before-pause hook";
  }
}

}  // namespace
}  // namespace vmstash
