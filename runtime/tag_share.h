// Mapped tags: one process (the exporter: a rollout engine) lets another process on the
// same GPU (the importer: the trainer) map a tag's memory read-write at the importer's own
// addresses, for the life of the job (docs/weights.md). This header owns the protocol and
// its messages; the exporter's side is tag_exporter.h, the importer's tag_import.h.
//
// Note [Mapped Tags]
//   Opt-in: the exporter shares a tag (TagExporter::Share); only shared tags can be mapped.
//   It serves `<runtime dir>/<pid>.tags.sock` (SOCK_SEQPACKET; control/runtime_dir.h's
//   trust rules: both ends talk only to their own uid) from the first Share on.
//   Map: the importer connects and sends one request naming the tag and the device (by
//   UUID: CUDA_VISIBLE_DEVICES may number it differently in each process). The exporter
//   answers with an error, or "paused" (the tag holds no memory now), or a grant: the
//   tag's reservations and its mapped chunks, each chunk's descriptor attached
//   (Driver::ExportChunkFd; at most kMaxFdsPerPacket a packet, the rest in "chunks"
//   packets). The importer reserves as much address space as each reservation, maps every
//   chunk at the same offset in it (so an exporter's address A becomes the importer's
//   base + (A - reservation)), and acknowledges. The connection stays open: it is the
//   mapping's lease. Each grant names all the tag's reservations: the importer keeps its
//   own for those it knew (the same addresses), makes new ones for new ones and frees those
//   the exporter no longer has; a caller that kept an address checks it is still current
//   (MappedTag::Covers).
//   Transitions: a chunk the importer maps keeps its memory alive, so before the exporter
//   changes the tag's chunks — a pause, a switch pausing it, an empty_cache (and a resume:
//   Backups, below) — it revokes
//   every importer's grant (Runtime's TransitionObserver: before the call) and waits up to
//   ShareOptions::revoke_timeout_ms for each acknowledgement. The importer waits until no
//   use of the mapping is in progress (MappedTag::Use: a scope whose copies are complete
//   at its end), unmaps and releases every chunk, keeps its reservations, and
//   acknowledges; its uses fail FailedPrecondition ("paused") meanwhile. After the call,
//   whatever its outcome, each revoked importer of a tag now active gets a new grant of
//   the tag's present chunks at the same addresses (a resume maps the same addresses,
//   maybe with other chunks), so CUDA graphs and cached tensors over the importer's
//   addresses stay valid. Between Before and After the tags a call may release are
//   marked (whether shared then or not): a new importer of a marked tag is told "paused",
//   and granted by the After that unmarks it. An importer alive that does not acknowledge a
//   revoke in time (or whose connection takes no more sends within request_timeout_ms)
//   vetoes the transition (FailedPrecondition naming its pid) and its connection is
//   closed: its chunks are its own to release (it does so when it sees the close); the
//   call may be tried again. An importer whose connection is closed, or whose process is
//   gone (checked while its acknowledgement is awaited: a forked child of it may hold the
//   connection open), is dropped: its handles went with it.
//   Backups: a tag paused with its bytes in the node pool (both processes reach the same
//   node daemon: runtime/node_leases.h) is granted as its backup instead of "paused":
//   the pool's identity (node::NodeClient::pool_identity), the span of the pool its
//   arena leased, and each backed-up extent (exporter address, size, offset in the span),
//   kExtentsPerPacket a packet (TagPool::ExportBackup, NodeLeases::Locate). The importer
//   (state kBackup) borrows that span from its own mapping of the pool at its first
//   write (NodeLeases::Borrow: registered once per connection) and copies device bytes
//   of its own into it (MappedTag::WriteBackup), within a Use taken for it
//   (Acquire(backup=true); a plain Use still means mapped memory). Every call that may
//   resume a tag (ChunkChange::resume: a resume, a switch bringing it in) revokes its
//   backup's writers first, as a call that may release its chunks revokes its mappings
//   (each only those: a resume of an active tag leaves the mappings alone, a pause of a
//   paused one the writers), and marks it for its duration: the resume reads the backup
//   only once every writer let go (its copies complete), so it restores what they wrote.
//   A writer that does not let go in time vetoes the call and is fenced, not just dropped:
//   its copies may still be in flight, so its connection stays open and every later call
//   that may resume the tag waits for its acknowledgement or its exit first, and is
//   refused while neither comes (the tag stays paused, its backup intact); Unshare
//   and a re-publish revoke the same way, and the exporter's end waits once. A writer
//   with a revoke pending writes nothing more. The arena lent stays the exporter's until
//   the resume (TagPool::ExportBackup: a free while paused does not release it). A
//   tag paused otherwise (a discard tag, a disk or pageable store, the pool full at the
//   pause, an exporter without node:1) is "paused" with that reason, shown by the
//   importer's refusals. Not covered: an exporter killed while an importer's copy into
//   its backup is in flight — the daemon takes the lease back at once, and may lease
//   those bytes to a third process before the copy lands.
//   Index and generations: each Share bumps the tag's generation, sent with every grant,
//   and writes the exporter's index of the tag (its tensors' names and places: the caller's
//   JSON, opaque here) to `<dir>/<pid>.tags.<hex of the tag>.json` (0600, replaced
//   atomically; removed by Unshare and Stop) as {"generation":G,"index":...}. The importer
//   reads it when it maps; its present importers get a revoke and a grant (or "paused")
//   with the new generation at once, and their callers compare it with the index they
//   read (a tag re-created and published again is caught; one re-created without a new
//   Share is not).
//   Exits: the importer exiting closes its connection (the kernel releases its handles);
//   the exporter exiting, or stopping to share (Unshare, shutdown), closes it on the
//   importer's side: the importer unmaps and its uses fail FailedPrecondition ("gone").
//   The exporter shuts a connection down before closing it, and both sides close their
//   copies of the connections in a child forked without exec (process.h, Note [Fork]),
//   so that a close is seen while such a child lives. Closing a mapping (the C ABI) or
//   shutting the importer's runtime down is refused while a use is in progress.
//   What is not revoked: chunks the exporter's allocator releases by itself (the OOM
//   ladder's empty_cache inside an allocation) or maps by itself (growth): the importer
//   keeps the released memory alive until the next revoke, and sees no new chunk until
//   the next grant (MappedTag::Local says so for an address outside what it maps).
//
// Messages (one JSON object per packet, at most node::kMaxMessageBytes; "v":kShareVersion):
//   importer -> exporter  {"op":"map","tag":T,"device":UUID}        once, first
//                         {"ack":"grant"|"revoke"|"paused"|"backup","ok":B,"message":M}
//   exporter -> importer  {"ev":"grant","generation":G,"reservations":[[A,N],...],"chunks":K}
//                         {"ev":"chunks","chunks":[[A,N],...]}     with one descriptor each
//                         {"ev":"backup","generation":G,"pool":P,"span":[O,N],"extents":K}
//                         {"ev":"extents","extents":[[A,N,O],...]}  no descriptors
//                         {"ev":"revoke"}   {"ev":"paused","generation":G[,"message":M]}
//                         {"ok":false,"code":C,"message":M}        the map refused
//
// Thread-safety: pure functions.
#ifndef VMSTASH_RUNTIME_TAG_SHARE_H_
#define VMSTASH_RUNTIME_TAG_SHARE_H_

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "vmm/driver.h"

