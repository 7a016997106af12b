// The runtime directory: where this user's vmstash sockets live (the control endpoints',
// control/endpoint.h, and the node daemon's, node/daemon.h), and the trust rules both
// apply to it and to their peers.
//
// Where: $VMSTASH_RUNTIME_DIR, else $XDG_RUNTIME_DIR/vmstash, else /tmp/vmstash-<uid>. A
// server creates it 0700 and refuses it unless it is a directory owned by this user with
// no group/other access (someone else could plant sockets there); a client trusts it on
// the same terms, and talks only to a peer running as its own uid (SO_PEERCRED).
//
// Thread-safety: pure functions of the file system and the environment.
#ifndef VMSTASH_CONTROL_RUNTIME_DIR_H_
#define VMSTASH_CONTROL_RUNTIME_DIR_H_

#include <sys/types.h>
#include <sys/un.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace vmstash::control {

// The runtime directory for this user (see above); not created.
std::string DefaultRuntimeDir();
// OK when `dir` is a directory of ours closed to others; else PermissionDenied (or
// FailedPrecondition: not a directory; Unavailable: missing) naming why.
absl::Status CheckPrivateDir(const std::string& dir);
// Creates `dir` 0700 when missing (the umask can only make it stricter), then checks it.
absl::Status EnsurePrivateDir(const std::string& dir);
// The uid and pid of the peer of the connected Unix socket `fd` (SO_PEERCRED).
struct Peer {
  uid_t uid = 0;
  pid_t pid = 0;
};
absl::StatusOr<Peer> PeerOf(int fd);
// Whether process `pid` has ended: no such process, or a zombie (exited, not yet reaped by
// its parent). A peer whose connection a forked child of it still holds open is seen gone
// this way (Note [Client Deadlines] in endpoint.h; Note [Mapped Tags] in runtime/tag_share.h).
bool ProcessGone(pid_t pid);
// The address of the Unix socket at `path` (cut to sun_path's size: a server checks the
// length before it binds).
sockaddr_un UnixAddress(const std::string& path);
// An errno as a status: PermissionDenied (EACCES, EPERM), Unavailable (ENOENT,
// ECONNREFUSED), else Internal; the message is "<what>: <strerror>".
absl::Status Errno(absl::string_view what, int err);

}  // namespace vmstash::control

#endif  // VMSTASH_CONTROL_RUNTIME_DIR_H_
