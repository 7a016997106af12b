// NodeDaemon: the node's memory daemon, vmstashd (docs/node.md): one per user per node.
// It owns the node's one host pool (shared_memory.h: a memfd every client maps) and its
// ledger (host_pool.h), and serves the node protocol (wire.h) on
// `<runtime dir>/vmstashd.sock`.
//
// Note [Node Daemon Lifecycle]
//   Serving: one thread polls the listening socket and every client's connection; each
//   request is answered at once (no request blocks: the ledger is a table), so the
//   thread is the ledger's one writer. A connection is a client: hello first (the reply
//   carries the pool's memfd), then leases and gives. A peer of another uid is refused
//   at accept. At most DaemonOptions::max_clients connections are served at once: one
//   more gets its first request answered with ResourceExhausted and is closed (twice as
//   many at once: closed at accept).
//   Crashes: the daemon keeps no state a crash can corrupt. When a client's connection
//   closes — it exited, or died — everything it leased returns to the pool at once
//   (HostPoolLedger::GiveAll). When the daemon dies, its clients keep the pool's pages
//   they mapped (the memfd lives while a process maps it) and what they leased stays
//   theirs to use; their new requests fail Unavailable (node/client.h) until they
//   connect to a daemon started again, which starts with an empty pool.
//   Start: one daemon per directory — it holds an flock on `<dir>/vmstashd.lock` while it
//   lives (the kernel drops it however the process ends), so a second one, started at the
//   same moment or later, is refused (AlreadyExists); the socket it finds is a dead
//   daemon's and is replaced. Stop: wakes the thread, joins it, closes every connection
//   (their leases go back), removes the socket, then lets go of the lock.
//   Node switches (Note [Node Switch], node_switch.h): the daemon keeps their ledger
//   (switch_ledger.h) and decides each, recording the decision (decision_record.h)
//   before it tells anyone. A vote's reply is held until the decision; the participants
//   that have not been told are watched through pidfds (an exit decides "abort" when the
//   process had not voted), and the poll's timeout is the next deadline. A forgotten
//   switch's record is removed a minute later; at start, the records whose participants
//   are all gone are removed.
//   Misbehaving clients: connections are non-blocking, so a client that does not read
//   its replies is dropped (its leases go back) when its send buffer is full; an empty
//   packet, garbage, or a packet with descriptors gets an error reply (the descriptors
//   are closed); out of descriptors, a pending connection is taken and closed rather than
//   left to spin the loop. A client's connection inherited by a forked child (fork without
//   exec) stays open while the child lives: its leases go back when both have closed it.
//
// Thread-safety: Start/Stop/stats from any thread; the serving thread owns the rest.
#ifndef VMSTASH_NODE_DAEMON_H_
#define VMSTASH_NODE_DAEMON_H_

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <functional>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/mutex.h"
#include "node/host_pool.h"
#include "node/shared_memory.h"
#include "node/switch_ledger.h"
#include "node/wire.h"

namespace vmstash::node {

struct DaemonOptions {
  std::string dir;                // empty: control::DefaultRuntimeDir()
  std::size_t capacity_bytes = 0; // the pool's size (rounded down to ledger units); > 0
  int max_clients = 256;
  // Which peer uids may connect (default: our own uid only).
  std::function<bool(uid_t)> peer_allowed;
};

class NodeDaemon {
 public:
  static absl::StatusOr<std::unique_ptr<NodeDaemon>> Start(DaemonOptions options);
  ~NodeDaemon();  // Stop()
  NodeDaemon(const NodeDaemon&) = delete;
  NodeDaemon& operator=(const NodeDaemon&) = delete;

