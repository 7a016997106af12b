// host_ceiling_bench: what the host side allows a backup that gives its memory back
// (issue 33, item 1), measured in one run beside the pinned link it feeds.
//
//   link          pinned D2H / H2D of 2 GiB (cudaHostAlloc'd memory): the ceiling of any path
//   host_alloc    cudaHostAlloc + cudaFreeHost of SIZE: what a backup pinned anew each pause pays
//   fault         first touch of fresh anonymous memory (MADV_POPULATE_WRITE), 1 and N threads,
//                 4 KiB pages and transparent huge pages (MADV_HUGEPAGE)
//   memcpy        N threads copying into fresh memory (faults included) and into touched memory
//   register      cudaHostRegister of touched memory: one call, 64 MiB pieces on 1 thread and
//                 on N threads; cudaHostUnregister of it
//   pipeline      D2H of SIZE into touched memory registered piece by piece while the copies
//                 of the pieces before run (what a pause into returned memory can do)
//   span          a D2H copy spanning two adjacent registrations: correct, and its rate
//   overlap       whether (un)registering waits for copies already queued
//   lazy          after unregister + MADV_FREE: MemAvailable and RSS (memory handed back),
//                 then the next register of the same range (pages reused, not faulted)
//   staged        D2H / H2D of SIZE through a ring of pinned slots, N threads copying each slot
//                 to / from touched pageable memory while the link fills the next slots
//                 (memory that never needs registering), for a few slot sizes and counts
//   hybrid        D2H of SIZE into touched memory given back (MADV_FREE) after the last
//                 use: 64 MiB pieces registered by R threads running ahead of the copies,
//                 and every S-th piece staged through the ring on a second stream instead
//                 of registered (what a pause into returned memory could do beyond
//                 `pipeline`); then H2D of it the same way. Copies queued from this thread wait
//                 while another registers: see `reuse`, "thread"
//   reuse         the memory as a later pause finds it (registered, written by the device,
//                 unregistered; then given back with MADV_FREE or MADV_DONTNEED, kept, or
//                 mapped anew), made resident again (MADV_POPULATE_WRITE / a byte written per
//                 page / nothing), then D2H into it registered piece by piece: inline (register
//                 a piece, queue its copy), by a thread running ahead, or all before the copies
//                 (the time excludes making it resident)
//
// Usage: host_ceiling_bench [SIZE_GIB=8] [THREADS=hardware threads] [SECTIONS=all, e.g. link,lazy]. Prints one line per
// figure, GB = 1e9 bytes.
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
double GBps(std::size_t bytes, double s) { return s > 0 ? bytes / s / 1e9 : 0; }

#define CHECK_CUDA(call)                                                                          \
  do {                                                                                            \
    cudaError_t e_ = (call);                                                                      \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

constexpr std::size_t kPiece = std::size_t{64} << 20;

// "Key: N kB" of /proc/meminfo (or /proc/self/status), in bytes.
std::size_t KiBField(const char* file, const char* key) {
  std::ifstream in(file);
  std::string line;
  const std::size_t n = std::strlen(key);
  while (std::getline(in, line)) {
    if (line.compare(0, n, key) == 0) return std::strtoull(line.c_str() + n + 1, nullptr, 10) << 10;
  }
  return 0;
}
double GiB(std::size_t b) { return b / double(std::size_t{1} << 30); }

char* MapFresh(std::size_t size, bool huge) {
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) std::perror("mmap"), std::exit(1);
  madvise(p, size, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  return static_cast<char*>(p);
}

// Runs fn(begin, end) over [0, size) cut into `threads` page-aligned parts.
void Parallel(std::size_t size, int threads, const std::function<void(std::size_t, std::size_t)>& fn) {
  const std::size_t part = (size / threads + (2u << 20) - 1) / (2u << 20) * (2u << 20);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    const std::size_t b = std::min(size, t * part), e = std::min(size, b + part);
    if (b < e) pool.emplace_back(fn, b, e);
  }
  for (std::thread& t : pool) t.join();
}

void Fault(char* p, std::size_t size, int threads) {
  Parallel(size, threads, [&](std::size_t b, std::size_t e) {
    if (madvise(p + b, e - b, MADV_POPULATE_WRITE) != 0) {
      for (std::size_t i = b; i < e; i += 4096) p[i] = 0;  // kernels before 5.14
    }
  });
}

