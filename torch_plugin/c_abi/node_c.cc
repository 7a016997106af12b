// The node pool from the C ABI (vmstash.h: vmstash_node_connect, vmstash_node_stats_json):
// thin shims over the runtime's NodeLeases (runtime/node_leases.h, Note [Node Leases]).
#include <cstdlib>
#include <cstring>
#include <string>

#include "base/json_writer.h"
#include "runtime/node_leases.h"
#include "runtime/runtime.h"
#include "torch_plugin/c_abi/shim.h"
#include "torch_plugin/include/vmstash/vmstash.h"

using vmstash::JsonWriter;
using vmstash::NodeLeases;
using vmstash::Runtime;
using vmstash::c_abi::Code;
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
    const std::string& json = w.str();
    out = static_cast<char*>(std::malloc(json.size() + 1));
    if (out == nullptr) return Fail(absl::ResourceExhaustedError("vmstash: host out of memory"));
    std::memcpy(out, json.c_str(), json.size() + 1);
    return 0;
  });
  return out;
}

}  // extern "C"
