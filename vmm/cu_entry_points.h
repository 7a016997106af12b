// The libcuda entry points CudaDriver uses: one X-macro list, so that the function-pointer
// table, its loading through cuGetProcAddress and any check of it stay in step.
//
// X(name) is given the API name as cuda.h spells it (cuMemGetInfo). cuda.h may #define that
// name to a versioned symbol (cuMemGetInfo_v2): `decltype(&name)` then gives the versioned
// signature, while `#name` gives the base name cuGetProcAddress expects; CUDA_VERSION
// selects the matching version.
#ifndef VMSTASH_VMM_CU_ENTRY_POINTS_H_
#define VMSTASH_VMM_CU_ENTRY_POINTS_H_

#define VMSTASH_CU_ENTRY_POINTS(X) \
  X(cuInit)                        \
  X(cuDriverGetVersion)            \
  X(cuDeviceGet)                   \
  X(cuDeviceGetCount)              \
  X(cuDeviceGetAttribute)          \
  X(cuDeviceGetUuid)               \
  X(cuDevicePrimaryCtxRetain)      \
  X(cuDevicePrimaryCtxRelease)     \
  X(cuCtxPushCurrent)              \
  X(cuCtxPopCurrent)               \
  X(cuCtxSynchronize)              \
  X(cuMemGetInfo)                  \
  X(cuMemGetAllocationGranularity) \
  X(cuMemAddressReserve)           \
  X(cuMemAddressFree)              \
  X(cuMemCreate)                   \
  X(cuMemRelease)                  \
  X(cuMemExportToShareableHandle)  \
  X(cuMemImportFromShareableHandle) \
  X(cuMemMap)                      \
  X(cuMemUnmap)                    \
  X(cuMemSetAccess)                \
  X(cuMemHostAlloc)                \
  X(cuMemFreeHost)                 \
  X(cuMemHostRegister)             \
  X(cuMemHostUnregister)           \
  X(cuThreadExchangeStreamCaptureMode) \
  X(cuStreamCreate)                \
  X(cuStreamDestroy)               \
  X(cuStreamSynchronize)           \
  X(cuStreamWaitEvent)             \
  X(cuEventCreate)                 \
  X(cuEventDestroy)                \
  X(cuEventRecord)                 \
  X(cuEventQuery)                  \
  X(cuEventSynchronize)            \
  X(cuEventElapsedTime)            \
  X(cuIpcGetEventHandle)           \
  X(cuIpcOpenEventHandle)          \
  X(cuMemcpyDtoHAsync)             \
  X(cuMemcpyHtoDAsync)             \
  X(cuMemcpyDtoDAsync)             \
  X(cuMemsetD8Async)

#endif  // VMSTASH_VMM_CU_ENTRY_POINTS_H_
