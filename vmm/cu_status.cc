#include "vmm/cu_status.h"

#include "absl/strings/str_cat.h"

namespace vmstash {

absl::StatusCode CuResultToCode(CUresult result) {
  switch (result) {
    case CUDA_SUCCESS:
      return absl::StatusCode::kOk;
    case CUDA_ERROR_OUT_OF_MEMORY:
      return absl::StatusCode::kResourceExhausted;
    case CUDA_ERROR_NOT_SUPPORTED:
      return absl::StatusCode::kUnimplemented;
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_HANDLE:
    case CUDA_ERROR_INVALID_DEVICE:
    case CUDA_ERROR_NOT_FOUND:
      return absl::StatusCode::kInvalidArgument;
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_DEINITIALIZED:
    case CUDA_ERROR_INVALID_CONTEXT:
    case CUDA_ERROR_ALREADY_MAPPED:
    case CUDA_ERROR_NOT_MAPPED:
    case CUDA_ERROR_NOT_PERMITTED:
    case CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
    case CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED:
    case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED:
    case CUDA_ERROR_STREAM_CAPTURE_INVALIDATED:
    case CUDA_ERROR_STREAM_CAPTURE_MERGE:
    case CUDA_ERROR_STREAM_CAPTURE_UNMATCHED:
    case CUDA_ERROR_STREAM_CAPTURE_UNJOINED:
    case CUDA_ERROR_STREAM_CAPTURE_ISOLATION:
    case CUDA_ERROR_STREAM_CAPTURE_IMPLICIT:
    case CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD:
      return absl::StatusCode::kFailedPrecondition;
    case CUDA_ERROR_NO_DEVICE:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInternal;
  }
}

std::string CuResultName(CUresult result) {
  switch (result) {
#define VMSTASH_CU_NAME(x) \
  case x:                  \
    return #x;
    VMSTASH_CU_NAME(CUDA_SUCCESS)
    VMSTASH_CU_NAME(CUDA_ERROR_INVALID_VALUE)
    VMSTASH_CU_NAME(CUDA_ERROR_OUT_OF_MEMORY)
    VMSTASH_CU_NAME(CUDA_ERROR_NOT_INITIALIZED)
    VMSTASH_CU_NAME(CUDA_ERROR_DEINITIALIZED)
    VMSTASH_CU_NAME(CUDA_ERROR_NO_DEVICE)
    VMSTASH_CU_NAME(CUDA_ERROR_INVALID_DEVICE)
    VMSTASH_CU_NAME(CUDA_ERROR_INVALID_CONTEXT)
    VMSTASH_CU_NAME(CUDA_ERROR_ALREADY_MAPPED)
    VMSTASH_CU_NAME(CUDA_ERROR_NOT_MAPPED)
    VMSTASH_CU_NAME(CUDA_ERROR_INVALID_HANDLE)
    VMSTASH_CU_NAME(CUDA_ERROR_NOT_FOUND)
    VMSTASH_CU_NAME(CUDA_ERROR_NOT_READY)
    VMSTASH_CU_NAME(CUDA_ERROR_ILLEGAL_ADDRESS)
    VMSTASH_CU_NAME(CUDA_ERROR_LAUNCH_FAILED)
    VMSTASH_CU_NAME(CUDA_ERROR_NOT_PERMITTED)
    VMSTASH_CU_NAME(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)
    VMSTASH_CU_NAME(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)
    VMSTASH_CU_NAME(CUDA_ERROR_NOT_SUPPORTED)
    VMSTASH_CU_NAME(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
    VMSTASH_CU_NAME(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
    VMSTASH_CU_NAME(CUDA_ERROR_STREAM_CAPTURE_MERGE)
    VMSTASH_CU_NAME(CUDA_ERROR_STREAM_CAPTURE_UNMATCHED)
    VMSTASH_CU_NAME(CUDA_ERROR_STREAM_CAPTURE_UNJOINED)
    VMSTASH_CU_NAME(CUDA_ERROR_STREAM_CAPTURE_ISOLATION)
    VMSTASH_CU_NAME(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
    VMSTASH_CU_NAME(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD)
    VMSTASH_CU_NAME(CUDA_ERROR_UNKNOWN)
#undef VMSTASH_CU_NAME
    default:
      return absl::StrCat("CUresult ", static_cast<int>(result));
  }
}

absl::Status CuStatus(CUresult result, absl::string_view call, absl::string_view detail) {
  if (result == CUDA_SUCCESS) return absl::OkStatus();
  std::string message = absl::StrCat(call, ": ", CuResultName(result), " (", static_cast<int>(result), ")");
  if (!detail.empty()) absl::StrAppend(&message, ": ", detail);
  return absl::Status(CuResultToCode(result), message);
}

}  // namespace vmstash
