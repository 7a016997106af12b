#include "vmm/host_copy_pool.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "vmm/pinned_pieces.h"

namespace vmstash {

HostCopyPool& HostCopyPool::Shared() {
  static std::mutex mu;
  static HostCopyPool* pool = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(mu);
  if (pool == nullptr || owner != getpid()) {  // a forked child: the parent's threads are gone
    pool = new HostCopyPool(PinnedPieces::DefaultThreads());  // leaked: see the header
    owner = getpid();
  }
  return *pool;
}

HostCopyPool::HostCopyPool(int threads) : threads_(std::max(1, threads)) {
  workers_.reserve(threads_ - 1);
  for (int part = 1; part < threads_; ++part) workers_.emplace_back([this, part] { Work(part); });
}

HostCopyPool::~HostCopyPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    ++generation_;
  }
  start_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void HostCopyPool::Copy(const std::vector<Span>& spans) {
  std::size_t total = 0;
  for (const Span& s : spans) total += s.size_bytes;
  if (total == 0) return;
  if (total <= kInlineBytes || threads_ == 1) {
    for (const Span& s : spans) std::memcpy(s.dst, s.src, s.size_bytes);
    return;
  }
  std::lock_guard<std::mutex> turn(turn_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    spans_ = &spans;
    total_ = total;
    // Parts of whole 4 KiB pages, so that no two threads write the same page.
    share_ = ((total + threads_ - 1) / threads_ + 4095) / 4096 * 4096;
    pending_ = threads_ - 1;
    ++generation_;
  }
  start_.notify_all();
  CopyPart(0);
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [this] { return pending_ == 0; });
  spans_ = nullptr;
}

void HostCopyPool::CopyPart(int part) {
  const std::size_t begin = std::min(total_, part * share_), end = std::min(total_, begin + share_);
  std::size_t at = 0;  // where the current span starts in the spans laid end to end
  for (const Span& s : *spans_) {
    if (at >= end) break;
    const std::size_t from = std::max(begin, at), to = std::min(end, at + s.size_bytes);
    if (from < to) {
      std::memcpy(static_cast<char*>(s.dst) + (from - at), static_cast<const char*>(s.src) + (from - at), to - from);
    }
    at += s.size_bytes;
  }
}

void HostCopyPool::Work(int part) {
  std::uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (stop_) return;
    }
    CopyPart(part);
    std::lock_guard<std::mutex> lock(mu_);
    if (--pending_ == 0) done_.notify_one();
  }
}

}  // namespace vmstash
