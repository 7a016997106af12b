#!/usr/bin/env bash
# Runs torch_memory_saver's own test suite, unmodified (test/test_examples.py of its
# repository at 4a43c97; scripts/export_tms_suite.sh copies it here), on the GPU machine,
# against vmstash's torch_memory_saver drop-in, or against torch_memory_saver's own wheel
# (the baseline, side by side). What it tests is installed into a temporary folder (the
# wheels unpacked, as pip install --target does) that comes first on PYTHONPATH, so it
# shadows any torch_memory_saver installed in the Python environment.
#
#   scripts/run_tms_suite.sh [DIR] [--wheels WDIR | --build-tree | --tms-wheel WHEEL]
#                            [--min-passed N] [-- PYTEST_ARG...]
#     DIR           a folder holding torch_memory_saver's test/ (default third_party/tms_suite)
#     --wheels WDIR the drop-in as a user installs it (the default, WDIR dist/):
#                   vmstash-*.whl and torch_memory_saver-*+vmstash*.whl of scripts/build_wheel.sh
#     --build-tree  the drop-in wheel built now from the libraries of a build (CTest, Bazel):
#                   $VMSTASH_PRELOAD_LIBRARY, with the vmstash package of PYTHONPATH and
#                   $VMSTASH_LIBRARY (under `bazel test`, those of the runfiles)
#     --tms-wheel W torch_memory_saver's own wheel instead of vmstash
#     --min-passed N  fail unless at least N tests passed (19 on one GPU: the suite's 30
#                   tests less its multi-device and XPU ones)
#     --beside-tms W  then the same suite, same N, against torch_memory_saver's own wheel W
#                   (or the one torch_memory_saver-*.whl without "+vmstash" in folder W):
#                   both counts in one run; the exit status fails when either run does
# Prints the counts ("tms_suite (<what>): P passed, F failed, E errors, S skipped") and the
# tests that did not pass. Exit status: 0 when none failed; 1 when some did (or too few
# passed); 77 (a skip for CTest) when DIR has no suite or no CUDA device is visible,
# unless VMSTASH_TEST_REQUIRE_GPU=1, which makes both a failure.
set -euo pipefail
root=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
dir=$root/third_party/tms_suite
mode=wheels
wheels=$root/dist
tms_wheel=
min_passed=0
beside=
pytest_args=()
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) mode=wheels; wheels=${2:?--wheels needs a folder}; shift 2 ;;
    --build-tree) mode=build-tree; shift ;;
    --tms-wheel) mode=tms; tms_wheel=${2:?--tms-wheel needs a wheel}; shift 2 ;;
    --min-passed) min_passed=${2:?--min-passed needs a number}; shift 2 ;;
    --beside-tms) beside=${2:?--beside-tms needs a wheel or a folder}; shift 2 ;;
    --) shift; pytest_args=("$@"); break ;;
    -h|--help) usage ;;
    -*) echo "run_tms_suite: unknown option $1" >&2; usage ;;
    *) dir=$1; shift ;;
  esac
done

