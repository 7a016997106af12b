// vmstash for LibTorch (C++) programs: vmstash as the process's CUDA allocator through
// torch::cuda::CUDAPluggableAllocator (global mode), tag scopes, pause and resume.
//
//   vmstash::libtorch::Install();                 // before the first CUDA allocation
//   at::Tensor w;
//   { vmstash::libtorch::TagScope tag("weights", "backup"); w = at::randn({n}, at::kCUDA); }
//   vmstash::libtorch::Pause("weights");          // physical memory released, bytes kept
//   vmstash::libtorch::Resume("weights");         // same addresses
//
// Errors are std::runtime_error with vmstash's (or PyTorch's) message; nothing exits.
// In global mode PyTorch's own memory statistics are unavailable (its rule); use
// vmstash_stats_json. Built by CMake when VMSTASH_TORCH_DIR points at a torch install.
#ifndef VMSTASH_TORCH_PLUGIN_LIBTORCH_VMSTASH_LIBTORCH_H_
#define VMSTASH_TORCH_PLUGIN_LIBTORCH_VMSTASH_LIBTORCH_H_

#include <string>

namespace vmstash::libtorch {

// Makes vmstash PyTorch's CUDA allocator for this process. `options`: a VMSTASH_CONF
// string (empty: the environment). Throws if a CUDA allocation already happened.
void Install(const std::string& options = "");

// While alive, this thread's allocations go to `tag` (created with `policy`, "discard" or
// "backup", on first use). Restores the previous tag on destruction. Scopes nest.
class TagScope {
 public:
  explicit TagScope(const std::string& tag, const std::string& policy = "discard");
  ~TagScope();
  TagScope(const TagScope&) = delete;
  TagScope& operator=(const TagScope&) = delete;

 private:
  std::string previous_;
};

// Pause/resume `tag` on `device` (-1: every device in use). Return false when there was
// nothing to do (already paused / active). Throw on failure (out of memory included).
bool Pause(const std::string& tag, int device = -1);
bool Resume(const std::string& tag, int device = -1);

}  // namespace vmstash::libtorch

#endif  // VMSTASH_TORCH_PLUGIN_LIBTORCH_VMSTASH_LIBTORCH_H_
