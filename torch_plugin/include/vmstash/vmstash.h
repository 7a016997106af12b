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

/* Return codes: the absl::StatusCode values. */
enum vmstash_code {
  VMSTASH_OK = 0,
  VMSTASH_INVALID_ARGUMENT = 3,
  VMSTASH_NOT_FOUND = 5,
  VMSTASH_RESOURCE_EXHAUSTED = 8,
  VMSTASH_FAILED_PRECONDITION = 9,
  VMSTASH_UNIMPLEMENTED = 12,
  VMSTASH_INTERNAL = 13,
  VMSTASH_UNAVAILABLE = 14
};

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

/* Pause and resume a tag (allocator/caching_allocator.h, Note [Pause/Resume Protocol]):
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
/* Pause with a liveness hint: `n` byte ranges [starts[i], starts[i] + sizes[i]) that hold
 * data (e.g. PyTorch's active blocks inside our segments, from MemPool.snapshot()). A
 * backup pause copies only the parts of the tag's blocks inside them; other bytes of the
 * tag are not preserved. n == 0 with NULL arrays: nothing is preserved. */
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
 * twice or in both lists, VMSTASH_RESOURCE_EXHAUSTED when the incoming tags do not fit.
 * On a failure every tag is as it was, except: after-resume hooks that failed with the
 * switch done (vmstash_last_error_done() is 1), and a tag whose memory a rollback could
 * not restore (the message names it "broken", and any device left switched). `live` (NULL, or `n_live` entries): for an
 * outgoing tag on one device, the byte ranges that hold data, as for vmstash_pause_live. */
typedef struct vmstash_live_ranges {
  const char* tag;
  int device;
  const uint64_t* starts;
  const uint64_t* sizes;
  size_t n;
} vmstash_live_ranges;
int vmstash_switch(const char* const* pause_tags, size_t n_pause, const char* const* resume_tags, size_t n_resume,
                   int device, const vmstash_live_ranges* live, size_t n_live) VMSTASH_NOEXCEPT;
/* Pause with a liveness hint per device, in one call: `live` (NULL, or `n_live` entries)
 * gives, for one device each, the byte ranges of `tag` that hold data there, as for
 * vmstash_pause_live. VMSTASH_INVALID_ARGUMENT, with nothing paused, for an entry whose
 * `tag` is neither NULL nor `tag`, whose device is not one of this process's (negative,
 * -1 included, or out of range), names a device an earlier entry names, or, when `device`
 * is not -1, names another device than `device` (with -1, entries of any devices). A
 * device without an entry pauses without a hint (every live block of a backup tag is
 * copied). device -1: every device in use, all
 * or nothing as vmstash_pause — where one vmstash_pause_live call per device would leave
 * the first devices paused when a later one fails. Returns as vmstash_pause. */
int vmstash_pause_live_devices(const char* tag, int device, const vmstash_live_ranges* live,
                               size_t n_live) VMSTASH_NOEXCEPT;
/* Copies `size` bytes at device address `ptr` from the backup of a paused "backup" tag
 * into host memory `dst` (what a pause saved there). VMSTASH_INVALID_ARGUMENT when the
 * range wraps the address space; VMSTASH_NOT_FOUND when no paused backup holds it. */
int vmstash_read_backup(const void* ptr, size_t size, int device, void* dst) VMSTASH_NOEXCEPT;
/* Sets *address to the host address where the backup of those `size` bytes lies (no
 * copy); same errors as vmstash_read_backup. Valid until the tag is resumed or its backup
 * released: the caller keeps the tag paused while it reads there. */
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
 * each resume) or "disk" with `directory` (an existing directory: a file there holds the
 * paused bytes, not host memory; NULL otherwise). VMSTASH_NOT_FOUND for an undeclared tag
 * or a missing directory; VMSTASH_FAILED_PRECONDITION for a discard tag or one paused on
 * some device (nothing changed). The default is VMSTASH_CONF's backup key. */
int vmstash_set_backup_store(const char* tag, const char* store, const char* directory) VMSTASH_NOEXCEPT;
/* The tag's store as "pinned", "pageable" or "disk:<directory>"; free with
 * vmstash_string_free. NULL on failure. */
char* vmstash_backup_store(const char* tag) VMSTASH_NOEXCEPT;
/* Callbacks around transitions of `tag` on every device (e.g. NCCL/RDMA re-registration),
 * called without vmstash locks (the tag is active in both): they may allocate and free,
 * in their own tag too; pausing or resuming their own tag, or vmstash_shutdown, fails
 * with VMSTASH_FAILED_PRECONDITION. A non-zero return from before_pause vetoes the
 * pause; one from after_resume is reported by vmstash_resume and vmstash_switch (its
 * code: ABORTED, 10) with the transition done on every device: the message says so
 * and names each device whose hook failed, and vmstash_last_error_done() is 1
 * (runtime/runtime.h, Note [All-or-Nothing Transitions]). Either may be NULL. */
typedef int (*vmstash_hook_fn)(const char* tag, int device, void* user);
int vmstash_register_hooks(const char* tag, vmstash_hook_fn before_pause, vmstash_hook_fn after_resume,
                           void* user) VMSTASH_NOEXCEPT;

/* Releases cached free chunks. device -1: all devices; tag NULL: all tags (a tag name
 * this process never created or used: VMSTASH_NOT_FOUND). */
int vmstash_empty_cache(int device, const char* tag) VMSTASH_NOEXCEPT;
/* JSON documents (see allocator/stats.h and allocator/snapshot.h); NULL on failure.
 * device -1: a JSON array with one entry per device in use. */
char* vmstash_stats_json(int device) VMSTASH_NOEXCEPT;
char* vmstash_snapshot_json(int device) VMSTASH_NOEXCEPT;
void vmstash_string_free(char* s) VMSTASH_NOEXCEPT;

/* This thread's message for its last failed call ("" if none). */
const char* vmstash_last_error(void) VMSTASH_NOEXCEPT;
/* 1 when this thread's last failed call is a transition that is done nonetheless (every
 * tag in its requested state on every device; only after-resume hooks failed), 0 when it
 * changed nothing or failed otherwise (runtime/runtime.h, Note [All-or-Nothing
 * Transitions]). Tells a vetoed switch from a done one: both are ABORTED from hooks. */
int vmstash_last_error_done(void) VMSTASH_NOEXCEPT;

#ifdef __cplusplus
}
#endif

#endif /* VMSTASH_VMSTASH_H_ */