void Line(const char* what, const char* how, std::size_t bytes, double s) {
  std::printf("%-10s %-44s %7.3f s  %6.1f GB/s\n", what, how, s, GBps(bytes, s));
  std::fflush(stdout);
}

void RegisterPieces(char* p, std::size_t size, int threads) {
  std::atomic<std::size_t> next{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (std::size_t off; (off = next.fetch_add(kPiece)) < size;) {
        CHECK_CUDA(cudaHostRegister(p + off, std::min(kPiece, size - off), cudaHostRegisterPortable));
      }
    });
  }
  for (std::thread& t : pool) t.join();
}
void UnregisterPieces(char* p, std::size_t size) {
  for (std::size_t off = 0; off < size; off += kPiece) CHECK_CUDA(cudaHostUnregister(p + off));
}

// A fixed set of threads that run fn(begin, end) over parts of a range together.
class Pool {
 public:
  explicit Pool(int threads) {
    for (int t = 1; t < threads; ++t) workers_.emplace_back([this, t] { Work(t); });
    n_ = threads;
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
      ++generation_;
    }
    cv_.notify_all();
    for (std::thread& t : workers_) t.join();
  }
  void Run(std::size_t size, const std::function<void(std::size_t, std::size_t)>& fn) {
    {
      std::lock_guard<std::mutex> l(mu_);
      fn_ = &fn;
      size_ = size;
      pending_ = n_ - 1;
      ++generation_;
    }
    cv_.notify_all();
    Part(0);
    std::unique_lock<std::mutex> l(mu_);
    done_.wait(l, [&] { return pending_ == 0; });
  }

 private:
  void Part(int t) {
    const std::size_t part = (size_ / n_ + 4095) / 4096 * 4096;
    const std::size_t b = std::min(size_, t * part), e = std::min(size_, b + part);
    if (b < e) (*fn_)(b, e);
  }
  void Work(int t) {
    std::uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return generation_ != seen; });
        seen = generation_;
        if (stop_) return;
      }
      Part(t);
      std::lock_guard<std::mutex> l(mu_);
      if (--pending_ == 0) done_.notify_one();
    }
  }
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_, done_;
  const std::function<void(std::size_t, std::size_t)>* fn_ = nullptr;
  std::size_t size_ = 0;
  int n_ = 1, pending_ = 0;
  std::uint64_t generation_ = 0;
  bool stop_ = false;
};

