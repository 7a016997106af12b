#!/usr/bin/env bash
# Installs what the build needs on a fresh Debian 12 machine, skipping what is present:
# Bazel 4.2.3 (bazel-bootstrap) with Debian's rules_java, abseil, fmt, googletest,
# benchmark, pkg-config, CMake, ninja, python3 with pytest (the Python package's tests, run
# by /usr/bin/python3: Bazel's sh_tests see only /bin:/usr/bin under
# --incompatible_strict_action_env; Debian 12's python3-pytest, pinned to pytest 7.2.1 below)
# and clang with its libFuzzer runtime (the control-protocol fuzzer). The CUDA toolkit (nvcc 13,
# headers) must already be installed (it is on the project's machines; Debian 12 has no
# CUDA 13 package): the build needs its headers and nvcc, not a GPU.
set -euo pipefail

packages=(bazel-bootstrap bazel-rules-java libabsl-dev libfmt-dev libgtest-dev libgmock-dev
          libbenchmark-dev pkg-config g++ cmake ninja-build python3 python3-pytest clang libclang-rt-14-dev)
# Versions held where the tests depend on them (apt's version glob: any Debian revision).
declare -A pins=([python3-pytest]="7.2.1*")
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p${pins[$p]:+=${pins[$p]}}")
done
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# Debian's /usr/bin/bazel wrapper runs /usr/bin/bazel-<.bazelversion>; the package ships
# Bazel 4.2.3 as bazel-4. Give it its full version name so .bazelversion can pin 4.2.3.
version=$(dpkg-query -W -f='${Version}' bazel-bootstrap)
case "$version" in
  4.2.3*) [ -e /usr/bin/bazel-4.2.3 ] || $sudo ln -s bazel-4 /usr/bin/bazel-4.2.3 ;;
  *) echo "setup: bazel-bootstrap is $version, the project pins 4.2.3" >&2; exit 1 ;;
esac

if ! command -v nvcc >/dev/null && [ ! -x "${CUDA_PATH:-/usr/local/cuda}/bin/nvcc" ]; then
  echo "setup: the CUDA toolkit (nvcc, cuda.h) is not installed; install CUDA 13 or set CUDA_PATH" >&2
  exit 1
fi
