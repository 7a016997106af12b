#!/usr/bin/env bash
# The README's main job: set up, build and run the demo (pause/resume at the same
# address) on the GPU if one is usable, on the simulated driver otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_debian.sh
bazel run //tools/demo:vmstash_demo -- "$@"
