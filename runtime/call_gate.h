// CallGate: the calls into the process runtime in flight (process.h), so that a shutdown
// can wait for them and refuse later ones (Note [Shutdown] in process.h), at about the
// cost of two plain stores per call.
//
// Each thread owns a slot (a counter only it writes, on its own cache line), taken on
// its first call and given back at thread exit. A call stores count + 1, then reads the
// phase; a shutdown stores the phase, then reads every slot. The two sides form a Dekker
// pair, ordered by an asymmetric fence: the caller's side is a compiler barrier and the
// shutdown's side is membarrier(PRIVATE_EXPEDITED), which runs a full barrier on every
// thread of the process. Where membarrier is unavailable both sides use a full fence.
// Leaving is a release store and the shutdown reads with acquire, so whatever a call did
// happens before what the shutdown does next.
//
// Thread-safety: all functions are thread-safe. AfterForkInChild runs in the child only.
#ifndef VMSTASH_RUNTIME_CALL_GATE_H_
#define VMSTASH_RUNTIME_CALL_GATE_H_

namespace vmstash::process {

// kOpen: calls run (the first one may initialize the runtime from the environment).
enum class Phase : int { kOpen, kClosing, kShutDown };

// Caller side: Enter counts the calling thread in and returns the phase it saw; every
// Enter is paired with a Leave, whatever the phase.
Phase EnterCall();
void LeaveCall();
// Calls in flight on the calling thread (> 0 inside a hook run by a vmstash call).
int CallDepth();

// Shutdown side.
void SetPhase(Phase phase);
Phase CurrentPhase();
// True when no thread is inside a call.
bool NoCallsInFlight();
// fork(): in the child only the forking thread exists; the other threads' slots are
// emptied and freed. Call with no other thread inside a gate function (a fork handler).
void AfterForkInChild();
void LockForFork();
void UnlockAfterFork();

}  // namespace vmstash::process

#endif  // VMSTASH_RUNTIME_CALL_GATE_H_
