#!/usr/bin/env bash
# The layer order (docs/architecture.md, //:BUILD.bazel's package groups), checked twice:
#  1. `bazel query`: no library or binary of a package depends on a package above it
#     (tests may use the programs above them as data, e.g. the CLI's end-to-end test);
#  2. visibility: a dependency against the order is refused by the build (one probe per
#     layer boundary, in a scratch package that is removed afterwards).
set -euo pipefail
cd "$(dirname "$0")/.."

# package: the packages it may depend on (besides itself; //bazel is build plumbing).
declare -A allowed=(
  [base]=""
  [vmm]="base"
  [control]="base"
  [node]="base control"
  [allocator]="base vmm"
  [stash]="base vmm allocator"
  [runtime]="base vmm allocator stash control node"
  [torch_plugin]="base vmm allocator stash control node runtime"
  [tools/cli]="base control node"
  [tools/vmstashd]="base control node"
)
failed=0
for pkg in "${!allowed[@]}"; do
  ok="//${pkg}/... + //bazel/..."
  for a in ${allowed[$pkg]}; do ok+=" + //${a}/..."; done
  query="deps(kind('cc_library|cc_binary|cuda_library', //${pkg}/...)) intersect //... except (${ok})"
  if ! out=$(bazel query --noshow_progress "$query" 2>&1); then
    echo "layering: bazel query failed for //${pkg}:" >&2
    echo "$out" | grep -v sandbox | tail -5 >&2
    exit 1
  fi
  bad=$(grep '^//' <<<"$out" | grep -v '\.bzl$' || true)
  if [ -n "$bad" ]; then
    echo "layering: //${pkg} depends on what is above it:" >&2
    echo "$bad" | sed 's/^/  /' >&2
    failed=1
  fi
done

# Visibility probes: lower package -> a target of the layer above it.
probes=(
  "base //vmm:driver"
  "vmm //allocator:tag"
  "allocator //stash:page_model"
  "stash //runtime"
  "control //runtime"
  "node //runtime"
  "runtime //torch_plugin:c_abi"
  "tools/cli //runtime"
)
for p in "${probes[@]}"; do
  read -r pkg target <<<"$p"
  dir="${pkg}/layering_probe"
  mkdir -p "$dir"
  trap 'rm -rf "$dir"' EXIT
  printf 'cc_library(name = "probe", deps = ["%s"])\n' "$target" > "$dir/BUILD.bazel"
  if out=$(bazel build --nobuild --noshow_progress "//${dir}:probe" 2>&1); then
    echo "layering: //${pkg} may depend on ${target} (visibility should refuse it)" >&2
    failed=1
  elif ! grep -q "is not visible" <<<"$out"; then
    echo "layering: the probe //${dir} failed for another reason:" >&2
    echo "$out" | grep -v sandbox | tail -5 >&2
    failed=1
  fi
  rm -rf "$dir"
done
trap - EXIT
[ "$failed" = 0 ] || exit 1
echo "layering: no dependency against the layer order; visibility refuses ${#probes[@]} upward dependencies"
