// Note [Retained Backups] (allocator/tag_pool.h) and Note [Disk Backup Files]
// (allocator/backup_arena.h) on the simulator: a failed pause or switch changes nothing a
// retained backup holds (it stays readable with its bytes, or is dropped once the arena
// was written over, never read back changed); a backup released with its blocks is
// released even when a reader held the tag's transition lock at the last free, and stays
// released (Note [Retired Ranges]: no later arena is pinned at its addresses); a forked
// child that exits leaves its parent's disk backup files in place.
#include <dirent.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "allocator/backup_arena.h"
#include "allocator/caching_allocator.h"
#include "allocator/tag_pool.h"
#include "allocator/testing.h"
#include "gtest/gtest.h"
#include "vmm/sim_driver.h"

namespace vmstash {
namespace {

using ::vmstash::testing::TagStatsOf;

void Fill(DevicePtr p, std::size_t n, std::uint8_t seed) {
  auto* b = reinterpret_cast<std::uint8_t*>(p);
  for (std::size_t i = 0; i < n; i += 4096) b[i] = static_cast<std::uint8_t>(seed + i / 4096);
  b[n - 1] = static_cast<std::uint8_t>(seed ^ 0x5a);
}

// Whether `buf` (n bytes) holds Fill(seed).
bool Holds(const std::vector<std::uint8_t>& buf, std::size_t n, std::uint8_t seed) {
  for (std::size_t i = 0; i < n; i += 4096) {
    if (buf[i] != static_cast<std::uint8_t>(seed + i / 4096)) return false;
  }
  return buf[n - 1] == static_cast<std::uint8_t>(seed ^ 0x5a);
}

class RetainedBackupTest : public testing::SimAllocatorTest {
 protected:
  void Make(BackupStore store = {}) {
    AllocatorOptions options = testing::TestOptions();
    options.auto_prepare = false;
    MakeAllocator(SimDriverOptions{1, 512 * kMiB, 2 * kMiB, {}}, options);
    tag_ = *InternTag("retained_a");
    other_ = *InternTag("retained_b");
    ASSERT_TRUE(alloc_->CreateTag(tag_, Policy::kBackup).ok());
    ASSERT_TRUE(alloc_->CreateTag(other_, Policy::kBackup).ok());
    ASSERT_TRUE(alloc_->SetBackupStore(tag_, store).ok());
    ASSERT_TRUE(alloc_->SetBackupRetention(tag_, BackupRetention{true, true}).ok());
  }

  // Blocks of `tag_` filled with seeds 1, 2, ...; paused and resumed: their backup retained.
  void AllocatePauseResume(std::vector<std::size_t> sizes) {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      DevicePtr p = *alloc_->Allocate(sizes[i], nullptr, tag_);
      Fill(p, sizes[i], static_cast<std::uint8_t>(i + 1));
      blocks_.emplace_back(p, sizes[i]);
    }
    ASSERT_TRUE(alloc_->Pause(tag_).ok());
    ASSERT_TRUE(alloc_->Resume(tag_).ok());
    ASSERT_TRUE(RetainedIntact());
  }

  // Every block's retained backup reads back as it was written.
  bool RetainedIntact() {
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      std::vector<std::uint8_t> buf(blocks_[i].second);
      absl::Status s = alloc_->ReadBackup(blocks_[i].first, blocks_[i].second, buf.data());
      if (!s.ok()) {
        ADD_FAILURE() << "block " << i << ": " << s;
        return false;
      }
      if (!Holds(buf, blocks_[i].second, static_cast<std::uint8_t>(i + 1))) {
        ADD_FAILURE() << "block " << i << ": its retained backup was changed";
        return false;
      }
    }
    return true;
  }

  void FreeAll() {
    for (auto [p, n] : blocks_) ASSERT_TRUE(alloc_->Free(p).ok());
    blocks_.clear();
  }

  TagId tag_ = 0, other_ = 0;
  std::vector<std::pair<DevicePtr, std::size_t>> blocks_;
};

// A pause that fails before touching the arena (its device synchronization) changes
// nothing: the retained backup stays readable.
TEST_F(RetainedBackupTest, APauseFailingBeforeItsCopiesKeepsTheRetainedBackup) {
  Make();
  AllocatePauseResume({3 * kMiB, 5 * kMiB});
  sim_->InjectFault(FaultRule{DriverOp::kSynchronizeDevice, 1, 1, absl::StatusCode::kInternal});
  EXPECT_FALSE(alloc_->Pause(tag_).ok());
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).state, "active");
  EXPECT_TRUE(RetainedIntact());
  EXPECT_TRUE(alloc_->Validate().ok());
  FreeAll();
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).backup_arena_bytes, 0);
}

