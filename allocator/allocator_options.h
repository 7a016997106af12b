// AllocatorOptions: how a CachingAllocator caches, grows and backs up, and the
// allocator's VMSTASH_CONF keys (the syntax: base/conf.h; the composed table:
// runtime/runtime_options.h).
//
//   bypass        0 | 1   every allocation straight to the driver (no caching), for
//                         compute-sanitizer and for finding use-after-free
//   min_chunk     smallest chunk of a large heap (default 20M, rounded up to the granularity)
//   max_chunk     largest chunk made by geometric growth (default 2G); a single larger
//                 request still gets one chunk of its own size
//   heap_va       VA reserved per heap at a time (default 0 = 2x device memory)
//   backup        pinned | pageable | disk:<dir>   where paused `backup` bytes go by
//                 default (a tag may choose its own: CachingAllocator::SetBackupStore):
//                 pinned host memory (default; link speed), pageable mmap (RSS given back
//                 after resume) or a file in <dir> (backup_arena.h, Note [Disk Backup])
//   auto_prepare  1 | 0   a background thread sizes the backup arena of a `backup` tag as
//                 the tag grows, so even the first pause runs at link speed (default 1;
//                 0: only explicit Prepare)
//   switch_zero   1 | 0   a switch zeroes the memory it hands to tags that receive no
//                 restore copies (discard tags), as freshly created memory reads (default
//                 1; 0: their contents are another tag's old bytes — in a node switch
//                 another process's (Note [Node Switch Handover]) — which the discard
//                 policy allows; saves a device memset; Note [Switch Protocol])
//   host_max      cap on the host memory the process's backup arenas hold, pinned or
//                 pageable pages (a size, e.g. 64G; default 0 = no cap; across every
//                 device and tag: allocator/host_budget.h). A pause whose backup does
//                 not fit first takes back the arenas other active tags of its device
//                 hold prepared; if it still does not fit, it moves its tag to the disk
//                 store in spill_dir, or without one fails with ResourceExhausted naming
//                 host_max, every tag left as it was (Note [Host Budget] in
//                 backup_arena.h)
//   share_chunks  0 | 1   chunks are created exportable, so that a switch across processes
//                 (vmstash switch --node) hands this process's released chunks to the
//                 process that resumes, instead of each releasing and creating its own
//                 (default 0; `node:1` turns it on unless set: runtime/runtime_options.h)
//   spill_dir     <dir>   an existing directory (NotFound when the conf is read
//                 otherwise): a tag whose backup does not fit under host_max moves to a
//                 disk store there, for that pause and the later ones (TagPool::
//                 ReserveBackup); absent = no spill
//
// The other fields are set by programs and tests, not by VMSTASH_CONF.
#ifndef VMSTASH_ALLOCATOR_ALLOCATOR_OPTIONS_H_
#define VMSTASH_ALLOCATOR_ALLOCATOR_OPTIONS_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "allocator/backup_arena.h"
#include "allocator/host_lease.h"

namespace vmstash {

struct AllocatorOptions {
  bool bypass = false;
  std::size_t min_chunk_bytes = std::size_t{20} << 20;
  std::size_t max_chunk_bytes = std::size_t{2} << 30;
  std::size_t heap_va_bytes = 0;  // 0: twice the device memory
  // Run Validate() after every operation; on by default in debug builds (no NDEBUG),
  // so every test built that way walks the invariants after each call.
#ifdef NDEBUG
  bool validate_each_op = false;
#else
  bool validate_each_op = true;
#endif
  BackupStore backup_store;  // pinned
  // Pipelining (Note [Pause/Resume Protocol]): a pause unmaps in stages of at least this
  // many copied bytes (at most 16 stages); a resume maps a large cover in pieces growing
  // from resume_first_piece_bytes to max_chunk_bytes (0: one chunk per cover).
  std::size_t pause_stage_bytes = std::size_t{64} << 20;
  std::size_t resume_first_piece_bytes = std::size_t{64} << 20;
  // A background thread prepares the backup arena of a `backup` tag as it grows (see
  // auto_preparer.h), once the tag has not grown for auto_prepare_settle_ms. Tests that
  // count driver calls turn it off.
  bool auto_prepare = true;
  int auto_prepare_settle_ms = 250;
  // Switch (Note [Switch Protocol]): copies are cut into pieces of at most this many bytes,
  // an event after each group of them, so a restore into a handed-over chunk waits only
  // for the reads of the bytes it overwrites; and the zeroing of switch_zero.
  std::size_t switch_group_bytes = std::size_t{64} << 20;
  bool switch_zero = true;
  // Host memory (host_budget.h): the cap on backup arenas' host pages in this process
  // (0: none), and where backups beyond it go ("": nowhere, the pause fails).
  std::size_t host_max_bytes = 0;
  std::string spill_dir;
  // Chunks are created exportable (Driver::ExportChunkFd), so a node switch can hand them
  // to another process (Note [Node Switch Handover], node/node_switch.h).
  bool share_chunks = false;
  // Where pinned backups lease their host memory first (allocator/host_lease.h, Note
  // [Pool-Backed Backups]; the runtime's node pool); null: each arena pins its own. Not a
  // VMSTASH_CONF key (the runtime's `node` option sets it).
  std::shared_ptr<HostLeaseSource> host_leases;
};

inline constexpr absl::string_view kAllocatorConfKeys[] = {"bypass",      "min_chunk", "max_chunk",
                                                           "heap_va",     "backup",    "auto_prepare",
                                                           "switch_zero", "host_max",  "spill_dir",
                                                           "share_chunks"};

// Sets `key` (one of kAllocatorConfKeys) from `value`; InvalidArgument naming both on a
// bad value, NotFound naming both for a spill_dir that is missing or not a directory.
absl::Status ApplyAllocatorOption(absl::string_view key, absl::string_view value, AllocatorOptions& options);
// InvalidArgument unless 0 < min_chunk_bytes <= max_chunk_bytes (CachingAllocator::Create).
absl::Status CheckChunkBounds(const AllocatorOptions& options);
// Appends the canonical "key:value" items of the VMSTASH_CONF keys (comma-separated;
// spill_dir only when set).
void AppendAllocatorOptions(const AllocatorOptions& options, std::string* out);

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_ALLOCATOR_OPTIONS_H_
