// The switch scenario the switch tests share (switch_fault_test, ringed_backup_test):
// outgoing `out_b` (backup) and `out_d` (discard), active; incoming `in_b` (backup) and
// `in_d` (discard), paused. The sizes make a switch hand chunks over, create fresh pieces
// and release leftovers, with several copy groups each way; out_b also holds a free cached
// block. Every block holds FillPattern(seed) (base/byte_pattern.h).
//
// Test-only (part of the allocator's testing library). Thread-safety: one test's thread.
#ifndef VMSTASH_ALLOCATOR_SWITCH_SCENARIO_H_
#define VMSTASH_ALLOCATOR_SWITCH_SCENARIO_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "allocator/backup_arena.h"
#include "allocator/caching_allocator.h"
#include "allocator/tag.h"
#include "vmm/sim_driver.h"

namespace vmstash::testing {

// A block of a tag filled with FillPattern(seed).
struct PatternBlock {
  DevicePtr address = 0;
  std::size_t size = 0;
  std::uint8_t seed = 0;
};

// One block per size in `tag`, seeds from `seed` in steps of 17.
std::vector<PatternBlock> FillBlocks(CachingAllocator& a, TagId tag, const std::vector<std::size_t>& sizes,
                                     std::uint8_t seed);
// The bytes of `blocks` that differ from their patterns (sim device memory is host memory).
std::size_t WrongBlocks(const std::vector<PatternBlock>& blocks);

struct SwitchScenario {
  std::unique_ptr<SimDriver> sim;
  std::unique_ptr<CachingAllocator> alloc;
  TagId out_b = 0, out_d = 0, in_b = 0, in_d = 0;
  std::vector<PatternBlock> out_blocks;   // both outgoing tags
  std::vector<PatternBlock> in_blocks;    // in_b only (in_d's bytes are undefined after a resume)
  std::vector<PatternBlock> in_d_blocks;
};

// The scenario on a 256 MiB sim device (stages, copy groups and first resume pieces of
// 4 MiB; no background preparation: tests count driver calls), its tags named
// `<prefix>out_backup` and so on; the backup tags on `store` when given.
SwitchScenario MakeSwitchScenario(std::string_view prefix, const BackupStore* store = nullptr);
// Every tag resumed, every block freed, the cache emptied: no device memory is left, then
// the allocator is destroyed and the sim's leak check must pass.
void FinishSwitchScenario(SwitchScenario& f);

}  // namespace vmstash::testing

#endif  // VMSTASH_ALLOCATOR_SWITCH_SCENARIO_H_
