// fork() while another thread interns tag names (issue 28, a suspected item): the child's
// copy of the intern table's lock must not be left held by a thread the child does not
// have (tag.cc holds it across fork). Each child interns a name and exits; the parent
// waits with a deadline, so a hung child fails the test instead of hanging it.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "allocator/tag.h"
#include "gtest/gtest.h"

namespace vmstash {
namespace {

// The child's exit status, or -1 (after killing it) when it has not ended by `deadline`.
int WaitWithDeadline(pid_t child, std::chrono::steady_clock::time_point deadline) {
  int status = 0;
  while (waitpid(child, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(child, SIGKILL);
      waitpid(child, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return status;
}

TEST(ForkTest, AChildInternsTagsWhileAnotherThreadWasInterningAtTheFork) {
  ASSERT_TRUE(InternTag("fork_parent").ok());
  std::atomic<bool> stop{false};
  std::atomic<long> interned{0};
  std::thread hammer([&] {
    while (!stop.load(std::memory_order_relaxed)) {
      if (InternTag("fork_parent").ok()) interned.fetch_add(1, std::memory_order_relaxed);
    }
  });
  while (interned.load() < 100) std::this_thread::yield();
  constexpr int kForks = 200;
  int hung = 0, failed = 0;
  for (int i = 0; i < kForks; ++i) {
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      // Only async-signal-safe work is strictly allowed here; the table's own lock is what
      // is under test (malloc's locks are handled by glibc's fork).
      absl::StatusOr<TagId> id = InternTag("fork_child");
      const bool ok = id.ok() && TagName(*id) == "fork_child" && InternTag("fork_parent").ok();
      _exit(ok ? 0 : 3);
    }
    // Generous: a child needs microseconds; only a hang reaches this.
    const int status = WaitWithDeadline(child, std::chrono::steady_clock::now() + std::chrono::seconds(20));
    if (status == -1) {
      ++hung;
      break;  // one hang is the failure; do not wait 20 s more for each
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  stop = true;
  hammer.join();
  EXPECT_EQ(hung, 0) << "a child hung in InternTag: the intern lock was held at fork()";
  EXPECT_EQ(failed, 0);
  // The parent's table is unchanged by the children.
  EXPECT_TRUE(InternTag("fork_parent").ok());
  for (int id = 0; id < TagCount(); ++id) EXPECT_NE(TagName(id), "fork_child");
}

}  // namespace
}  // namespace vmstash
