/* vmstash C ABI (libvmstash.so): the allocator for PyTorch's CUDAPluggableAllocator,
 * ctypes, LD_PRELOAD shims and C programs.
 *
 * Entry points PyTorch calls (exact pluggable-allocator signatures):
 *   void* vmstash_malloc(size_t size, int device, cudaStream_t stream);
 *   void  vmstash_free(void* ptr, size_t size, int device, cudaStream_t stream);
 *
 * Contract:
 *   - Every function is noexcept, never exits or aborts, and reports failure by its
 *     return value (a vmstash_code, or NULL); vmstash_last_error() then gives this
 *     thread's message for the last failed call.
 *   - vmstash_init(options) starts the library with a VMSTASH_CONF-style string (NULL:
 *     read VMSTASH_CONF/VMSTASH_DRIVER). Any other call initializes from the environment
 *     on first use. Initializing again with different options fails (FAILED_PRECONDITION).
 *   - Tags are per thread: vmstash_set_current_tag() routes this thread's later
 *     allocations. vmstash_create_tag() fixes a tag's policy on every device.
 *   - Strings returned as char* are owned by the caller: release them with
 *     vmstash_string_free().
 *   - Thread-safe. The library state lives until the process ends (no teardown at exit,
 *     so nothing runs while CUDA is being torn down); vmstash_shutdown() releases
 *     everything explicitly.
 */
#ifndef VMSTASH_VMSTASH_H_
#define VMSTASH_VMSTASH_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#define VMSTASH_NOEXCEPT noexcept
#else
#define VMSTASH_NOEXCEPT
#endif

/* Same type as the CUDA runtime's cudaStream_t (an identical typedef is legal). */
struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

/* Note [Status Codes]
 * Return codes are the absl::StatusCode values; VMSTASH_STATUS_CODES is their one table
 * (name, number), from which enum vmstash_code is made. The C ABI checks it against
 * absl::StatusCode at compile time and in c_abi_test (every absl code, by name and
 * number); Python's vmstash/_codes.py mirrors it, and its test compares it with this
 * header's table and with the library's (vmstash_code_name), so they cannot drift.
 * Numbers never change: absl adds new codes at the end, and so does this table. What a
 * code means here:
 *   INVALID_ARGUMENT bad input; NOT_FOUND an unknown tag, device memory or backup;
 *   RESOURCE_EXHAUSTED out of device or host memory, or of tag slots; FAILED_PRECONDITION
 *   wrong state (paused, shut down, inside a hook); ABORTED a hook vetoed a pause or switch,
 *   or an after-resume hook failed (vmstash_last_error_done() tells which); INTERNAL a
 *   driver failure or an unexpected exception. Each call's comment names its own.
 * VMSTASH_NOOP (-1), below, is not a status code: a transition that changed nothing.
 * A call that returns NULL or -1 instead of a code leaves its code in
 * vmstash_last_error_code(), as every failed call does, and its message in
 * vmstash_last_error(). */
#define VMSTASH_STATUS_CODES(X) \
  X(OK, 0)                      \
  X(CANCELLED, 1)               \
  X(UNKNOWN, 2)                 \
  X(INVALID_ARGUMENT, 3)        \
  X(DEADLINE_EXCEEDED, 4)       \
  X(NOT_FOUND, 5)               \
  X(ALREADY_EXISTS, 6)          \
  X(PERMISSION_DENIED, 7)       \
  X(RESOURCE_EXHAUSTED, 8)      \
  X(FAILED_PRECONDITION, 9)     \
  X(ABORTED, 10)                \
  X(OUT_OF_RANGE, 11)           \
  X(UNIMPLEMENTED, 12)          \
  X(INTERNAL, 13)               \
  X(UNAVAILABLE, 14)            \
  X(DATA_LOSS, 15)              \
  X(UNAUTHENTICATED, 16)

/* VMSTASH_OK, VMSTASH_INVALID_ARGUMENT, ... VMSTASH_ABORTED, ... */
#define VMSTASH_CODE_ENUMERATOR_(name, number) VMSTASH_##name = number,
enum vmstash_code { VMSTASH_STATUS_CODES(VMSTASH_CODE_ENUMERATOR_) };
#undef VMSTASH_CODE_ENUMERATOR_

