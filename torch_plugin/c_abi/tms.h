// What the preload library (torch_plugin/preload/vmstash_preload.cc) shares with the
// torch_memory_saver entry points (tms_c.cc, torch_plugin/include/vmstash/vmstash_tms.h):
// one routing state per thread, kept here so that tms_set_interesting_region and the
// preload hooks read and write the same flag, whichever library carries the C ABI.
//
// Thread-safety: the override and the thread's config are thread-locals; the whole-process
// tag is set once, at the preload library's load, before any other thread runs.
#ifndef VMSTASH_TORCH_PLUGIN_C_ABI_TMS_H_
#define VMSTASH_TORCH_PLUGIN_C_ABI_TMS_H_

namespace vmstash::tms {

// The calling thread's routing override: -1 unset (the default rule), 0 never routed, 1
// always routed (torch_memory_saver's interesting-region flag).
int RoutedOverride();
// Sets it (-1, 0 or 1; any other positive value is 1); returns the previous one.
int SetRoutedOverride(int routed);

// The preload library, at load, in whole-process mode: the name of its process tag, which
// torch_memory_saver's tag "default" with the TMS_INIT_* backup setting maps to (Note [TMS
// Tags] in vmstash_tms.h). The string must live as long as the process.
void SetProcessTag(const char* name);

// The vmstash tag the calling thread's routed allocations go to when it configured
// torch_memory_saver's per-thread state (a tms_set_* call, or a region pushed by the
// Python layer): its tag and backup setting's vmstash tag, declared on first use
// (nullptr and *error set on failure: the allocation fails), or "default" for the
// whole-process default (the preload library's process tag follows). nullptr without
// error when the thread never configured it: vmstash's own routing applies.
const char* AllocationTag(bool* error);

}  // namespace vmstash::tms

#endif  // VMSTASH_TORCH_PLUGIN_C_ABI_TMS_H_
