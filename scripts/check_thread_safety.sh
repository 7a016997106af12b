#!/usr/bin/env bash
# Clang's thread-safety analysis over the annotated code (ABSL_GUARDED_BY,
# ABSL_EXCLUSIVE_LOCKS_REQUIRED, ... on base/mutex.h's Mutex): every library source of the
# layers that take locks, compiled with -Wthread-safety as errors (syntax and analysis
# only, no object files). GCC, the build's compiler, ignores the annotations.
set -euo pipefail
cd "$(dirname "$0")/.."
cuda="${CUDA_PATH:-/usr/local/cuda}"
mapfile -t sources < <(git ls-files 'base/*.cc' 'vmm/*.cc' 'allocator/*.cc' 'stash/*.cc' 'control/*.cc' 'node/*.cc' \
                         'runtime/*.cc' 'torch_plugin/c_abi/*.cc' 'torch_plugin/preload/vmstash_preload.cc' |
                       grep -v -e '_test\.cc$' -e '_fuzzer\.cc$' -e 'fake_cudart')
# The analysis must be live: a read of a guarded field without its lock must fail.
probe=$(mktemp --suffix=.cc)
trap 'rm -f "$probe"' EXIT
cat > "$probe" <<'PROBE'
#include "base/mutex.h"
struct Probe {
  vmstash::Mutex mu;
  int value ABSL_GUARDED_BY(mu) = 0;
  int Read() { return value; }
};
PROBE
if clang++ -std=c++17 -fsyntax-only -Wthread-safety -Werror=thread-safety -I. "$probe" 2>/dev/null; then
  echo "thread-safety: the analysis did not flag an unlocked read of a guarded field" >&2
  exit 1
fi
failed=0
for f in "${sources[@]}"; do
  clang++ -std=c++17 -fsyntax-only -Wthread-safety -Wthread-safety-beta -Werror=thread-safety \
    -Werror=thread-safety-beta -I. -I"$cuda/include" "$f" || { echo "thread-safety: $f" >&2; failed=1; }
done
[ "$failed" = 0 ] || exit 1
echo "thread-safety: ${#sources[@]} sources analysed, no warning"
