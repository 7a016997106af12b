#include "allocator/switch_scenario.h"

#include <string>

#include "allocator/testing.h"
#include "base/byte_pattern.h"
#include "gtest/gtest.h"

namespace vmstash::testing {

std::vector<PatternBlock> FillBlocks(CachingAllocator& a, TagId tag, const std::vector<std::size_t>& sizes,
                                     std::uint8_t seed) {
  std::vector<PatternBlock> out;
  for (std::size_t n : sizes) {
    DevicePtr p = *a.Allocate(n, nullptr, tag);
    FillPattern(p, n, seed);
    out.push_back({p, n, seed});
    seed = static_cast<std::uint8_t>(seed + 17);
  }
  return out;
}

std::size_t WrongBlocks(const std::vector<PatternBlock>& blocks) {
  std::size_t wrong = 0;
  for (const PatternBlock& b : blocks) wrong += WrongBytes(b.address, b.size, b.seed);
  return wrong;
}

SwitchScenario MakeSwitchScenario(std::string_view prefix, const BackupStore* store) {
  SwitchScenario f;
  f.sim = std::make_unique<SimDriver>(SimDriverOptions{1, 256 * kMiB, 2 * kMiB, {}});
  AllocatorOptions options = TestOptions();
  options.auto_prepare = false;  // tests count driver calls
  options.pause_stage_bytes = 4 * kMiB;
  options.switch_group_bytes = 4 * kMiB;
  options.resume_first_piece_bytes = 4 * kMiB;
  f.alloc = *CachingAllocator::Create(f.sim.get(), 0, options);
  const std::string p(prefix);
  f.out_b = *InternTag(p + "out_backup");
  f.out_d = *InternTag(p + "out_discard");
  f.in_b = *InternTag(p + "in_backup");
  f.in_d = *InternTag(p + "in_discard");
  EXPECT_TRUE(f.alloc->CreateTag(f.out_b, Policy::kBackup).ok());
  EXPECT_TRUE(f.alloc->CreateTag(f.out_d, Policy::kDiscard).ok());
  EXPECT_TRUE(f.alloc->CreateTag(f.in_b, Policy::kBackup).ok());
  EXPECT_TRUE(f.alloc->CreateTag(f.in_d, Policy::kDiscard).ok());
  if (store != nullptr) {
    EXPECT_TRUE(f.alloc->SetBackupStore(f.out_b, *store).ok());
    EXPECT_TRUE(f.alloc->SetBackupStore(f.in_b, *store).ok());
  }
  const std::vector<std::size_t> sizes = {4096, 700 * 1024, 3 * kMiB, 12 * kMiB, 20 * kMiB};
  f.in_blocks = FillBlocks(*f.alloc, f.in_b, sizes, 101);
  f.in_d_blocks = FillBlocks(*f.alloc, f.in_d, {6 * kMiB}, 7);
  EXPECT_EQ(*f.alloc->Pause(f.in_b), CachingAllocator::Transition::kDone);
  EXPECT_EQ(*f.alloc->Pause(f.in_d), CachingAllocator::Transition::kDone);
  f.out_blocks = FillBlocks(*f.alloc, f.out_b, sizes, 1);
  DevicePtr dropped = *f.alloc->Allocate(5 * kMiB, nullptr, f.out_b);  // a free cached block
  EXPECT_TRUE(f.alloc->Free(dropped).ok());
  std::vector<PatternBlock> d = FillBlocks(*f.alloc, f.out_d, {8 * kMiB, 64 * 1024}, 200);
  f.out_blocks.insert(f.out_blocks.end(), d.begin(), d.end());
  return f;
}

void FinishSwitchScenario(SwitchScenario& f) {
  for (TagId t : {f.out_b, f.out_d, f.in_b, f.in_d}) ASSERT_TRUE(f.alloc->Resume(t).ok());
  for (const auto* v : {&f.out_blocks, &f.in_blocks, &f.in_d_blocks}) {
    for (const PatternBlock& b : *v) ASSERT_TRUE(f.alloc->Free(b.address).ok());
  }
  ASSERT_TRUE(f.alloc->EmptyCache().ok());
  EXPECT_EQ(f.sim->UsedBytes(0), 0u);
  f.alloc.reset();
  absl::Status leaks = f.sim->CheckNoLeaks();
  ASSERT_TRUE(leaks.ok()) << leaks;
}

}  // namespace vmstash::testing
