// The one CUresult -> absl::Status mapping (docs/architecture.md §10).
//
//   CUDA_ERROR_OUT_OF_MEMORY                      -> ResourceExhausted
//   CUDA_ERROR_NOT_SUPPORTED                      -> Unimplemented
//   INVALID_VALUE / INVALID_HANDLE / INVALID_DEVICE / NOT_FOUND   -> InvalidArgument
//   NOT_INITIALIZED / DEINITIALIZED / INVALID_CONTEXT / ALREADY_MAPPED / NOT_MAPPED /
//   stream-capture errors / NOT_PERMITTED / HOST_MEMORY_(ALREADY|NOT)_REGISTERED
//                                                 -> FailedPrecondition
//   NO_DEVICE                                     -> Unavailable
//   anything else                                 -> Internal
// Every message names the call and the CUresult: "cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY (2)".
#ifndef VMSTASH_VMM_CU_STATUS_H_
#define VMSTASH_VMM_CU_STATUS_H_

#include <cuda.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace vmstash {

absl::StatusCode CuResultToCode(CUresult result);
// "CUDA_ERROR_OUT_OF_MEMORY"; "CUresult 12345" for codes this table does not name.
std::string CuResultName(CUresult result);
// OK for CUDA_SUCCESS; else the mapped code with "<call>: <name> (<n>)[: detail]".
absl::Status CuStatus(CUresult result, absl::string_view call, absl::string_view detail = {});

}  // namespace vmstash

#endif  // VMSTASH_VMM_CU_STATUS_H_
