// Mapped tags' backups (Note [Mapped Tags], tag_share.h): while the exporter's tag is
// paused with its backup in the node pool, the importer writes that backup and the
// exporter's resume restores what it wrote. On the simulated driver, with a node daemon in
// a child process; the importer runs in this process on a runtime (and driver) of its own.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <optional>
#include <thread>
#include <vector>

#include "base/byte_pattern.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "node/testing.h"
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

TagId Tag(const char* name) { return InternTag(name).value(); }

// A runtime on a simulated driver whose backups go to the node pool of `dir` (node:1), or
// to its own memory (`node` false).
std::unique_ptr<Runtime> NodeRuntime(const std::string& dir, bool node) {
  AllocatorOptions options;
  options.auto_prepare = false;
  options.share_chunks = true;
  node::NodeOptions n;
  n.enabled = node;
  n.dir = dir;
  std::unique_ptr<Runtime> rt =
      Runtime::Create(std::make_unique<SimDriver>(SimDriverOptions{1, std::size_t{1} << 30, kGranule, {}}), options, n)
          .value();
  if (node) {
    EXPECT_TRUE(rt->node().Connect(/*start=*/false).ok());
  }
  return rt;
}

// The exporting process (its backups in the pool unless `node` is false) and an importing
// one, sharing one daemon.
struct Pair {
  std::string dir = node::PrivateDir();
  std::unique_ptr<node::DaemonProcess> daemon;
  std::unique_ptr<Runtime> rt;   // the exporter's
  std::shared_ptr<TagExporter> ex;
  std::unique_ptr<Runtime> imp;  // the importer's
  explicit Pair(bool node = true, int revoke_timeout_ms = 5000) {
    daemon = std::make_unique<node::DaemonProcess>(dir, 64 * node::HostPoolLedger::kUnitBytes);
    EXPECT_TRUE(daemon->started());
    rt = NodeRuntime(dir, node);
    imp = NodeRuntime(dir, true);
    ShareOptions so;
    so.dir = dir;
    so.revoke_timeout_ms = revoke_timeout_ms;
    ex = TagExporter::Start(rt.get(), so).value();
    rt->SetTransitionObserver(ex);
  }
  ~Pair() {
    rt->SetTransitionObserver(nullptr);
    ex.reset();
    rt.reset();
    imp.reset();
  }
  DevicePtr Filled(Runtime& r, TagId tag, unsigned char seed) {
    DevicePtr p = r.Allocator(0).value()->Allocate(kBlock, Stream{}, tag).value();
    FillPattern(p, kBlock, seed);
    return p;
  }
  // A backup tag `name` with one block filled with `seed`, shared; a discard tag of the
  // importer with one block filled with 9 (the writes' source); the importer's mapping
  // (null when it failed).
  struct Shared {
    TagId tag;
    DevicePtr p = 0, src = 0;
    std::unique_ptr<MappedTag> m;
  };
  Shared ShareOne(const std::string& name, unsigned char seed) {
    Shared out;
    out.tag = Tag(name.c_str());
    EXPECT_TRUE(rt->CreateTag(out.tag, Policy::kBackup).ok());
    out.p = Filled(*rt, out.tag, seed);
    EXPECT_TRUE(ex->Share(out.tag).ok());
    const TagId src_tag = Tag((name + "_src").c_str());
    EXPECT_TRUE(imp->CreateTag(src_tag, Policy::kDiscard).ok());
    out.src = Filled(*imp, src_tag, 9);
    out.m = Map(name, &imp->node());
    return out;
  }
  std::unique_ptr<MappedTag> Map(const std::string& name, NodeLeases* pool) {
    absl::StatusOr<std::unique_ptr<MappedTag>> m = MappedTag::Map(&imp->driver(), 0, ::getpid(), name, {dir}, pool);
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? *std::move(m) : nullptr;
  }
};

