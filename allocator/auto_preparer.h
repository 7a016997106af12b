// AutoPreparer: one background thread that sizes backup arenas ahead of the first pause
// (docs/architecture.md §5: "pinned ahead of time ... or in a background thread"), and
// hands the memory of resumed arenas back to the OS when their retention says so (the
// CUDA driver's unregistering waits for all queued work, so a resume cannot do it behind
// its own copies: Note [Pinned Pieces]).
//
// Pinning host memory costs ~0.4 s/GiB. A tag that pays it inside Pause() pauses at a
// few GiB/s instead of link speed, so the allocator asks this thread to Prepare a
// `backup` tag whenever the tag's reserved bytes outgrow what was last prepared (with 25%
// headroom, so a growing tag re-pins a logarithmic number of times). The work function is
// the allocator's Prepare(tag, bytes); it runs without allocator locks, under the tag's
// transition lock, so allocations proceed while the thread pins and a Pause simply waits
// for a preparation in progress (it would have had to pin anyway).
//
// Requests for one tag coalesce (the largest wins) and wait until the tag has stopped
// growing for `settle` (each request restarts the wait): a tag filled in a burst (loading
// weights, sizing a KV cache) is pinned once at its final size instead of re-pinned at
// every growth step, since a larger arena replaces the smaller one. The thread starts on
// the first request, so allocators without `backup` tags never start it. Failures are
// logged (the pause then pins what it needs itself, or reports the host's refusal).
//
// Thread-safety: Request() is thread-safe and never blocks on the work; the destructor
// stops the thread after the preparation in progress (if any) and drops queued ones.
#ifndef VMSTASH_ALLOCATOR_AUTO_PREPARER_H_
#define VMSTASH_ALLOCATOR_AUTO_PREPARER_H_

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "absl/status/status.h"
#include "allocator/tag.h"

namespace vmstash {

class AutoPreparer {
 public:
  // `bytes` > 0: prepare that much arena; `give_back`: hand a resumed arena's memory back
  // first (Note [Retained Backups], give_back).
  using PrepareFn = std::function<absl::Status(TagId tag, std::size_t bytes, bool give_back)>;
  // `on_thread_start` (may be empty) runs first on the thread, once: the driver's
  // RelaxStreamCaptureForThisThread, so the thread's work never invalidates a user's graph
  // capture in another thread.
  AutoPreparer(PrepareFn prepare, std::chrono::milliseconds settle, std::function<void()> on_thread_start = {})
      : prepare_(std::move(prepare)), settle_(settle), on_thread_start_(std::move(on_thread_start)) {}
  ~AutoPreparer();
  AutoPreparer(const AutoPreparer&) = delete;
  AutoPreparer& operator=(const AutoPreparer&) = delete;

  // Queues Prepare(tag, bytes), due `settle` from now.
  void Request(TagId tag, std::size_t bytes);
  // Queues the hand-back of `tag`'s resumed arena, due kGiveBackDelay from now (a request
  // for the tag already queued keeps its bytes and runs then too). The delay lets a burst of
  // resumes (torch_memory_saver resumes its tags one after another) finish first: the
  // driver's unregistering waits for all queued work, the resumes' copies included.
  static constexpr std::chrono::milliseconds kGiveBackDelay{50};
  void RequestGiveBack(TagId tag);
  // Drops queued preparations and refuses new ones, without waiting for one in progress
  // (for process exit: the CUDA driver may be shutting down after it).
  void Stop();
  // Blocks until nothing is queued or in progress (for tests and benchmarks).
  void WaitIdle();
  // After Stop(): requests are dropped.
  bool stopped() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stop_;
  }

 private:
  void Loop();

  struct Pending {
    std::size_t bytes = 0;
    bool give_back = false;
    std::chrono::steady_clock::time_point due;
  };
  const PrepareFn prepare_;
  const std::chrono::milliseconds settle_;
  const std::function<void()> on_thread_start_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<TagId, Pending> queue_;      // guarded by mu_
  bool busy_ = false;                   // guarded by mu_
  bool stop_ = false;                   // guarded by mu_
  std::thread thread_;                  // started by the first Request
};

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_AUTO_PREPARER_H_