# Missing prerequisites: a skip, or a failure where the GPU tests must run.
unable() {
  echo "run_tms_suite: $1" >&2
  if [ "${VMSTASH_TEST_REQUIRE_GPU:-}" = 1 ]; then
    echo "run_tms_suite: failing (VMSTASH_TEST_REQUIRE_GPU=1)" >&2
    exit 1
  fi
  exit 77
}
if [ -n "$beside" ]; then  # this run, then torch_memory_saver's own: both counts, one status
  if [ -d "$beside" ]; then
    found=()
    for w in "$beside"/torch_memory_saver-*.whl; do
      case "$w" in *+vmstash*) ;; *) [ -f "$w" ] && found+=("$w") ;; esac
    done
    if [ ${#found[@]} -ne 1 ]; then
      echo "run_tms_suite: --beside-tms: expected one torch_memory_saver wheel (not vmstash's) in $beside, found ${#found[@]}" >&2
      exit 1
    fi
    beside=${found[0]}
  fi
  [ -f "$beside" ] || { echo "run_tms_suite: --beside-tms: no such wheel: $beside" >&2; exit 1; }
  mine=(--wheels "$wheels")
  [ "$mode" = build-tree ] && mine=(--build-tree)
  [ "$mode" = tms ] && mine=(--tms-wheel "$tms_wheel")
  set +e
  "$0" "$dir" "${mine[@]}" --min-passed "$min_passed" -- "${pytest_args[@]}"
  first=$?
  "$0" "$dir" --tms-wheel "$beside" --min-passed "$min_passed" -- "${pytest_args[@]}"
  second=$?
  set -e
  echo "run_tms_suite: exit status $first (${mine[*]}), $second (torch_memory_saver's own wheel)"
  for rc in "$first" "$second"; do [ "$rc" -ne 0 ] && exit "$rc"; done
  exit 0
fi
given=$dir
dir=$(cd "$dir" 2>/dev/null && pwd) || true
if [ -z "$dir" ] || [ ! -f "$dir/test/test_examples.py" ]; then
  unable "no torch_memory_saver test suite in $given (no test/test_examples.py): copy the test/ folder of
  github.com/fzyzcjy/torch_memory_saver at commit 4a43c97 there, e.g. from a clone:
    scripts/export_tms_suite.sh /path/to/torch_memory_saver    (fills third_party/tms_suite/test)"
fi
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.device_count() > 0 else 1)" 2>/dev/null; then
  unable "torch is not importable or sees no CUDA device"
fi
if ! python3 -c "import pytest" 2>/dev/null; then
  # shellcheck source=gpu_build.sh
  source "$root/scripts/gpu_build.sh"  # vmstash_ensure_pytest: from third_party/wheels
  vmstash_ensure_pytest
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/vmstash_tms_suite.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
site=$tmp/site
mkdir -p "$site"
unpack() {  # wheels into $site, as pip install --no-deps --target does
  python3 - "$site" "$@" <<'PY'
import os, sys, zipfile
site = sys.argv[1]
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
        for info in z.infolist():
            mode = (info.external_attr >> 16) & 0o777
            if mode or info.filename.endswith(".so"):
                os.chmod(os.path.join(site, info.filename), mode or 0o755)
    print(f"run_tms_suite: installed {os.path.basename(wheel)}")
PY
}
one() {  # the one file matching a pattern, or an error naming it
  local found=("$@")
  if [ ${#found[@]} -ne 1 ] || [ ! -f "${found[0]}" ]; then
    echo "run_tms_suite: expected one file matching $1, found ${#found[@]} (build them: scripts/build_wheel.sh)" >&2
    exit 1
  fi
  echo "${found[0]}"
}
case "$mode" in
  wheels)
    vmstash_wheel=$(one "$wheels"/vmstash-*.whl)
    dropin_wheel=$(one "$wheels"/torch_memory_saver-*+vmstash*.whl)
    unpack "$vmstash_wheel" "$dropin_wheel"
    unset VMSTASH_LIBRARY VMSTASH_PRELOAD_LIBRARY
    what="vmstash drop-in, wheels of $wheels" ;;
  build-tree)
    if [ -n "${TEST_SRCDIR:-}" ]; then  # bazel test: the runfiles
      runfiles=$TEST_SRCDIR/$TEST_WORKSPACE
      export VMSTASH_LIBRARY=$runfiles/torch_plugin/libvmstash.so
      export VMSTASH_PRELOAD_LIBRARY=$runfiles/torch_plugin/libvmstash_preload.so
      export PYTHONPATH=$runfiles/torch_plugin/python${PYTHONPATH:+:$PYTHONPATH}
      builder=$runfiles/scripts/build_tms_dropin_wheel.py
    else
      builder=$root/scripts/build_tms_dropin_wheel.py
    fi
    : "${VMSTASH_PRELOAD_LIBRARY:?--build-tree needs VMSTASH_PRELOAD_LIBRARY (the built libvmstash_preload.so)}"
    dropin_wheel=$(python3 "$builder" --preload "$VMSTASH_PRELOAD_LIBRARY" --out "$tmp")
    unpack "$dropin_wheel"
    what="vmstash drop-in, built from $VMSTASH_PRELOAD_LIBRARY" ;;
  tms)
    unpack "$tms_wheel"
    unset VMSTASH_LIBRARY VMSTASH_PRELOAD_LIBRARY
    what="torch_memory_saver's own wheel $(basename "$tms_wheel")" ;;
esac
unset LD_PRELOAD
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch_memory_saver as t; print('run_tms_suite: torch_memory_saver from', t.__file__, \
'(served by', getattr(t, 'served_by', 'torch_memory_saver itself') + ')')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true

# pytest from DIR with an empty configuration of its own (no ini file of this repository
# applies), its results as JUnit XML for the counts.
: > "$tmp/pytest.ini"
set +e
(cd "$dir" && python3 -m pytest -c "$tmp/pytest.ini" --rootdir "$dir" -p no:cacheprovider -v -rfEs \
   --junitxml="$tmp/junit.xml" test/test_examples.py "${pytest_args[@]}")
rc=$?
set -e
python3 - "$tmp/junit.xml" "$what" "$min_passed" "$rc" <<'PY'
import sys
import xml.etree.ElementTree as ET
path, what, min_passed, rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
try:
    root = ET.parse(path).getroot()
except (OSError, ET.ParseError) as e:
    print(f"tms_suite ({what}): no results (pytest exit status {rc}: {e})")
    sys.exit(1)
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
tests = sum(int(s.get("tests", 0)) for s in suites)
failed = sum(int(s.get("failures", 0)) for s in suites)
errors = sum(int(s.get("errors", 0)) for s in suites)
skipped = sum(int(s.get("skipped", 0)) for s in suites)
passed = tests - failed - errors - skipped
print(f"tms_suite ({what}): {passed} passed, {failed} failed, {errors} errors, {skipped} skipped")
for case in root.iter("testcase"):
    for kind in ("failure", "error"):
        if case.find(kind) is not None:
            print(f"  {kind}: {case.get('name')}")
ok = failed == 0 and errors == 0 and rc in (0, 5) and passed >= min_passed
if passed < min_passed:
    print(f"tms_suite: {passed} passed, fewer than the {min_passed} expected")
sys.exit(0 if ok else 1)
PY
