#!/usr/bin/env bash
# Downloads pytest and its pure-Python dependencies, megatron-core 0.19.2 and
# torch_memory_saver 0.0.10, as wheels for Python 3.12 (about 4 MB), into third_party/wheels/ (git-ignored), for the GPU machine, which
# has no network: scripts/gpu_build_and_test.sh installs each there when python3 cannot
# import it. Needs pip and the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=third_party/wheels
mkdir -p "$dest"
# pytest 8.3 needs exactly these on Python 3.12 (exceptiongroup and tomli only before 3.11).
wheels=(pytest==8.3.5 pluggy==1.5.0 iniconfig==2.0.0 packaging==24.2)
# megatron-core for the Megatron GPU tests (its dependencies, torch and numpy, are there).
wheels+=(megatron-core==0.19.2)
# torch_memory_saver 0.0.10 itself, the peer that the benchmark report and its own test
# suite run beside the drop-in (scripts/bench_report.sh, scripts/run_tms_suite.sh).
wheels+=(torch_memory_saver==0.0.10)
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any \
  --dest "$dest" "${wheels[@]}"
du -sh "$dest"
ls "$dest"
