/* vmstash paged stash C ABI (libvmstash.so, built with the CUDA kernels): arenas of
 * fixed-size pages that hold variable-size activations (MoE expert inputs) between
 * forward and backward with CUDA-graph-capturable launches. Semantics:
 * docs/architecture.md §6; C++ class: stash/arena.h.
 *
 * Contract (as vmstash.h): every function is noexcept, returns a vmstash_code (0 = OK)
 * and sets vmstash_last_error() on failure.
 *   - An arena serves one device and one row size (row_bytes, a page = page_rows rows, a
 *     power of two). Its memory comes from the allocator under `tag` (policy discard;
 *     default "stash"), so pausing the tag releases it; a pause is refused with
 *     FAILED_PRECONDITION while pages are in use. After a resume, call reset.
 *   - A handle describes one stashed tensor of up to max_rows rows; it lives in device
 *     memory and is reused across steps (and graph replays).
 *   - reset, stash, restore, discard and write_flags are stream-ordered and capturable:
 *     no host synchronization, no allocation; the row count is read on the device from an
 *     int64 at `n_rows`. All operations of one arena go on one stream (or streams ordered
 *     by events); two streams concurrently are not supported.
 *   - create, prepare, new_handle, free_handle, read_flags and destroy are host calls
 *     (not capturable). vmstash_shutdown() refuses while arenas exist.
 *   - An arena belongs to the runtime and the process that created it. In a forked child
 *     (which must vmstash_shutdown() and vmstash_init() before using vmstash) an inherited
 *     arena is refused by every call with VMSTASH_FAILED_PRECONDITION ("belongs to the
 *     vmstash runtime of process P"), and vmstash_stash_destroy of it returns 0 after
 *     freeing the handle only: the memory stays the parent's, and the child's own
 *     shutdown does not count it (stash_c.cc, Note [Arenas Across Fork]).
 *   - Under the simulated driver the operations run on the host at once (for tests).
 */
#ifndef VMSTASH_VMSTASH_STASH_H_
#define VMSTASH_VMSTASH_STASH_H_

#include <stddef.h>
#include <stdint.h>

#include "vmstash.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct vmstash_stash_arena vmstash_stash_arena;

/* The arena's flags after a step (same layout in device memory for write_flags). */
typedef struct vmstash_stash_flags {
  uint32_t overflow;   /* sticky until reset: a stash found no room; outputs are wrong */
  uint32_t host_spill; /* some stash went to the host tier */
  uint64_t peak_pages[2]; /* device, host */
  uint64_t overflow_count;
  uint64_t last_failed_pages;
} vmstash_stash_flags;

int vmstash_stash_create(int device, const char* tag, uint64_t row_bytes, uint32_t page_rows,
                         vmstash_stash_arena** out) VMSTASH_NOEXCEPT;
/* Allocates device_pages (> 0) device pages and host_pages pinned host pages, and resets. */
int vmstash_stash_prepare(vmstash_stash_arena* arena, uint64_t device_pages, uint64_t host_pages,
                          cudaStream_t stream) VMSTASH_NOEXCEPT;
int vmstash_stash_destroy(vmstash_stash_arena* arena) VMSTASH_NOEXCEPT;
int vmstash_stash_new_handle(vmstash_stash_arena* arena, uint64_t max_rows, void** out) VMSTASH_NOEXCEPT;
int vmstash_stash_free_handle(vmstash_stash_arena* arena, void* handle) VMSTASH_NOEXCEPT;

int vmstash_stash_reset(vmstash_stash_arena* arena, cudaStream_t stream) VMSTASH_NOEXCEPT;
/* Links int64 flags in device memory shared with other arenas (null: unlinked), as
 * Megatron-LM shares one overflow and one host-spill tensor among its buffers: a nonzero
 * *overflow makes this arena's stashes and restores no-ops; this arena's overflow and host
 * spill set them to 1. Resets the arena (stream-ordered). Not capturable. */
int vmstash_stash_link_flags(vmstash_stash_arena* arena, cudaStream_t stream, int64_t* overflow,
                             int64_t* host_spill) VMSTASH_NOEXCEPT;
/* Tuning (benchmarks): the most blocks and the threads per block of later stash/restore
 * launches of every arena (max_grid 0: one wave, the default; threads 0 keeps the
 * current value, else a multiple of 32 up to 1024) and the 16-byte units each thread
 * keeps in flight (0 keeps it, else 4 or 8). A captured graph keeps the shape it was
 * captured with. Not thread-safe with launches. */
int vmstash_stash_set_launch_shape(uint32_t max_grid, uint32_t threads, uint32_t units_in_flight) VMSTASH_NOEXCEPT;
int vmstash_stash_stash(vmstash_stash_arena* arena, cudaStream_t stream, const void* src, const int64_t* n_rows,
                        uint64_t max_rows, void* handle) VMSTASH_NOEXCEPT;
/* Copies min(stashed rows, max_rows) rows to dst and gives the pages back; zero_tail
 * zeroes dst's rows after them up to max_rows. */
int vmstash_stash_restore(vmstash_stash_arena* arena, cudaStream_t stream, void* handle, void* dst,
                          uint64_t max_rows, int zero_tail) VMSTASH_NOEXCEPT;
int vmstash_stash_discard(vmstash_stash_arena* arena, cudaStream_t stream, void* handle,
                          uint64_t max_rows) VMSTASH_NOEXCEPT;
/* Capturable: copies the flags into device memory `out` (a vmstash_stash_flags). */
int vmstash_stash_write_flags(vmstash_stash_arena* arena, cudaStream_t stream,
                              vmstash_stash_flags* out) VMSTASH_NOEXCEPT;
/* Host: synchronizes `stream` and reads the flags. */
int vmstash_stash_read_flags(vmstash_stash_arena* arena, cudaStream_t stream,
                             vmstash_stash_flags* out) VMSTASH_NOEXCEPT;
/* Pages in use now, over both tiers (synchronizes the device). */
int vmstash_stash_pages_in_use(vmstash_stash_arena* arena, uint64_t* out) VMSTASH_NOEXCEPT;
/* Bytes of the device tier; the executor's name ("cuda kernels" or "host"); static string. */
int vmstash_stash_info(vmstash_stash_arena* arena, uint64_t* device_bytes, const char** executor) VMSTASH_NOEXCEPT;

#ifdef __cplusplus
}
#endif

#endif /* VMSTASH_VMSTASH_STASH_H_ */
