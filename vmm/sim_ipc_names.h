// The names of the simulator's interprocess events (SimDriver::CreateIpcEvent): each is a
// POSIX shared-memory object, "/vmstash-simev-<pid>-<count>-<random>", and its handle
// (kIpcEventHandleBytes) is a magic followed by that name, zero padded. Here: new names,
// handles to and from names, and the sweep of names that killed exporters left behind.
//
// Thread-safety: pure functions (NewSimIpcName counts atomically).
#ifndef VMSTASH_VMM_SIM_IPC_NAMES_H_
#define VMSTASH_VMM_SIM_IPC_NAMES_H_

#include <string>

#include "absl/status/statusor.h"

namespace vmstash {

// A name no other object has (O_EXCL makes sure): this pid, a process-wide count, and a
// few random bits, so that a pid recycled after a crash that left a name behind differs.
std::string NewSimIpcName();
// The handle of the event named `name` (a NewSimIpcName).
std::string SimIpcHandle(const std::string& name);
// The name in `handle`; InvalidArgument naming the fault for any other bytes.
absl::StatusOr<std::string> SimIpcNameOf(const std::string& handle);
// Removes from /dev/shm the names whose pid is no process (exporters killed before they
// destroyed their events).
void SweepDeadSimIpcNames();

}  // namespace vmstash

#endif  // VMSTASH_VMM_SIM_IPC_NAMES_H_