// D2H (to_host) or H2D of `size` bytes between dev and the pageable `host` through `slots`
// pinned slots of `slot` bytes; the pool copies slot <-> host while the link fills / drains
// the other slots. Returns seconds.
double Staged(bool to_host, char* dev, char* host, std::size_t size, char* ring, std::size_t slot, int slots,
              std::vector<cudaEvent_t>& ev, Pool& pool, cudaStream_t stream) {
  const std::size_t chunks = (size + slot - 1) / slot;
  auto bytes = [&](std::size_t i) { return std::min(slot, size - i * slot); };
  auto t = Clock::now();
  if (to_host) {
    for (std::size_t i = 0; i < chunks && i < std::size_t(slots); ++i) {
      CHECK_CUDA(cudaMemcpyAsync(ring + (i % slots) * slot, dev + i * slot, bytes(i), cudaMemcpyDeviceToHost, stream));
      CHECK_CUDA(cudaEventRecord(ev[i % slots], stream));
    }
    for (std::size_t i = 0; i < chunks; ++i) {
      char* s = ring + (i % slots) * slot;
      CHECK_CUDA(cudaEventSynchronize(ev[i % slots]));
      pool.Run(bytes(i), [&](std::size_t b, std::size_t e) { std::memcpy(host + i * slot + b, s + b, e - b); });
      const std::size_t j = i + slots;
      if (j < chunks) {
        CHECK_CUDA(cudaMemcpyAsync(s, dev + j * slot, bytes(j), cudaMemcpyDeviceToHost, stream));
        CHECK_CUDA(cudaEventRecord(ev[i % slots], stream));
      }
    }
  } else {
    for (std::size_t i = 0; i < chunks; ++i) {
      char* s = ring + (i % slots) * slot;
      CHECK_CUDA(cudaEventSynchronize(ev[i % slots]));  // the slot's last copy (a call before included)
      pool.Run(bytes(i), [&](std::size_t b, std::size_t e) { std::memcpy(s + b, host + i * slot + b, e - b); });
      CHECK_CUDA(cudaMemcpyAsync(dev + i * slot, s, bytes(i), cudaMemcpyHostToDevice, stream));
      CHECK_CUDA(cudaEventRecord(ev[i % slots], stream));
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));
  }
  return Since(t);
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t size = (argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 8) << 30;
  const int threads = argc > 2 ? std::atoi(argv[2]) : static_cast<int>(std::thread::hardware_concurrency());
  const std::string only = argc > 3 ? argv[3] : "";  // a comma-separated list of sections
  auto on = [&](const char* section) { return only.empty() || ("," + only + ",").find(std::string(",") + section + ",") != std::string::npos; };
  CHECK_CUDA(cudaSetDevice(0));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::string thp;
  std::getline(std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled"), thp);
  std::printf("host_ceiling_bench: %s, %.0f GiB, %d threads, THP [%s]\n", prop.name, GiB(size), threads, thp.c_str());
  void* dev = nullptr;
  CHECK_CUDA(cudaMalloc(&dev, size));
  CHECK_CUDA(cudaMemset(dev, 0x5a, size));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CHECK_CUDA(cudaDeviceSynchronize());

  // link
  if (on("link")) {
    const std::size_t n = std::min<std::size_t>(size, std::size_t{2} << 30);
    void* h = nullptr;
    CHECK_CUDA(cudaHostAlloc(&h, n, cudaHostAllocPortable));
    for (int dir = 0; dir < 2; ++dir) {
      double best = 1e9;
      for (int r = 0; r < 3; ++r) {
        auto t = Clock::now();
        CHECK_CUDA(dir == 0 ? cudaMemcpyAsync(h, dev, n, cudaMemcpyDeviceToHost, stream)
                            : cudaMemcpyAsync(dev, h, n, cudaMemcpyHostToDevice, stream));
        CHECK_CUDA(cudaStreamSynchronize(stream));
        best = std::min(best, Since(t));
      }
      Line("link", dir == 0 ? "pinned D2H (best of 3)" : "pinned H2D (best of 3)", n, best);
    }
    CHECK_CUDA(cudaFreeHost(h));
  }
  // host_alloc
  if (on("host_alloc")) {
    void* h = nullptr;
    auto t = Clock::now();
    CHECK_CUDA(cudaHostAlloc(&h, size, cudaHostAllocPortable));
    Line("host_alloc", "cudaHostAlloc", size, Since(t));
    t = Clock::now();
    CHECK_CUDA(cudaFreeHost(h));
    Line("host_alloc", "cudaFreeHost", size, Since(t));
  }
  // fault
  for (bool huge : {false, true}) {
    if (!on("fault")) break;
    for (int n : {1, threads}) {
      char* p = MapFresh(size, huge);
      auto t = Clock::now();
      Fault(p, size, n);
      char how[64];
      std::snprintf(how, sizeof(how), "first touch, %s, %d thread%s", huge ? "THP" : "4 KiB", n, n > 1 ? "s" : "");
      Line("fault", how, size, Since(t));
      munmap(p, size);
    }
  }
  // memcpy: a touched source of SIZE
  char* src = on("memcpy") ? MapFresh(size, true) : nullptr;
  if (src != nullptr) Fault(src, size, threads);
  for (bool huge : {false, true}) {
    if (src == nullptr) break;
    char* p = MapFresh(size, huge);
    auto t = Clock::now();
    Parallel(size, threads, [&](std::size_t b, std::size_t e) { std::memcpy(p + b, src + b, e - b); });
    Line("memcpy", huge ? "into fresh memory, THP, N threads" : "into fresh memory, 4 KiB, N threads", size, Since(t));
    t = Clock::now();
    Parallel(size, threads, [&](std::size_t b, std::size_t e) { std::memcpy(p + b, src + b, e - b); });
    Line("memcpy", huge ? "into touched memory, THP, N threads" : "into touched memory, 4 KiB, N threads", size,
         Since(t));
    munmap(p, size);
  }
  if (src != nullptr) munmap(src, size);

  // register
  for (bool huge : {false, true}) {
    if (!on("register")) break;
    char* p = MapFresh(size, huge);
    Fault(p, size, threads);
    const char* kind = huge ? "THP" : "4 KiB";
    char how[80];
    auto t = Clock::now();
    CHECK_CUDA(cudaHostRegister(p, size, cudaHostRegisterPortable));
    std::snprintf(how, sizeof(how), "cudaHostRegister, touched, %s, one call", kind);
    Line("register", how, size, Since(t));
    t = Clock::now();
    CHECK_CUDA(cudaHostUnregister(p));
    std::snprintf(how, sizeof(how), "cudaHostUnregister, %s, one call", kind);
    Line("register", how, size, Since(t));
    for (int n : {1, threads}) {
      t = Clock::now();
      RegisterPieces(p, size, n);
      std::snprintf(how, sizeof(how), "register 64 MiB pieces, %s, %d thread%s", kind, n, n > 1 ? "s" : "");
      Line("register", how, size, Since(t));
      t = Clock::now();
      UnregisterPieces(p, size);
      std::snprintf(how, sizeof(how), "unregister 64 MiB pieces, %s", kind);
      Line("register", how, size, Since(t));
    }
    munmap(p, size);
  }

  // pipeline: register piece k (this thread) while the copies of pieces < k run
  for (bool huge : {false, true}) {
    if (!on("pipeline")) break;
    char* p = MapFresh(size, huge);
    Fault(p, size, threads);
    for (int round = 0; round < 2; ++round) {
      auto t = Clock::now();
      for (std::size_t off = 0; off < size; off += kPiece) {
        const std::size_t n = std::min(kPiece, size - off);
        CHECK_CUDA(cudaHostRegister(p + off, n, cudaHostRegisterPortable));
        CHECK_CUDA(cudaMemcpyAsync(p + off, static_cast<char*>(dev) + off, n, cudaMemcpyDeviceToHost, stream));
      }
      CHECK_CUDA(cudaStreamSynchronize(stream));
      const double s = Since(t);
      Line("pipeline", huge ? "register 64 MiB + D2H, touched, THP" : "register 64 MiB + D2H, touched, 4 KiB", size, s);
      t = Clock::now();
      for (std::size_t off = 0; off < size; off += kPiece) {
        CHECK_CUDA(cudaMemcpyAsync(static_cast<char*>(dev) + off, p + off, std::min(kPiece, size - off),
                                   cudaMemcpyHostToDevice, stream));
      }
      CHECK_CUDA(cudaStreamSynchronize(stream));
      Line("pipeline", "H2D of the registered pieces", size, Since(t));
      UnregisterPieces(p, size);
    }
    munmap(p, size);
  }

  // span: one copy across two registrations
  if (on("span")) {
    const std::size_t half = std::size_t{512} << 20;
    char* p = MapFresh(2 * half, true);
    Fault(p, 2 * half, threads);
    std::memset(p, 0, 2 * half);
    CHECK_CUDA(cudaHostRegister(p, half, cudaHostRegisterPortable));
    CHECK_CUDA(cudaHostRegister(p + half, half, cudaHostRegisterPortable));
    double best = 1e9;
    for (int r = 0; r < 3; ++r) {
      auto t = Clock::now();
      cudaError_t e = cudaMemcpyAsync(p, dev, 2 * half, cudaMemcpyDeviceToHost, stream);
      if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
      if (e != cudaSuccess) {
        std::printf("span       D2H across two registrations failed: %s\n", cudaGetErrorString(e));
        cudaGetLastError();
        best = 0;
        break;
      }
      best = std::min(best, Since(t));
    }
    if (best > 0) {
      bool same = true;
      for (std::size_t i = 0; i < 2 * half; i += 4096) same = same && p[i] == 0x5a && p[i + 4095] == 0x5a;
      std::printf("span       D2H across two registrations: %s\n", same ? "bytes correct" : "BYTES WRONG");
      Line("span", "D2H 1 GiB across two registrations (best of 3)", 2 * half, best);
    }
    CHECK_CUDA(cudaHostUnregister(p));
    CHECK_CUDA(cudaHostUnregister(p + half));
    munmap(p, 2 * half);
  }

  // overlap: does (un)registering wait for copies queued on another buffer? A 4 GiB pinned
  // D2H (~75 ms) is queued, then a separate 64 MiB piece is unregistered / registered.
  if (on("overlap")) {
    const std::size_t n = std::min<std::size_t>(size, std::size_t{4} << 30);
    void* h = nullptr;
    CHECK_CUDA(cudaHostAlloc(&h, n, cudaHostAllocPortable));
    char* piece = MapFresh(kPiece, true);
    Fault(piece, kPiece, 1);
    for (int what = 0; what < 2; ++what) {
      if (what == 0) CHECK_CUDA(cudaHostRegister(piece, kPiece, cudaHostRegisterPortable));
      CHECK_CUDA(cudaStreamSynchronize(stream));
      auto t = Clock::now();
      CHECK_CUDA(cudaMemcpyAsync(h, dev, n, cudaMemcpyDeviceToHost, stream));
      const double queued = Since(t);
      t = Clock::now();
      CHECK_CUDA(what == 0 ? cudaHostUnregister(piece) : cudaHostRegister(piece, kPiece, cudaHostRegisterPortable));
      const double call = Since(t);
      CHECK_CUDA(cudaStreamSynchronize(stream));
      const double total = Since(t) + queued;
      std::printf("overlap    %s of 64 MiB while a %.0f GiB D2H runs: %.1f ms (the copy: %.1f ms)\n",
                  what == 0 ? "cudaHostUnregister" : "cudaHostRegister", GiB(n), call * 1e3, total * 1e3);
    }
    CHECK_CUDA(cudaHostUnregister(piece));
    munmap(piece, kPiece);
    CHECK_CUDA(cudaFreeHost(h));
  }

  // lazy: hand back with MADV_FREE, then reuse
  if (on("lazy")) {
    char* p = MapFresh(size, true);
    const std::size_t avail0 = KiBField("/proc/meminfo", "MemAvailable:");
    Fault(p, size, threads);
    CHECK_CUDA(cudaHostRegister(p, size, cudaHostRegisterPortable));
    const std::size_t avail1 = KiBField("/proc/meminfo", "MemAvailable:");
    auto t = Clock::now();
    CHECK_CUDA(cudaHostUnregister(p));
    const double unreg = Since(t);
    t = Clock::now();
    madvise(p, size, MADV_FREE);
    const double freed = Since(t);
    const std::size_t avail2 = KiBField("/proc/meminfo", "MemAvailable:");
    const std::size_t rss = KiBField("/proc/self/status", "VmRSS:");
    std::printf("lazy       MemAvailable GiB: before %.2f, registered %.2f, after unregister+MADV_FREE %.2f; "
                "RSS %.2f GiB; unregister %.3f s, MADV_FREE %.3f s\n",
                GiB(avail0), GiB(avail1), GiB(avail2), GiB(rss), unreg, freed);
    t = Clock::now();
    Parallel(size, threads, [&](std::size_t b, std::size_t e) {
      for (std::size_t i = b; i < e; i += 4096) p[i] = 1;  // keeps the page: it is dirty again
    });
    Line("lazy", "write one byte per page, N threads (reuse)", size, Since(t));
    t = Clock::now();
    CHECK_CUDA(cudaHostRegister(p, size, cudaHostRegisterPortable));
    Line("lazy", "cudaHostRegister of the reused range", size, Since(t));
    CHECK_CUDA(cudaHostUnregister(p));
    t = Clock::now();
    madvise(p, size, MADV_DONTNEED);
    Line("lazy", "MADV_DONTNEED (handed back at once)", size, Since(t));
    munmap(p, size);
  }
  // hybrid: registering ahead on R threads, every S-th piece staged instead
  if (on("hybrid")) {
    char* p = MapFresh(size, true);
    Fault(p, size, threads);
    void* ring = nullptr;
    CHECK_CUDA(cudaHostAlloc(&ring, std::size_t{128} << 20, cudaHostAllocPortable));
    std::vector<cudaEvent_t> ev(8);
    for (cudaEvent_t& e : ev) CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    cudaStream_t staged_stream;
    CHECK_CUDA(cudaStreamCreateWithFlags(&staged_stream, cudaStreamNonBlocking));
    Pool pool(threads);
    const std::size_t pieces = (size + kPiece - 1) / kPiece;
    auto piece_bytes = [&](std::size_t k) { return std::min(kPiece, size - k * kPiece); };
    struct Shape { int reg_threads; int every; };  // every: 0 = nothing staged
    for (Shape sh : {Shape{1, 0}, Shape{2, 0}, Shape{4, 0}, Shape{1, 4}, Shape{2, 4}, Shape{1, 3}, Shape{2, 8}}) {
      auto staged = [&](std::size_t k) { return sh.every > 0 && k % sh.every == std::size_t(sh.every - 1); };
      // the memory as a pause finds it after a hand-back: unregistered, MADV_FREE'd, rewarmed
      madvise(p, size, MADV_FREE);
      Fault(p, size, threads);
      std::vector<std::atomic<int>> ready(pieces);
      for (auto& r : ready) r.store(0);
      std::atomic<std::size_t> next{0};
      auto t = Clock::now();
      std::vector<std::thread> regs;
      for (int r = 0; r < sh.reg_threads; ++r) {
        regs.emplace_back([&] {
          for (std::size_t k; (k = next.fetch_add(1)) < pieces;) {
            if (staged(k)) continue;
            CHECK_CUDA(cudaHostRegister(p + k * kPiece, piece_bytes(k), cudaHostRegisterPortable));
            ready[k].store(1, std::memory_order_release);
          }
        });
      }
      for (std::size_t k = 0; k < pieces; ++k) {
        if (staged(k)) {
          Staged(true, static_cast<char*>(dev) + k * kPiece, p + k * kPiece, piece_bytes(k), static_cast<char*>(ring),
                 16 << 20, 8, ev, pool, staged_stream);
          continue;
        }
        while (ready[k].load(std::memory_order_acquire) == 0) std::this_thread::yield();
        CHECK_CUDA(cudaMemcpyAsync(p + k * kPiece, static_cast<char*>(dev) + k * kPiece, piece_bytes(k),
                                   cudaMemcpyDeviceToHost, stream));
      }
      for (std::thread& r : regs) r.join();
      CHECK_CUDA(cudaStreamSynchronize(stream));
      CHECK_CUDA(cudaStreamSynchronize(staged_stream));
      char how[80];
      std::snprintf(how, sizeof(how), "D2H, %d register thread%s, %s", sh.reg_threads, sh.reg_threads > 1 ? "s" : "",
                    sh.every ? ("1 piece in " + std::to_string(sh.every) + " staged").c_str() : "none staged");
      Line("hybrid", how, size, Since(t));
      t = Clock::now();
      for (std::size_t k = 0; k < pieces; ++k) {
        if (staged(k)) {
          Staged(false, static_cast<char*>(dev) + k * kPiece, p + k * kPiece, piece_bytes(k), static_cast<char*>(ring),
                 16 << 20, 8, ev, pool, staged_stream);
        } else {
          CHECK_CUDA(cudaMemcpyAsync(static_cast<char*>(dev) + k * kPiece, p + k * kPiece, piece_bytes(k),
                                     cudaMemcpyHostToDevice, stream));
        }
      }
      CHECK_CUDA(cudaStreamSynchronize(stream));
      CHECK_CUDA(cudaStreamSynchronize(staged_stream));
      std::snprintf(how, sizeof(how), "H2D of the same");
      Line("hybrid", how, size, Since(t));
      for (std::size_t k = 0; k < pieces; ++k) {
        if (!staged(k)) CHECK_CUDA(cudaHostUnregister(p + k * kPiece));
      }
    }
    for (cudaEvent_t& e : ev) CHECK_CUDA(cudaEventDestroy(e));
    CHECK_CUDA(cudaStreamDestroy(staged_stream));
    CHECK_CUDA(cudaFreeHost(ring));
    munmap(p, size);
  }
  // reuse: what a pause into memory handed back by the resume before it can do
  if (on("reuse")) {
    bool huge = true;
    char* p = MapFresh(size, huge);
    Fault(p, size, threads);
    // back: how the last cycle left it; rewarm: how it is made resident again; issue: who
    // registers (inline: register piece k, queue its copy, next; thread: one thread registers
    // ahead of the copies; serial: every piece registered, then the copies)
    enum Back { kFree, kDontneed, kKeep, kNewMap };
    enum Rewarm { kPopulate, kByte, kNone };
    enum Issue { kInline, kThread, kSerial, kBatch };
    struct Shape { Back back; Rewarm rewarm; Issue issue; std::size_t piece_mib; int batch = 1; bool huge = true; };
    static const char* const kBack[] = {"FREE", "DONTNEED", "kept", "new map"};
    static const char* const kRewarm[] = {"populate", "byte/page", "none"};
    static const char* const kIssue[] = {"inline", "thread", "serial", "batch"};
    const Shape shapes[] = {{kKeep, kNone, kInline, 64},       {kNewMap, kPopulate, kInline, 64},
                            {kFree, kPopulate, kInline, 64},   {kFree, kNone, kInline, 64},
                            {kFree, kByte, kInline, 64},       {kDontneed, kPopulate, kInline, 64},
                            {kKeep, kNone, kThread, 64},       {kFree, kPopulate, kThread, 64},
                            {kFree, kPopulate, kSerial, 64},   {kKeep, kNone, kSerial, 64},
                            {kFree, kPopulate, kInline, 256},  {kFree, kPopulate, kInline, 1024},
                            {kFree, kPopulate, kBatch, 64, 2},  {kFree, kPopulate, kBatch, 64, 4},
                            {kFree, kPopulate, kBatch, 64, 8},  {kFree, kPopulate, kInline, 64, 1, false},
                            {kFree, kPopulate, kBatch, 64, 2, false}, {kFree, kPopulate, kBatch, 64, 4, false},
                            {kFree, kPopulate, kBatch, 64, 8, false}, {kFree, kPopulate, kBatch, 64, 16, false}};
    for (const Shape& sh : shapes) {
      const std::size_t piece = sh.piece_mib << 20;
      const std::size_t pieces = (size + piece - 1) / piece;
      auto bytes = [&](std::size_t k) { return std::min(piece, size - k * piece); };
      auto reg = [&](std::size_t k) { CHECK_CUDA(cudaHostRegister(p + k * piece, bytes(k), cudaHostRegisterPortable)); };
      auto copy = [&](std::size_t k) {
        CHECK_CUDA(cudaMemcpyAsync(p + k * piece, static_cast<char*>(dev) + k * piece, bytes(k),
                                   cudaMemcpyDeviceToHost, stream));
      };
      if (sh.huge != huge) munmap(p, size), p = MapFresh(size, huge = sh.huge), Fault(p, size, threads);
      // the cycle before: registered, written by the device, unregistered, given back
      for (std::size_t k = 0; k < pieces; ++k) reg(k), copy(k);
      CHECK_CUDA(cudaStreamSynchronize(stream));
      for (std::size_t k = 0; k < pieces; ++k) CHECK_CUDA(cudaHostUnregister(p + k * piece));
      if (sh.back == kFree || sh.back == kDontneed) madvise(p, size, sh.back == kFree ? MADV_FREE : MADV_DONTNEED);
      if (sh.back == kNewMap) munmap(p, size), p = MapFresh(size, huge);
      auto t = Clock::now();
      if (sh.rewarm == kPopulate) Fault(p, size, threads);
      if (sh.rewarm == kByte) {
        Parallel(size, threads, [&](std::size_t b, std::size_t e) {
          for (std::size_t i = b; i < e; i += 4096) p[i] = 1;
        });
      }
      const double rewarm = Since(t);
      t = Clock::now();
      double registered = 0;
      if (sh.issue == kInline) {
        for (std::size_t k = 0; k < pieces; ++k) reg(k), copy(k);
      } else if (sh.issue == kBatch) {  // `batch` threads register a batch while the last one's copies run
        for (std::size_t k0 = 0; k0 < pieces; k0 += sh.batch) {
          std::vector<std::thread> regs;
          for (std::size_t k = k0; k < std::min(pieces, k0 + sh.batch); ++k) regs.emplace_back(reg, k);
          for (std::thread& r : regs) r.join();
          for (std::size_t k = k0; k < std::min(pieces, k0 + sh.batch); ++k) copy(k);
        }
      } else if (sh.issue == kSerial) {
        for (std::size_t k = 0; k < pieces; ++k) reg(k);
        registered = Since(t);
        for (std::size_t k = 0; k < pieces; ++k) copy(k);
      } else {
        std::vector<std::atomic<int>> ready(pieces);
        for (auto& r : ready) r.store(0);
        std::thread ahead([&] {
          for (std::size_t k = 0; k < pieces; ++k) reg(k), ready[k].store(1, std::memory_order_release);
        });
        for (std::size_t k = 0; k < pieces; ++k) {
          while (ready[k].load(std::memory_order_acquire) == 0) std::this_thread::yield();
          copy(k);
        }
        ahead.join();
      }
      CHECK_CUDA(cudaStreamSynchronize(stream));
      const double s = Since(t);
      for (std::size_t k = 0; k < pieces; ++k) CHECK_CUDA(cudaHostUnregister(p + k * piece));
      char how[96];
      std::snprintf(how, sizeof(how), "%s, %s, %s x%d, %zu MiB %s", kBack[sh.back], kRewarm[sh.rewarm],
                    kIssue[sh.issue], sh.batch, sh.piece_mib, sh.huge ? "THP" : "4K");
      std::printf("reuse      %-44s %7.3f s  %6.1f GB/s  (rewarm %.3f s; register %.3f s)\n", how, s, GBps(size, s),
                  rewarm, registered);
      std::fflush(stdout);
    }
    munmap(p, size);
  }
  // staged: through a pinned ring into touched pageable (THP) memory
  if (on("staged")) {
    char* p = MapFresh(size, true);
    Fault(p, size, threads);
    const std::size_t max_ring = std::size_t{512} << 20;
    void* ring = nullptr;
    CHECK_CUDA(cudaHostAlloc(&ring, max_ring, cudaHostAllocPortable));
    std::vector<cudaEvent_t> ev(32);
    for (cudaEvent_t& e : ev) CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    struct Shape { std::size_t slot_mib; int slots; int threads; };
    const int half = std::max(1, threads / 2);
    for (Shape sh : {Shape{16, 8, threads}, Shape{32, 8, threads}, Shape{64, 4, threads}, Shape{64, 8, threads},
                     Shape{32, 8, half}}) {
      Pool pool(sh.threads);
      const std::size_t slot = sh.slot_mib << 20;
      for (int dir = 0; dir < 2; ++dir) {
        double best = 1e9;
        for (int r = 0; r < 2; ++r) {
          best = std::min(best, Staged(dir == 0, static_cast<char*>(dev), p, size, static_cast<char*>(ring), slot,
                                       sh.slots, ev, pool, stream));
        }
        char how[80];
        std::snprintf(how, sizeof(how), "%s, %d x %zu MiB slots, %d threads", dir == 0 ? "D2H" : "H2D", sh.slots,
                      sh.slot_mib, sh.threads);
        Line("staged", how, size, best);
      }
    }
    // into fresh memory (what a pageable store that gave its pages back pays): 4 KiB / THP
    for (bool huge : {false, true}) {
      Pool pool(threads);
      char* fresh = MapFresh(size, huge);
      const double s = Staged(true, static_cast<char*>(dev), fresh, size, static_cast<char*>(ring), 16 << 20, 8, ev,
                              pool, stream);
      Line("staged", huge ? "D2H into fresh memory, THP, 8 x 16 MiB" : "D2H into fresh memory, 4 KiB, 8 x 16 MiB",
           size, s);
      auto t = Clock::now();
      madvise(fresh, size, MADV_DONTNEED);
      Line("staged", huge ? "MADV_DONTNEED of it, THP" : "MADV_DONTNEED of it, 4 KiB", size, Since(t));
      munmap(fresh, size);
    }
    // the bytes came back: D2H then H2D into a second device buffer, compared
    bool same = true;
    {
      Pool pool(threads);
      CHECK_CUDA(cudaMemset(dev, 0x3c, size / 2));
      Staged(true, static_cast<char*>(dev), p, size, static_cast<char*>(ring), 32 << 20, 8, ev, pool, stream);
      for (std::size_t i = 0; i < size; i += 4096) same = same && p[i] == (i < size / 2 ? 0x3c : 0x5a);
    }
    std::printf("staged     D2H bytes %s\n", same ? "correct" : "WRONG");
    for (cudaEvent_t& e : ev) CHECK_CUDA(cudaEventDestroy(e));
    CHECK_CUDA(cudaFreeHost(ring));
    munmap(p, size);
  }
  CHECK_CUDA(cudaFree(dev));
  return 0;
}
