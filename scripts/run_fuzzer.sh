#!/usr/bin/env bash
# Builds the control-protocol fuzzer with clang (libFuzzer + ASAN + UBSAN) and runs it for
# a bounded time (default 60 s; FUZZ_SECONDS overrides) from the seed corpus in
# control/fuzz_corpus. Fails on any crash, leak, sanitizer report or timeout; the log shows
# a crashing input in Base64, and FUZZ_ARTIFACTS=DIR keeps it as a file there.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FUZZ_SECONDS:-60}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
clang++ -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -I. \
  control/protocol_fuzzer.cc control/protocol.cc base/json_reader.cc base/json_writer.cc -o "$out/protocol_fuzzer" \
  $(pkg-config --libs absl_status absl_statusor absl_strings absl_str_format)
mkdir -p "$out/corpus"
cp control/fuzz_corpus/* "$out/corpus/"
"$out/protocol_fuzzer" -max_total_time="$seconds" -max_len=4096 -timeout=5 -rss_limit_mb=2048 \
  -artifact_prefix="${FUZZ_ARTIFACTS:-$out}/" -print_final_stats=1 "$out/corpus" 2>&1 | tail -12
echo "fuzzer: ${seconds} s without a crash or leak"
