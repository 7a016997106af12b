#!/usr/bin/env bash
# End to end on the simulated driver: a demo process serves its control endpoint; the
# `vmstash` CLI lists it, shows it, pauses and resumes a tag remotely, and takes a
# snapshot; bad requests fail with clear messages; once the process is gone its stale
# socket disappears; --version, --help on every command, and bad usage (exit 2).
set -euo pipefail
root="${TEST_SRCDIR}/${TEST_WORKSPACE}"
cli="$root/tools/cli/vmstash_cli"
demo="$root/tools/demo/vmstash_demo"
export VMSTASH_RUNTIME_DIR
VMSTASH_RUNTIME_DIR=$(mktemp -d /tmp/vmstash-e2e-XXXXXX)/run
out=$(mktemp -d)
fail() { echo "FAIL: $*" >&2; [ -n "${pid:-}" ] && kill "$pid" 2>/dev/null; exit 1; }

VMSTASH_DRIVER=sim VMSTASH_CONF=sim_capacity:2G,auto_prepare:0 "$demo" --size=8M --chunk=2M --serve=60 \
  > "$out/demo.log" 2>&1 &
pid=$!
for _ in $(seq 100); do grep -q "serving" "$out/demo.log" 2>/dev/null && break; sleep 0.1; done
grep -q "pid $pid serving" "$out/demo.log" || fail "demo did not start serving: $(cat "$out/demo.log")"

"$cli" ps > "$out/ps.txt"
grep -q "^ *$pid  vmstash_demo" "$out/ps.txt" || fail "ps does not list $pid: $(cat "$out/ps.txt")"
"$cli" ps --json | python3 -c "import json,sys; d=json.load(sys.stdin); assert any(p['pid']==$pid and p['reserved_bytes']>0 for p in d), d"

"$cli" show "$pid" > "$out/show.txt"
grep -q "^process $pid (vmstash_demo), vmstash .*, driver sim, 1 device" "$out/show.txt" || fail "hello: $(head -1 "$out/show.txt")"
grep -q "weights *backup *active" "$out/show.txt" || fail "show: $(cat "$out/show.txt")"
grep -q "kv_cache *discard *active" "$out/show.txt" || fail "show: $(cat "$out/show.txt")"
"$cli" show "$pid" --json | python3 -c "import json,sys; d=json.load(sys.stdin); assert 'tags' in d[0], d"

"$cli" pause "$pid" weights | grep -q "pause weights of process $pid: done" || fail "pause"
"$cli" pause "$pid" weights | grep -q "already paused" || fail "second pause is not a no-op"
"$cli" show "$pid" | grep -q "weights *backup *paused" || fail "state after pause: $("$cli" show "$pid")"
"$cli" pause "$pid" kv_cache --json | python3 -c "import json,sys; d=json.load(sys.stdin); assert d['changed'], d"
"$cli" resume "$pid" weights | grep -q "done" || fail "resume"
"$cli" resume "$pid" kv_cache | grep -q "done" || fail "resume kv_cache"

# A switch: one transaction pausing some tags and resuming others.
"$cli" pause "$pid" kv_cache > /dev/null
"$cli" switch "$pid" --pause weights --resume kv_cache | grep -q "pause weights; resume kv_cache).*: done" \
  || fail "switch"
"$cli" show "$pid" | grep -q "weights *backup *paused" || fail "state after switch: $("$cli" show "$pid")"
"$cli" show "$pid" | grep -q "kv_cache *discard *active" || fail "state after switch: $("$cli" show "$pid")"
"$cli" switch "$pid" --pause=kv_cache --resume=weights --json \
  | python3 -c "import json,sys; d=json.load(sys.stdin); assert d['changed'] and d['op']=='switch', d"
