#!/usr/bin/env bash
# On the GPU machine (Ubuntu 24.04, CUDA 13, CMake + ninja, no Bazel, no network): build
# with CMake (scripts/gpu_build.sh: the .debs of scripts/fetch_debs.sh unpacked into a
# prefix) and run the `gpu`-labelled tests (the Python ones under pytest, installed first
# from the wheels of scripts/fetch_wheels.sh where python3 lacks it, as megatron-core).
#
#   scripts/gpu_build_and_test.sh [--all]
#     --all    also run the CPU tests with ctest
# The benchmarks and their report: scripts/bench_report.sh.
set -euo pipefail
run_all=0
for arg in "$@"; do
  case "$arg" in
    --all) run_all=1 ;;
    *) echo "usage: $0 [--all]   (benchmarks: scripts/bench_report.sh)" >&2; exit 2 ;;
  esac
done
source "$(dirname "$0")/gpu_build.sh"
vmstash_ensure_pytest
vmstash_ensure_megatron
vmstash_build
cd "$build"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
if [ "$run_all" = 1 ]; then
  ctest --output-on-failure
else
  ctest -L gpu --output-on-failure
fi
# Show the per-case results of the conformance suites (the driver's, the allocator's).
VMSTASH_TEST_REQUIRE_GPU=1 ./tests/gpu/cuda_driver_conformance_test --gtest_brief=0 | grep -E '^\[ +(OK|FAILED|SKIPPED|PASSED) '
VMSTASH_TEST_REQUIRE_GPU=1 ./tests/gpu/cuda_allocator_conformance_test --gtest_brief=0 | grep -E '^\[ +(OK|FAILED|SKIPPED|PASSED) '
