#!/usr/bin/env bash
# The README's test command: set up a fresh Debian 12 machine, then `bazel test //...`
# (everything that needs no GPU; tests tagged `gpu` run on the GPU machine instead).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_debian.sh
bazel test //... "$@"
