// The allocator conformance suite (allocator/allocator_conformance.h) on CudaDriver, so
// the caching allocator's behaviours proven on the simulator in CI hold on the GPU too.
// Label/tag `gpu`. With VMSTASH_TEST_REQUIRE_GPU=1 (the GPU run sets it) a missing GPU is
// a failure; otherwise these cases skip on machines without one.
#include "allocator/allocator_conformance.h"
#include "tests/gpu/cuda_factory.h"

namespace vmstash {
namespace {

INSTANTIATE_TEST_SUITE_P(Cuda, AllocatorConformanceTest, ::testing::Values(testing::CudaDriverFactory()),
                         testing::FactoryName);

}  // namespace
}  // namespace vmstash
