// HostCopyPool: a few threads that copy host memory together (the staging ring's half of
// a copy between the device and pageable memory: vmm/staging_ring.h, Note [Staging Ring]).
//
// One thread copies host memory at ~10 GB/s; the link a backup feeds runs at ~55 GB/s
// each way, and 16 threads copying into memory already touched reach ~60 GB/s
// (bench/host_ceiling_bench.cc, "memcpy" and "staged"). Starting threads per copy would
// cost more than a 16 MiB copy takes, so the threads live as long as the pool and wait
// for work between copies.
//
// Copy(spans) cuts the spans' bytes into one equal part per thread (the caller's thread is
// one of them) and returns when every byte is copied. Spans must not overlap one another's
// destinations; a span's source and destination must not overlap. Copies too small to be
// worth waking threads for (kInlineBytes) run on the caller's thread alone.
//
// Shared() is the process's pool: made at first use with PinnedPieces::DefaultThreads()
// threads (the hardware's, at most 16), never destroyed (a copy may run from an arena's
// destructor at exit). A forked child's first call makes a new one (the parent's threads
// do not exist in the child; the old pool is leaked there).
//
// Thread-safety: Copy may be called from any thread; callers take turns (one copy at a
// time: they share the host's memory bandwidth anyway). Copying cannot fail.
#ifndef VMSTASH_VMM_HOST_COPY_POOL_H_
#define VMSTASH_VMM_HOST_COPY_POOL_H_

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace vmstash {

class HostCopyPool {
 public:
  struct Span {
    void* dst = nullptr;
    const void* src = nullptr;
    std::size_t size_bytes = 0;
  };
  static constexpr std::size_t kInlineBytes = std::size_t{1} << 20;

  static HostCopyPool& Shared();

  explicit HostCopyPool(int threads);
  ~HostCopyPool();
  HostCopyPool(const HostCopyPool&) = delete;
  HostCopyPool& operator=(const HostCopyPool&) = delete;

  void Copy(const std::vector<Span>& spans);
  int threads() const { return threads_; }

 private:
  // Copies part `part` of the current job: bytes [part * share, (part + 1) * share) of
  // the spans laid end to end.
  void CopyPart(int part);
  void Work(int part);

  const int threads_;
  std::mutex turn_;  // one Copy at a time
  std::mutex mu_;
  std::condition_variable start_, done_;
  // The current job (guarded by mu_; read by the workers between start_ and their part's end).
  const std::vector<Span>* spans_ = nullptr;
  std::size_t total_ = 0;
  std::size_t share_ = 0;
  int pending_ = 0;              // guarded by mu_: workers still copying their part
  std::uint64_t generation_ = 0;  // guarded by mu_: bumped per job
  bool stop_ = false;            // guarded by mu_
  std::vector<std::thread> workers_;
};

}  // namespace vmstash

#endif  // VMSTASH_VMM_HOST_COPY_POOL_H_
