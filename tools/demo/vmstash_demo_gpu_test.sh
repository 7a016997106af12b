#!/bin/sh
# The demo on the GPU: it must pick the CUDA driver and find its data identical after
# resume. Run from the build root (CMake) or the runfiles root (Bazel).
set -u
out=$(VMSTASH_DRIVER=cuda tools/demo/vmstash_demo --size=1G --chunk=64M 2>&1) || { echo "demo failed: $out"; exit 1; }
echo "$out"
echo "$out" | grep -q "(cuda driver)" || { echo "expected the cuda driver"; exit 1; }
echo "$out" | grep -q "identical after resume" || { echo "expected identical data after resume"; exit 1; }
