// The control endpoint: a Unix-domain socket served by threads of a process using vmstash
// (Note [Serving Model]), and the client side the CLI uses (Note [Client Deadlines];
// docs/architecture.md §8; protocol in protocol.h).
//
// Where: `<dir>/<pid>.sock` in the runtime directory (runtime_dir.h: where it is, and
// its trust rules: else the server refuses to start); the socket is 0600. Each connection's peer uid (SO_PEERCRED) must equal
// ours (an injected predicate in tests); others get PERMISSION_DENIED and are closed.
// Sockets of dead processes (<pid>.sock with no such pid) are removed at start and by
// ListEndpoints.
//
// Note [Serving Model]
//   One accept thread; each accepted connection is served on a thread of its own, at most
//   ServerOptions::max_connections at once (a connection beyond that gets
//   RESOURCE_EXHAUSTED at once and is closed; finished threads are joined by the accept
//   thread). So a transition that runs for minutes (a 16 GiB pause to disk) holds one
//   connection only: `stats`, `ps` and `hello` are answered meanwhile, and the Runtime
//   orders concurrent transitions itself. The serving threads never touch the allocation
//   path: they call the handler, which takes the allocator's locks like any other caller.
//   A request longer than kMaxMessageBytes, or one not read completely within the timeout
//   (a total deadline per request, not per read), gets an error reply. Stopping the server
//   wakes the accept thread and every read or write in progress, then joins every thread:
//   a handler already running is waited for. When accept fails for want of descriptors or
//   memory (EMFILE, ENFILE, ENOBUFS, ENOMEM) the connection stays pending: the accept
//   thread logs a warning (once per server) and retries every 100 ms instead of spinning,
//   still woken at once by a stop; the client waits meanwhile, up to its deadline. The
//   process umask is never changed. A forked child's copy of a server neither stops the
//   parent's threads nor removes its socket.
//
// Note [Client Deadlines]
//   The client side (ListEndpoints, EndpointOf, Call) trusts a runtime directory only when
//   it is ours with no group/other access, and talks only to a server running as our uid
//   (SO_PEERCRED on the connected socket); otherwise PERMISSION_DENIED. Call's deadline
//   covers sending the request and receiving the whole reply. By default a read (hello,
//   stats, tags, snapshot) gets 5 s, and a transition (pause, resume, switch) none: its
//   time grows with the bytes it moves (minutes for a large pause to disk), and a reply
//   after any fixed deadline would be reported as a failure of a transition that happened.
//   Without a deadline the call still ends when the server process dies. Usually its exit
//   closes the connection and the call fails UNAVAILABLE at once; but a process the server
//   forked while serving (a DataLoader worker) holds a copy of the connection, which then
//   stays open until that child exits. So the client waits in slices of at most 1 s and
//   between them checks the server process, whose pid SO_PEERCRED gave at connect: when
//   it no longer exists, or is a zombie, the call fails UNAVAILABLE "the server process P
//   is gone; the outcome of the request is unknown" (within about a second of its death;
//   with a deadline too). A caller may name a deadline (the CLI's --timeout).
//
// Thread-safety: ControlServer's methods may be called from any thread; the handler runs
// on the serving threads, several at once, so it must be thread-safe. Call and the other
// client functions are thread-safe.
#ifndef VMSTASH_CONTROL_ENDPOINT_H_
#define VMSTASH_CONTROL_ENDPOINT_H_

#include <sys/types.h>

#include <atomic>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "control/protocol.h"
#include "control/runtime_dir.h"

namespace vmstash::control {


using Handler = std::function<absl::StatusOr<std::string>(const Request& request)>;  // result JSON

struct ServerOptions {
  std::string dir;              // empty: DefaultRuntimeDir()
  int timeout_ms = 2000;        // per request: reading it all; then again for writing the reply
  int max_connections = 8;      // served at once (Note [Serving Model]); at least 1
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
  // A serving thread; `done` is its last store, after which the accept thread joins it.
  struct Worker {
    std::thread thread;
    std::atomic<bool> done{false};
  };

  ControlServer(ServerOptions options, Handler handler, int listen_fd, int wake_fd[2], std::string path);
  void Loop();
  void Dispatch(int fd);  // on the accept thread: a serving thread for `fd`, or a refusal
  void Serve(int fd);

  const ServerOptions options_;
  const Handler handler_;
  const int listen_fd_;
  const int wake_read_, wake_write_;
  const std::string path_;
  const pid_t owner_pid_;  // a forked child's copy leaves the parent's socket alone
  std::atomic<std::uint64_t> served_{0}, refused_{0};
  std::thread thread_;  // the accept thread
  // The serving threads: touched by the accept thread only, and by the destructor once
  // that thread is joined. A forked child leaks its copy (the threads are the parent's).
  std::unique_ptr<std::list<std::unique_ptr<Worker>>> workers_;
};

struct Endpoint {
  int pid = 0;
  std::string path;
};
// Live endpoints in `dir` (empty: DefaultRuntimeDir()), by pid; removes stale sockets.
std::vector<Endpoint> ListEndpoints(const std::string& dir = "");
// The socket of `pid` in `dir`: NotFound (no such process / no endpoint), with a clear message.
absl::StatusOr<std::string> EndpointOf(int pid, const std::string& dir = "");
// Deadlines of Call (Note [Client Deadlines]); 0: none.
struct CallOptions {
  int read_timeout_ms = 5000;     // hello, stats, tags, snapshot
  int transition_timeout_ms = 0;  // pause, resume, switch
};
// Whether `op` changes a tag's state (pause, resume, switch).
bool IsTransition(Op op);
// Sends one request and returns the result JSON, or the error the process replied with.
// Unavailable when nothing listens or the connection closes before the reply,
// PermissionDenied when refused, DeadlineExceeded on timeout.
absl::StatusOr<std::string> Call(const std::string& socket_path, const Request& request,
                                 const CallOptions& options = CallOptions());
// As above with one deadline for any op (0: none).
absl::StatusOr<std::string> Call(const std::string& socket_path, const Request& request, int timeout_ms);

}  // namespace vmstash::control

#endif  // VMSTASH_CONTROL_ENDPOINT_H_
