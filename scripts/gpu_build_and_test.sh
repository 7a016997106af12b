#!/usr/bin/env bash
# On the GPU machine (Ubuntu 24.04, CUDA 13, CMake + ninja, no Bazel, no network):
# unpack the .debs fetched by scripts/fetch_debs.sh into a prefix, build with CMake, and
# run the `gpu`-labelled tests.
#
#   scripts/gpu_build_and_test.sh [--all] [--bench]
#     --all    also run the CPU tests with ctest
#     --bench  then run bench/vmm_bench (16 GiB chunk-size sweep, pinned copy bandwidth) and
#              bench/allocator_bench (vs PyTorch's caching allocator when torch is importable)
#              and bench/pause_bench (pause/resume of 16 GiB vs pinned copies) and
#              bench/python_bench.py (the Python package's costs, when torch is importable)
#              and bench/stash_bench + bench/moe_stash_bench.py (the paged stash)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
debs=${VMSTASH_DEBS:-$root/third_party/debs}
prefix=${VMSTASH_PREFIX:-$root/build/prefix}
build=${VMSTASH_BUILD:-$root/build/cmake}
run_all=0
run_bench=0
for arg in "$@"; do
  case "$arg" in
    --all) run_all=1 ;;
    --bench) run_bench=1 ;;
    *) echo "usage: $0 [--all] [--bench]" >&2; exit 2 ;;
  esac
done
ls "$debs"/*.deb >/dev/null 2>&1 || { echo "no .debs in $debs: run scripts/fetch_debs.sh on a Debian machine" >&2; exit 1; }
mkdir -p "$prefix"
for deb in "$debs"/*.deb; do dpkg -x "$deb" "$prefix"; done
# The Debian shared libraries find each other through the library path (RUNPATH is not
# transitive), so point the loader at the prefix for the tests and tools.
export LD_LIBRARY_PATH="$prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
torch_dir=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null || true)
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix/usr" \
  -DVMSTASH_TORCH_DIR="$torch_dir"
cmake --build "$build" -j "$(nproc)"
cd "$build"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
if [ "$run_all" = 1 ]; then
  ctest --output-on-failure
else
  ctest -L gpu --output-on-failure
fi
# Show the per-case results of the conformance suite.
VMSTASH_TEST_REQUIRE_GPU=1 ./tests/gpu/cuda_driver_conformance_test --gtest_brief=0 | grep -E '^\[ +(OK|FAILED|SKIPPED|PASSED) '
if [ "$run_bench" = 1 ]; then
  ./bench/vmm_bench
  VMSTASH_DRIVER=cuda ./bench/allocator_bench
  VMSTASH_DRIVER=cuda ./bench/pause_bench 16
  if python3 -c 'import torch' 2>/dev/null; then
    VMSTASH_LIBRARY="$build/torch_plugin/libvmstash.so" PYTHONPATH="$root/torch_plugin/python" \
      python3 "$root/bench/python_bench.py"
  fi
  ./bench/stash_bench
  if python3 -c 'import torch' 2>/dev/null; then
    VMSTASH_LIBRARY="$build/torch_plugin/libvmstash.so" PYTHONPATH="$root/torch_plugin/python" \
      python3 "$root/bench/moe_stash_bench.py"
  fi
  python3 -c 'import torch_memory_saver' 2>/dev/null && echo "torch_memory_saver: importable" \
    || echo "torch_memory_saver: not importable here (no comparison run)"
fi
