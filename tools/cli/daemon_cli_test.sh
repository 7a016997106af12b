#!/usr/bin/env bash
# `vmstash daemon start|stop|status` (daemon_cmd.h) with the vmstashd program, in a
# private runtime directory of its own: usage errors (2), status with none running (1),
# start, start again (said, 0), status (text and JSON), stop, stop again (said, 0).
set -uo pipefail
cli=tools/cli/vmstash_cli  # from the runfiles root (Bazel) or the build tree (CTest)
export VMSTASH_DAEMON="$PWD/tools/vmstashd/vmstashd"
export VMSTASH_RUNTIME_DIR
VMSTASH_RUNTIME_DIR=$(mktemp -d /tmp/vmstash-daemon-cli-XXXXXX)
trap '"$cli" daemon stop >/dev/null 2>&1; rm -rf "$VMSTASH_RUNTIME_DIR"' EXIT
fail() { echo "daemon_cli_test: $*"; exit 1; }
expect() {  # expect RC ARGS...: runs the CLI, checks its exit status, leaves its output in $out
  local want=$1; shift
  out=$("$cli" "$@" 2>&1); local rc=$?
  [ "$rc" = "$want" ] || fail "vmstash $*: exit $rc, not $want: $out"
}
expect 2 daemon
expect 2 daemon bogus
expect 2 daemon start
expect 2 daemon stop --capacity=1G
expect 2 daemon start --capacity=lots
expect 2 daemon stop --json
expect 1 daemon status
grep -q "no daemon serves" <<<"$out" || fail "status without a daemon: $out"
expect 0 daemon start --capacity=64M
grep -q "started (pid [0-9]*), a pool of 64.00 MiB" <<<"$out" || fail "start: $out"
expect 0 daemon start --capacity=64M
grep -q "already running" <<<"$out" || fail "second start: $out"
expect 0 daemon status
grep -q "pool     64.00 MiB" <<<"$out" || fail "status: $out"
expect 0 daemon status --json
grep -q '"capacity_bytes":67108864' <<<"$out" || fail "status --json: $out"
expect 0 daemon stop
grep -q "stopped (pid" <<<"$out" || fail "stop: $out"
expect 1 daemon status
expect 0 daemon stop
grep -q "none running" <<<"$out" || fail "second stop: $out"
grep -q "serving a pool of 67108864 bytes" "$VMSTASH_RUNTIME_DIR/vmstashd.log" || fail "no log"
echo "daemon_cli_test: ok"
