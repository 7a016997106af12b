#include "vmm/cu_status.h"

#include "gtest/gtest.h"

namespace vmstash {
namespace {

TEST(CuStatusTest, MapsTheDocumentedCodes) {
  EXPECT_TRUE(CuStatus(CUDA_SUCCESS, "cuInit").ok());
  EXPECT_EQ(CuResultToCode(CUDA_ERROR_OUT_OF_MEMORY), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(CuResultToCode(CUDA_ERROR_NOT_SUPPORTED), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(CuResultToCode(CUDA_ERROR_INVALID_VALUE), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CuResultToCode(CUDA_ERROR_INVALID_HANDLE), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CuResultToCode(CUDA_ERROR_INVALID_DEVICE), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CuResultToCode(CUDA_ERROR_NOT_INITIALIZED), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CuResultToCode(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CuResultToCode(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CuResultToCode(CUDA_ERROR_NO_DEVICE), absl::StatusCode::kUnavailable);
  EXPECT_EQ(CuResultToCode(CUDA_ERROR_ILLEGAL_ADDRESS), absl::StatusCode::kInternal);
  EXPECT_EQ(CuResultToCode(CUDA_ERROR_UNKNOWN), absl::StatusCode::kInternal);
}

TEST(CuStatusTest, MessageNamesCallAndResult) {
  absl::Status s = CuStatus(CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate", "4096 bytes on device 0");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(), "cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY (2): 4096 bytes on device 0");
  EXPECT_EQ(CuResultName(static_cast<CUresult>(12345)), "CUresult 12345");
}

}  // namespace
}  // namespace vmstash
