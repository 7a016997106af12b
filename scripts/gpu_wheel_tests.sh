#!/usr/bin/env bash
# The node's GPU checks run from the installed wheel, as a user's processes run them: the
# wheel of scripts/build_wheel.sh (dist/vmstash-*.whl) installed with pip into build/site,
# with no VMSTASH_LIBRARY, VMSTASH_DAEMON or VMSTASH_CLI set, so the package loads its own
# libvmstash.so and that library starts the vmstashd beside it (node/launch.h). Runs, in order:
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
wheel=$(ls dist/vmstash-*.whl 2>/dev/null | tail -1 || true)
if [ -z "$wheel" ]; then
  echo "error: no dist/vmstash-*.whl: build it with scripts/build_wheel.sh and copy dist/ here" >&2
  exit 2
fi
site=$PWD/build/site
rm -rf "$site"
python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-index --target "$site" "$wheel"
echo "installed $wheel into build/site"
unset VMSTASH_LIBRARY VMSTASH_PRELOAD_LIBRARY VMSTASH_DAEMON VMSTASH_CLI VMSTASH_CONF
export PYTHONPATH="$site"
runtime=$(mktemp -d /tmp/vmstash-wheel-XXXXXX)
chmod 700 "$runtime"
export VMSTASH_RUNTIME_DIR="$runtime"
python3 -c 'import vmstash, sys; sys.exit(0 if vmstash.__file__.startswith(sys.argv[1]) else
            f"vmstash was imported from {vmstash.__file__}, not from the wheel")' "$site"

echo "== 1. vmstash daemon start / status / stop (the wheel's console script)"
cli="$site/bin/vmstash"
"$cli" daemon start --capacity=4G
"$cli" daemon status
"$cli" daemon stop

echo "== 2. examples/two_processes.py"
python3 examples/two_processes.py --turns 4

echo "== 3. gpu_node_switch.py gpu_node_pool.py"
source scripts/gpu_build.sh
vmstash_ensure_pytest
cd torch_plugin/python/tests
python3 -m pytest -p no:cacheprovider -m gpu -v gpu_node_switch.py gpu_node_pool.py "$@"
