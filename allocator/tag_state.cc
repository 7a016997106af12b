// TagState: see tag_state.h.
#include "allocator/tag_state.h"

namespace vmstash {
namespace {

struct Move {
  TagState from;
  TagState to;
};
// The state machine of tag_pool.h: every allowed (from, to) pair, and only those.
constexpr Move kAllowedTransitions[] = {
    {TagState::kActive, TagState::kPausing},    // Pause, Switch (outgoing)
    {TagState::kPausing, TagState::kPaused},    // its commit
    {TagState::kPausing, TagState::kActive},    // its rollback
    {TagState::kPausing, TagState::kBroken},    // a rollback that could not map the memory back
    {TagState::kPaused, TagState::kResuming},   // Resume, Switch (incoming)
    {TagState::kResuming, TagState::kActive},   // its commit
    {TagState::kResuming, TagState::kPaused},   // its rollback
};

}  // namespace

const char* TagStateName(TagState state) {
  switch (state) {
    case TagState::kActive: return "active";
    case TagState::kPausing: return "pausing";
    case TagState::kPaused: return "paused";
    case TagState::kResuming: return "resuming";
    case TagState::kBroken: return "broken";
  }
  return "active";
}

bool TagTransitionAllowed(TagState from, TagState to) {
  for (const Move& m : kAllowedTransitions) {
    if (m.from == from && m.to == to) return true;
  }
  return false;
}

}  // namespace vmstash
