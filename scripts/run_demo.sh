#!/usr/bin/env bash
# The README's main job. On a machine with a usable GPU and PyTorch: install the wheel
# (dist/vmstash-*.whl from scripts/build_wheel.sh, into build/site with pip; without a
# wheel, build the library with CMake: scripts/gpu_build.sh) and run the RL phase-switch
# demo (python3 -m vmstash.demo: rollout and training alternate on one GPU, both CUDA
# graphs captured once). Elsewhere:
# set up Debian 12 and run the C++ demo on the simulated driver (reserve, map, write, pause
# with backup, resume at the same address, verify). Both end with a short summary.
#
#   scripts/run_demo.sh [--rl | --cpp] [options of that demo]
#     --rl   the RL demo (default when a GPU and torch are usable); options: --cycles N,
#            --plot FILE.svg, --json FILE, --peer MODULE
#     --cpp  the C++ demo (default elsewhere; on the GPU when one is usable, else on the
#            simulated driver); options: --size=4G --chunk=64M
set -euo pipefail
cd "$(dirname "$0")/.."
mode=""
case "${1:-}" in
  --rl) mode=rl; shift ;;
  --cpp) mode=cpp; shift ;;
esac
if [ -z "$mode" ]; then
  if python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    mode=rl
  else
    mode=cpp
    echo "no usable GPU with PyTorch here: the C++ demo (on the simulated driver when no GPU is" \
         "usable; scripts/run_demo.sh --rl runs the RL demo on a GPU machine)"
  fi
fi
if [ "$mode" = rl ]; then
  [ $# -gt 0 ] || set -- --cycles 10 --plot build/rl_phase_switch_memory.svg
  wheel=$(ls dist/vmstash-*.whl 2>/dev/null | tail -1 || true)
  if [ -n "$wheel" ]; then
    rm -rf build/site
    python3 -m pip install --quiet --no-deps --no-index --target build/site "$wheel"
    echo "installed $wheel into build/site"
    PYTHONPATH="$PWD/build/site" exec python3 -m vmstash.demo "$@"
  fi
  source scripts/gpu_build.sh
  vmstash_build vmstash vmstash_preload
  vmstash_python_env
  exec python3 -m vmstash.demo "$@"
fi
if command -v bazel >/dev/null || grep -qs '^12' /etc/debian_version; then  # Debian 12: Bazel
  scripts/setup_debian.sh
  exec bazel run //tools/demo:vmstash_demo -- "$@"
fi
# No Bazel (the GPU machine): the CMake build.
source scripts/gpu_build.sh
vmstash_build vmstash_demo
exec "$build/tools/demo/vmstash_demo" "$@"
