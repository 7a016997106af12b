#!/usr/bin/env bash
# Issue 16 item 8 on a GPU machine, after scripts/gpu_build.sh: runs the cuBLAS-workspace
# scenarios with vmstash's protection switched off (warm_blas_workspaces replaced by a
# no-op), which must fail, then as shipped, which must pass. Shows that the scenarios
# catch the trap.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${VMSTASH_BUILD:-$root/build/cmake}
export VMSTASH_LIBRARY=$build/torch_plugin/libvmstash.so PYTHONPATH=$root/torch_plugin/python PYTHONUNBUFFERED=1
scenarios=$root/torch_plugin/python/tests/gpu_torch_scenarios.py
status=0
for name in cublas_workspace_linear_in_region cublas_workspace_transformer_prefill; do
  python3 - "$scenarios" "$name" <<'PY'
import runpy, sys
import vmstash._torch as t
t.warm_blas_workspaces = lambda *a, **k: None  # the protection off
path, name = sys.argv[1], sys.argv[2]
sys.argv = [path, name]
runpy.run_path(path, run_name="__main__")
PY
  rc=$?
  if [ $rc -eq 0 ]; then echo "repro: $name PASSED without the protection (it should fail)"; status=1;
  else echo "repro: $name failed without the protection (rc $rc), as before the fix"; fi
  if python3 "$scenarios" "$name"; then echo "repro: $name passes with the protection";
  else echo "repro: $name FAILED with the protection"; status=1; fi
done
exit $status
