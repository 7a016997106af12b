// AutoPreparer: see auto_preparer.h.
#include "allocator/auto_preparer.h"

#include <algorithm>
#include <utility>

#include "base/log.h"

namespace vmstash {

AutoPreparer::~AutoPreparer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    queue_.clear();
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void AutoPreparer::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    queue_.clear();
  }
  cv_.notify_all();
}

void AutoPreparer::Request(TagId tag, std::size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    Pending& p = queue_[tag];
    p.bytes = std::max(p.bytes, bytes);
    p.due = std::chrono::steady_clock::now() + settle_;
    if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
  }
  cv_.notify_all();
}

void AutoPreparer::RequestGiveBack(TagId tag) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    Pending& p = queue_[tag];
    p.give_back = true;
    p.due = std::chrono::steady_clock::now() + kGiveBackDelay;
    if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
  }
  cv_.notify_all();
}

void AutoPreparer::WaitIdle() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return stop_ || (queue_.empty() && !busy_); });
}

void AutoPreparer::Loop() {
  if (on_thread_start_) on_thread_start_();
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    auto next = std::min_element(queue_.begin(), queue_.end(),
                                 [](const auto& a, const auto& b) { return a.second.due < b.second.due; });
    if (next->second.due > std::chrono::steady_clock::now()) {
      // A copy: wait_until reads its deadline again after waking up, when the entry may
      // already be gone (Stop/destruction clear the queue, a request may replace it).
      const std::chrono::steady_clock::time_point due = next->second.due;
      cv_.wait_until(lock, due);  // a new request may move it; look again
      continue;
    }
    const TagId tag = next->first;
    const std::size_t bytes = next->second.bytes;
    const bool give_back = next->second.give_back;
    queue_.erase(next);
    busy_ = true;
    lock.unlock();
    absl::Status s = prepare_(tag, bytes, give_back);
    if (!s.ok()) {
      VMSTASH_LOG(kWarning, "vmstash: {} the backup arena of tag '{}' in the background: {}",
                  give_back ? "giving back the memory of" : "preparing", TagName(tag), s.ToString());
    }
    lock.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

}  // namespace vmstash
