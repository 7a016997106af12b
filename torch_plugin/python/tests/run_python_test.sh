#!/usr/bin/env bash
# Runs Python under `bazel test`: the vmstash package from the runfiles tree, the libraries
# and the CLI built by Bazel (where the test's data has them), the system's python3.
#   run_python_test.sh FILE [ARG...]       a Python file (a path in the workspace) with its arguments
#   run_python_test.sh -m pytest [ARG...]  pytest in the workspace's runfiles root (paths relative
#                                          to it), its results as the test's XML for Bazel
set -euo pipefail
root="${TEST_SRCDIR}/${TEST_WORKSPACE}"
export PYTHONPATH="${root}/torch_plugin/python${PYTHONPATH:+:${PYTHONPATH}}"
export VMSTASH_LIBRARY="${root}/torch_plugin/libvmstash.so"
[ -e "${root}/torch_plugin/libvmstash_preload.so" ] && export VMSTASH_PRELOAD_LIBRARY="${root}/torch_plugin/libvmstash_preload.so"
[ -e "${root}/tools/cli/vmstash_cli" ] && export VMSTASH_CLI="${root}/tools/cli/vmstash_cli"
[ -e "${root}/tools/vmstashd/vmstashd" ] && export VMSTASH_DAEMON="${root}/tools/vmstashd/vmstashd"
if [ "$1" = "-m" ] && [ "${2:-}" = "pytest" ]; then
  shift 2
  cd "$root"
  exec python3 -m pytest -p no:cacheprovider ${XML_OUTPUT_FILE:+--junitxml="$XML_OUTPUT_FILE"} "$@"
fi
script="$1"
shift
exec python3 "${root}/${script}" "$@"
