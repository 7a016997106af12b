// TagState: the states of a tag on one device and the moves allowed between them (the
// state machine drawn in tag_pool.h; TagPool::MoveTo is its one writer). Apart from
// TagPool so that the parts a pool owns (tag_backup.h) can be told the state without
// reading the pool.
#ifndef VMSTASH_ALLOCATOR_TAG_STATE_H_
#define VMSTASH_ALLOCATOR_TAG_STATE_H_

namespace vmstash {

enum class TagState { kActive, kPausing, kPaused, kResuming, kBroken };
const char* TagStateName(TagState state);
// True when a move from `from` to `to` is in the table (tag_state.cc).
bool TagTransitionAllowed(TagState from, TagState to);

}  // namespace vmstash

#endif  // VMSTASH_ALLOCATOR_TAG_STATE_H_