int vmstash_init(const char* options) VMSTASH_NOEXCEPT;
/* 1 when initialized, else 0. */
int vmstash_is_initialized(void) VMSTASH_NOEXCEPT;
/* Releases every device's memory and the driver. Safe against concurrent calls: those in
 * flight complete first, later ones fail with VMSTASH_FAILED_PRECONDITION ("shut down")
 * until vmstash_init is called again (nothing re-initializes silently). Fails from
 * inside a hook, and while stash arenas exist. */
int vmstash_shutdown(void) VMSTASH_NOEXCEPT;
/* "1.0.0"-style version of the library. */
const char* vmstash_version(void) VMSTASH_NOEXCEPT;

void* vmstash_malloc(size_t size, int device, cudaStream_t stream) VMSTASH_NOEXCEPT;
void vmstash_free(void* ptr, size_t size, int device, cudaStream_t stream) VMSTASH_NOEXCEPT;
/* The device whose vmstash allocator returned `ptr` (a live allocation), or -1. */
int vmstash_owner_device(const void* ptr) VMSTASH_NOEXCEPT;
/* The block at ptr is also used by `stream` (like Tensor.record_stream). */
int vmstash_record_stream(void* ptr, int device, cudaStream_t stream) VMSTASH_NOEXCEPT;

/* Per-tag allocation entry points, for one CUDAPluggableAllocator (and MemPool) per tag:
 * vmstash_bind_tag_slot(tag) returns a slot number s in [0, VMSTASH_TAG_SLOTS) bound to
 * the tag (the same slot on every call for that tag), or -1 (see vmstash_last_error) when
 * all slots are taken. The exported function vmstash_malloc_slot<s> (e.g.
 * "vmstash_malloc_slot3") has vmstash_malloc's signature and allocates in that tag
 * whatever thread calls it (autograd's backward threads included); vmstash_free frees
 * blocks of every tag. */
#define VMSTASH_TAG_SLOTS 32
int vmstash_bind_tag_slot(const char* tag) VMSTASH_NOEXCEPT;

/* Tag names: 1..64 printable ASCII characters. policy: "discard" or "backup". */
int vmstash_create_tag(const char* tag, const char* policy) VMSTASH_NOEXCEPT;
int vmstash_set_current_tag(const char* tag) VMSTASH_NOEXCEPT;
/* The policy of a tag declared with vmstash_create_tag ("discard" or "backup"; a static
 * string), or NULL when it was never declared (vmstash_last_error() says why). */
const char* vmstash_tag_policy(const char* tag) VMSTASH_NOEXCEPT;
/* Every declared tag with its policy, in declaration order, as a JSON object
 * {"tag": "policy", ...}; free with vmstash_string_free. NULL on failure. */
char* vmstash_tags_json(void) VMSTASH_NOEXCEPT;
/* This thread's current tag ("default" until set); valid until the process ends. */
const char* vmstash_get_current_tag(void) VMSTASH_NOEXCEPT;

/* Pause and resume a tag (allocator/pause_resume.h, Note [Pause/Resume Protocol]):
 * pause releases the tag's physical memory after copying its live bytes to host memory
 * when its policy is "backup"; resume maps memory at the same addresses and restores.
 * device -1: every device in use. Returns 0 when done, VMSTASH_NOOP when the tag was
 * already paused (resp. active) everywhere or has no memory on the device(s),
 * VMSTASH_NOT_FOUND for a tag this process never created or used, else an error code.
 * All or nothing: a failed pause leaves the tag active and intact on every device (the
 * devices already paused by the call are resumed), a failed resume leaves it paused
 * with its backup everywhere. A device this process never used gets no allocator. */
#define VMSTASH_NOOP (-1)
int vmstash_pause(const char* tag, int device) VMSTASH_NOEXCEPT;
int vmstash_resume(const char* tag, int device) VMSTASH_NOEXCEPT;
/* Note [Liveness Hints]
 * A pause of a "backup" tag copies the requested bytes of each of its live blocks, unless
 * the call gives a hint for the device: byte ranges [starts[i], starts[i] + sizes[i]) that
 * hold data. Then only the parts of the tag's live blocks inside those ranges are copied;
 * the tag's other bytes on that device are not preserved (a "discard" tag ignores hints).
 * Ranges may be unsorted or overlap, and may run to the end of the address space (a size
 * past it ends there). A hint of no range (n == 0, the arrays may be NULL) preserves
 * nothing on that device. A layer that caches inside vmstash blocks passes what it knows
 * to be live and every byte it does not manage: vmstash.region's MemPools give their
 * active blocks plus the gaps between the pool's own segments up to the end of the
 * address space, so a live block of the tag that is no segment of the pool (global mode,
 * C++ callers) is copied whole (torch_plugin/python/vmstash/_torch.py, live_ranges). */
