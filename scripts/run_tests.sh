#!/usr/bin/env bash
# The README's test command: set up a fresh Debian 12 machine, then `bazel build //...`
# (every target) and `bazel test //...` (everything that needs no GPU; tests tagged `gpu`
# run on the GPU machine instead).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_debian.sh
# Every target analyses and builds, the gpu-tagged ones too (`bazel test` skips those with
# --build_tests_only), so a target that does not can never land.
if [[ $# -eq 0 ]]; then
  bazel build //...
fi
bazel test //... "$@"
# The allocator's stress and fault-injection tests again under AddressSanitizer and
# ThreadSanitizer (docs/architecture.md §10), the control endpoint under ASAN, and the protocol fuzzer.
if [[ $# -eq 0 ]]; then
  bazel test --config=asan //allocator:caching_allocator_stress_test //allocator:caching_allocator_fault_test \
    //allocator:pause_resume_stress_test //allocator:pause_resume_test //allocator:pause_resume_hardening_test \
    //allocator:backup_store_test //allocator:switch_test //allocator:switch_fault_test //allocator:sim_allocator_conformance_test \
    //stash:arena_sim_test //torch_plugin:c_abi_hardening_test //runtime:runtime_test \
    //runtime:process_test //runtime:transition_sweep_test //runtime:control_service_test //allocator:tag_test \
    //allocator:fork_test //allocator:tag_pool_test //allocator:host_budget_test //vmm:pinned_pieces_test \
    //allocator:give_back_test //allocator:host_cap_test //allocator:agreed_switch_test //base:mutex_test \
    //allocator:tag_backup_test //node:daemon_test //node:host_pool_test //allocator:pool_backup_test \
    //runtime:node_leases_test //runtime:node_fork_test //node:node_switch_test //node:switch_ledger_test \
    //allocator:switch_handover_test //node:chunk_trade_test //runtime:tag_share_test //runtime:mapped_backup_test \
    //vmm:sim_driver_test
  bazel test --config=tsan //allocator:caching_allocator_stress_test //allocator:pause_resume_stress_test \
    //allocator:pause_resume_hardening_test //allocator:switch_test //torch_plugin:c_abi_hardening_test //runtime:process_test \
    //allocator:fork_test //control:endpoint_test //allocator:host_budget_test //allocator:agreed_switch_test \
    //base:mutex_test //node:daemon_test //allocator:pool_backup_test //runtime:node_leases_test \
    //node:node_switch_test //allocator:switch_handover_test //node:chunk_trade_test //runtime:tag_share_test //runtime:mapped_backup_test
  # The background hand-back racing pauses, resumes and allocations, and foreground callers
  # meeting the background loops (give_back_test's threaded cases).
  bazel test --config=tsan //allocator:give_back_test --test_arg=--gtest_filter='*Background*:*Concurrent*'
  # Pauses over the host cap taking back other tags' prepared arenas (their transition
  # locks tried) while those tags pause, switch and prepare (host_cap_test's threaded cases).
  bazel test --config=tsan //allocator:host_cap_test --test_arg=--gtest_filter='*NeverDeadlock*:*Background*'
  # The control endpoint under ASAN, and its protocol parser fuzzed for a bounded time.
  bazel test --config=asan //control/... //tools/cli:cli_e2e_test
  scripts/run_fuzzer.sh
  # The architecture's checks: the layer order (query and visibility), clang's
  # thread-safety analysis of the annotated code, Bazel/CMake build parity, and the table
  # of Notes (docs/architecture.md §11).
  scripts/check_layering.sh
  scripts/check_thread_safety.sh
  scripts/check_build_parity.py
  scripts/check_note_index.py
  # The wheels (the whole product and the torch_memory_saver drop-in), built as a user
  # would and checked: NEEDED entries, glibc tag, the paged stash kernels.
  scripts/build_wheel.sh build/ci-dist
fi