namespace vmstash::share {

inline constexpr int kShareVersion = 2;
// Reservations one grant names at most (each ~40 bytes of the packet).
inline constexpr std::size_t kMaxReservations = 256;
// Chunks one "chunks" packet names (one descriptor each).
inline constexpr std::size_t kChunksPerPacket = 32;
// Backup extents one "extents" packet names (each ~45 bytes of the packet).
inline constexpr std::size_t kExtentsPerPacket = 256;

struct ShareRange {
  DevicePtr address = 0;
  std::size_t size_bytes = 0;
};

// Exporter bytes [address, address + size_bytes) are backed up at `offset` of a backup
// grant's span.
struct BackupRange {
  DevicePtr address = 0;
  std::size_t size_bytes = 0;
  std::size_t offset = 0;
};

enum class ShareKind { kMap, kAck, kGrant, kChunks, kRevoke, kPaused, kError, kBackup, kExtents };

struct ShareMessage {
  ShareKind kind = ShareKind::kError;
  std::string tag;                      // map
  std::string device;                   // map: Driver::DeviceUuid
  std::string ack;                      // ack: "grant", "revoke", "paused" or "backup"
  bool ok = true;                       // ack
  std::string message;                  // ack (ok false), error; paused: why no backup grant
  std::string code;                     // error: an absl status code name
  std::uint64_t generation = 0;         // grant, paused
  std::vector<ShareRange> reservations; // grant
  std::size_t chunk_count = 0;          // grant: how many chunks follow
  std::vector<ShareRange> chunks;       // chunks
  std::string pool;                     // backup: the node pool's identity (NodeClient::pool_identity)
  std::size_t span_offset = 0;          // backup: where the span is in the pool
  std::size_t span_bytes = 0;           // backup
  std::size_t extent_count = 0;         // backup: how many extents follow
  std::vector<BackupRange> extents;     // extents
};

std::string FormatShare(const ShareMessage& m);
// InvalidArgument naming what is wrong: not JSON, another version, an unknown kind or
// key, a missing or mistyped field, a range of size 0 or wrapping the address space, more
// than kMaxReservations reservations, kChunksPerPacket chunks or kExtentsPerPacket
// extents, an extent outside its span's size (checked by the importer).
absl::StatusOr<ShareMessage> ParseShare(absl::string_view text);
// An error message for `status` (not OK), and the status it carries back.
ShareMessage ShareError(const absl::Status& status);
absl::Status StatusOfError(const ShareMessage& m);

// `<dir>/<pid>.tags.sock`.
std::string ShareSocketPath(const std::string& dir, pid_t pid);
// `<dir>/<pid>.tags.<tag in hex>.json`: the index the exporter published for `tag`.
std::string ShareIndexPath(const std::string& dir, pid_t pid, const std::string& tag);

}  // namespace vmstash::share

#endif  // VMSTASH_RUNTIME_TAG_SHARE_H_