// A pause that fails after its copies wrote into the arena: the retained extents are
// gone (never read back changed), and the arena goes with the tag's blocks all the same.
TEST_F(RetainedBackupTest, APauseFailingInItsCopiesDropsTheRetainedBackupAndTheArenaGoesWithTheBlocks) {
  Make();
  AllocatePauseResume({3 * kMiB, 5 * kMiB});
  sim_->InjectFault(FaultRule{DriverOp::kSynchronizeEvent, 1, 1, absl::StatusCode::kInternal});
  EXPECT_FALSE(alloc_->Pause(tag_).ok());
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).state, "active");
  std::vector<std::uint8_t> buf(4096);
  EXPECT_TRUE(absl::IsNotFound(alloc_->ReadBackup(blocks_[0].first, 4096, buf.data())));
  EXPECT_TRUE(alloc_->Validate().ok());
  FreeAll();
  // release_with_blocks: the backup lives no longer than its blocks.
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).backup_arena_bytes, 0);
  EXPECT_TRUE(alloc_->Validate().ok());
}

// A switch that fails before its backups touch the outgoing tag's arena (the device
// synchronization) changes nothing: a pageable arena's retained bytes stay readable.
TEST_F(RetainedBackupTest, ASwitchFailingBeforeItsBackupsKeepsTheRetainedBackup) {
  Make(BackupStore{BackupStore::Kind::kPageable, ""});
  DevicePtr q = *alloc_->Allocate(2 * kMiB, nullptr, other_);
  Fill(q, 2 * kMiB, 99);
  ASSERT_TRUE(alloc_->Pause(other_).ok());
  AllocatePauseResume({3 * kMiB, 5 * kMiB});
  sim_->InjectFault(FaultRule{DriverOp::kSynchronizeDevice, 1, 1, absl::StatusCode::kInternal});
  EXPECT_FALSE(alloc_->Switch({tag_}, {other_}).ok());
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).state, "active");
  EXPECT_EQ(TagStatsOf(*alloc_, other_).state, "paused");
  EXPECT_TRUE(RetainedIntact());
  EXPECT_TRUE(alloc_->Validate().ok());
  // A switch that goes through overwrites it in place and reads back the new bytes.
  ASSERT_TRUE(alloc_->Switch({tag_}, {other_}).ok());
  ASSERT_TRUE(alloc_->Switch({other_}, {tag_}).ok());
  EXPECT_TRUE(RetainedIntact());
  ASSERT_TRUE(alloc_->Free(q).ok());
  FreeAll();
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).backup_arena_bytes, 0);
  EXPECT_TRUE(alloc_->Validate().ok());
}

// A switch failing in its device-to-host copies: the retained extents are dropped, and
// the arena goes with the blocks.
TEST_F(RetainedBackupTest, ASwitchFailingInItsBackupsDropsTheRetainedBackup) {
  Make(BackupStore{BackupStore::Kind::kPageable, ""});
  DevicePtr q = *alloc_->Allocate(2 * kMiB, nullptr, other_);
  ASSERT_TRUE(alloc_->Pause(other_).ok());
  AllocatePauseResume({3 * kMiB, 5 * kMiB});
  sim_->InjectFault(FaultRule{DriverOp::kCopyToHost, 1, 1, absl::StatusCode::kInternal});
  EXPECT_FALSE(alloc_->Switch({tag_}, {other_}).ok());
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).state, "active");
  std::vector<std::uint8_t> buf(4096);
  EXPECT_TRUE(absl::IsNotFound(alloc_->ReadBackup(blocks_[0].first, 4096, buf.data())));
  EXPECT_TRUE(alloc_->Validate().ok());
  FreeAll();
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).backup_arena_bytes, 0);
  ASSERT_TRUE(alloc_->Resume(other_).ok());
  ASSERT_TRUE(alloc_->Free(q).ok());
}