typedef struct vmstash_live_ranges {
  const char* tag; /* the tag the ranges are of (vmstash_pause_live_devices: NULL or its tag) */
  int device;
  const uint64_t* starts;
  const uint64_t* sizes;
  size_t n;
} vmstash_live_ranges;
/* Pause with liveness hints (Note [Liveness Hints]): THE hinted pause, one call for every
 * device, as vmstash_switch takes them. `live` (NULL, or `n_live` entries) gives, for one
 * device each, the byte ranges of `tag` that hold data there; a device without an entry
 * pauses without a hint (every live block of a backup tag is copied whole). device -1:
 * every device in use, all or nothing as vmstash_pause (entries may name any device of
 * this process); else only `device` (an entry must name it). VMSTASH_INVALID_ARGUMENT, with nothing
 * paused, for a NULL tag, NULL `live` with n_live > 0, an entry with NULL arrays and
 * n > 0, an entry whose `tag` is neither NULL nor `tag`, whose device is not one of this
 * process's (negative, -1 included, or out of range), names a device an earlier entry
 * names, or is not `device` when that is not -1. Returns as vmstash_pause. */
int vmstash_pause_live_devices(const char* tag, int device, const vmstash_live_ranges* live,
                               size_t n_live) VMSTASH_NOEXCEPT;
/* Deprecated (kept for existing callers): vmstash_pause_live_devices with one hint, these
 * `n` ranges, for `device`; with device -1 the same ranges stand for every device.
 * VMSTASH_INVALID_ARGUMENT for NULL arrays with n > 0. */
int vmstash_pause_live(const char* tag, int device, const uint64_t* starts, const uint64_t* sizes,
                       size_t n) VMSTASH_NOEXCEPT;
/* A phase switch: pauses the `n_pause` tags of `pause_tags` and resumes the `n_resume`
 * tags of `resume_tags` in one transaction (allocator/caching_allocator.h, Note [Switch
 * Protocol]): the outgoing tags' live bytes go to host memory while the incoming tags'
 * come back, both directions at once, and physical memory is handed from the outgoing to
 * the incoming tags where chunk sizes allow instead of being released and created again.
 * Hooks run as for pause and resume. device -1: every device in use, all or nothing (a
 * device already switched is switched back when another fails). Returns 0 when done,
 * VMSTASH_NOOP when every tag already was in its requested state, VMSTASH_NOT_FOUND for a
 * tag this process never created or used, VMSTASH_INVALID_ARGUMENT for a tag listed
 * twice or in both lists, VMSTASH_RESOURCE_EXHAUSTED when the incoming tags do not fit,
 * VMSTASH_ABORTED when a before-pause hook vetoed it. On a failure every tag is as it
 * was, except: after-resume hooks that failed with the switch done
 * (vmstash_last_error_done() is 1), and a tag whose memory a rollback could not restore
 * (the message names it "broken", and any device left switched). `live` (NULL, or
 * `n_live` entries): for an outgoing tag on one device, its liveness hint (Note [Liveness
 * Hints]). */
int vmstash_switch(const char* const* pause_tags, size_t n_pause, const char* const* resume_tags, size_t n_resume,
                   int device, const vmstash_live_ranges* live, size_t n_live) VMSTASH_NOEXCEPT;
/* A switch as one of several processes' switches (one per rank of a job) that all commit
 * or all roll back (Note [Agreed Switch], allocator/switch.h; vmstash.distributed builds the
 * agreement on torch.distributed). `agree` is called exactly once, on the calling thread,
 * whatever happens: with local_code 0 once this process's switch is prepared (every copy
 * done, a rollback still possible), else with the local failure's code and message. It
 * returns 0 to commit, nonzero to roll back; then the switch returns VMSTASH_ABORTED, every
 * tag as it was, with the text `agree` wrote into `reason` (reason_size bytes with the NUL)
 * as the error message. A local failure rolls back whatever `agree` returns. `agree` may
 * not call vmstash. The switch covers one device of this process: `device`, or with -1 the
 * one device holding memory of these tags (VMSTASH_INVALID_ARGUMENT when several do).
 * Otherwise as vmstash_switch; VMSTASH_INVALID_ARGUMENT for a NULL `agree` (not called). */
typedef int (*vmstash_agree_fn)(void* ctx, int local_code, const char* local_message, char* reason,
                                size_t reason_size);
