// vmstash's version: its one place. The library reports it (vmstash_version(), the control
// endpoint's hello, vmstash.__version__), the CLI prints it (`vmstash --version`), and the
// wheels are named after it (scripts/wheel_writer.py, pyproject.toml read this line).
#ifndef VMSTASH_BASE_VERSION_H_
#define VMSTASH_BASE_VERSION_H_

namespace vmstash {

inline constexpr char kVersion[] = "0.3.0";

}  // namespace vmstash

#endif  // VMSTASH_BASE_VERSION_H_