// The control of the next test: with nobody reading, the last free releases the backup.
TEST_F(RetainedBackupTest, TheLastFreeReleasesTheBackup) {
  Make();
  AllocatePauseResume({16 * kMiB, 2 * kMiB});
  EXPECT_GT(TagStatsOf(*alloc_, tag_).backup_arena_bytes, 0);
  ASSERT_TRUE(alloc_->Free(blocks_[0].first).ok());
  EXPECT_GT(TagStatsOf(*alloc_, tag_).backup_arena_bytes, 0);  // block 1 still has its bytes there
  ASSERT_TRUE(alloc_->Free(blocks_[1].first).ok());
  blocks_.clear();
  EXPECT_EQ(TagStatsOf(*alloc_, tag_).backup_arena_bytes, 0);
  EXPECT_TRUE(alloc_->Validate().ok());
}

// The last retained block freed while another thread reads that backup (holding the
// tag's transition lock): the arena is still released once the reader is done.
TEST_F(RetainedBackupTest, TheLastFreeReleasesTheBackupEvenWhileAReaderHoldsTheTag) {
  Make();
  int leaked = 0;
  for (int round = 0; round < 30; ++round) {
    blocks_.clear();
    AllocatePauseResume({16 * kMiB});
    const DevicePtr p = blocks_[0].first;
    std::atomic<bool> started{false};
    std::thread reader([&] {
      std::vector<std::uint8_t> buf(16 * kMiB);
      for (;;) {
        absl::Status s = alloc_->ReadBackup(p, 16 * kMiB, buf.data());
        started.store(true);
        if (!s.ok()) break;  // NotFound: the block was freed
      }
    });
    while (!started.load()) std::this_thread::yield();
    ASSERT_TRUE(alloc_->Free(p).ok());
    reader.join();
    blocks_.clear();
    if (TagStatsOf(*alloc_, tag_).backup_arena_bytes != 0) ++leaked;
    // Whatever was left is given back before the next round.
    ASSERT_TRUE(alloc_->ReleaseBackup(tag_).ok());
  }
  EXPECT_EQ(leaked, 0) << "rounds whose backup outlived its last block";
  EXPECT_TRUE(alloc_->Validate().ok());
}

// Whether anything is mapped at the page holding `p` (another mapping could not take it).
bool PageMapped(const void* p) {
  const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  void* at = reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(p) / page * page);
  void* got = mmap(at, page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
  if (got == MAP_FAILED) return errno == EEXIST;
  munmap(got, page);
  return got != at;  // a kernel without MAP_FIXED_NOREPLACE places it elsewhere when taken
}

// torch_memory_saver's retain_cpu_backup: a backup read in place (BackupAddress, its
// get_cpu_backup(zero_copy=True)), then the tag's last block freed. The backup is released
// and stays released: its host address is not page-locked afterwards, also when another
// tag's pinned arena is made right after (here a foreground preparation; in the drop-in,
// a background preparation of another tag that came due then) — that arena must not take
// the released address range. The tag's own next arena does not either.
TEST_F(RetainedBackupTest, AReleasedBackupsAddressStaysUnpinnedWhenAnotherArenaIsMadeAfterIt) {
  Make();
  const DevicePtr q = *alloc_->Allocate(2 * kMiB, nullptr, other_);
  for (bool paused : {true, false}) {
    SCOPED_TRACE(paused ? "freed while paused" : "freed after the resume");
    const DevicePtr p = *alloc_->Allocate(4 * kKiB, nullptr, tag_);
    Fill(p, 4 * kKiB, 7);
    ASSERT_TRUE(alloc_->Pause(tag_).ok());
    const void* backup = *alloc_->BackupAddress(p, 4 * kKiB);
    if (!paused) {
      ASSERT_TRUE(alloc_->Resume(tag_).ok());
      ASSERT_EQ(*alloc_->BackupAddress(p, 4 * kKiB), backup) << "retained in place";
    }
    ASSERT_TRUE(sim_->HostPageLocked(backup));
    ASSERT_TRUE(alloc_->Free(p).ok());
    EXPECT_EQ(TagStatsOf(*alloc_, tag_).backup_arena_bytes, 0);
    EXPECT_FALSE(sim_->HostPageLocked(backup)) << "released";
    EXPECT_TRUE(PageMapped(backup)) << "the released range was left for any mapping to take";
    ASSERT_TRUE(alloc_->Prepare(other_, 4 * kKiB).ok());  // a new pinned arena of the same size
    EXPECT_FALSE(sim_->HostPageLocked(backup)) << "another tag's arena took the released range";
    if (paused) {
      ASSERT_TRUE(alloc_->Resume(tag_).ok());
    }
    // The tag's own next backup goes elsewhere too.
    const DevicePtr again = *alloc_->Allocate(4 * kKiB, nullptr, tag_);
    ASSERT_TRUE(alloc_->Pause(tag_).ok());
    EXPECT_FALSE(sim_->HostPageLocked(backup)) << "the tag's next arena took the released range";
    ASSERT_TRUE(alloc_->Resume(tag_).ok());
    ASSERT_TRUE(alloc_->Free(again).ok());
    ASSERT_TRUE(alloc_->ReleaseBackup(other_).ok());
  }
  ASSERT_TRUE(alloc_->Free(q).ok());
  EXPECT_TRUE(alloc_->Validate().ok());
}

