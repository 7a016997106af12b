#!/usr/bin/env bash
# vmstashd as a program: refuses bad arguments (2), serves until SIGTERM (0, the socket
# removed), and a second one on the same directory does not start (1).
set -euo pipefail
bin=tools/vmstashd/vmstashd  # from the runfiles root (Bazel) or the build tree (CTest)
dir=$(mktemp -d /tmp/vmstashd-test-XXXXXX)
pid=
trap '[ -z "$pid" ] || kill -KILL "$pid" 2>/dev/null; rm -rf "$dir"' EXIT
set +e
"$bin" 2>/dev/null; [ $? -eq 2 ] || { echo "no --capacity: not 2"; exit 1; }
"$bin" --capacity lots --dir "$dir" 2>/dev/null; [ $? -eq 2 ] || { echo "bad size: not 2"; exit 1; }
set -e
"$bin" --capacity 64M --dir "$dir" 2>"$dir/log" &
pid=$!
for _ in $(seq 100); do [ -S "$dir/vmstashd.sock" ] && break; sleep 0.05; done
[ -S "$dir/vmstashd.sock" ] || { echo "no socket"; cat "$dir/log"; exit 1; }
set +e
"$bin" --capacity 64M --dir "$dir" 2>"$dir/second"; rc=$?
set -e
[ $rc -eq 1 ] && grep -q "already serves" "$dir/second" || { echo "a second daemon: rc $rc"; cat "$dir/second"; exit 1; }
kill -TERM "$pid"
wait "$pid"
pid=
[ ! -e "$dir/vmstashd.sock" ] || { echo "socket left behind"; exit 1; }
grep -q "serving a pool of 67108864 bytes" "$dir/log"
echo "vmstashd_test: ok"
