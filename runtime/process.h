// The process runtime: the one Runtime (runtime.h) of a process, as the C ABI, the
// LD_PRELOAD library, the stash entry points and the control endpoint share it. It
// chooses the driver (CreateDriver from the options), initializes from VMSTASH_CONF on
// first use or from explicit options (Init), runs the shutdown protocol, survives fork(),
// stops background work at exit and serves the control endpoint.
//
// Note [Shutdown]
//   Every use of the process runtime runs inside a Call: it counts itself in its thread's
//   in-flight counter, then checks the phase (call_gate.h). Shutdown() sets the phase to
//   "closing", stops the control endpoint (outside the lock; a request it serves completes
//   or fails), waits until no call is in flight, and only then destroys the Runtime (its
//   allocators, then the driver). The gate's fences make a call either see "closing" and
//   fail with FailedPrecondition, or be counted and complete before anything is destroyed.
//   After a shutdown every call fails with FailedPrecondition until Init() is called again
//   (no silent re-initialization from the environment, which would drop the options given
//   to Init). A shutdown from inside a call (a pause/resume hook) would wait for itself:
//   it fails. A shutdown while stash arenas exist (Runtime::dependents) fails too.
//
// Note [Fork]
//   The runtime lock is held across fork(), so the child's copy is consistent; in the
//   child only the forking thread exists, so the in-flight count is that thread's own,
//   and the control endpoint (thread, socket) stays the parent's: the child never stops it
//   or removes its socket.
//   A child of a process with a runtime cannot use that runtime: its allocators' locks may
//   be held by parent threads the child does not have (a call would hang), its background
//   threads are gone, and its device memory belongs to the parent's CUDA context (CUDA
//   does not support a forked child either). So in the child every Call is refused with
//   FailedPrecondition naming both processes, Initialized() is false and Init() fails;
//   Shutdown() succeeds without touching the copy (it is abandoned, never destroyed), after
//   which Init() may create a runtime of the child's own. The check costs one relaxed load
//   per call. The tag-intern table (allocator/tag.cc) has fork handlers of its own: tag
//   names stay usable in the child. Stash arenas the child inherited stay the parent's
//   runtime's: refused in the child's own (torch_plugin/c_abi/stash_c.cc, Note [Arenas
//   Across Fork]).
//
// Thread-safety: every function is thread-safe. The Runtime a Call returns is valid until
// that Call ends.
#ifndef VMSTASH_RUNTIME_PROCESS_H_
#define VMSTASH_RUNTIME_PROCESS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "runtime/runtime.h"
#include "runtime/tag_import.h"

namespace vmstash::process {

class Call {
 public:
  Call();
  ~Call();
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;

  // OK, or why this call must not touch the runtime (shutting down, or shut down).
  const absl::Status& refused() const { return refused_; }
  // The process's Runtime, initialized from the environment on first use; refused() when
  // the call was refused.
  absl::StatusOr<Runtime*> runtime();
  // The process's Runtime if it is initialized (and the call not refused), else nullptr;
  // never initializes.
  Runtime* runtime_if_initialized() const;

 private:
  absl::Status refused_;
};

// Initializes the process runtime from `conf` (VMSTASH_CONF syntax), or from the
// environment when `conf` is null. Already initialized: OK for a null `conf` or the same
// options, FailedPrecondition naming both for others. After Shutdown(), initializes anew.
absl::Status Init(const char* conf);
// Note [Shutdown]. OK when already shut down. In a forked child, drops the parent's copy
// without touching it (Note [Fork]).
absl::Status Shutdown();
// True between a successful initialization and the start of a shutdown.
bool Initialized();

// Mapped tags (Note [Mapped Tags] in tag_share.h), owned by the process runtime: stopped
// and closed by Shutdown (before the runtime goes), left alone in a forked child. Each is
// called inside a Call (`runtime`: that call's runtime).
// This process shares `tag` by `name` and publishes `index` (TagExporter::Share; the exporter is
// started on first use and made the runtime's observer); returns the tag's new generation.
absl::StatusOr<std::uint64_t> ShareTag(Runtime& runtime, TagId tag, const std::string& index, const std::string& name);
absl::Status UnshareTag(TagId tag);
// Maps tag `tag` of process `pid` on this process's `device`; returns a handle (> 0).
absl::StatusOr<std::uint64_t> MapTag(Runtime& runtime, int pid, const std::string& tag, int device, int timeout_ms);
// The mapped tag of `handle` (NotFound for an unknown or closed handle).
absl::StatusOr<std::shared_ptr<share::MappedTag>> Mapped(std::uint64_t handle);
// Takes it out of the table (later calls with the handle are NotFound); the caller drops
// it, which unmaps it once every copy is gone (waiting for its Uses). NotFound for an
// unknown handle.
absl::StatusOr<std::shared_ptr<share::MappedTag>> TakeMapped(std::uint64_t handle);

}  // namespace vmstash::process

#endif  // VMSTASH_RUNTIME_PROCESS_H_
