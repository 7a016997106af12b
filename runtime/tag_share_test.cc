// Mapped tags (Note [Mapped Tags], tag_share.h) on the simulated driver: the messages, an
// importer following the exporter's pauses, resumes, switches and empty_cache, a use that
// holds a revoke up, exits on either side, bad input, and driver faults in the importer.
// The importer runs in this process on a driver of its own (the simulator's chunks are
// memfds, imported like CUDA's), or in a child process.
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "base/byte_pattern.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "node/testing.h"
#include "node/wire.h"
#include "runtime/runtime.h"
#include "runtime/tag_exporter.h"
#include "runtime/tag_import.h"
#include "runtime/tag_share.h"
#include "vmm/sim_driver.h"

namespace vmstash::share {
namespace {

using ::testing::HasSubstr;

constexpr std::size_t kBlock = std::size_t{3} << 20;
constexpr std::size_t kGranule = std::size_t{2} << 20;

std::unique_ptr<SimDriver> Sim() {
  return std::make_unique<SimDriver>(SimDriverOptions{1, std::size_t{1} << 30, kGranule, {}});
}

TagId Tag(const char* name) { return InternTag(name).value(); }

// The exporting process's side: a runtime whose chunks are exportable, and its exporter.
struct Exporter {
  std::string dir = node::PrivateDir();
  std::unique_ptr<Runtime> rt;
  std::shared_ptr<TagExporter> ex;
  explicit Exporter(int revoke_timeout_ms = 5000) {
    AllocatorOptions options;
    options.auto_prepare = false;
    options.share_chunks = true;
    rt = Runtime::Create(Sim(), options).value();
    ShareOptions so;
    so.dir = dir;
    so.revoke_timeout_ms = revoke_timeout_ms;
    ex = TagExporter::Start(rt.get(), so).value();
    rt->SetTransitionObserver(ex);
  }
  ~Exporter() {
    rt->SetTransitionObserver(nullptr);
    ex.reset();
    rt.reset();
  }
  DevicePtr Filled(TagId tag, unsigned char seed) {
    DevicePtr p = rt->Allocator(0).value()->Allocate(kBlock, Stream{}, tag).value();
    FillPattern(p, kBlock, seed);
    return p;
  }
};

// Waits up to 5 s for `m` to reach `s`.
bool Reaches(const MappedTag& m, MappedTag::State s) {
  for (int i = 0; i < 500 && m.state() != s; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return m.state() == s;
}

TEST(ShareWireTest, RoundTripsEveryMessage) {
  ShareMessage grant;
  grant.kind = ShareKind::kGrant;
  grant.generation = 7;
  grant.reservations = {{0x7f0000000000, 1 << 30}};
  grant.chunk_count = 40;
  absl::StatusOr<ShareMessage> g = ParseShare(FormatShare(grant));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->kind, ShareKind::kGrant);
  EXPECT_EQ(g->generation, 7u);
  ASSERT_EQ(g->reservations.size(), 1u);
  EXPECT_EQ(g->reservations[0].address, 0x7f0000000000u);
  EXPECT_EQ(g->chunk_count, 40u);
  ShareMessage map;
  map.kind = ShareKind::kMap;
  map.tag = "weights";
  map.device = "GPU-1";
  EXPECT_EQ(ParseShare(FormatShare(map))->tag, "weights");
  ShareMessage ack;
  ack.kind = ShareKind::kAck;
  ack.ack = "revoke";
  ack.ok = false;
  ack.message = "no";
  EXPECT_EQ(ParseShare(FormatShare(ack))->message, "no");
  ShareMessage revoke;
  revoke.kind = ShareKind::kRevoke;
  EXPECT_EQ(ParseShare(FormatShare(revoke))->kind, ShareKind::kRevoke);
  const absl::Status back = StatusOfError(*ParseShare(FormatShare(ShareError(absl::NotFoundError("gone")))));
  EXPECT_EQ(back, absl::NotFoundError("gone"));
}

TEST(ShareWireTest, RefusesBadMessages) {
  for (const char* bad : {"", "[]", "{\"v\":2}", "{\"v\":2,\"op\":\"map\",\"tag\":\"\",\"device\":\"d\"}",
                          "{\"v\":2,\"op\":\"unmap\"}", "{\"v\":2,\"op\":\"map\",\"tag\":\"t\"}",
                          "{\"v\":2,\"op\":\"map\",\"tag\":\"t\",\"device\":\"d\",\"x\":1}",
                          "{\"v\":2,\"ack\":\"later\",\"ok\":true}", "{\"v\":2,\"ack\":\"grant\"}",
                          "{\"v\":2,\"ev\":\"grant\",\"generation\":1,\"reservations\":[[0,4]],\"chunks\":0}",
                          "{\"v\":2,\"ev\":\"grant\",\"generation\":1,\"reservations\":[[4,0]],\"chunks\":0}",
                          "{\"v\":2,\"ev\":\"grant\",\"generation\":-1,\"reservations\":[],\"chunks\":0}",
                          "{\"v\":2,\"ev\":\"grant\",\"generation\":1,\"reservations\":[[4]],\"chunks\":0}",
                          "{\"v\":2,\"ev\":\"chunks\",\"chunks\":[[18446744073709551615,4096]]}",
                          "{\"v\":2,\"ev\":\"dance\"}"}) {
    EXPECT_EQ(ParseShare(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  std::string many = "{\"v\":2,\"ev\":\"chunks\",\"chunks\":[";
  for (std::size_t i = 0; i <= kChunksPerPacket; ++i) many += (i ? ",[4096,4096]" : "[4096,4096]");
  EXPECT_EQ(ParseShare(many + "]}").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseShare("{\"v\":3,\"ev\":\"revoke\"}").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(MappedTagTest, FollowsPausesAndResumesAtTheSameAddresses) {
  Exporter e;
  const TagId weights = Tag("share_weights");
  ASSERT_TRUE(e.rt->CreateTag(weights, Policy::kBackup).ok());
  const DevicePtr p = e.Filled(weights, 1);
  ASSERT_EQ(e.ex->Share(weights).value(), 1u);
  std::unique_ptr<SimDriver> mine = Sim();
  absl::StatusOr<std::unique_ptr<MappedTag>> m = MappedTag::Map(mine.get(), 0, ::getpid(), "share_weights", {e.dir});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->state(), MappedTag::State::kMapped);
  EXPECT_EQ((*m)->generation(), 1u);
  const DevicePtr q = (*m)->Local(p, kBlock).value();
  EXPECT_NE(q, p);  // another driver's address space: the same memory at our own address
  EXPECT_EQ(WrongBytes(q, kBlock, 1), 0u);
  for (unsigned char seed = 2; seed < 8; ++seed) {
    {
      absl::StatusOr<MappedTag::Use> use = (*m)->Acquire();
      ASSERT_TRUE(use.ok()) << use.status();
      FillPattern(q, kBlock, seed);  // the trainer's write
    }
    EXPECT_EQ(WrongBytes(p, kBlock, seed), 0u);  // the rollout sees it
    ASSERT_TRUE(e.rt->Pause(weights, -1).ok());
    EXPECT_EQ((*m)->state(), MappedTag::State::kPaused);  // revoked before the pause released anything
    absl::StatusOr<MappedTag::Use> refused = (*m)->Acquire();
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(refused.status().message(), HasSubstr("paused"));
    EXPECT_EQ((*m)->Local(p, kBlock).status().code(), absl::StatusCode::kFailedPrecondition);
    ASSERT_TRUE(e.rt->Resume(weights, -1).ok());
    EXPECT_EQ((*m)->state(), MappedTag::State::kMapped);  // granted again before Resume returned
    EXPECT_EQ((*m)->Local(p, kBlock).value(), q);
    EXPECT_EQ(WrongBytes(q, kBlock, seed), 0u);
  }
  EXPECT_EQ((*m)->revokes(), 6u);
  EXPECT_EQ((*m)->grants(), 7u);
  EXPECT_EQ(e.ex->importers(weights), 1u);
  m->reset();
  EXPECT_TRUE(mine->CheckNoLeaks().ok()) << mine->CheckNoLeaks();
  // The importer is gone: the next pause drops it and goes through.
  EXPECT_TRUE(e.rt->Pause(weights, -1).ok());
  EXPECT_EQ(e.ex->importers(weights), 0u);
}

TEST(MappedTagTest, FollowsSwitchesAndEmptyCache) {
  Exporter e;
  const TagId weights = Tag("share_sw_weights"), kv = Tag("share_sw_kv");
  ASSERT_TRUE(e.rt->CreateTag(weights, Policy::kBackup).ok());
  ASSERT_TRUE(e.rt->CreateTag(kv, Policy::kDiscard).ok());
  const DevicePtr p = e.Filled(weights, 3);
  (void)e.Filled(kv, 4);
  ASSERT_TRUE(e.rt->Pause(kv, -1).ok());
  ASSERT_TRUE(e.ex->Share(weights).ok());
  std::unique_ptr<SimDriver> mine = Sim();
  std::unique_ptr<MappedTag> m = MappedTag::Map(mine.get(), 0, ::getpid(), "share_sw_weights", {e.dir}).value();
  const DevicePtr q = m->Local(p, kBlock).value();
  EXPECT_TRUE(m->Covers({{p, kBlock}, {p + 4096, 4096}}).ok());
  ASSERT_TRUE(e.rt->Switch({weights}, {kv}, -1).ok());
  EXPECT_EQ(m->Covers({{p, kBlock}}).code(), absl::StatusCode::kFailedPrecondition);  // paused
  EXPECT_EQ(m->state(), MappedTag::State::kPaused);
  ASSERT_TRUE(e.rt->Switch({kv}, {weights}, -1).ok());
  EXPECT_EQ(m->state(), MappedTag::State::kMapped);
  EXPECT_EQ(WrongBytes(m->Local(p, kBlock).value(), kBlock, 3), 0u);
  EXPECT_EQ(m->Local(p, kBlock).value(), q);
  // Freed and given back: the importer's view no longer holds that memory.
  ASSERT_TRUE(e.rt->Allocator(0).value()->Free(p).ok());
  ASSERT_TRUE(e.rt->EmptyCache(-1, weights).ok());
  EXPECT_EQ(m->state(), MappedTag::State::kMapped);
  // Its reservation went with it (empty_cache freed it): the address is in the tag no more.
  absl::StatusOr<DevicePtr> stale = m->Local(p, kBlock);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(stale.status().message(), HasSubstr("is not in tag"));
  EXPECT_EQ(m->Covers({{p, kBlock}}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(m->Covers({}).ok());
  EXPECT_EQ(m->Local(p - (std::size_t{1} << 40), 16).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MappedTagTest, AUseThatDoesNotEndVetoesThePauseAndLosesItsMapping) {
  Exporter e(/*revoke_timeout_ms=*/300);
  const TagId weights = Tag("share_veto_weights");
  ASSERT_TRUE(e.rt->CreateTag(weights, Policy::kBackup).ok());
  const DevicePtr p = e.Filled(weights, 5);
  ASSERT_TRUE(e.ex->Share(weights).ok());
  std::unique_ptr<SimDriver> mine = Sim();
  std::unique_ptr<MappedTag> m = MappedTag::Map(mine.get(), 0, ::getpid(), "share_veto_weights", {e.dir}).value();
  std::optional<MappedTag::Use> held(m->Acquire().value());
  absl::StatusOr<bool> paused = e.rt->Pause(weights, -1);
  EXPECT_EQ(paused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(paused.status().message(), HasSubstr(absl::StrCat("process ", ::getpid(), " maps tag")));
  EXPECT_THAT(paused.status().message(), HasSubstr("did not let go"));
  EXPECT_EQ(WrongBytes(p, kBlock, 5), 0u);  // nothing changed in the exporter
  held.reset();  // the revoke the importer was waiting on completes, then it sees the close
  EXPECT_TRUE(Reaches(*m, MappedTag::State::kGone));
  EXPECT_THAT(m->Acquire().status().message(), HasSubstr("dropped this mapping"));
  ASSERT_TRUE(e.rt->Pause(weights, -1).ok());  // tried again: nobody maps it now
  ASSERT_TRUE(e.rt->Resume(weights, -1).ok());
  EXPECT_EQ(WrongBytes(p, kBlock, 5), 0u);
}

TEST(MappedTagTest, RefusesBadRequests) {
  Exporter e;
  const TagId weights = Tag("share_bad_weights");
  ASSERT_TRUE(e.rt->CreateTag(weights, Policy::kBackup).ok());
  (void)e.Filled(weights, 6);
  std::unique_ptr<SimDriver> mine = Sim();
  // Not shared yet.
  absl::StatusOr<std::unique_ptr<MappedTag>> m = MappedTag::Map(mine.get(), 0, ::getpid(), "share_bad_weights", {e.dir});
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(m.status().message(), HasSubstr("does not share tag"));
  ASSERT_TRUE(e.ex->Share(weights).ok());
  EXPECT_EQ(MappedTag::Map(mine.get(), 0, ::getpid(), "share_no_such_tag", {e.dir}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(MappedTag::Map(mine.get(), 0, ::getpid(), "", {e.dir}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MappedTag::Map(mine.get(), 3, ::getpid(), "share_bad_weights", {e.dir}).status().code(),
            absl::StatusCode::kInvalidArgument);  // no such device here
  EXPECT_EQ(MappedTag::Map(mine.get(), 0, -4, "share_bad_weights", {e.dir}).status().code(),
            absl::StatusCode::kInvalidArgument);
  const pid_t gone = ::fork();
  if (gone == 0) ::_exit(0);
  ::waitpid(gone, nullptr, 0);
  EXPECT_EQ(MappedTag::Map(mine.get(), 0, gone, "share_bad_weights", {e.dir}).status().code(),
            absl::StatusCode::kNotFound);
  absl::StatusOr<std::unique_ptr<MappedTag>> elsewhere =
      MappedTag::Map(mine.get(), 0, ::getpid(), "share_bad_weights", {node::PrivateDir()});
  EXPECT_EQ(elsewhere.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(elsewhere.status().message(), HasSubstr("shares no tag"));
  EXPECT_EQ(e.ex->Share(Tag("share_never_declared")).status().code(), absl::StatusCode::kNotFound);
  // Another tag may not take a name already shared.
  ASSERT_TRUE(e.rt->CreateTag(Tag("share_bad_other"), Policy::kBackup).ok());
  EXPECT_EQ(e.ex->Share(Tag("share_bad_other"), "[]", "share_bad_weights").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(mine->CheckNoLeaks().ok()) << mine->CheckNoLeaks();
}

TEST(MappedTagTest, ATagSharedByAFrameworksNameIsMappedByThatName) {
  Exporter e;
  const TagId weights = Tag("vllm.share_alias_weights");
  ASSERT_TRUE(e.rt->CreateTag(weights, Policy::kBackup).ok());
  const DevicePtr p = e.Filled(weights, 15);
  ASSERT_TRUE(e.ex->Share(weights, "[]", "share_alias_weights").ok());
  std::unique_ptr<SimDriver> mine = Sim();
  std::unique_ptr<MappedTag> m = MappedTag::Map(mine.get(), 0, ::getpid(), "share_alias_weights", {e.dir}).value();
  EXPECT_EQ(WrongBytes(m->Local(p, kBlock).value(), kBlock, 15), 0u);
  EXPECT_EQ(m->index(), "{\"generation\":1,\"index\":[]}\n");
  EXPECT_EQ(MappedTag::Map(mine.get(), 0, ::getpid(), "vllm.share_alias_weights", {e.dir}).status().code(),
            absl::StatusCode::kNotFound);  // importers know it by the name it was shared by
}

TEST(MappedTagTest, ChunksThatCannotBeExportedAreRefusedAtShare) {
  AllocatorOptions options;
  options.auto_prepare = false;  // share_chunks off
  std::unique_ptr<Runtime> rt = Runtime::Create(Sim(), options).value();
  ShareOptions so;
  so.dir = node::PrivateDir();
  std::shared_ptr<TagExporter> ex = TagExporter::Start(rt.get(), so).value();
  const TagId weights = Tag("share_unshareable_weights");
  ASSERT_TRUE(rt->CreateTag(weights, Policy::kBackup).ok());
  absl::StatusOr<std::uint64_t> g = ex->Share(weights);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(g.status().message(), HasSubstr("share_chunks:1"));
}

TEST(MappedTagTest, ThePausedTagIsMappedAtItsResume) {
  Exporter e;
  const TagId weights = Tag("share_late_weights");
  ASSERT_TRUE(e.rt->CreateTag(weights, Policy::kBackup).ok());
  const DevicePtr p = e.Filled(weights, 9);
  ASSERT_TRUE(e.rt->Pause(weights, -1).ok());
  ASSERT_TRUE(e.ex->Share(weights).ok());
  ASSERT_EQ(e.ex->Share(weights, "[{\"name\":\"w\"}]").value(), 2u);  // published again: a new generation
  EXPECT_EQ(e.ex->Share(weights, "{not json").status().code(), absl::StatusCode::kInvalidArgument);
  std::unique_ptr<SimDriver> mine = Sim();
  std::unique_ptr<MappedTag> m = MappedTag::Map(mine.get(), 0, ::getpid(), "share_late_weights", {e.dir}).value();
  EXPECT_EQ(m->state(), MappedTag::State::kPaused);
  EXPECT_EQ(m->generation(), 2u);
  EXPECT_EQ(m->index(), "{\"generation\":2,\"index\":[{\"name\":\"w\"}]}\n");
  EXPECT_EQ(m->Local(p, kBlock).status().code(), absl::StatusCode::kInvalidArgument);  // no reservation known yet
  ASSERT_TRUE(e.rt->Resume(weights, -1).ok());
  ASSERT_EQ(m->state(), MappedTag::State::kMapped);
  EXPECT_EQ(WrongBytes(m->Local(p, kBlock).value(), kBlock, 9), 0u);
}

TEST(MappedTagTest, TheExporterStoppingLeavesTheImporterGone) {
  std::unique_ptr<SimDriver> mine = Sim();
  std::unique_ptr<MappedTag> m;
  DevicePtr p = 0;
  {
    Exporter e;
    const TagId weights = Tag("share_stop_weights");
    ASSERT_TRUE(e.rt->CreateTag(weights, Policy::kBackup).ok());
    p = e.Filled(weights, 11);
    ASSERT_TRUE(e.ex->Share(weights).ok());
    m = MappedTag::Map(mine.get(), 0, ::getpid(), "share_stop_weights", {e.dir}).value();
    ASSERT_TRUE(e.ex->Unshare(weights).ok());
    EXPECT_FALSE(std::filesystem::exists(ShareIndexPath(e.dir, ::getpid(), "share_stop_weights")));
    EXPECT_TRUE(Reaches(*m, MappedTag::State::kGone));
    EXPECT_THAT(m->Acquire().status().message(), HasSubstr("stopped sharing"));
    ASSERT_TRUE(e.ex->Share(weights).ok());
    m = MappedTag::Map(mine.get(), 0, ::getpid(), "share_stop_weights", {e.dir}).value();
    EXPECT_EQ(WrongBytes(m->Local(p, kBlock).value(), kBlock, 11), 0u);
  }  // the exporter's process ends its runtime
  EXPECT_TRUE(Reaches(*m, MappedTag::State::kGone));
  EXPECT_EQ(m->Acquire().status().code(), absl::StatusCode::kFailedPrecondition);
  m.reset();
  EXPECT_TRUE(mine->CheckNoLeaks().ok()) << mine->CheckNoLeaks();
}

TEST(MappedTagTest, DriverFaultsInTheImporterLeaveNothingBehind) {
  Exporter e;
  const TagId weights = Tag("share_fault_weights");
  ASSERT_TRUE(e.rt->CreateTag(weights, Policy::kBackup).ok());
  const DevicePtr p = e.Filled(weights, 12);
  ASSERT_TRUE(e.ex->Share(weights).ok());
  std::unique_ptr<SimDriver> mine = Sim();
  for (DriverOp op : {DriverOp::kReserveAddress, DriverOp::kImportChunkFd, DriverOp::kMap, DriverOp::kSetAccess}) {
    mine->InjectFault(FaultRule{op, 1, 1, absl::StatusCode::kInternal});
    absl::StatusOr<std::unique_ptr<MappedTag>> m = MappedTag::Map(mine.get(), 0, ::getpid(), "share_fault_weights", {e.dir});
    EXPECT_FALSE(m.ok()) << DriverOpName(op);
    EXPECT_TRUE(mine->CheckNoLeaks().ok()) << DriverOpName(op) << ": " << mine->CheckNoLeaks();
  }
  // A fault in a later grant: the importer loses its mapping; the exporter's resume succeeds.
  std::unique_ptr<MappedTag> m = MappedTag::Map(mine.get(), 0, ::getpid(), "share_fault_weights", {e.dir}).value();
  ASSERT_TRUE(e.rt->Pause(weights, -1).ok());
  mine->InjectFault(FaultRule{DriverOp::kMap, 1, 1, absl::StatusCode::kInternal});
  ASSERT_TRUE(e.rt->Resume(weights, -1).ok());
  EXPECT_EQ(WrongBytes(p, kBlock, 12), 0u);
  EXPECT_TRUE(Reaches(*m, MappedTag::State::kGone));
  m.reset();
  EXPECT_TRUE(mine->CheckNoLeaks().ok()) << mine->CheckNoLeaks();
  EXPECT_EQ(e.ex->importers(weights), 0u);
}

TEST(MappedTagTest, UsesNeverSeeARevokedMappingUnderTransitions) {
  Exporter e;
  const TagId weights = Tag("share_stress_weights");
  ASSERT_TRUE(e.rt->CreateTag(weights, Policy::kBackup).ok());
  const DevicePtr p = e.Filled(weights, 13);
  ASSERT_TRUE(e.ex->Share(weights).ok());
  std::unique_ptr<SimDriver> mine = Sim();
  std::unique_ptr<MappedTag> m = MappedTag::Map(mine.get(), 0, ::getpid(), "share_stress_weights", {e.dir}).value();
  std::atomic<bool> done{false};
  std::atomic<int> uses{0};
  std::thread writer([&] {
    while (!done.load()) {
      absl::StatusOr<MappedTag::Use> use = m->Acquire();
      if (!use.ok()) continue;
      absl::StatusOr<DevicePtr> q = m->Local(p, kBlock);
      if (!q.ok()) continue;
      FillPattern(*q, kBlock, 13);  // unmapped memory here would be a crash
      uses.fetch_add(1);
    }
  });
  for (int i = 0; i < 30; ++i) {
    ASSERT_TRUE(e.rt->Pause(weights, -1).ok());
    ASSERT_TRUE(e.rt->Resume(weights, -1).ok());
    // Let the writer in before the next revoke (a bounded wait: the test judges no timing).
    const int before = uses.load();
    for (int w = 0; w < 1000 && uses.load() == before; ++w) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  done = true;
  writer.join();
  EXPECT_GT(uses.load(), 0);
  EXPECT_EQ(WrongBytes(p, kBlock, 13), 0u);
}

// A tag shared from inside its own pause (as another thread's publish would), then mapped
// from inside the next pause: the importer is told "paused" and mapped at the resume.
TEST(MappedTagTest, SharingDuringATransitionNeverGrantsChunksItReleases) {
  Exporter e;
  const TagId w = Tag("share_mid_weights");
  ASSERT_TRUE(e.rt->CreateTag(w, Policy::kBackup).ok());
  const DevicePtr p = e.Filled(w, 1);
  std::unique_ptr<SimDriver> mine = Sim();
  std::unique_ptr<MappedTag> late;
  int phase = 0;
  ASSERT_TRUE(e.rt->AddHooks(w, [&](TagId, int) -> absl::Status {
    if (phase == 0) {
      (void)e.ex->Share(w);
    } else if (phase == 1) {
      absl::StatusOr<std::unique_ptr<MappedTag>> m = MappedTag::Map(mine.get(), 0, ::getpid(), "share_mid_weights",
                                                                    {e.dir, 3000});
      if (m.ok()) late = std::move(*m);
    } else if (phase == 2) {
      (void)e.ex->Unshare(w);
    }
    return absl::OkStatus();
  }, nullptr).ok());
  for (phase = 0; phase < 3; ++phase) {
    if (phase == 2) {  // unshared inside a pause, then shared again: the same holds
      ASSERT_TRUE(e.rt->Pause(w, -1).ok());
      ASSERT_TRUE(e.rt->Resume(w, -1).ok());
      ASSERT_TRUE(e.ex->Share(w).ok());
      phase = 1;
      late.reset();
      ASSERT_TRUE(e.rt->Pause(w, -1).ok());
      phase = 3;
    } else {
      ASSERT_TRUE(e.rt->Pause(w, -1).ok());
    }
    if (phase >= 1) {
      ASSERT_NE(late, nullptr);
      EXPECT_EQ(late->state(), MappedTag::State::kPaused);
    }
    ASSERT_TRUE(e.rt->Resume(w, -1).ok());
    if (phase >= 1) {
      const DevicePtr q = late->Local(p, kBlock).value();
      {
        MappedTag::Use use = late->Acquire().value();
        FillPattern(q, kBlock, static_cast<unsigned char>(20 + phase));
      }
      EXPECT_EQ(WrongBytes(p, kBlock, static_cast<unsigned char>(20 + phase)), 0u);
    }
  }
}

// The exporter forked a child (without exec) that holds its copy of the importer's
// connection: an unshared importer still sees its connection close.
TEST(MappedTagTest, ADroppedImporterSeesTheCloseWhileTheExporterHasAForkedChild) {
  Exporter e;
  const TagId w = Tag("share_forked_weights");
  ASSERT_TRUE(e.rt->CreateTag(w, Policy::kBackup).ok());
  (void)e.Filled(w, 1);
  ASSERT_TRUE(e.ex->Share(w).ok());
  std::unique_ptr<SimDriver> mine = Sim();
  std::unique_ptr<MappedTag> m = MappedTag::Map(mine.get(), 0, ::getpid(), "share_forked_weights", {e.dir}).value();
  const pid_t child = ::fork();
  if (child == 0) {
    ::sleep(30);
    ::_exit(0);
  }
  ASSERT_TRUE(e.ex->Unshare(w).ok());
  EXPECT_TRUE(Reaches(*m, MappedTag::State::kGone));
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
}

// A Share whose index cannot be written leaves the tag unshared.
TEST(MappedTagTest, AFailedShareLeavesTheTagUnshared) {
  Exporter e;
  const TagId w = Tag("share_failed_weights");
  ASSERT_TRUE(e.rt->CreateTag(w, Policy::kBackup).ok());
  (void)e.Filled(w, 1);
  const std::string tmp = ShareIndexPath(e.dir, ::getpid(), "share_failed_weights") + ".tmp";
  std::filesystem::create_directory(tmp);  // the index's write fails: EISDIR
  EXPECT_FALSE(e.ex->Share(w).ok());
  std::unique_ptr<SimDriver> mine = Sim();
  EXPECT_EQ(MappedTag::Map(mine.get(), 0, ::getpid(), "share_failed_weights", {e.dir}).status().code(),
            absl::StatusCode::kNotFound);
  std::filesystem::remove(tmp);
  EXPECT_EQ(e.ex->Share(w).value(), 1u);
  EXPECT_TRUE(MappedTag::Map(mine.get(), 0, ::getpid(), "share_failed_weights", {e.dir}).ok());
}

TEST(MappedTagTest, AnImporterProcessKilledDoesNotHoldThePauseUp) {
  Exporter e(/*revoke_timeout_ms=*/60000);
  const TagId weights = Tag("share_kill_weights");
  ASSERT_TRUE(e.rt->CreateTag(weights, Policy::kBackup).ok());
  const DevicePtr p = e.Filled(weights, 14);
  ASSERT_TRUE(e.ex->Share(weights).ok());
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    // An importer at the protocol's level (no thread may start in a forked child under
    // TSAN): map, take the grant's descriptors, acknowledge, then wait to be killed.
    char ok = 0;
    absl::StatusOr<int> fd = node::Connect(ShareSocketPath(e.dir, ::getppid()));
    ShareMessage map;
    map.kind = ShareKind::kMap;
    map.tag = "share_kill_weights";
    map.device = "sim-0";
    if (fd.ok() && node::Send(*fd, FormatShare(map)).ok()) {
      absl::StatusOr<node::Received> grant = node::Receive(*fd, 5000, 0);
      absl::StatusOr<ShareMessage> g = grant.ok() ? ParseShare(grant->message) : grant.status();
      std::size_t taken = 0;
      while (g.ok() && g->kind == ShareKind::kGrant && taken < g->chunk_count) {
        absl::StatusOr<node::Received> part = node::Receive(*fd, 5000, kChunksPerPacket);
        if (!part.ok() || part->fds.empty()) break;
        taken += part->fds.size();  // kept open: this process holds the chunks
      }
      ShareMessage ack;
      ack.kind = ShareKind::kAck;
      ack.ack = "grant";
      ok = g.ok() && taken == g->chunk_count && taken > 0 && node::Send(*fd, FormatShare(ack)).ok() ? 1 : 0;
      // A worker forked without exec (a DataLoader's) holds the connection past this
      // process's death: the exporter must still see this process gone.
      if (::fork() == 0) {
        ::sleep(30);
        ::_exit(0);
      }
    }
    (void)!::write(ready[1], &ok, 1);
    ::pause();
    ::_exit(0);
  }
  char ok = 0;
  pollfd wait{ready[0], POLLIN, 0};
  ASSERT_EQ(::poll(&wait, 1, 30000), 1) << "the importer process did not report";
  ASSERT_EQ(::read(ready[0], &ok, 1), 1);
  EXPECT_EQ(ok, 1);
  EXPECT_EQ(e.ex->importers(weights), 1u);
  (void)p;
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(e.rt->Pause(weights, -1).ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));  // not the 60 s revoke limit
  EXPECT_EQ(e.ex->importers(weights), 0u);
  ::close(ready[0]);
  ::close(ready[1]);
}

}  // namespace
}  // namespace vmstash::share
