/* torch_memory_saver's C entry points on vmstash (libvmstash.so and libvmstash_preload.so;
 * implemented in torch_plugin/c_abi/tms_c.cc), and the vmstash_tms_* calls its Python
 * layer (vmstash.compat.torch_memory_saver) uses.
 *
 * torch_memory_saver 0.0.10's library exports tms_* functions that its Python package,
 * its tests and some frameworks call through ctypes (torch_memory_saver._impl.
 * _binary_wrapper.cdll, or ctypes.CDLL(None) in a preloaded process). vmstash exports the
 * same names with the same signatures, so the drop-in wheel serves them:
 *
 *   Per thread (each thread starts from the TMS_INIT_* environment variables, as there;
 *   they, TMS_DISK_BACKUP_DIR and TMS_RETAIN_CPU_BACKUP are read once per process, at the
 *   first use of this library — torch_plugin/c_abi/tms_env.h — so a change made to the
 *   environment later is not seen; a flag is on for "1" or "true"):
 *     tms_set_interesting_region / tms_get_interesting_region  whether the thread's CUDA
 *         allocations are managed. Under the preload library this is its routing (set:
 *         an override; unset: whole-process mode — TMS_INIT_ENABLE / VMSTASH_PRELOAD_ALL —
 *         or a vmstash region, i.e. a current tag other than "default"). Elsewhere the
 *         same rule, which only tms_torch_malloc checks.
 *     tms_set_current_tag / tms_get_current_tag  (default "default")
 *     tms_set_enable_cpu_backup / tms_get_enable_cpu_backup  (TMS_INIT_ENABLE_CPU_BACKUP)
 *     tms_set_cpu_backup_backend / tms_get_cpu_backup_backend  "pinned" or "mmap"
 *         (TMS_INIT_CPU_BACKUP_BACKEND, default "pinned")
 *     tms_set_enable_disk_backup / tms_get_enable_disk_backup  (TMS_INIT_ENABLE_DISK_BACKUP)
 *     Once a thread set any of these, its routed allocations (the preload library's
 *     cudaMalloc, tms_torch_malloc) go to the vmstash tag of (tag, backup setting), see
 *     Note [TMS Tags]; a thread that never did keeps vmstash's own routing.
 *   Process-wide:
 *     tms_set_disk_backup_dir  where later disk backups go (TMS_DISK_BACKUP_DIR, default
 *         /tmp); read at each pause
 *     tms_set_retain_cpu_backup / tms_get_retain_cpu_backup  (TMS_RETAIN_CPU_BACKUP)
 *     set_memory_margin_bytes  vmstash_set_memory_margin
 *     tms_pause / tms_resume  one torch_memory_saver tag, or every one (NULL); 0 when done
 *         (also when there was nothing to do), else a vmstash_code (vmstash_last_error()
 *         says why). A failed pause leaves every tag as it was; a failed resume stops
 *         at the tag that failed, the tags resumed before it active (the message names
 *         them), the others paused, and a retry resumes the rest.
 *     tms_get_cpu_backup_pointer  where the backup of [gpu_ptr, gpu_ptr + size) is in host
 *         memory: while paused, or after a resume that retained it; NULL otherwise.
 *     tms_torch_malloc / tms_torch_free  a CUDAPluggableAllocator's pair allocating in the
 *         calling thread's tag (only while its region is interesting, else NULL).
 *   Not exported: the tms_xpu_* calls (Intel XPU; vmstash runs on CUDA only).
 *
 * Differences, on purpose: nothing exits the process (torch_memory_saver exits on a
 * failed check): a setter given a bad value keeps the previous one and records the error
 * (vmstash_last_error); tms_pause / tms_resume return an error code, and pausing a paused
 * tag or resuming an active one is a no-op (0); tms_get_cpu_backup_pointer returns NULL
 * for memory it does not back up, and also serves a disk backup while paused (it maps
 * the files).
 *
 * Note [TMS Tags]
 *   A torch_memory_saver tag with one backup setting — "discard" (no backup), "pinned",
 *   "mmap" (vmstash store "pageable") or "disk" (store "disk_files", in the disk backup
 *   directory: one file per backed-up allocation while paused, backup_arena.h, Note [Disk
 *   Backup Files]) — is one vmstash tag: the first setting seen for a name keeps the name,
 *   the others get ":<setting>" appended ("kv", "kv:pinned"); where another entry has that
 *   vmstash tag already (a torch_memory_saver tag itself named "kv:pinned", or the preload
 *   library's process tag), ":2", ":3", ... follows, so no two entries share a vmstash tag
 *   and pausing one torch_memory_saver tag never touches another's memory. In whole-process mode
 *   (under the preload library) the setting of TMS_INIT_ENABLE_CPU_BACKUP /
 *   TMS_INIT_ENABLE_DISK_BACKUP / TMS_INIT_CPU_BACKUP_BACKEND of tag "default" is the
 *   preload library's process tag. Pausing or resuming a torch_memory_saver tag acts on
 *   every vmstash tag made for it (and, for "default" or NULL, on the process tag).
 *   Backup tags retain their backup after a resume while retain_cpu_backup is on, and
 *   their backup goes with their last freed block (allocator/tag_pool.h, Note [Retained
 *   Backups]); with retain_cpu_backup off, resume gives it back.
 */
#ifndef VMSTASH_VMSTASH_TMS_H_
#define VMSTASH_VMSTASH_TMS_H_

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "vmstash.h"