"$cli" switch "$pid" --pause kv_cache --resume weights | grep -q "nothing to do" || fail "a repeated switch is not a no-op"
if "$cli" switch "$pid" --pause weights --resume weights 2> "$out/err.txt"; then fail "a tag both paused and resumed"; fi
grep -q "both paused and resumed" "$out/err.txt" || fail "switch error: $(cat "$out/err.txt")"
set +e; "$cli" switch "$pid" > /dev/null 2>&1; rc=$?; set -e
[ "$rc" = 2 ] || fail "switch without tag lists: exit $rc, want 2 (usage)"
"$cli" resume "$pid" kv_cache | grep -q "done" || fail "resume kv_cache after the switches"
# Deadlines (Note [Client Deadlines]): none for transitions by default; --timeout names one.
"$cli" pause "$pid" kv_cache --timeout=0 | grep -q "done" || fail "pause with --timeout=0 (none)"
"$cli" resume "$pid" kv_cache --timeout=30 | grep -q "done" || fail "resume with --timeout=30"
"$cli" show "$pid" --timeout=2.5 | grep -q "kv_cache *discard *active" || fail "show with --timeout"
for bad in --timeout=-1 --timeout=soon; do
  set +e; "$cli" show "$pid" "$bad" > /dev/null 2>&1; rc=$?; set -e
  [ "$rc" = 2 ] || fail "show $bad: exit $rc, want 2 (usage)"
done

"$cli" snapshot "$pid" -o "$out/snap.json" | grep -q "written to" || fail "snapshot"
python3 -c "import json; d=json.load(open('$out/snap.json')); assert any(s['tag']=='weights' for x in d for s in x['segments']), d"

"$cli" pause "$pid" weights > /dev/null  # a paused tag shows up as segment_unmap entries
"$cli" snapshot "$pid" -o "$out/snap.pickle" --format=torch | grep -q "torch pickle" || fail "torch snapshot"
python3 - "$out/snap.pickle" <<'PY' || fail "torch pickle schema"
import pickle, sys
d = pickle.load(open(sys.argv[1], "rb"))
assert set(d) >= {"segments", "device_traces", "allocator_settings"}, d.keys()
segs = d["segments"]
assert segs and all(s["total_size"] == sum(b["size"] for b in s["blocks"]) for s in segs), segs
assert all(b["state"] in ("active_allocated", "inactive") for s in segs for b in s["blocks"])
assert any("kv_cache" in s["frames"][0]["name"] for s in segs)
assert any(e["action"] == "segment_unmap" and "weights" in e["user_metadata"] for e in d["device_traces"][0])
PY
"$cli" map "$pid" -o "$out/map.svg" | grep -q "written to" || fail "map svg"
"$cli" map "$pid" -o "$out/map.html" > /dev/null || fail "map html"
python3 - "$out/map.svg" "$out/map.html" <<'PY' || fail "map is not well-formed"
import sys, xml.etree.ElementTree as ET
svg = ET.parse(sys.argv[1]).getroot()
assert svg.tag.endswith("svg"), svg.tag
rects = [e for e in svg.iter() if e.tag.endswith("rect")]
assert any(e.get("stroke-dasharray") for e in rects), "the paused tag's blocks should be dashed"
assert "weights" in open(sys.argv[1]).read() and "kv_cache" in open(sys.argv[1]).read()
html = open(sys.argv[2]).read()
assert html.startswith("<!DOCTYPE html>") and "<svg" in html
PY
"$cli" resume "$pid" weights > /dev/null
"$cli" top --interval=0.1 --iterations=2 | grep -c "vmstash top" | grep -q 2 || fail "top"

# Clear errors, non-zero exits.
if "$cli" show 999999999 2> "$out/err.txt"; then fail "show of a missing process succeeded"; fi
grep -q "no process 999999999" "$out/err.txt" || fail "missing-process message: $(cat "$out/err.txt")"
if "$cli" pause "$pid" "bad tag" 2> "$out/err.txt"; then fail "pause of a bad tag name succeeded"; fi
grep -q "INVALID_ARGUMENT\|printable\|tag" "$out/err.txt" || fail "bad tag message: $(cat "$out/err.txt")"
if "$cli" pause "$pid" no_such_tag 2> "$out/err.txt"; then fail "pause of a tag never created succeeded"; fi
grep -q "'no_such_tag' does not exist" "$out/err.txt" || fail "unknown tag message: $(cat "$out/err.txt")"
if "$cli" frobnicate 2> /dev/null; then fail "unknown command accepted"; fi

# --version: the one version (base/version.h), the same the process's library reports.
version=$("$cli" --version) || fail "--version: exit $?"
[[ "$version" =~ ^vmstash\ [0-9]+\.[0-9]+\.[0-9]+[^\ ]*$ ]] || fail "--version printed: $version"
"$cli" show "$pid" | grep -q "^process $pid (vmstash_demo), ${version}, " \
  || fail "the CLI's version ($version) is not the library's: $("$cli" show "$pid" | head -1)"
