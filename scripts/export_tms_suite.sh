#!/usr/bin/env bash
# Exports torch_memory_saver's own test suite (its test/ folder at commit 4a43c97, the
# one scripts/run_tms_suite.sh runs) from a local clone into a folder this repository
# ignores. Nothing of it is committed here: it is torch_memory_saver's code.
#
#   scripts/export_tms_suite.sh CLONE [DEST]
#     CLONE  a clone of github.com/fzyzcjy/torch_memory_saver (a work tree or a bare git
#            directory) that has commit 4a43c97 (git -C CLONE fetch if it lacks it)
#     DEST   default third_party/tms_suite (git-ignored); DEST/test/ is replaced
set -euo pipefail
commit=4a43c97
root=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: $0 CLONE [DEST]   (DEST default: third_party/tms_suite)" >&2
  exit 2
fi
src=$1
dest=${2:-$root/third_party/tms_suite}
if ! git -C "$src" rev-parse --verify --quiet "$commit^{commit}" >/dev/null; then
  echo "error: $src is not a git clone of torch_memory_saver with commit $commit (git -C $src fetch origin)" >&2
  exit 1
fi
mkdir -p "$dest"
rm -rf "$dest/test"
git -C "$src" archive --format=tar "$commit" test | tar -x -C "$dest"
if [ ! -f "$dest/test/test_examples.py" ]; then
  echo "error: $commit of $src has no test/test_examples.py" >&2
  exit 1
fi
echo "exported test/ of torch_memory_saver $commit ($(find "$dest/test" -type f | wc -l) files) to $dest"