#ifdef __cplusplus
extern "C" {
#endif

/* --- torch_memory_saver's names ------------------------------------------------------- */
void tms_set_interesting_region(bool is_interesting_region) VMSTASH_NOEXCEPT;
bool tms_get_interesting_region(void) VMSTASH_NOEXCEPT;
void tms_set_current_tag(const char* tag) VMSTASH_NOEXCEPT;
const char* tms_get_current_tag(void) VMSTASH_NOEXCEPT;
bool tms_get_enable_cpu_backup(void) VMSTASH_NOEXCEPT;
void tms_set_enable_cpu_backup(bool enable_cpu_backup) VMSTASH_NOEXCEPT;
const char* tms_get_cpu_backup_backend(void) VMSTASH_NOEXCEPT;
void tms_set_cpu_backup_backend(const char* backend) VMSTASH_NOEXCEPT;
bool tms_get_enable_disk_backup(void) VMSTASH_NOEXCEPT;
void tms_set_enable_disk_backup(bool enable_disk_backup) VMSTASH_NOEXCEPT;
void tms_set_disk_backup_dir(const char* dir) VMSTASH_NOEXCEPT;
void set_memory_margin_bytes(uint64_t value) VMSTASH_NOEXCEPT;
void tms_set_retain_cpu_backup(bool retain_cpu_backup) VMSTASH_NOEXCEPT;
bool tms_get_retain_cpu_backup(void) VMSTASH_NOEXCEPT;
int tms_pause(const char* tag) VMSTASH_NOEXCEPT;
int tms_resume(const char* tag) VMSTASH_NOEXCEPT;
uint8_t* tms_get_cpu_backup_pointer(const uint8_t* gpu_ptr, uint64_t size) VMSTASH_NOEXCEPT;
void* tms_torch_malloc(ssize_t size, int device, cudaStream_t stream) VMSTASH_NOEXCEPT;
void tms_torch_free(void* ptr, ssize_t size, int device, cudaStream_t stream) VMSTASH_NOEXCEPT;

/* --- vmstash's calls for its torch_memory_saver layer --------------------------------- */
/* The vmstash tag of (tms_tag, setting) (Note [TMS Tags]; setting: "discard", "pinned",
 * "mmap" or "disk"), declared with its policy and store on first use; valid until the
 * process ends. NULL on failure (vmstash_last_error). */
const char* vmstash_tms_tag(const char* tms_tag, const char* setting) VMSTASH_NOEXCEPT;
/* The vmstash tags tms_pause(tms_tag) acts on (tms_tag NULL: every one): *count is how
 * many there are, and the first `capacity` of their names go to `names` (each valid until
 * the process ends; call again with more room when *count > capacity). */
int vmstash_tms_targets(const char* tms_tag, const char** names, size_t capacity, size_t* count) VMSTASH_NOEXCEPT;
/* torch_memory_saver's variables as this library read them (once, at the first use):
 * check_env is VMSTASH_INVALID_ARGUMENT for a TMS_INIT_CPU_BACKUP_BACKEND other than
 * pinned or mmap (taken as pinned), whole_process 1 with TMS_INIT_ENABLE (or
 * VMSTASH_PRELOAD_ALL) "1" or "true". */
int vmstash_tms_check_env(void) VMSTASH_NOEXCEPT;
int vmstash_tms_whole_process(void) VMSTASH_NOEXCEPT;
/* The vmstash tag of whole-process mode's allocations (the preload library's process tag,
 * torch_memory_saver's tag "default"), or NULL in a process without the preload library. */
const char* vmstash_tms_process_tag(void) VMSTASH_NOEXCEPT;
/* tms_pause with liveness hints (vmstash.h, Note [Liveness Hints]): an entry of `live`
 * applies to the vmstash tag its `tag` names (entries naming other tags are skipped), on
 * its device; an entry naming a device that is not this process's is
 * VMSTASH_INVALID_ARGUMENT (nothing paused), several entries for one tag and device add up.
 * tms_pause, tms_resume and this one make no runtime: before the first allocation, or
 * after vmstash_shutdown, they have nothing to move and return 0. */
int vmstash_tms_pause(const char* tms_tag, const vmstash_live_ranges* live, size_t n_live) VMSTASH_NOEXCEPT;
/* The calling thread's config for a region (tms_set_* of all five, the interesting flag
 * on), the previous one saved; backend NULL keeps the thread's backend. Pop restores the
 * saved config exactly (the routing override's "unset" included). Push fails
 * (VMSTASH_INVALID_ARGUMENT) for a NULL tag or a backend other than "pinned"/"mmap"; pop
 * with nothing pushed is VMSTASH_FAILED_PRECONDITION. */
int vmstash_tms_push_region(const char* tag, int enable_cpu_backup, const char* backend,
                            int enable_disk_backup) VMSTASH_NOEXCEPT;
int vmstash_tms_pop_region(void) VMSTASH_NOEXCEPT;
/* The calling thread's routing override: 1 managed, 0 not, -1 unset (the default rule).
 * Returns the previous one in the same terms. (The preload library's
 * vmstash_preload_set_routed is the same call.) */
int vmstash_tms_set_interesting(int interesting) VMSTASH_NOEXCEPT;

#ifdef __cplusplus
}
#endif

#endif /* VMSTASH_VMSTASH_TMS_H_ */