int vmstash_switch_agreed(const char* const* pause_tags, size_t n_pause, const char* const* resume_tags,
                          size_t n_resume, int device, const vmstash_live_ranges* live, size_t n_live,
                          vmstash_agree_fn agree, void* ctx) VMSTASH_NOEXCEPT;
/* Copies `size` bytes at device address `ptr` from the backup of a paused "backup" tag
 * into host memory `dst` (what a pause saved there); `device` -1: the device whose
 * allocator holds those bytes. VMSTASH_INVALID_ARGUMENT when the range wraps the address
 * space; VMSTASH_NOT_FOUND when no paused backup holds it. */
int vmstash_read_backup(const void* ptr, size_t size, int device, void* dst) VMSTASH_NOEXCEPT;
/* Sets *address to the host address where the backup of those `size` bytes lies (no
 * copy); same errors as vmstash_read_backup. Valid until the tag is resumed or its backup
 * released: the caller keeps the tag paused while it reads there. Both also serve a backup
 * that a resume retained (allocator/tag_pool.h, Note [Retained Backups]: torch_memory_saver's
 * retain_cpu_backup), valid until the tag's next pause or its release. */
int vmstash_backup_address(const void* ptr, size_t size, int device, const void** address) VMSTASH_NOEXCEPT;
/* Refuse to map new device memory when the device's free memory would fall below `bytes`
 * (0: no margin). Applies to every device, now and later. */
int vmstash_set_memory_margin(size_t bytes) VMSTASH_NOEXCEPT;
/* Pins the tag's backup arena ahead of the first pause: `bytes`, or (0) the tag's
 * allocated bytes. Both are VMSTASH_FAILED_PRECONDITION while the tag is paused (its
 * arena holds the paused bytes). vmstash_release_backup gives that host memory back.
 * Both are VMSTASH_NOT_FOUND for a tag name this process never created or used. */
int vmstash_prepare(const char* tag, int device, size_t bytes) VMSTASH_NOEXCEPT;
int vmstash_release_backup(const char* tag, int device) VMSTASH_NOEXCEPT;
/* Where the declared `backup` tag's later pauses put its bytes, on every device: store
 * "pinned" (pinned host memory, link speed), "pageable" (anonymous mmap, given back after
 * each resume), "disk" with `directory` (an existing directory: a file there, unlinked at
 * once, holds the paused bytes, not host memory; NULL otherwise) or "disk_files" with
 * `directory` (torch_memory_saver's layout: a visible file per backed-up allocation while
 * paused, removed at the resume; allocator/backup_arena.h, Note [Disk Backup Files]).
 * VMSTASH_NOT_FOUND for an undeclared tag
 * or a missing directory; VMSTASH_FAILED_PRECONDITION for a discard tag or one paused on
 * some device (nothing changed). The default is VMSTASH_CONF's backup key. */
int vmstash_set_backup_store(const char* tag, const char* store, const char* directory) VMSTASH_NOEXCEPT;
/* Whether the declared tag's pinned backup is prepared ahead of its pauses by the
 * background preparation (VMSTASH_CONF auto_prepare; `ahead` 1, the default) or made by
 * the pause that first needs it (0; an arena already made is kept), on every device,
 * present and future. VMSTASH_NOT_FOUND for an undeclared tag. */
int vmstash_set_prepare_ahead(const char* tag, int ahead) VMSTASH_NOEXCEPT;
/* The tag's store as "pinned", "pageable" or "disk:<directory>"; free with
 * vmstash_string_free. NULL on failure. */
char* vmstash_backup_store(const char* tag) VMSTASH_NOEXCEPT;
/* Callbacks around transitions of `tag` on every device (e.g. NCCL/RDMA re-registration),
 * called without vmstash locks (the tag is active in both): they may allocate and free,
 * in their own tag too; pausing or resuming their own tag, or vmstash_shutdown, fails
 * with VMSTASH_FAILED_PRECONDITION. A non-zero return from before_pause vetoes the
 * pause or switch (VMSTASH_ABORTED, nothing changed); one from after_resume is reported
 * by vmstash_resume and vmstash_switch (VMSTASH_ABORTED too) with the transition done on
 * every device: the message says so and names each device whose hook failed, and
 * vmstash_last_error_done() is 1 (runtime/runtime.h, Note [All-or-Nothing Transitions]).
 * Either may be NULL. */
