// vmstash for LibTorch programs: see vmstash_libtorch.h.
#include "torch_plugin/libtorch/vmstash_libtorch.h"

#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "torch_plugin/include/vmstash/vmstash.h"

namespace vmstash::libtorch {
namespace {

[[noreturn]] void Throw(const std::string& what) { throw std::runtime_error(what + ": " + vmstash_last_error()); }

void Check(int code, const std::string& what) {
  if (code != VMSTASH_OK && code != VMSTASH_NOOP) Throw(what);
}

}  // namespace

void Install(const std::string& options) {
  if (!options.empty() || !vmstash_is_initialized()) {
    Check(vmstash_init(options.empty() ? nullptr : options.c_str()), "vmstash::libtorch::Install: init");
  }
  std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator =
      torch::cuda::CUDAPluggableAllocator::createCustomAllocator(
          [](size_t size, int device, cudaStream_t stream) { return vmstash_malloc(size, device, stream); },
          [](void* ptr, size_t size, int device, cudaStream_t stream) { vmstash_free(ptr, size, device, stream); });
  auto pluggable = std::dynamic_pointer_cast<torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator>(allocator);
  if (pluggable != nullptr) {
    // Tensor.record_stream and torch.cuda.empty_cache reach vmstash too.
    pluggable->set_record_stream_fn([](void* ptr, cudaStream_t stream) {
      const int device = vmstash_owner_device(ptr);
      if (device >= 0) (void)vmstash_record_stream(ptr, device, stream);
    });
    pluggable->set_reset_fn([] { (void)vmstash_empty_cache(-1, nullptr); });
  }
  try {
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("vmstash::libtorch::Install must run before the first CUDA allocation "
                                         "(PyTorch: ") + e.what() + ")");
  }
}

TagScope::TagScope(const std::string& tag, const std::string& policy) : previous_(vmstash_get_current_tag()) {
  const int created = vmstash_create_tag(tag.c_str(), policy.c_str());
  if (created != VMSTASH_OK) Throw("vmstash::libtorch::TagScope('" + tag + "')");
  Check(vmstash_set_current_tag(tag.c_str()), "vmstash::libtorch::TagScope('" + tag + "')");
}

TagScope::~TagScope() { (void)vmstash_set_current_tag(previous_.c_str()); }

bool Pause(const std::string& tag, int device) {
  const int code = vmstash_pause(tag.c_str(), device);
  Check(code, "vmstash::libtorch::Pause('" + tag + "')");
  return code == VMSTASH_OK;
}

bool Resume(const std::string& tag, int device) {
  const int code = vmstash_resume(tag.c_str(), device);
  Check(code, "vmstash::libtorch::Resume('" + tag + "')");
  return code == VMSTASH_OK;
}

}  // namespace vmstash::libtorch
