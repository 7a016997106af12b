// The control endpoint of a process using the C ABI (DESIGN §8): a control::ControlServer
// whose handler answers through the C ABI itself (stats, snapshot, pause, resume), so it
// sees exactly what a caller of libvmstash.so sees. Started by vmstash_init unless
// VMSTASH_CONF has control:0; a failure to start is logged, never fatal.
#ifndef VMSTASH_TORCH_PLUGIN_C_ABI_CONTROL_SERVICE_H_
#define VMSTASH_TORCH_PLUGIN_C_ABI_CONTROL_SERVICE_H_

#include <functional>
#include <memory>

#include "allocator/json_writer.h"
#include "control/endpoint.h"

namespace vmstash {

// `describe` adds the runtime's fields to the hello reply (driver, devices).
std::unique_ptr<control::ControlServer> StartControlService(std::function<void(JsonWriter&)> describe);

}  // namespace vmstash

#endif  // VMSTASH_TORCH_PLUGIN_C_ABI_CONTROL_SERVICE_H_