typedef int (*vmstash_hook_fn)(const char* tag, int device, void* user);
int vmstash_register_hooks(const char* tag, vmstash_hook_fn before_pause, vmstash_hook_fn after_resume,
                           void* user) VMSTASH_NOEXCEPT;

/* Releases cached free chunks. device -1: all devices; tag NULL: all tags (a tag name
 * this process never created or used: VMSTASH_NOT_FOUND). */
int vmstash_empty_cache(int device, const char* tag) VMSTASH_NOEXCEPT;
/* The node pool (docs/node.md): pinned backups of this process lease their host memory
 * from the node daemon's pool, shared by the node's processes. vmstash_node_connect
 * connects (start != 0: starting vmstashd when none serves; VMSTASH_CONF node:1 does it
 * at initialization); VMSTASH_UNAVAILABLE with no daemon, VMSTASH_NOT_FOUND without
 * vmstashd. Once connected, a pause the pool cannot serve uses the process's own memory
 * (logged), never fails for it. vmstash_node_stats_json: the pool's and this process's
 * figures (free with vmstash_string_free); NULL when not connected. */
int vmstash_node_connect(int start) VMSTASH_NOEXCEPT;
char* vmstash_node_stats_json(void) VMSTASH_NOEXCEPT;
/* A switch across the node's processes (docs/node.md; node/node_switch.h, Note [Node
 * Switch]): every tag of `pause` paused and every tag of `resume` resumed, each in the
 * process named, all or none. `pause`, `resume`: "PID:TAG,PID:TAG,..." (either may be
 * NULL or empty, not both); `device` in every process (-1: where its tags are);
 * `timeout_ms` (> 0) for every process's vote. Any process of the user may call it, one
 * taking part or not; the node daemon is started when none serves. Returns 0 when the
 * switch committed and every process confirmed it; VMSTASH_ABORTED when it rolled back
 * (the message names the process that failed, or did not answer, and why); the bad
 * request's or the daemon's code when it could not begin. *result_json (when not NULL):
 * the per-process JSON ({"txn","committed","reason","processes":[...]}) whenever the
 * switch began, else NULL; free with vmstash_string_free. */
int vmstash_node_switch(const char* pause, const char* resume, int device, int timeout_ms,
                        char** result_json) VMSTASH_NOEXCEPT;

/* Mapped tags (docs/weights.md; runtime/tag_share.h, Note [Mapped Tags]): a tag of this
 * process that another process of the user on the same GPU maps read-write at its own
 * addresses, revoked before every pause, switch or empty_cache of the tag and granted
 * again after it. The exporting side: vmstash_share_tag lets other processes map `tag`
 * (its chunks must be exportable: VMSTASH_CONF share_chunks:1, or node:1:
 * VMSTASH_FAILED_PRECONDITION otherwise) by the name `name` (NULL: the tag's own; e.g.
 * "weights" for the vLLM backend's "vllm.weights"), publishes `index_json` (JSON text,
 * NULL: "[]"; the tensors' names and places, opaque to the library) for the importers,
 * and returns in *generation (may be NULL) the tag's new generation, bumped by each call;
 * vmstash_unshare_tag closes every importer's mapping. The importing side:
 * vmstash_map_tag maps the tag process `pid` shares by the name `tag` on this process's
 * `device`, waiting up to `timeout_ms` (<= 0: 10 s) for the exporter, and returns a
 * handle in *handle;
 * vmstash_mapped_acquire / vmstash_mapped_release bracket a use (the memory stays mapped
 * in between; a revoke waits for the release, so the caller's work on the memory must be
 * complete when it releases): VMSTASH_FAILED_PRECONDITION while the exporter's tag is
 * paused or the exporter is gone; vmstash_mapped_acquire_any, with `backup` non-zero, also
 * takes a use of a paused tag whose backup is granted, and says what the use holds (each
 * pointer may be NULL; the use keeps them so): *state (0 mapped, 3 backup), *generation,
 * *grants (the grants taken so far: addresses checked under one count stay good while it
 * stays). While the tag is paused with its backup in the node pool (state 3,
 * "backup"), vmstash_mapped_write_backup queues
 * `n` copies of bytes[i] of this process's device memory at srcs[i] into the backup of the
 * exporter's bytes at remotes[i] on `stream` (all checked before any is queued; hold a
 * use until the stream completes them); vmstash_mapped_local gives this process's address of
 * the exporter's [remote, remote + bytes); vmstash_mapped_check whether `n` such ranges
 * all lie in the memory mapped now and (`locals`, may be NULL) at those addresses here
 * (VMSTASH_FAILED_PRECONDITION naming the first that does not); vmstash_mapped_locals
 * vmstash_mapped_local's addresses of `n` ranges at once, into out[n];
 * vmstash_mapped_state the state (0 mapped, 1 paused, 2 gone, 3 backup) and generation;
 * vmstash_mapped_index_json
 * the index the
 * exporter published, as read at the map ({"generation":G,"index":...}; NOT_FOUND when
 * none); vmstash_mapped_info_json its state
 * ({"state":"mapped"|"paused"|"gone"|"backup","generation","grants","revokes","pid",
 * "tag","device","mapped_bytes","backup_bytes"}; free with vmstash_string_free); vmstash_mapped_close unmaps
 * it (VMSTASH_FAILED_PRECONDITION while a use is acquired: release it first). */
