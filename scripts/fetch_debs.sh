#!/usr/bin/env bash
# Downloads Debian 12's .debs of abseil, fmt, googletest and benchmark (about 2.5 MB)
# into third_party/debs/ (git-ignored), for the GPU machine, which has no network and
# none of these libraries. scripts/gpu_build_and_test.sh unpacks them there.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=third_party/debs
mkdir -p "$dest"
packages=(libabsl-dev libabsl20220623 libfmt-dev libfmt9 libgtest-dev libgmock-dev
          libbenchmark-dev libbenchmark1debian)
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
if ! (cd "$dest" && apt-get download "${packages[@]}" >/dev/null 2>&1); then
  $sudo apt-get update -qq
  (cd "$dest" && apt-get download "${packages[@]}")
fi
du -sh "$dest"
ls "$dest"
