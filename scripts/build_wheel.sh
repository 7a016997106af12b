#!/usr/bin/env bash
# Builds the product's wheels on a Debian 12 machine (no GPU needed; the CUDA toolkit,
# CMake, ninja, abseil and fmt as scripts/setup_debian.sh installs them):
#   dist/vmstash-<version>-py3-none-manylinux_2_<N>_x86_64.whl        the whole product
#   dist/torch_memory_saver-0.0.10+vmstash.<version>-...whl           the opt-in drop-in
# then checks them (scripts/check_wheel.py: NEEDED entries, glibc tag, stash kernels).
#
#   scripts/build_wheel.sh [OUT_DIR]          (VMSTASH_WHEEL_BUILD: the CMake folder)
#
# On the GPU machine: python3 -m pip install --no-deps dist/vmstash-*.whl, then
# `python3 -m vmstash.demo` (or `vmstash-demo`) and `vmstash --help`.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dist}
build=${VMSTASH_WHEEL_BUILD:-build/wheel}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DVMSTASH_BUILD_TESTS=OFF -DVMSTASH_PACKAGE=ON >/dev/null
cmake --build "$build" -j "$(nproc)" --target vmstash vmstash_preload vmstash_cli vmstashd | grep -v "^\[" || true
rm -rf "$build/stage"
cmake --install "$build" --prefix "$build/stage" >/dev/null
mkdir -p "$out"
rm -f "$out"/vmstash-*.whl "$out"/torch_memory_saver-*.whl
wheel=$(python3 scripts/build_vmstash_wheel.py --stage "$build/stage" --out "$out")
dropin=$(python3 scripts/build_tms_dropin_wheel.py --preload "$build/stage/vmstash/lib/libvmstash_preload.so" --out "$out")
python3 scripts/check_wheel.py "$wheel" "$dropin"
echo "$wheel"
echo "$dropin"