int vmstash_share_tag(const char* tag, const char* name, const char* index_json,
                      unsigned long long* generation) VMSTASH_NOEXCEPT;
int vmstash_unshare_tag(const char* tag) VMSTASH_NOEXCEPT;
int vmstash_map_tag(int pid, const char* tag, int device, int timeout_ms, unsigned long long* handle) VMSTASH_NOEXCEPT;
int vmstash_mapped_acquire(unsigned long long handle) VMSTASH_NOEXCEPT;
int vmstash_mapped_acquire_any(unsigned long long handle, int backup, int* state, unsigned long long* generation,
                               unsigned long long* grants) VMSTASH_NOEXCEPT;
int vmstash_mapped_release(unsigned long long handle) VMSTASH_NOEXCEPT;
int vmstash_mapped_local(unsigned long long handle, unsigned long long remote, unsigned long long bytes,
                         unsigned long long* local) VMSTASH_NOEXCEPT;
int vmstash_mapped_check(unsigned long long handle, const unsigned long long* remotes,
                         const unsigned long long* bytes, const unsigned long long* locals,
                         size_t n) VMSTASH_NOEXCEPT;
int vmstash_mapped_locals(unsigned long long handle, const unsigned long long* remotes,
                          const unsigned long long* bytes, unsigned long long* out, size_t n) VMSTASH_NOEXCEPT;
int vmstash_mapped_write_backup(unsigned long long handle, const unsigned long long* remotes,
                                const unsigned long long* srcs, const unsigned long long* bytes, size_t n,
                                cudaStream_t stream) VMSTASH_NOEXCEPT;
int vmstash_mapped_state(unsigned long long handle, int* state, unsigned long long* generation) VMSTASH_NOEXCEPT;
char* vmstash_mapped_info_json(unsigned long long handle) VMSTASH_NOEXCEPT;
char* vmstash_mapped_index_json(unsigned long long handle) VMSTASH_NOEXCEPT;
int vmstash_mapped_close(unsigned long long handle) VMSTASH_NOEXCEPT;

/* JSON documents (see allocator/stats.h and allocator/snapshot.h); NULL on failure.
 * device -1: a JSON array with one entry per device in use. */
char* vmstash_stats_json(int device) VMSTASH_NOEXCEPT;
char* vmstash_snapshot_json(int device) VMSTASH_NOEXCEPT;
void vmstash_string_free(char* s) VMSTASH_NOEXCEPT;

/* This thread's message for its last failed call ("" if none). */
const char* vmstash_last_error(void) VMSTASH_NOEXCEPT;
/* This thread's code for its last failed call (a vmstash_code; VMSTASH_OK if none): the
 * code of a call that returns NULL or -1 (Note [Status Codes]). */
int vmstash_last_error_code(void) VMSTASH_NOEXCEPT;
/* The name of a code in the table ("ABORTED" for VMSTASH_ABORTED; a static string), or
 * NULL for a number that is none (VMSTASH_NOOP included). */
const char* vmstash_code_name(int code) VMSTASH_NOEXCEPT;
/* 1 when this thread's last failed call is a transition that is done nonetheless (every
 * tag in its requested state on every device; only after-resume hooks failed), 0 when it
 * changed nothing or failed otherwise (runtime/runtime.h, Note [All-or-Nothing
 * Transitions]). Tells a vetoed switch from a done one: both are ABORTED from hooks. */
int vmstash_last_error_done(void) VMSTASH_NOEXCEPT;

#ifdef __cplusplus
}
#endif

#endif /* VMSTASH_VMSTASH_H_ */
