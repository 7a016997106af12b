#!/bin/sh
# The demo binary end to end on the simulated driver: success output, and clean failures.
set -u
err="${TEST_TMPDIR:-/tmp}/vmstash_demo_err.txt"
demo=tools/demo/vmstash_demo
out=$("$demo" --size=64M --chunk=8M) || { echo "demo failed: $out"; exit 1; }
echo "$out"
echo "$out" | grep -q "sim driver" || { echo "expected the sim driver"; exit 1; }
echo "$out" | grep -q "same address" || exit 1
echo "$out" | grep -q "64.0 MiB identical after resume" || exit 1
echo "$out" | grep -q "not GPU figures" || { echo "expected the simulated driver's note"; exit 1; }
# Out of (simulated) device memory: a clear message and exit status 1, no crash.
VMSTASH_CONF="sim_capacity:32M" "$demo" --size=64M 2>"$err"; rc=$?
[ "$rc" = 1 ] || { echo "expected exit 1 on OOM, got $rc"; exit 1; }
grep -q "RESOURCE_EXHAUSTED" "$err" || { cat "$err"; exit 1; }
# An injected driver fault is reported, not fatal.
VMSTASH_CONF="sim_fail:map@2=internal" "$demo" --size=64M --chunk=8M 2>"$err"; rc=$?
[ "$rc" = 1 ] && grep -q "injected failure of map" "$err" || { cat "$err"; exit 1; }
# Bad configuration and usage.
VMSTASH_CONF="no_such_key:1" "$demo" 2>"$err"; [ $? = 1 ] && grep -q "no_such_key" "$err" || exit 1
"$demo" --bogus 2>/dev/null; [ $? = 2 ] || exit 1
echo PASS
