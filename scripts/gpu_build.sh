# Sourced (not run) by the GPU-machine scripts: gpu_build_and_test.sh, run_demo.sh and
# bench_report.sh. Unpacks the Debian .debs of third_party/debs (scripts/fetch_debs.sh)
# into a prefix when they are there, else uses the system's abseil/fmt/googletest; points
# the loader at the prefix (RUNPATH is not transitive); configures CMake with torch when
# `import torch` works; then `vmstash_build [TARGET...]` builds (everything when none).
#
#   VMSTASH_DEBS, VMSTASH_PREFIX, VMSTASH_BUILD override the folders.
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

# The Python package from the build tree, for the scripts that run it.
vmstash_python_env() {
  export VMSTASH_LIBRARY="$build/torch_plugin/libvmstash.so"
  export VMSTASH_PRELOAD_LIBRARY="$build/torch_plugin/libvmstash_preload.so"
  export PYTHONPATH="$root/torch_plugin/python${PYTHONPATH:+:$PYTHONPATH}"
}
