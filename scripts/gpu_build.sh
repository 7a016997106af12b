# Sourced (not run) by the GPU-machine scripts: gpu_build_and_test.sh, gpu_wheel_tests.sh, run_demo.sh and
# bench_report.sh. Unpacks the Debian .debs of third_party/debs (scripts/fetch_debs.sh)
# into a prefix when they are there, else uses the system's abseil/fmt/googletest; points
# the loader at the prefix (RUNPATH is not transitive); configures CMake with torch when
# `import torch` works; then `vmstash_build [TARGET...]` builds (everything when none).
# `vmstash_ensure_pytest` installs pytest (the Python tests' runner) from the wheels of
# scripts/fetch_wheels.sh in third_party/wheels when python3 cannot import it;
# `vmstash_ensure_megatron` likewise megatron-core, for the Megatron GPU tests.
#
#   VMSTASH_DEBS, VMSTASH_PREFIX, VMSTASH_BUILD, VMSTASH_WHEELS override the folders.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
debs=${VMSTASH_DEBS:-$root/third_party/debs}
prefix=${VMSTASH_PREFIX:-$root/build/prefix}
build=${VMSTASH_BUILD:-$root/build/cmake}
cmake_prefix=()
if ls "$debs"/*.deb >/dev/null 2>&1; then
  mkdir -p "$prefix"
  for deb in "$debs"/*.deb; do dpkg -x "$deb" "$prefix"; done
  export LD_LIBRARY_PATH="$prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  cmake_prefix=(-DCMAKE_PREFIX_PATH="$prefix/usr")
else
  echo "note: no .debs in $debs; using the system's abseil/fmt/googletest (without network:" \
       "run scripts/fetch_debs.sh on a Debian 12 machine and copy third_party/debs here)" >&2
fi
torch_dir=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null || true)

vmstash_build() {
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${cmake_prefix[@]}" \
    -DVMSTASH_TORCH_DIR="$torch_dir" >/dev/null
  if [ $# -gt 0 ]; then
    cmake --build "$build" -j "$(nproc)" --target "$@"
  else
    cmake --build "$build" -j "$(nproc)"
  fi
}

# pytest for python3, which the `gpu`-labelled Python tests run (python3 -m pytest): nothing
# when it imports; else from the wheels in third_party/wheels (no network here) with pip,
# into the environment or, where the system's Python refuses (PEP 668), the user's site;
# without pip, the pure-Python wheels unpacked into the user's site.
vmstash_ensure_pytest() {
  python3 -c "import pytest" 2>/dev/null && return 0
  local wheels=${VMSTASH_WHEELS:-$root/third_party/wheels}
  if ! ls "$wheels"/pytest-*.whl >/dev/null 2>&1; then
    echo "error: $(command -v python3) cannot import pytest, which runs the Python tests, and $wheels" \
         "has no pytest wheel: run scripts/fetch_wheels.sh on a machine with network and copy" \
         "third_party/wheels here (as third_party/debs), or install pytest for this python3" >&2
    return 1
  fi
  echo "note: installing pytest for $(command -v python3) from $wheels" >&2
  local pip=(python3 -m pip install --quiet --disable-pip-version-check --no-index --find-links "$wheels" pytest)
  if ! "${pip[@]}" 2>/dev/null && ! "${pip[@]}" --user --break-system-packages; then
    python3 - "$wheels" <<'PY' || return 1
import glob, os, site, sys, zipfile
dest = site.getusersitepackages()
os.makedirs(dest, exist_ok=True)
for wheel in glob.glob(os.path.join(sys.argv[1], "*-py3-none-any.whl")):
    zipfile.ZipFile(wheel).extractall(dest)
print(f"note: pip did not install pytest; unpacked its wheels into {dest}", file=sys.stderr)
PY
  fi
  python3 -c "import pytest" || { echo "error: pytest still not importable by $(command -v python3)" >&2; return 1; }
}

# megatron-core for the Megatron GPU tests (gpu_megatron_compat_scenarios.py): nothing when
# python3 imports it; else the wheel of scripts/fetch_wheels.sh from third_party/wheels,
# without its dependencies (torch, numpy: there). Without the wheel, a note: those tests then
# fail, saying megatron-core is missing.
vmstash_ensure_megatron() {
  python3 -c "import megatron.core" 2>/dev/null && return 0
  local wheels=${VMSTASH_WHEELS:-$root/third_party/wheels}
  if ! ls "$wheels"/megatron_core-*.whl >/dev/null 2>&1; then
    echo "note: $(command -v python3) cannot import megatron.core and $wheels has no megatron_core wheel" \
         "(scripts/fetch_wheels.sh): the Megatron GPU tests will fail" >&2
    return 0
  fi
  echo "note: installing megatron-core for $(command -v python3) from $wheels" >&2
  local pip=(python3 -m pip install --quiet --disable-pip-version-check --no-index --no-deps "$wheels"/megatron_core-*.whl)
  "${pip[@]}" 2>/dev/null || "${pip[@]}" --user --break-system-packages || return 1
  python3 -c "import megatron.core" || { echo "error: megatron.core still not importable" >&2; return 1; }
}

# torch_memory_saver 0.0.10 itself, the peer the benchmarks run beside vmstash: nothing when
# python3 imports it; else its wheel of scripts/fetch_wheels.sh from third_party/wheels,
# unpacked into $build/peers, which goes first on PYTHONPATH. Without the wheel, a note: the
# benchmarks then leave it out.
vmstash_tms_peer() {
  python3 -c "import torch_memory_saver" 2>/dev/null && return 0
  local wheels=${VMSTASH_WHEELS:-$root/third_party/wheels} wheel
  for wheel in "$wheels"/torch_memory_saver-0.0.10-*.whl; do
    [ -f "$wheel" ] || continue
    python3 -m zipfile -e "$wheel" "$build/peers" || return 1
    export PYTHONPATH="$build/peers${PYTHONPATH:+:$PYTHONPATH}"
    python3 -c "import torch_memory_saver" || { echo "error: torch_memory_saver not importable from $build/peers" >&2; return 1; }
    return 0
  done
  echo "note: $(command -v python3) cannot import torch_memory_saver and $wheels has no torch_memory_saver-0.0.10" \
       "wheel (scripts/fetch_wheels.sh): the benchmarks run without it" >&2
}

# The Python package from the build tree, for the scripts that run it.
vmstash_python_env() {
  export VMSTASH_LIBRARY="$build/torch_plugin/libvmstash.so"
  export VMSTASH_PRELOAD_LIBRARY="$build/torch_plugin/libvmstash_preload.so"
  export PYTHONPATH="$root/torch_plugin/python${PYTHONPATH:+:$PYTHONPATH}"
}
