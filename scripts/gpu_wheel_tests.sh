#!/usr/bin/env bash
# The node's GPU checks run from the installed wheel, as a user's processes run them: the
# wheel of scripts/build_wheel.sh (dist/vmstash-*.whl, one) installed with pip into
# build/site, with no VMSTASH_LIBRARY, VMSTASH_DAEMON, VMSTASH_CLI or LD_PRELOAD set, so the
# package loads its own libvmstash.so (checked) and, in steps 1 and 2, the CLI and the library
# start the vmstashd beside them (node/launch.h); step 3's tests name the wheel's vmstashd
# themselves (node_helpers.py). Runs, in order:
#   1. the wheel's console script `vmstash daemon start|status|stop`;
#   2. the README's two-process example (examples/two_processes.py: a trainer and a rollout
#      process taking turns through vmstash.node.switch, the rollout's CUDA graph replayed);
#   3. the node's GPU tests (gpu_node_switch.py, gpu_node_pool.py; pytest from
#      third_party/wheels when python3 lacks it) against the installed package.
# Needs a GPU, PyTorch and pip; no network and no build.
#
#   scripts/gpu_wheel_tests.sh [PYTEST ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=(dist/vmstash-*.whl)
if [ ! -e "${wheels[0]}" ]; then
  echo "error: no dist/vmstash-*.whl: build it with scripts/build_wheel.sh and copy dist/ here" >&2
  exit 2
fi
if [ ${#wheels[@]} -ne 1 ]; then
  echo "error: ${#wheels[@]} wheels in dist/ (${wheels[*]}): leave the one to test" >&2
  exit 2
fi
site=$PWD/build/site
rm -rf "$site"
python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-index --target "$site" "${wheels[0]}"
echo "installed ${wheels[0]} into build/site"
unset VMSTASH_LIBRARY VMSTASH_PRELOAD_LIBRARY VMSTASH_DAEMON VMSTASH_CLI VMSTASH_CONF LD_PRELOAD
export PYTHONPATH="$site"
export VMSTASH_TEST_REQUIRE_GPU=1  # step 3: no GPU or torch fails, never skips
runtime=$(mktemp -d /tmp/vmstash-wheel-XXXXXX)
chmod 700 "$runtime"
export VMSTASH_RUNTIME_DIR="$runtime"
cli="$site/bin/vmstash"
# The daemon that step 1 or 2 started (the example leaves it serving, as a user's would) is
# stopped however the script ends.
trap '"$cli" daemon stop >/dev/null 2>&1 || true; rm -rf "$runtime"' EXIT
python3 - "$site" <<'PY'
import os, sys
from vmstash import _lib
site = sys.argv[1]
for what, path in (("the package", os.path.dirname(_lib.__file__)), ("libvmstash.so", _lib.library_path())):
    if not os.path.realpath(path).startswith(os.path.realpath(site) + os.sep):
        sys.exit(f"error: {what} is {path}, not the wheel's (under {site})")
print(f"the package and {_lib.library_path()} come from the wheel")
PY

echo "== 1. vmstash daemon start / status / stop (the wheel's console script)"
"$cli" daemon start --capacity=4G
"$cli" daemon status
"$cli" daemon stop

echo "== 2. examples/two_processes.py (the daemon started by the library, from beside it)"
python3 examples/two_processes.py --turns 4
"$cli" daemon status

echo "== 3. gpu_node_switch.py gpu_node_pool.py (their processes: the wheel's package, library and vmstashd)"
source scripts/gpu_build.sh
vmstash_ensure_pytest
cd torch_plugin/python/tests
python3 -m pytest -p no:cacheprovider -m gpu -v gpu_node_switch.py gpu_node_pool.py "$@"
