// Starting the node daemon (daemon.h) from a client process or the CLI (docs/node.md):
// find vmstashd, run it detached in its own session with its output appended to
// `<dir>/vmstashd.log`, and wait until it serves.
//
// Where vmstashd is looked for, in order: $VMSTASH_DAEMON (when set, only there); beside the running program and
// in `../vmstashd/` from it (the CLI and its build tree); beside the shared library that
// holds this code and in `../bin/` from it (the wheel: vmstash/lib/libvmstash.so and
// vmstash/bin/vmstashd); then each directory of $PATH.
//
// The daemon is spawned (posix_spawn: no fork handler of the caller runs, so a process
// holding its own locks across fork, as the vmstash runtime does, can start it), with
// LD_PRELOAD removed from its environment (a preload library meant for the client is not
// the daemon's), and `--detach`: it leaves its own session as a grandchild, so it is
// nobody's zombie and outlives the process that started it.
//
// Thread-safety: pure functions.
#ifndef VMSTASH_NODE_LAUNCH_H_
#define VMSTASH_NODE_LAUNCH_H_

#include <sys/types.h>

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace vmstash::node {

// vmstashd's path (above), or NotFound listing where it looked.
absl::StatusOr<std::string> DaemonBinary();
// The pid of the daemon serving `dir`'s socket as our uid, or 0 when none answers.
pid_t ServingPid(const std::string& dir);
// Half of the host's memory (MemTotal), rounded down to 2 MiB: the default pool size.
std::size_t DefaultCapacityBytes();

struct Started {
  pid_t pid = 0;
  bool already = false;  // it was serving before this call
};
// The daemon serving `dir`, started with a pool of `capacity_bytes` when none was.
// NotFound (no vmstashd), FailedPrecondition (the directory's trust rules), Unavailable
// (it did not come up within `wait_ms`; the message holds the end of its log).
absl::StatusOr<Started> StartDaemon(const std::string& dir, std::size_t capacity_bytes, int wait_ms = 10000);

}  // namespace vmstash::node

#endif  // VMSTASH_NODE_LAUNCH_H_
