// The node from the C ABI (vmstash.h): the pool (vmstash_node_connect,
// vmstash_node_stats_json: thin shims over the runtime's NodeLeases, runtime/node_leases.h,
// Note [Node Leases]) and the switch across processes (vmstash_node_switch: over
// node/node_switch.h, Note [Node Switch]).
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "base/json_writer.h"
#include "node/node_switch.h"
#include "runtime/node_leases.h"
#include "runtime/runtime.h"
#include "torch_plugin/c_abi/shim.h"
#include "torch_plugin/include/vmstash/vmstash.h"

using vmstash::JsonWriter;
using vmstash::NodeLeases;
using vmstash::Runtime;
using vmstash::c_abi::Code;
using vmstash::c_abi::CopyOut;
using vmstash::c_abi::Fail;
using vmstash::c_abi::WithRuntime;

extern "C" {

int vmstash_node_connect(int start) noexcept {
  return WithRuntime([&](Runtime& rt) { return Code(rt.node().Connect(start != 0)); });
}

char* vmstash_node_stats_json(void) noexcept {
  char* out = nullptr;
  WithRuntime([&](Runtime& rt) {
    absl::StatusOr<NodeLeases::Report> r = rt.node().Stats();
    if (!r.ok()) return Fail(r.status());
    JsonWriter w;
    w.BeginObject();
    w.Field("socket", r->socket);
    w.Field("capacity_bytes", static_cast<std::uint64_t>(r->pool.capacity_bytes));
    w.Field("leased_bytes", static_cast<std::uint64_t>(r->pool.leased_bytes));
    w.Field("peak_bytes", static_cast<std::uint64_t>(r->pool.peak_bytes));
    w.Field("largest_free_bytes", static_cast<std::uint64_t>(r->pool.largest_free_bytes));
    w.Field("leases", static_cast<std::uint64_t>(r->pool.leases));
    w.Field("clients", static_cast<std::uint64_t>(r->pool.clients));
    w.Field("refused", static_cast<std::uint64_t>(r->pool.refused));
    w.Field("process_leases", static_cast<std::uint64_t>(r->leases));
    w.Field("process_leased_bytes", static_cast<std::uint64_t>(r->leased_bytes));
    w.Field("process_registered_bytes", static_cast<std::uint64_t>(r->registered_bytes));
    w.Field("process_fallbacks", static_cast<std::uint64_t>(r->fallbacks));
    w.Field("process_pinning", r->pinning);
    w.EndObject();
    out = CopyOut(w.str());
    if (out == nullptr) return Fail(absl::ResourceExhaustedError("vmstash: host out of memory"));
    return 0;
  });
  return out;
}

int vmstash_node_switch(const char* pause, const char* resume, int device, int timeout_ms,
                        char** result_json) noexcept {
  if (result_json != nullptr) *result_json = nullptr;
  // No process Call: the switch uses no runtime of this process (the initiator may take no
  // part; its own part, if any, is served by its control endpoint), so it works in a forked
  // child and during a shutdown, and a shutdown does not wait for it.
  try {
    absl::StatusOr<std::vector<vmstash::node::NodeSwitchPart>> parts =
        vmstash::node::ParseNodeSwitchParts(pause == nullptr ? "" : pause, resume == nullptr ? "" : resume);
    if (!parts.ok()) return Fail(parts.status());
    vmstash::node::NodeSwitchRequest request;
    request.parts = std::move(*parts);
    request.device = device;
    request.timeout_ms = timeout_ms;
    absl::StatusOr<vmstash::node::NodeSwitchResult> result = vmstash::node::RunNodeSwitch(request);
    if (!result.ok()) return Fail(result.status());
    if (result_json != nullptr) *result_json = CopyOut(vmstash::node::NodeSwitchJson(*result));
    return Code(vmstash::node::NodeSwitchStatus(*result));
  } catch (const std::bad_alloc&) {
    return Fail(absl::ResourceExhaustedError("vmstash: host out of memory"));
  } catch (...) {
    return Fail(absl::InternalError("vmstash: unexpected exception"));
  }
}

}  // extern "C"
