#!/usr/bin/env bash
# Runs vLLM's own allocator tests, unmodified (0.33: tests/basic_correctness/memory/cumem/
# test_cumem.py of its source archive; scripts/fetch_vllm.py puts it in third_party/vllm; an
# earlier release's tests/basic_correctness/test_mem.py, from third_party/vllm-V, with
# VMSTASH_VLLM_DIR=third_party/vllm-V),
# on the GPU machine, against vmstash's vLLM allocator (the plugin registered and selected,
# as a model with sleep_mode_backend="vmstash" has it) or, with --baseline, against vLLM's
# own CuMemAllocator (its wheel's cumem_allocator.abi3.so), side by side.
#
#   scripts/run_vllm_suite.sh [--baseline] [--min-passed N] [-- PYTEST_ARG...]
#
# vLLM's engine does not run under the GPU machine's PyTorch: the tests that start it (their
# code makes an LLM, AsyncLLMEngine or AsyncEngineArgs; listed when deselected) are left
# out, and so are those that read what only CuMemAllocator has (NOT_VMSTASH below, with the
# reason). The vmstash package comes from PYTHONPATH and the
# library from VMSTASH_LIBRARY (as the CTest environment sets them), or from an installed
# wheel. Exit status: pytest's; 1 also when fewer than N passed; 77 (a CTest skip) when the
# vLLM files or a CUDA device are missing, unless VMSTASH_TEST_REQUIRE_GPU=1.
set -euo pipefail
root=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
baseline=0
min_passed=0
pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --baseline) baseline=1; shift ;;
    --min-passed) min_passed=${2:?--min-passed needs a number}; shift 2 ;;
    --) shift; pytest_args=("$@"); break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
    *) echo "run_vllm_suite: unknown argument $1" >&2; exit 2 ;;
  esac
done
unable() {
  echo "run_vllm_suite: $1" >&2
  [ "${VMSTASH_TEST_REQUIRE_GPU:-}" = 1 ] && { echo "run_vllm_suite: failing (VMSTASH_TEST_REQUIRE_GPU=1)" >&2; exit 1; }
  exit 77
}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 "$root/torch_plugin/python/tests/vllm_standins/assemble.py" "$work" >/dev/null || unable "no vLLM files"
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null || unable "no CUDA device"

test_file=$(cd "$work" && find tests/basic_correctness -name test_cumem.py -o -name test_mem.py 2>/dev/null | head -1 || true)
[ -n "$test_file" ] || unable "no vLLM allocator test file (test_cumem.py, test_mem.py) in the vLLM files"
# Tests of what only CuMemAllocator has, not of the protocol:
#  test_level2_discards_ordinary_tensor_with_weights_tag replaces cumem.create_and_map (the
#    function CuMemAllocator maps memory with) to poison the memory it maps;
#  test_workspace_scratch_discarded_on_sleep imports vllm.v1.worker.workspace (the engine's
#    worker package) and counts CuMemAllocator's pools per tag (allocator_and_pools).
NOT_VMSTASH="test_level2_discards_ordinary_tensor_with_weights_tag or test_workspace_scratch_discarded_on_sleep"
# The engine tests, found by their code (the same rule for every release's test file).
cat > "$work/conftest.py" <<'EOF'
import inspect
import re


def pytest_collection_modifyitems(config, items):
    engine = [i for i in items if re.search(r"\b(LLM|AsyncLLMEngine|AsyncEngineArgs)\(",
                                            inspect.getsource(getattr(i.function, "__wrapped__", i.function)))]
    if engine:
        config.hook.pytest_deselected(items=engine)
        items[:] = [i for i in items if i not in engine]
        print("\nrun_vllm_suite: deselected (they start vLLM's engine):", " ".join(i.name for i in engine))
EOF
if [ $baseline = 1 ]; then
  what="vLLM's CuMemAllocator"
  deselect="not (test_workspace_scratch_discarded_on_sleep)"
else
  what="vmstash's vLLM allocator"
  deselect="not ($NOT_VMSTASH)"
  cat >> "$work/conftest.py" <<'EOF'
# vmstash's plugin, loaded and chosen as vLLM loads and chooses it for a model with
# sleep_mode_backend="vmstash": get_mem_allocator_instance() answers VmstashMemAllocator.
import vmstash.compat.vllm as vm

vm.register()
vm.select(True)
EOF
fi
cd "$work"
set +e
python3 -m pytest -p no:cacheprovider -v -rA -k "$deselect" "$test_file" \
  "${pytest_args[@]}" 2>&1 | tee "$work/log"
rc=${PIPESTATUS[0]}
set -e
passed=$(grep -Eo '[0-9]+ passed' "$work/log" | tail -1 | grep -Eo '[0-9]+' || echo 0)
echo "vllm_suite ($what): $passed passed"
if [ "$passed" -lt "$min_passed" ]; then
  echo "run_vllm_suite: $passed passed, at least $min_passed expected" >&2
  exit 1
fi
exit $rc
