#!/usr/bin/env bash
# On the GPU machine: build (scripts/gpu_build.sh) and run every benchmark of the project,
# writing the report bench/README.md with the machine named and the memory timeline of the
# RL demo (bench/results/rl_phase_switch_memory.svg).
#
#   scripts/bench_report.sh [--only NAME,...]     (names: see bench/report.py)
set -euo pipefail
source "$(dirname "$0")/gpu_build.sh"
nvidia-smi -L >/dev/null 2>&1 || { echo "bench_report: no GPU visible (nvidia-smi -L failed)" >&2; exit 1; }
vmstash_build vmstash vmstash_preload vmm_bench host_ceiling_bench allocator_bench pause_bench switch_bench stash_bench vmstash_demo
vmstash_python_env
vmstash_tms_peer
exec python3 "$root/bench/report.py" --build "$build" "$@"
