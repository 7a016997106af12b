// The control service: the answers of a process's control endpoint (control/endpoint.h,
// protocol in control/protocol.h) computed from its Runtime directly: hello (process,
// version, driver, devices), stats and tags (the allocator stats documents), snapshot,
// pause, resume and switch (Note [All-or-Nothing Transitions]). A remote request never
// creates an allocator, or a CUDA context, on a device the process never used, nor a tag
// name: the names of a transition are looked up (FindTag), never interned, so a name the
// process never created is NotFound and unknown names cannot fill the tag table. process.cc
// serves it, each request inside a process Call.
//
// Thread-safety: as the Runtime's methods.
#ifndef VMSTASH_RUNTIME_CONTROL_SERVICE_H_
#define VMSTASH_RUNTIME_CONTROL_SERVICE_H_

#include <string>

#include "absl/status/statusor.h"
#include "control/protocol.h"
#include "runtime/runtime.h"

namespace vmstash {

// The result JSON of `request` (control::OkReply wraps it), or the error to send.
absl::StatusOr<std::string> HandleControlRequest(Runtime& runtime, const control::Request& request);

}  // namespace vmstash

#endif  // VMSTASH_RUNTIME_CONTROL_SERVICE_H_
