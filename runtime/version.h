// The library's version, as vmstash_version() and the control endpoint's hello report it.
#ifndef VMSTASH_RUNTIME_VERSION_H_
#define VMSTASH_RUNTIME_VERSION_H_

namespace vmstash {

inline constexpr char kVersion[] = "0.3.0";

}  // namespace vmstash

#endif  // VMSTASH_RUNTIME_VERSION_H_
