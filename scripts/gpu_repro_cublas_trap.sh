#!/usr/bin/env bash
# Issue 16 item 8 on a GPU machine: builds (scripts/gpu_build.sh), then runs the
# cuBLAS-workspace scenarios with vmstash's protection switched off (warm_blas_workspaces
# replaced by a no-op), which must fail with CUBLAS_STATUS_EXECUTION_FAILED, then as
# shipped, which must pass. Shows that the scenarios catch the trap.
set -uo pipefail
source "$(dirname "$0")/gpu_build.sh"
vmstash_build vmstash >/dev/null || exit 1
vmstash_python_env
export PYTHONUNBUFFERED=1
scenarios=$root/torch_plugin/python/tests/gpu_torch_scenarios.py
log=$(mktemp)
status=0
for name in cublas_workspace_linear_in_region cublas_workspace_transformer_prefill; do
  python3 - "$scenarios" "$name" >"$log" 2>&1 <<'PY'
import runpy, sys
import vmstash._torch as t
t.warm_blas_workspaces = lambda *a, **k: None  # the protection off
path, name = sys.argv[1], sys.argv[2]
sys.argv = [path, name]
runpy.run_path(path, run_name="__main__")
PY
  rc=$?
  if [ $rc -ne 0 ] && grep -q CUBLAS_STATUS_EXECUTION_FAILED "$log"; then
    echo "repro: $name without the protection: CUBLAS_STATUS_EXECUTION_FAILED (rc $rc), as before the fix"
  else
    echo "repro: $name without the protection did not hit the trap (rc $rc); last lines:"; tail -5 "$log"
    status=1
  fi
  if python3 "$scenarios" "$name"; then echo "repro: $name with the protection: passed";
  else echo "repro: $name with the protection: FAILED"; status=1; fi
done
rm -f "$log"
exit $status
