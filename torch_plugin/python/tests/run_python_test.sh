#!/usr/bin/env bash
# Runs one Python file (the first argument; the others are its own) under `bazel test`:
# the vmstash package from the runfiles tree, the libraries and the CLI built by Bazel
# (where the test's data has them), the system's python3.
set -euo pipefail
root="${TEST_SRCDIR}/${TEST_WORKSPACE}"
export PYTHONPATH="${root}/torch_plugin/python${PYTHONPATH:+:${PYTHONPATH}}"
export VMSTASH_LIBRARY="${root}/torch_plugin/libvmstash.so"
[ -e "${root}/torch_plugin/libvmstash_preload.so" ] && export VMSTASH_PRELOAD_LIBRARY="${root}/torch_plugin/libvmstash_preload.so"
[ -e "${root}/tools/cli/vmstash_cli" ] && export VMSTASH_CLI="${root}/tools/cli/vmstash_cli"
script="$1"
shift
exec python3 "${root}/${script}" "$@"
