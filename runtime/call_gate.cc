// CallGate: see call_gate.h.
#include "runtime/call_gate.h"

#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <vector>

#include "base/mutex.h"

namespace vmstash::process {
namespace {

struct alignas(64) Slot {
  std::atomic<int> calls{0};   // written by its owner thread only
  std::atomic<bool> owned{false};
};

std::atomic<Phase> phase{Phase::kOpen};

// Slots are never freed (a thread's slot is reused after it exits); the registry lives
// until the process ends, like the runtime.
Mutex& RegistryMu() {
  static Mutex* mu = new Mutex();
  return *mu;
}
std::vector<Slot*>& Registry() ABSL_EXCLUSIVE_LOCKS_REQUIRED(RegistryMu()) {
  static auto* slots = new std::vector<Slot*>();
  return *slots;
}

// Asymmetric fence (call_gate.h): decided once when the library loads; until then both
// sides use a full fence.
std::atomic<bool> asymmetric{false};
[[maybe_unused]] const bool registered_membarrier = [] {
  const long cmds = ::syscall(__NR_membarrier, MEMBARRIER_CMD_QUERY, 0);
  if (cmds < 0 || (cmds & MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0) return false;
  if (::syscall(__NR_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0) != 0) return false;
  asymmetric.store(true, std::memory_order_release);
  return true;
}();

void LightFence() {
  if (asymmetric.load(std::memory_order_relaxed)) {
    std::atomic_signal_fence(std::memory_order_seq_cst);
  } else {
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
}

void HeavyFence() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (asymmetric.load(std::memory_order_acquire)) (void)::syscall(__NR_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0);
}

thread_local Slot* my_slot = nullptr;  // constant-initialized: no TLS guard on the fast path
thread_local bool exiting = false;

struct SlotOwner {
  ~SlotOwner() {
    exiting = true;
    if (my_slot != nullptr) my_slot->owned.store(false, std::memory_order_release);
    my_slot = nullptr;
  }
};
thread_local SlotOwner owner;  // touched once per thread, when its slot is taken

Slot* TakeSlot() {
  Slot* slot = nullptr;
  {
    MutexLock lock(&RegistryMu());
    for (Slot* s : Registry()) {
      if (!s->owned.load(std::memory_order_acquire)) {
        slot = s;
        break;
      }
    }
    if (slot == nullptr) Registry().push_back(slot = new Slot());
    slot->owned.store(true, std::memory_order_relaxed);
  }
  // A call from a thread-local destructor after ours ran keeps the slot for good (it is
  // back at 0 after the call, so it never holds a shutdown).
  if (!exiting) (void)&owner;
  my_slot = slot;
  return slot;
}

}  // namespace

Phase EnterCall() {
  Slot* s = my_slot != nullptr ? my_slot : TakeSlot();
  s->calls.store(s->calls.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  LightFence();
  return phase.load(std::memory_order_relaxed);
}

void LeaveCall() { my_slot->calls.store(my_slot->calls.load(std::memory_order_relaxed) - 1, std::memory_order_release); }

int CallDepth() { return my_slot != nullptr ? my_slot->calls.load(std::memory_order_relaxed) : 0; }

void SetPhase(Phase p) {
  phase.store(p, std::memory_order_relaxed);
  HeavyFence();
}

Phase CurrentPhase() { return phase.load(std::memory_order_acquire); }

bool NoCallsInFlight() {
  MutexLock lock(&RegistryMu());
  for (const Slot* s : Registry()) {
    if (s->calls.load(std::memory_order_acquire) != 0) return false;
  }
  return true;
}

void LockForFork() ABSL_NO_THREAD_SAFETY_ANALYSIS { RegistryMu().Lock(); }
void UnlockAfterFork() ABSL_NO_THREAD_SAFETY_ANALYSIS { RegistryMu().Unlock(); }

void AfterForkInChild() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  for (Slot* s : Registry()) {
    if (s == my_slot) continue;
    s->calls.store(0, std::memory_order_relaxed);
    s->owned.store(false, std::memory_order_relaxed);
  }
}

}  // namespace vmstash::process
