#!/usr/bin/env bash
# Runs one Python test file of the vmstash package under `bazel test`: the package from
# the runfiles tree, libvmstash.so built by Bazel, the system's python3.
set -euo pipefail
root="${TEST_SRCDIR}/${TEST_WORKSPACE}"
export PYTHONPATH="${root}/torch_plugin/python${PYTHONPATH:+:${PYTHONPATH}}"
export VMSTASH_LIBRARY="${root}/torch_plugin/libvmstash.so"
exec python3 "${root}/$1" -v