// The drop-in's sequence with its background preparation: another tag's block was
// allocated before the backup was read in place, so that tag's preparation (queued then,
// waiting for the tag to settle) comes due only after the backup's last block was freed.
// Its arena, of the released arena's size, must not be mapped and pinned at the released
// addresses. (A first preparation of the same size beforehand leaves the thread that warms
// two pieces with a stack already mapped, so nothing is mapped between the two arenas:
// without Note [Retired Ranges] the second lands where the first was.)
TEST_F(RetainedBackupTest, AReleasedBackupsAddressStaysUnpinnedWhenABackgroundPreparationComesDue) {
  AllocatorOptions options = testing::TestOptions();
  options.auto_prepare_settle_ms = 500;
  MakeAllocator(SimDriverOptions{1, 512 * kMiB, 2 * kMiB, {}}, options);
  tag_ = *InternTag("retained_a");
  other_ = *InternTag("retained_b");
  ASSERT_TRUE(alloc_->CreateTag(tag_, Policy::kBackup).ok());
  ASSERT_TRUE(alloc_->CreateTag(other_, Policy::kBackup).ok());
  ASSERT_TRUE(alloc_->SetBackupRetention(tag_, BackupRetention{true, true}).ok());
  const DevicePtr p = *alloc_->Allocate(4 * kKiB, nullptr, tag_);
  ASSERT_TRUE(alloc_->Prepare(tag_, 64 * kMiB).ok());  // what the background request asks for
  ASSERT_TRUE(alloc_->ReleaseBackup(tag_).ok());
  ASSERT_TRUE(alloc_->Prepare(tag_, 64 * kMiB).ok());
  const DevicePtr q = *alloc_->Allocate(2 * kMiB, nullptr, other_);  // its preparation is queued
  ASSERT_TRUE(alloc_->Pause(tag_).ok());
  const void* backup = *alloc_->BackupAddress(p, 4 * kKiB);
  ASSERT_TRUE(alloc_->Free(p).ok());
  EXPECT_FALSE(sim_->HostPageLocked(backup)) << "released";
  alloc_->WaitForBackgroundPrepare();
  EXPECT_GT(TagStatsOf(*alloc_, other_).backup_arena_bytes, 0) << "the other tag was prepared";
  EXPECT_FALSE(sim_->HostPageLocked(backup)) << "the other tag's prepared arena took the released range";
  ASSERT_TRUE(alloc_->Resume(tag_).ok());
  ASSERT_TRUE(alloc_->Free(q).ok());
  EXPECT_TRUE(alloc_->Validate().ok());
}

std::vector<std::string> FilesIn(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  while (const dirent* e = readdir(d)) {
    if (std::strncmp(e->d_name, "vmstash-tms-", 12) == 0) out.push_back(e->d_name);
  }
  closedir(d);
  return out;
}

// Note [Disk Backup Files]: the exit handler removes this process's files; a forked child
// (a copy of the parent's list) that exits must not remove the parent's.
TEST_F(RetainedBackupTest, AForkedChildThatExitsLeavesItsParentsDiskBackupFiles) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/retained_fork_XXXXXX");
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  Make(BackupStore{BackupStore::Kind::kDiskFiles, dir});
  for (std::size_t n : {3 * kMiB, 5 * kMiB}) blocks_.emplace_back(*alloc_->Allocate(n, nullptr, tag_), n);
  ASSERT_TRUE(alloc_->Pause(tag_).ok());
  const std::vector<std::string> files = FilesIn(dir);
  ASSERT_EQ(files.size(), 2u);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) std::exit(0);  // runs the exit handlers, as a forked worker's sys.exit() does
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_EQ(FilesIn(dir).size(), 2u) << "the child's exit removed its parent's backup files";
  ASSERT_TRUE(alloc_->Resume(tag_).ok());
  EXPECT_TRUE(FilesIn(dir).empty());
  FreeAll();
  rmdir(dir.c_str());
}

}  // namespace
}  // namespace vmstash