  void Stop();
  const std::string& socket_path() const { return path_; }
  // The ledger's stats and the connected clients, read under the daemon's lock.
  PoolStats stats() const ABSL_LOCKS_EXCLUDED(mu_);
  std::size_t connected() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Client {
    ClientId id = 0;
    bool said_hello = false;
    pid_t pid = 0;
    absl::Status refused;  // over max_clients: its first request gets this, then it is closed
    std::string waiting;   // the switch whose decision its vote waits for (no request meanwhile)
  };
  NodeDaemon(DaemonOptions options, std::unique_ptr<SharedHostMemory> memory, int listen_fd, int wake[2],
             std::string path, int lock_fd, int spare_fd);
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  void Accept() ABSL_LOCKS_EXCLUDED(mu_);
  // What goes back for one request: its text and the descriptors to pass with it (closed
  // after the send when `owned`).
  struct Reply {
    std::string text;
    std::vector<int> fds;
    bool owned = false;
  };
  // The reply to one request of a client, which came with descriptors `received` (taken by
  // an offer, else closed); nothing for a vote whose reply waits for the decision.
  std::optional<Reply> Handle(Client& client, const std::string& message, std::vector<int>& received)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The node switch requests (Note [Node Switch]).
  std::string Begin(const Client& client, const WireRequest& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::optional<std::string> Vote(Client& client, const WireRequest& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string Outcome(const Client& client, const WireRequest& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A vote in another protocol version (`message`, refused by ParseRequest): the client's
  // process, if it takes part in the switch named, is counted as voting no, naming the
  // versions, so the switch aborts now with that reason instead of at its deadline.
  void AbortForOtherVersion(const Client& client, const std::string& message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The handover of chunks (Note [Node Switch Handover]): an offer keeps `fds`.
  std::string Offer(const Client& client, const WireRequest& r, std::vector<int>& fds)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Reply Take(const Client& client, const WireRequest& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the takers of the client's chunks for restore gaps have voted or exited. A
  // switch forgotten lately (still lingering) is settled: the ledger forgets an aborted one
  // only once each live giver was told so (an ask repeated after that answer, say its reply
  // was lost, must not find it unknown and read the takers' notes that linger with it).
  std::string Settled(const Client& client, const WireRequest& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  struct HeldChunk;
  // The chunks granted to take `r`'s process for its device in its switch: at its first
  // take with gaps while chunks are held for the switch, those from other processes on
  // that device that FitChunks places in its gaps (moved out of held_; those placed in
  // restore gaps noted on disk and in the ledger, SwitchLedger::Took, the others' uses
  // made "only where no restore copy writes"); at later takes,
  // what is left of them. Nullptr while nothing was granted and nothing is held or no gap
  // is named.
  std::vector<HeldChunk>* GrantOnce(const WireRequest& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // How many chunks may be held at once: kMaxHeldChunks, less where the descriptor limit
  // would leave too little room for connections.
  static std::size_t HeldCap();
  // Closes the chunks still held for switch `id` (decided: no one takes them any more).
  void DropOffers(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records the ledger's decision of `id` (the record wins), makes it the ledger's, and
  // sends it to the votes waiting for it; returns it.
  SwitchDecision Decide(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Exits of watched participants (`readable`: the pids whose pidfd the last poll found
  // readable; a pid without a pidfd is checked here), passed deadlines, then what the
  // ledger forgot.
  void Tend(const std::vector<pid_t>& readable) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves what the ledger forgot to lingering_ (its records removed kRecordLingerMs later).
  void Linger() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The poll timeout: until the next deadline (-1: none; a bound where pidfds are missing).
  int PollTimeoutMs() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Drop(int fd) ABSL_LOCKS_EXCLUDED(mu_);  // the client's connection closed: its leases go back

  const DaemonOptions options_;
  const std::unique_ptr<SharedHostMemory> memory_;
  const int listen_fd_;
  const int wake_read_, wake_write_;
  const std::string path_;
  const int lock_fd_;  // <dir>/vmstashd.lock, flock'ed while this daemon lives
  int spare_fd_;       // the serving thread's (Accept)
  bool said_accept_error_ = false;  // the serving thread's
  const pid_t owner_pid_;
  mutable Mutex mu_;  // the ledger and the client table (written by the serving thread)
  HostPoolLedger ledger_ ABSL_GUARDED_BY(mu_);
  std::map<int, Client> clients_ ABSL_GUARDED_BY(mu_);  // by connection fd
  ClientId next_client_ ABSL_GUARDED_BY(mu_) = 1;
  SwitchLedger switches_ ABSL_GUARDED_BY(mu_);
  std::map<pid_t, int> pidfds_ ABSL_GUARDED_BY(mu_);  // watched participants (-1: no pidfd here)
  // Chunks offered in undecided switches, not taken yet (at most HeldCap() in all).
  struct HeldChunk {
    pid_t pid = 0;
    std::string device;
    std::size_t size_bytes = 0;
    int fd = -1;
    ChunkUse use;
  };
  std::map<std::string, std::vector<HeldChunk>> held_ ABSL_GUARDED_BY(mu_);
  // Chunks granted to a taker (GrantOnce) and not yet sent, by switch and taker (a
  // process and the device it takes for).
  using Taker = std::pair<pid_t, std::string>;
  std::map<std::string, std::map<Taker, std::vector<HeldChunk>>> granted_ ABSL_GUARDED_BY(mu_);
  std::size_t held_count_ ABSL_GUARDED_BY(mu_) = 0;  // in held_ and granted_
  // Records of forgotten switches, removed kRecordLingerMs after (a late reader still finds them).
  std::deque<std::pair<std::int64_t, std::string>> lingering_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace vmstash::node

#endif  // VMSTASH_NODE_DAEMON_H_
