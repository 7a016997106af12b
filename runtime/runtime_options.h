// RuntimeOptions: the one VMSTASH_CONF table, composed from the keys each layer owns:
// vmm's (driver, log_level, sim_*: vmm/vmm_options.h), the allocator's (bypass,
// min_chunk, max_chunk, heap_va, backup, auto_prepare, switch_zero, host_max, spill_dir,
// share_chunks: allocator/allocator_options.h) and
// the control endpoint's (control: control/control_options.h) and the node pool's (node,
// node_capacity: node/node_options.h). The syntax is base/conf.h. `node:1` turns
// share_chunks on unless the conf sets it.
// An unknown key is the same InvalidArgument whichever layer's key was meant, naming the
// key and listing every known one.
//
// RuntimeOptionsFromEnvironment() is the only place in the project that reads the
// environment for options: VMSTASH_CONF, VMSTASH_DRIVER (same values as `driver`,
// overrides it), and torch_memory_saver's TMS_DEBUG_LOG (1 or true: log_level debug,
// unless VMSTASH_CONF names a level).
//
// Thread-safety: pure functions (the environment read is a read).
#ifndef VMSTASH_RUNTIME_RUNTIME_OPTIONS_H_
#define VMSTASH_RUNTIME_RUNTIME_OPTIONS_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "allocator/allocator_options.h"
#include "control/control_options.h"
#include "node/node_options.h"
#include "vmm/vmm_options.h"

namespace vmstash {

struct RuntimeOptions {
  VmmOptions vmm;
  AllocatorOptions allocator;
  control::ControlOptions control;
  node::NodeOptions node;
};

absl::StatusOr<RuntimeOptions> ParseRuntimeOptions(absl::string_view conf);
// Parses VMSTASH_CONF, then applies VMSTASH_DRIVER.
absl::StatusOr<RuntimeOptions> RuntimeOptionsFromEnvironment();
// The canonical VMSTASH_CONF string for `options` (round-trips through ParseRuntimeOptions).
std::string RuntimeOptionsToString(const RuntimeOptions& options);

}  // namespace vmstash

#endif  // VMSTASH_RUNTIME_RUNTIME_OPTIONS_H_