bool Reaches(const MappedTag& m, MappedTag::State s) {
  for (int i = 0; i < 500 && m.state() != s; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return m.state() == s;
}

TEST(MappedBackupWireTest, RoundTripsAndRefuses) {
  ShareMessage head;
  head.kind = ShareKind::kBackup;
  head.generation = 3;
  head.pool = "12:34:1048576";
  head.span_offset = 0;
  head.span_bytes = 8192;
  head.extent_count = 2;
  absl::StatusOr<ShareMessage> h = ParseShare(FormatShare(head));
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->kind, ShareKind::kBackup);
  EXPECT_EQ(h->pool, head.pool);
  EXPECT_EQ(h->span_offset, 0u);
  EXPECT_EQ(h->span_bytes, 8192u);
  EXPECT_EQ(h->extent_count, 2u);
  ShareMessage part;
  part.kind = ShareKind::kExtents;
  part.extents = {{0x7f0000000000, 4096, 0}, {0x7f0000002000, 4096, 4096}};
  absl::StatusOr<ShareMessage> x = ParseShare(FormatShare(part));
  ASSERT_TRUE(x.ok()) << x.status();
  ASSERT_EQ(x->extents.size(), 2u);
  EXPECT_EQ(x->extents[1].offset, 4096u);
  ShareMessage paused;
  paused.kind = ShareKind::kPaused;
  paused.message = "its backup is on disk";
  EXPECT_EQ(ParseShare(FormatShare(paused))->message, paused.message);
  for (const char* bad : {"{\"v\":2,\"ev\":\"backup\",\"generation\":1,\"pool\":\"p\",\"span\":[[0,0]],\"extents\":1}",
                          "{\"v\":2,\"ev\":\"backup\",\"generation\":1,\"pool\":\"p\",\"span\":[0,4],\"extents\":1}",
                          "{\"v\":2,\"ev\":\"backup\",\"generation\":1,\"span\":[[0,4]],\"extents\":1}",
                          "{\"v\":2,\"ev\":\"extents\",\"extents\":[[0,4096,0]]}",
                          "{\"v\":2,\"ev\":\"extents\",\"extents\":[[4096,0,0]]}",
                          "{\"v\":2,\"ev\":\"extents\",\"extents\":[[4096,4096]]}",
                          "{\"v\":2,\"ev\":\"extents\",\"extents\":[[4096,4096,18446744073709551615]]}",
                          "{\"v\":2,\"ack\":\"maybe\",\"ok\":true}"}) {
    EXPECT_EQ(ParseShare(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  std::string many = "{\"v\":2,\"ev\":\"extents\",\"extents\":[";
  for (std::size_t i = 0; i <= kExtentsPerPacket; ++i) many += (i ? ",[4096,4096,0]" : "[4096,4096,0]");
  EXPECT_EQ(ParseShare(many + "]}").status().code(), absl::StatusCode::kInvalidArgument);
}

// The trainer writes new weights into the paused rollout's backup, six times; each resume
// restores them at the same address, and the view is mapped again.
TEST(MappedBackupTest, WritesIntoAPausedTagsBackupThatItsResumeRestores) {
  Pair x;
  const TagId weights = Tag("mb_weights");
  ASSERT_TRUE(x.rt->CreateTag(weights, Policy::kBackup).ok());
  const DevicePtr p = x.Filled(*x.rt, weights, 1);
  const DevicePtr p2 = x.Filled(*x.rt, weights, 2);
  ASSERT_TRUE(x.ex->Share(weights).ok());
  const TagId src_tag = Tag("mb_src");
  ASSERT_TRUE(x.imp->CreateTag(src_tag, Policy::kDiscard).ok());
  const DevicePtr src = x.Filled(*x.imp, src_tag, 0);
  std::unique_ptr<MappedTag> m = x.Map("mb_weights", &x.imp->node());
  ASSERT_NE(m, nullptr);
  const DevicePtr q = m->Local(p, kBlock).value();
  for (unsigned char seed = 10; seed < 16; ++seed) {
    ASSERT_TRUE(x.rt->Pause(weights, -1).ok());
    ASSERT_EQ(m->state(), MappedTag::State::kBackup);  // granted before Pause returned
    EXPECT_EQ(m->backup_bytes(), 2 * kBlock);
    FillPattern(src, kBlock, seed);
    {
      absl::StatusOr<MappedTag::Use> use = m->Acquire(/*backup=*/true);
      ASSERT_TRUE(use.ok()) << use.status();
      EXPECT_EQ(m->Local(p, kBlock).status().code(), absl::StatusCode::kFailedPrecondition);  // nothing mapped
      // One write whole, one cut in two (the second half of p2 from the first half of src).
      ASSERT_TRUE(m->WriteBackup({{p, src, kBlock}, {p2 + kBlock / 2, src, kBlock / 2}}, Stream{}).ok());
    }
    ASSERT_TRUE(x.rt->Resume(weights, -1).ok());
    EXPECT_EQ(WrongBytes(p, kBlock, seed), 0u) << int(seed);
    EXPECT_EQ(WrongBytes(p2, kBlock / 2, 2), 0u);  // untouched
    EXPECT_EQ(std::memcmp(reinterpret_cast<const void*>(p2 + kBlock / 2), reinterpret_cast<const void*>(src),
                          kBlock / 2),
              0);
    ASSERT_EQ(m->state(), MappedTag::State::kMapped);
    EXPECT_EQ(m->Local(p, kBlock).value(), q);
    EXPECT_EQ(WrongBytes(q, kBlock, seed), 0u);
  }
  // The pool holds nothing of the exporter's now (the resume gave its lease back).
  EXPECT_EQ(x.rt->node().Stats()->leases, 0u);
  m.reset();
  EXPECT_TRUE(x.rt->Pause(weights, -1).ok());
}

TEST(MappedBackupTest, BadWritesWriteNothing) {
  Pair x;
  const TagId weights = Tag("mb_bad_weights");
  ASSERT_TRUE(x.rt->CreateTag(weights, Policy::kBackup).ok());
  const DevicePtr p = x.Filled(*x.rt, weights, 1);
  ASSERT_TRUE(x.ex->Share(weights).ok());
  const TagId src_tag = Tag("mb_bad_src");
  ASSERT_TRUE(x.imp->CreateTag(src_tag, Policy::kDiscard).ok());
  const DevicePtr src = x.Filled(*x.imp, src_tag, 7);
  std::unique_ptr<MappedTag> m = x.Map("mb_bad_weights", &x.imp->node());
  ASSERT_NE(m, nullptr);
  {
    absl::StatusOr<MappedTag::Use> use = m->Acquire();
    absl::Status mapped = m->WriteBackup({{p, src, kBlock}}, Stream{});
    EXPECT_EQ(mapped.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(mapped.message(), HasSubstr("it is mapped"));
  }
  ASSERT_TRUE(x.rt->Pause(weights, -1).ok());
  ASSERT_EQ(m->state(), MappedTag::State::kBackup);
  EXPECT_EQ(m->WriteBackup({{p, src, kBlock}}, Stream{}).code(), absl::StatusCode::kFailedPrecondition);  // no use
  {
    absl::StatusOr<MappedTag::Use> use = m->Acquire(/*backup=*/true);
    ASSERT_TRUE(use.ok());
    // Past the block's end, before it, and a good write with a bad one: nothing written.
    for (const MappedTag::BackupWrite& bad : std::vector<MappedTag::BackupWrite>{
             {p + 4096, src, kBlock}, {p - 4096, src, 4096}, {p + kBlock, src, 1}}) {
      absl::Status s = m->WriteBackup({{p, src, 4096}, bad}, Stream{});
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_THAT(s.message(), HasSubstr("is not in its backup"));
    }
    EXPECT_TRUE(m->WriteBackup({}, Stream{}).ok());
  }
  ASSERT_TRUE(x.rt->Resume(weights, -1).ok());
  EXPECT_EQ(WrongBytes(p, kBlock, 1), 0u);
}

// The resume waits for a use in progress (its writes complete first). One that does not
// end in time vetoes the resume, and fences the tag: its writer stays connected (its
// copies may be in flight), no later call resumes the tag before it lets go or exits, and
// it writes nothing more meanwhile. Nothing is lost.
TEST(MappedBackupTest, AResumeWaitsForTheWritersUseOrIsVetoedAndFenced) {
  Pair x(/*node=*/true, /*revoke_timeout_ms=*/300);
  const TagId weights = Tag("mb_wait_weights"), other = Tag("mb_wait_other");
  ASSERT_TRUE(x.rt->CreateTag(weights, Policy::kBackup).ok());
  ASSERT_TRUE(x.rt->CreateTag(other, Policy::kBackup).ok());
  const DevicePtr p = x.Filled(*x.rt, weights, 4);
  const DevicePtr o = x.Filled(*x.rt, other, 5);
  ASSERT_TRUE(x.ex->Share(weights).ok());
  const TagId src_tag = Tag("mb_wait_src");
  ASSERT_TRUE(x.imp->CreateTag(src_tag, Policy::kDiscard).ok());
  const DevicePtr src = x.Filled(*x.imp, src_tag, 9);
  std::unique_ptr<MappedTag> m = x.Map("mb_wait_weights", &x.imp->node());
  ASSERT_NE(m, nullptr);
  ASSERT_TRUE(x.rt->Pause(weights, -1).ok());
  ASSERT_EQ(m->state(), MappedTag::State::kBackup);
  {
    absl::StatusOr<MappedTag::Use> use = m->Acquire(/*backup=*/true);
    ASSERT_TRUE(use.ok());
    ASSERT_TRUE(m->WriteBackup({{p, src, kBlock / 2}}, Stream{}).ok());  // a sync in progress
    absl::StatusOr<bool> vetoed = x.rt->Resume(weights, -1);
    EXPECT_EQ(vetoed.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(vetoed.status().message(), HasSubstr("did not let go"));
    absl::StatusOr<bool> fenced = x.rt->Resume(weights, -1);  // the writer still holds its use
    EXPECT_EQ(fenced.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(fenced.status().message(), HasSubstr("has not let go"));
    ASSERT_TRUE(x.rt->Pause(other, -1).ok());  // another backup in the pool meanwhile
    absl::Status late = m->WriteBackup({{p, src, kBlock}}, Stream{});
    EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition);  // a revoke waits: no new write
  }
  ASSERT_TRUE(x.rt->Resume(weights, -1).ok());  // it let go: the resume goes through
  EXPECT_EQ(std::memcmp(reinterpret_cast<const void*>(p), reinterpret_cast<const void*>(src), kBlock / 2), 0);
  EXPECT_EQ(WrongBytes(p + kBlock / 2, kBlock / 2, static_cast<unsigned char>(4 + 7 * (kBlock / 2))), 0u);
  EXPECT_TRUE(Reaches(*m, MappedTag::State::kGone));  // dropped once it let go
  ASSERT_TRUE(x.rt->Resume(other, -1).ok());
  EXPECT_EQ(WrongBytes(o, kBlock, 5), 0u);
  // Mapped again: a resume waits for a use in progress.
  ASSERT_TRUE(x.rt->Pause(weights, -1).ok());
  m = x.Map("mb_wait_weights", &x.imp->node());
  ASSERT_NE(m, nullptr);
  ASSERT_EQ(m->state(), MappedTag::State::kBackup);
  std::atomic<bool> resumed{false};
  std::thread resume;
  {
    absl::StatusOr<MappedTag::Use> use = m->Acquire(/*backup=*/true);
    ASSERT_TRUE(use.ok());
    resume = std::thread([&] {
      EXPECT_TRUE(x.rt->Resume(weights, -1).ok());
      resumed = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_FALSE(resumed.load());  // waiting for this use
  }
  resume.join();
  EXPECT_TRUE(resumed.load());
  EXPECT_EQ(m->state(), MappedTag::State::kMapped);
}

// Unshare while a writer holds its use: the writer is fenced as by a veto.
TEST(MappedBackupTest, UnshareFencesAWriterThatHoldsOn) {
  Pair x(/*node=*/true, /*revoke_timeout_ms=*/300);
  Pair::Shared s = x.ShareOne("mb_unsh_weights", 4);
  ASSERT_NE(s.m, nullptr);
  const TagId weights = s.tag;
  const DevicePtr p = s.p, src = s.src;
  std::unique_ptr<MappedTag>& m = s.m;
  ASSERT_TRUE(x.rt->Pause(weights, -1).ok());
  {
    absl::StatusOr<MappedTag::Use> use = m->Acquire(/*backup=*/true);
    ASSERT_TRUE(use.ok());
    ASSERT_TRUE(x.ex->Unshare(weights).ok());
    EXPECT_FALSE(x.rt->Resume(weights, -1).ok());  // fenced
    EXPECT_FALSE(m->WriteBackup({{p, src, kBlock}}, Stream{}).ok());
  }
  ASSERT_TRUE(x.rt->Resume(weights, -1).ok());
  EXPECT_EQ(WrongBytes(p, kBlock, 4), 0u);
  EXPECT_TRUE(Reaches(*m, MappedTag::State::kGone));
}

// A use of the mapping (not asked for the backup) is refused while the tag is paused,
// backup or not: nothing is mapped then.
TEST(MappedBackupTest, APlainUseIsRefusedInBackup) {
  Pair x;
  const TagId weights = Tag("mb_plain_weights");
  ASSERT_TRUE(x.rt->CreateTag(weights, Policy::kBackup).ok());
  (void)x.Filled(*x.rt, weights, 4);
  ASSERT_TRUE(x.ex->Share(weights).ok());
  std::unique_ptr<MappedTag> m = x.Map("mb_plain_weights", &x.imp->node());
  ASSERT_NE(m, nullptr);
  ASSERT_TRUE(x.rt->Pause(weights, -1).ok());
  ASSERT_EQ(m->state(), MappedTag::State::kBackup);
  absl::StatusOr<MappedTag::Use> plain = m->Acquire();
  EXPECT_EQ(plain.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(plain.status().message(), HasSubstr("backup is writable"));
  MappedTag::UseInfo info;
  EXPECT_TRUE(m->Acquire(/*backup=*/true, &info).ok());
  EXPECT_EQ(info.state, MappedTag::State::kBackup);
  EXPECT_EQ(info.grants, m->grants());
  EXPECT_EQ(info.generation, 1u);
  ASSERT_TRUE(x.rt->Resume(weights, -1).ok());
}

// A resume of a tag active already changes nothing a mapped importer holds: no revoke, and
// a use held across it does not veto it.
TEST(MappedBackupTest, AResumeOfAnActiveTagLeavesTheMappingAlone) {
  Pair x(/*node=*/true, /*revoke_timeout_ms=*/300);
  const TagId weights = Tag("mb_noop_weights");
  ASSERT_TRUE(x.rt->CreateTag(weights, Policy::kBackup).ok());
  (void)x.Filled(*x.rt, weights, 4);
  ASSERT_TRUE(x.ex->Share(weights).ok());
  std::unique_ptr<MappedTag> m = x.Map("mb_noop_weights", &x.imp->node());
  ASSERT_NE(m, nullptr);
  const std::uint64_t revokes = m->revokes();
  {
    absl::StatusOr<MappedTag::Use> use = m->Acquire();
    ASSERT_TRUE(use.ok());
    absl::StatusOr<bool> r = x.rt->Resume(weights, -1);
    EXPECT_TRUE(r.ok()) << r.status();
  }
  EXPECT_EQ(m->state(), MappedTag::State::kMapped);
  EXPECT_EQ(m->revokes(), revokes);
}

// The rollout frees its paused weights (release_with_blocks): the arena lent to the
// importer stays the exporter's until the resume, so no other tag's backup is leased
// those bytes while the importer may write them.
TEST(MappedBackupTest, AFreeWhilePausedKeepsTheLentArena) {
  Pair x;
  const TagId weights = Tag("mb_free_weights"), other = Tag("mb_free_other");
  ASSERT_TRUE(x.rt->CreateTag(weights, Policy::kBackup).ok());
  ASSERT_TRUE(x.rt->CreateTag(other, Policy::kBackup).ok());
  const DevicePtr p = x.Filled(*x.rt, weights, 1);
  BackupRetention r;
  r.release_with_blocks = true;
  ASSERT_TRUE(x.rt->Allocator(0).value()->SetBackupRetention(weights, r).ok());
  const DevicePtr o = x.Filled(*x.rt, other, 2);
  ASSERT_TRUE(x.ex->Share(weights).ok());
  const TagId src_tag = Tag("mb_free_src");
  ASSERT_TRUE(x.imp->CreateTag(src_tag, Policy::kDiscard).ok());
  const DevicePtr src = x.Filled(*x.imp, src_tag, 9);
  std::unique_ptr<MappedTag> m = x.Map("mb_free_weights", &x.imp->node());
  ASSERT_NE(m, nullptr);
  ASSERT_TRUE(x.rt->Pause(weights, -1).ok());
  ASSERT_EQ(m->state(), MappedTag::State::kBackup);
  ASSERT_TRUE(x.rt->Allocator(0).value()->Free(p).ok());
  EXPECT_EQ(x.rt->node().Stats()->leases, 1u);  // kept: lent
  ASSERT_TRUE(x.rt->Pause(other, -1).ok());
  {
    absl::StatusOr<MappedTag::Use> use = m->Acquire(/*backup=*/true);
    ASSERT_TRUE(use.ok());
    EXPECT_TRUE(m->WriteBackup({{p, src, kBlock}}, Stream{}).ok());  // into the lent arena: lost with the block
  }
  ASSERT_TRUE(x.rt->Resume(other, -1).ok());
  EXPECT_EQ(WrongBytes(o, kBlock, 2), 0u);
  ASSERT_TRUE(x.rt->Resume(weights, -1).ok());
  EXPECT_EQ(x.rt->node().Stats()->leases, 0u);  // given back with the resume
}

// The daemon started again: an importer whose idle connection maps the old pool finds the
// new one at its first write.
TEST(MappedBackupTest, AnImporterReachesADaemonStartedAgain) {
  Pair x;
  Pair::Shared s = x.ShareOne("mb_rs_weights", 1);
  ASSERT_NE(s.m, nullptr);
  const TagId weights = s.tag;
  const DevicePtr p = s.p, src = s.src;
  std::unique_ptr<MappedTag>& m = s.m;
  x.daemon.reset();  // the daemon stops; another starts (in this process: no fork under threads)
  node::DaemonOptions again;
  again.dir = x.dir;
  again.capacity_bytes = 64 * node::HostPoolLedger::kUnitBytes;
  absl::StatusOr<std::unique_ptr<node::NodeDaemon>> daemon = node::NodeDaemon::Start(again);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  EXPECT_FALSE(x.rt->node().Stats().ok());
  ASSERT_TRUE(x.rt->node().Connect(false).ok());
  ASSERT_TRUE(x.rt->Pause(weights, -1).ok());
  ASSERT_EQ(m->state(), MappedTag::State::kBackup);
  {
    absl::StatusOr<MappedTag::Use> use = m->Acquire(/*backup=*/true);
    ASSERT_TRUE(use.ok());
    absl::Status w = m->WriteBackup({{p, src, kBlock}}, Stream{});
    EXPECT_TRUE(w.ok()) << w;
  }
  ASSERT_TRUE(x.rt->Resume(weights, -1).ok());
  EXPECT_EQ(std::memcmp(reinterpret_cast<const void*>(p), reinterpret_cast<const void*>(src), kBlock), 0);
  m.reset();
  (*daemon)->Stop();
}

// Where the backup cannot be written from the importer: the view says why, and writes
// are refused; the exporter's pauses and resumes go on as before.
TEST(MappedBackupTest, BackupsOutsideThePoolOrUnreachableAreRefusedWithTheReason) {
  {  // The exporter's backups in its own memory.
    Pair x(/*node=*/false);
    const TagId weights = Tag("mb_own_weights");
    ASSERT_TRUE(x.rt->CreateTag(weights, Policy::kBackup).ok());
    const DevicePtr p = x.Filled(*x.rt, weights, 5);
    ASSERT_TRUE(x.ex->Share(weights).ok());
    std::unique_ptr<MappedTag> m = x.Map("mb_own_weights", &x.imp->node());
    ASSERT_NE(m, nullptr);
    ASSERT_TRUE(x.rt->Pause(weights, -1).ok());
    EXPECT_EQ(m->state(), MappedTag::State::kPaused);
    absl::StatusOr<MappedTag::Use> refused = m->Acquire();
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(refused.status().message(), HasSubstr("node:1"));
    ASSERT_TRUE(x.rt->Resume(weights, -1).ok());
    EXPECT_EQ(WrongBytes(p, kBlock, 5), 0u);
    EXPECT_EQ(m->state(), MappedTag::State::kMapped);
  }
  {  // A discard tag keeps no backup.
    Pair x;
    const TagId kv = Tag("mb_kv");
    ASSERT_TRUE(x.rt->CreateTag(kv, Policy::kDiscard).ok());
    (void)x.Filled(*x.rt, kv, 6);
    ASSERT_TRUE(x.ex->Share(kv).ok());
    std::unique_ptr<MappedTag> m = x.Map("mb_kv", &x.imp->node());
    ASSERT_NE(m, nullptr);
    ASSERT_TRUE(x.rt->Pause(kv, -1).ok());
    EXPECT_EQ(m->state(), MappedTag::State::kPaused);
    EXPECT_THAT(m->Acquire().status().message(), HasSubstr("discard"));
  }
  {  // An importer without a pool, and one whose pool is another daemon's.
    const std::string other_dir = node::PrivateDir();
    node::DaemonProcess other(other_dir, 16 * node::HostPoolLedger::kUnitBytes);  // forked before any thread
    ASSERT_TRUE(other.started());
    Pair x;
    const TagId weights = Tag("mb_far_weights");
    ASSERT_TRUE(x.rt->CreateTag(weights, Policy::kBackup).ok());
    const DevicePtr p = x.Filled(*x.rt, weights, 8);
    ASSERT_TRUE(x.ex->Share(weights).ok());
    const TagId src_tag = Tag("mb_far_src");
    ASSERT_TRUE(x.imp->CreateTag(src_tag, Policy::kDiscard).ok());
    const DevicePtr src = x.Filled(*x.imp, src_tag, 9);
    NodeLeases far(&x.imp->driver(), node::NodeOptions{true, 0, false, other_dir});
    std::unique_ptr<MappedTag> none = x.Map("mb_far_weights", nullptr);
    std::unique_ptr<MappedTag> elsewhere = x.Map("mb_far_weights", &far);
    ASSERT_NE(none, nullptr);
    ASSERT_NE(elsewhere, nullptr);
    ASSERT_TRUE(x.rt->Pause(weights, -1).ok());
    {
      absl::StatusOr<MappedTag::Use> a = none->Acquire(true);
      absl::StatusOr<MappedTag::Use> b = elsewhere->Acquire(true);
      ASSERT_TRUE(a.ok() && b.ok());
      EXPECT_THAT(none->WriteBackup({{p, src, kBlock}}, Stream{}).message(), HasSubstr("no node pool"));
      absl::Status s = elsewhere->WriteBackup({{p, src, kBlock}}, Stream{});
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_THAT(s.message(), HasSubstr("another node pool"));
    }
    none.reset();
    elsewhere.reset();
    ASSERT_TRUE(x.rt->Resume(weights, -1).ok());
    EXPECT_EQ(WrongBytes(p, kBlock, 8), 0u);
  }
}

// A tag shared while paused: the importer's first answer is the backup grant.
TEST(MappedBackupTest, APausedTagIsMappedAsItsBackup) {
  Pair x;
  const TagId weights = Tag("mb_late_weights");
  ASSERT_TRUE(x.rt->CreateTag(weights, Policy::kBackup).ok());
  const DevicePtr p = x.Filled(*x.rt, weights, 1);
  ASSERT_TRUE(x.rt->Pause(weights, -1).ok());
  ASSERT_TRUE(x.ex->Share(weights).ok());
  const TagId src_tag = Tag("mb_late_src");
  ASSERT_TRUE(x.imp->CreateTag(src_tag, Policy::kDiscard).ok());
  const DevicePtr src = x.Filled(*x.imp, src_tag, 3);
  std::unique_ptr<MappedTag> m = x.Map("mb_late_weights", &x.imp->node());
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->state(), MappedTag::State::kBackup);
  {
    absl::StatusOr<MappedTag::Use> use = m->Acquire(/*backup=*/true);
    ASSERT_TRUE(use.ok());
    ASSERT_TRUE(m->WriteBackup({{p, src, kBlock}}, Stream{}).ok());
  }
  // Re-published while paused: the importer is renewed with the backup again.
  ASSERT_EQ(x.ex->Share(weights).value(), 2u);
  EXPECT_EQ(m->state(), MappedTag::State::kBackup);
  EXPECT_EQ(m->generation(), 2u);
  ASSERT_TRUE(x.rt->Resume(weights, -1).ok());
  EXPECT_EQ(WrongBytes(p, kBlock, 3), 0u);
}

// Switches: the tag switched out is granted as its backup, switched in mapped again.
TEST(MappedBackupTest, FollowsSwitches) {
  Pair x;
  const TagId weights = Tag("mb_sw_weights"), kv = Tag("mb_sw_kv");
  ASSERT_TRUE(x.rt->CreateTag(weights, Policy::kBackup).ok());
  ASSERT_TRUE(x.rt->CreateTag(kv, Policy::kDiscard).ok());
  const DevicePtr p = x.Filled(*x.rt, weights, 1);
  (void)x.Filled(*x.rt, kv, 2);
  ASSERT_TRUE(x.rt->Pause(kv, -1).ok());
  ASSERT_TRUE(x.ex->Share(weights).ok());
  const TagId src_tag = Tag("mb_sw_src");
  ASSERT_TRUE(x.imp->CreateTag(src_tag, Policy::kDiscard).ok());
  const DevicePtr src = x.Filled(*x.imp, src_tag, 0);
  std::unique_ptr<MappedTag> m = x.Map("mb_sw_weights", &x.imp->node());
  ASSERT_NE(m, nullptr);
  for (unsigned char seed = 20; seed < 24; ++seed) {
    ASSERT_TRUE(x.rt->Switch({weights}, {kv}, -1).ok());
    ASSERT_EQ(m->state(), MappedTag::State::kBackup);
    FillPattern(src, kBlock, seed);
    {
      absl::StatusOr<MappedTag::Use> use = m->Acquire(/*backup=*/true);
      ASSERT_TRUE(use.ok());
      ASSERT_TRUE(m->WriteBackup({{p, src, kBlock}}, Stream{}).ok());
    }
    ASSERT_TRUE(x.rt->Switch({kv}, {weights}, -1).ok());
    ASSERT_EQ(m->state(), MappedTag::State::kMapped);
    EXPECT_EQ(WrongBytes(p, kBlock, seed), 0u);
  }
}

// Review: a revoke that comes while the first write of a grant registers the pool's span
// (outside the importer's lock): that write queues nothing.
TEST(MappedBackupTest, ARevokeArrivingDuringTheFirstBorrowWritesNothing) {
  Pair x(/*node=*/true, /*revoke_timeout_ms=*/300);
  Pair::Shared s = x.ShareOne("rv_borrow_weights", 4);
  ASSERT_NE(s.m, nullptr);
  const TagId weights = s.tag;
  const DevicePtr p = s.p, src = s.src;
  std::unique_ptr<MappedTag>& m = s.m;
  ASSERT_TRUE(x.rt->Pause(weights, -1).ok());
  ASSERT_EQ(m->state(), MappedTag::State::kBackup);
  SimDriver& sim = static_cast<SimDriver&>(x.imp->driver());
  std::atomic<bool> armed{true}, in_borrow{false}, go{false};
  sim.SetBeforeCall([&](DriverOp op) {
    if (op != DriverOp::kHostRegister || !armed.exchange(false)) return;
    in_borrow.store(true);
    for (int i = 0; i < 1000 && !go.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  });
  absl::Status written = absl::UnknownError("not run");
  {
    absl::StatusOr<MappedTag::Use> use = m->Acquire(/*backup=*/true);
    ASSERT_TRUE(use.ok());
    std::thread writer([&] { written = m->WriteBackup({{p, src, kBlock}}, Stream{}); });
    for (int i = 0; i < 500 && !in_borrow.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ASSERT_TRUE(in_borrow.load()) << "the write never registered the span";
    // The rollout resumes: the revoke reaches the importer (its watch thread waits for the use).
    absl::StatusOr<bool> vetoed = x.rt->Resume(weights, -1);
    EXPECT_EQ(vetoed.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(m->Acquire(true).status().code(), absl::StatusCode::kFailedPrecondition);  // a revoke is pending
    go.store(true);
    writer.join();
    EXPECT_FALSE(written.ok()) << "WriteBackup queued its copies although a revoke was pending";
  }
  sim.SetBeforeCall(nullptr);
  ASSERT_TRUE(x.rt->Resume(weights, -1).ok());
  EXPECT_EQ(WrongBytes(p, kBlock, 4), 0u);  // nothing queued after the revoke reached the exporter
}

// A fenced tag holds up its own resume, not an empty_cache of every tag nor one of another.
TEST(MappedBackupTest, AFencedTagHoldsUpItsResumeOnly) {
  Pair x(/*node=*/true, /*revoke_timeout_ms=*/300);
  const TagId weights = Tag("rv_ec_weights"), kv = Tag("rv_ec_kv");
  ASSERT_TRUE(x.rt->CreateTag(weights, Policy::kBackup).ok());
  ASSERT_TRUE(x.rt->CreateTag(kv, Policy::kDiscard).ok());
  (void)x.Filled(*x.rt, weights, 4);
  ASSERT_TRUE(x.ex->Share(weights).ok());
  std::unique_ptr<MappedTag> m = x.Map("rv_ec_weights", &x.imp->node());
  ASSERT_NE(m, nullptr);
  ASSERT_TRUE(x.rt->Pause(weights, -1).ok());
  {
    absl::StatusOr<MappedTag::Use> use = m->Acquire(/*backup=*/true);
    ASSERT_TRUE(use.ok());
    ASSERT_FALSE(x.rt->Resume(weights, -1).ok());  // vetoed: fenced
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status ec = x.rt->EmptyCache(Runtime::kAllDevices, std::nullopt);
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_TRUE(ec.ok()) << ec << " (after " << ms << " ms)";
    absl::Status ec_kv = x.rt->EmptyCache(Runtime::kAllDevices, kv);
    EXPECT_TRUE(ec_kv.ok()) << ec_kv;
  }
  ASSERT_TRUE(x.rt->Resume(weights, -1).ok());
}

// Two writers of one grant at once, and a resume meanwhile (for TSAN).
TEST(MappedBackupTest, TwoWritersAndAResumeAtOnce) {
  Pair x(/*node=*/true, /*revoke_timeout_ms=*/2000);
  Pair::Shared s = x.ShareOne("rv_two_weights", 4);
  ASSERT_NE(s.m, nullptr);
  const TagId weights = s.tag;
  const DevicePtr p = s.p, src = s.src;
  std::unique_ptr<MappedTag>& m = s.m;
  for (int round = 0; round < 5; ++round) {
    ASSERT_TRUE(x.rt->Pause(weights, -1).ok());
    ASSERT_TRUE(Reaches(*m, MappedTag::State::kBackup));
    std::vector<std::thread> ts;
    for (int t = 0; t < 2; ++t) {
      ts.emplace_back([&, t] {
        absl::StatusOr<MappedTag::Use> use = m->Acquire(true);
        if (!use.ok()) return;
        (void)m->WriteBackup({{p + t * (kBlock / 2), src + t * (kBlock / 2), kBlock / 2}}, Stream{});
      });
    }
    std::thread r([&] { (void)x.rt->Resume(weights, -1); });
    for (auto& t : ts) t.join();
    r.join();
    bool ok = false;
    for (int i = 0; i < 5 && !ok; ++i) ok = x.rt->Resume(weights, -1).ok();
    ASSERT_TRUE(ok);
    ASSERT_TRUE(Reaches(*m, MappedTag::State::kMapped));
  }
}

// A pause of a tag paused already changes nothing its backup's writers hold.
TEST(MappedBackupTest, APauseOfAPausedTagLeavesItsWritersAlone) {
  Pair x(/*node=*/true, /*revoke_timeout_ms=*/300);
  const TagId weights = Tag("rv_pp_weights");
  ASSERT_TRUE(x.rt->CreateTag(weights, Policy::kBackup).ok());
  (void)x.Filled(*x.rt, weights, 4);
  ASSERT_TRUE(x.ex->Share(weights).ok());
  std::unique_ptr<MappedTag> m = x.Map("rv_pp_weights", &x.imp->node());
  ASSERT_NE(m, nullptr);
  ASSERT_TRUE(x.rt->Pause(weights, -1).ok());
  const std::uint64_t revokes = m->revokes();
  {
    absl::StatusOr<MappedTag::Use> use = m->Acquire(/*backup=*/true);
    ASSERT_TRUE(use.ok());
    absl::StatusOr<bool> again = x.rt->Pause(weights, -1);
    EXPECT_TRUE(again.ok()) << again.status();
  }
  EXPECT_EQ(m->state(), MappedTag::State::kBackup);
  EXPECT_EQ(m->revokes(), revokes);
  ASSERT_TRUE(x.rt->Resume(weights, -1).ok());
}

}  // namespace
}  // namespace vmstash::share
