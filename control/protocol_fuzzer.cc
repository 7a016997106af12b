// libFuzzer target for the control protocol parser (control/protocol.h): any bytes must
// give a Request or an error, never a crash, a leak or an unbounded loop; a parsed request
// must format back to a line that parses to the same request. The reply parser gets the
// same bytes. Built and run by scripts/run_fuzzer.sh (clang, ASAN+UBSAN), bounded in time.
#include <cstddef>
#include <cstdint>
#include <string>

#include "control/protocol.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string line(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<vmstash::control::Request> r = vmstash::control::ParseRequest(line);
  if (r.ok()) {
    std::string again = vmstash::control::FormatRequest(*r);
    again.pop_back();  // the '\n'
    absl::StatusOr<vmstash::control::Request> back = vmstash::control::ParseRequest(again);
    if (!back.ok() || back->op != r->op || back->tag != r->tag || back->device != r->device) __builtin_trap();
  } else if (r.status().message().empty()) {
    __builtin_trap();  // every refusal says why
  }
  (void)vmstash::control::ParseReply(line);
  return 0;
}