# The console script (vmstash._cli, the wheel's `vmstash`) runs this binary: the same answer.
shim_version=$(VMSTASH_CLI="$cli" PYTHONPATH="$root/torch_plugin/python${PYTHONPATH:+:$PYTHONPATH}" \
  python3 -c 'import sys; from vmstash._cli import main; sys.exit(main())' --version) || fail "console script --version"
[ "$shim_version" = "$version" ] || fail "console script --version: '$shim_version', the CLI's: '$version'"
# --help and -h: the usage on stdout, exit 0; of one command after its name (doing nothing).
"$cli" --help > "$out/usage.txt" || fail "--help: exit $?"
for cmd in ps show pause resume switch snapshot map top; do
  grep -q "vmstash $cmd" "$out/usage.txt" || fail "--help does not list $cmd: $(cat "$out/usage.txt")"
  for flag in --help -h; do
    "$cli" "$cmd" "$flag" > "$out/help.txt" 2> "$out/help.err" || fail "$cmd $flag: exit $?"
    grep -q "^usage: vmstash $cmd" "$out/help.txt" || fail "$cmd $flag printed: $(cat "$out/help.txt")"
    grep -q "^  -h, --help" "$out/help.txt" || fail "$cmd $flag lists no options: $(cat "$out/help.txt")"
    [ ! -s "$out/help.err" ] || fail "$cmd $flag wrote to stderr: $(cat "$out/help.err")"
  done
done
"$cli" pause "$pid" weights --help | grep -q "^usage: vmstash pause PID TAG" || fail "pause PID TAG --help"
"$cli" show "$pid" | grep -q "weights *backup *active" || fail "pause ... --help paused: $("$cli" show "$pid")"
# Bad usage: exit 2, the reason and the command's usage on stderr, nothing done.
expect_usage_error() {  # REASON ARGS...
  local reason=$1 rc
  shift
  set +e; "$cli" "$@" > "$out/stdout.txt" 2> "$out/err.txt"; rc=$?; set -e
  [ "$rc" = 2 ] || fail "vmstash $*: exit $rc, want 2 (usage)"
  grep -qF -- "$reason" "$out/err.txt" || fail "vmstash $*: no '$reason' in: $(cat "$out/err.txt")"
  grep -q "^usage: vmstash" "$out/err.txt" || fail "vmstash $*: no usage on stderr: $(cat "$out/err.txt")"
  [ ! -s "$out/stdout.txt" ] || fail "vmstash $*: wrote to stdout: $(cat "$out/stdout.txt")"
}
expect_usage_error "no command given"
expect_usage_error "unknown command 'frobnicate'" frobnicate --help
expect_usage_error "unknown option --bogus" ps --bogus
expect_usage_error "unknown option --bogus" pause "$pid" --bogus
expect_usage_error "unknown option -x" show "$pid" -x
expect_usage_error "--device is not an option of show" show "$pid" --device=0
expect_usage_error "--json is not an option of top" top --json
expect_usage_error "PID is missing" show
expect_usage_error "TAG is missing" pause "$pid"
expect_usage_error "PID must be a process id" show self
expect_usage_error "unexpected argument 'extra'" show "$pid" extra
expect_usage_error "-o FILE is missing" snapshot "$pid"
expect_usage_error "-o needs a value" map "$pid" -o
expect_usage_error "the format is json or torch" snapshot "$pid" -o "$out/x" --format=xml
expect_usage_error "usage: vmstash switch" switch "$pid"
"$cli" show "$pid" | grep -q "weights *backup *active" || fail "a bad usage changed a tag: $("$cli" show "$pid")"

kill -TERM "$pid"
wait "$pid" || fail "demo exited non-zero: $(cat "$out/demo.log")"
grep -q "weights intact" "$out/demo.log" || fail "weights after remote pause/resume: $(cat "$out/demo.log")"
"$cli" ps | grep -q "no process" || fail "stale endpoint still listed: $("$cli" ps)"
[ -z "$(ls "$VMSTASH_RUNTIME_DIR")" ] || fail "stale socket not removed: $(ls "$VMSTASH_RUNTIME_DIR")"
echo "cli e2e: OK"
