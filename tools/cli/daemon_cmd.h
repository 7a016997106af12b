// The node's commands (docs/node.md): `vmstash daemon start|stop|status`, this user's node
// daemon (vmstashd; node/daemon.h), and `vmstash switch --node`, a switch over the node's
// processes (node/node_switch.h, Note [Node Switch]).
//
//   start   runs vmstashd in the background (its own session, its output appended to
//           <runtime dir>/vmstashd.log) with a pool of `capacity_bytes`, and returns once
//           it serves (within 10 s; else the log's last lines say why). A daemon serving
//           already is fine: said, exit 0. vmstashd is $VMSTASH_DAEMON, else the one beside
//           this program (a wheel's vmstash/bin), else tools/vmstashd/vmstashd of a build
//           tree.
//   stop    sends SIGTERM to the daemon (its pid from the socket's peer credentials) and
//           waits up to 10 s for its socket to go; none running: said, exit 0.
//   status  the pool: capacity, leased now and at the peak, leases, clients; exit 1 when
//           no daemon serves.
//   switch --node  pauses and resumes PID:TAG lists as one transaction, each process given
//           `timeout_ms` to vote; prints each process's outcome; exit 1 when it rolled
//           back (the reason: the process that failed and why) or a process did not confirm.
//
// Thread-safety: one call per process (it forks).
#ifndef VMSTASH_TOOLS_CLI_DAEMON_CMD_H_
#define VMSTASH_TOOLS_CLI_DAEMON_CMD_H_

#include <cstdint>
#include <string>

namespace vmstash::cli {

// The exit status (0 ok, 1 failed), messages on stdout/stderr.
int DaemonStart(std::uint64_t capacity_bytes);
int DaemonStop();
int DaemonStatus(bool json);
int NodeSwitch(const std::string& pause, const std::string& resume, int device, int timeout_ms, bool json);

}  // namespace vmstash::cli

#endif  // VMSTASH_TOOLS_CLI_DAEMON_CMD_H_
