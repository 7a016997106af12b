// The control endpoint: a Unix-domain socket served by one thread of a process using
// vmstash, and the client side the CLI uses (docs/architecture.md §8; protocol in protocol.h).
//
// Where: `<dir>/<pid>.sock`, dir = $VMSTASH_RUNTIME_DIR, else $XDG_RUNTIME_DIR/vmstash,
// else /tmp/vmstash-<uid>. The directory is created 0700 and must be owned by this user
// with no group/other access (else the server refuses to start: someone else could
// plant sockets); the socket is 0600. Each connection's peer uid (SO_PEERCRED) must equal
// ours (an injected predicate in tests); others get PERMISSION_DENIED and are closed.
// Sockets of dead processes (<pid>.sock with no such pid) are removed at start and by
// ListEndpoints.
//
// The server thread never touches the allocation path: it calls the handler, which takes
// the allocator's locks like any other caller. A request longer than kMaxMessageBytes,
// or one not read completely within the timeout (a total deadline per request, not per
// read), gets an error reply; the thread keeps serving. The process umask is never
// changed. A forked child's copy of a server neither stops the parent's thread nor
// removes its socket.
//
// The client side (ListEndpoints, EndpointOf, Call) trusts a runtime directory only when
// it is ours with no group/other access, and talks only to a server running as our uid
// (SO_PEERCRED on the connected socket); otherwise PERMISSION_DENIED.
//
// Thread-safety: ControlServer's methods may be called from any thread; the handler runs
// on the server thread only.
#ifndef VMSTASH_CONTROL_ENDPOINT_H_
#define VMSTASH_CONTROL_ENDPOINT_H_

#include <sys/types.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "control/protocol.h"

namespace vmstash::control {

// The runtime directory for this user (see above); not created.
std::string DefaultRuntimeDir();

using Handler = std::function<absl::StatusOr<std::string>(const Request& request)>;  // result JSON

struct ServerOptions {
  std::string dir;              // empty: DefaultRuntimeDir()
  int timeout_ms = 2000;        // per request: reading it all; then again for writing the reply
  // Which peer uids may talk to us (default: our own uid only).
  std::function<bool(uid_t)> peer_allowed;
};

class ControlServer {
 public:
  static absl::StatusOr<std::unique_ptr<ControlServer>> Start(ServerOptions options, Handler handler);
  ~ControlServer();  // stops the thread, removes the socket
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;

  const std::string& socket_path() const { return path_; }
  std::uint64_t served() const { return served_.load(); }
  std::uint64_t refused() const { return refused_.load(); }

 private:
  ControlServer(ServerOptions options, Handler handler, int listen_fd, int wake_fd[2], std::string path);
  void Loop();
  void Serve(int fd);

  const ServerOptions options_;
  const Handler handler_;
  const int listen_fd_;
  const int wake_read_, wake_write_;
  const std::string path_;
  const pid_t owner_pid_;  // a forked child's copy leaves the parent's socket alone
  std::atomic<std::uint64_t> served_{0}, refused_{0};
  std::thread thread_;
};

struct Endpoint {
  int pid = 0;
  std::string path;
};
// Live endpoints in `dir` (empty: DefaultRuntimeDir()), by pid; removes stale sockets.
std::vector<Endpoint> ListEndpoints(const std::string& dir = "");
// The socket of `pid` in `dir`: NotFound (no such process / no endpoint), with a clear message.
absl::StatusOr<std::string> EndpointOf(int pid, const std::string& dir = "");
// Sends one request and returns the result JSON, or the error the process replied with.
// Unavailable when nothing listens, PermissionDenied when refused, DeadlineExceeded on timeout.
absl::StatusOr<std::string> Call(const std::string& socket_path, const Request& request, int timeout_ms = 5000);

}  // namespace vmstash::control

#endif  // VMSTASH_CONTROL_ENDPOINT_H_
