#!/usr/bin/env bash
# fuzz.sh -- builds the libFuzzer targets (make fuzz) and runs each for a bounded time from its
# seed corpus (fuzz/corpus/NAME/). Prints one TAP line per target and ends with
# `N passed, N failed`; a crash, a sanitizer report or a failed check fails that target and
# keeps the input that caused it in $RELAYBUS_FUZZ_ARTIFACTS (default build-fuzz/artifacts/).
#
#   scripts/fuzz.sh [NAME...]        default: every fuzz/*_fuzz.c
#   RELAYBUS_FUZZ_SECONDS            seconds per target (default 60)
set -uo pipefail
cd "$(dirname "$0")/.."
SECS=${RELAYBUS_FUZZ_SECONDS:-60}
ART=${RELAYBUS_FUZZ_ARTIFACTS:-build-fuzz/artifacts}
mkdir -p "$ART"

if ! make fuzz >build-fuzz.log 2>&1; then
  tail -n 20 build-fuzz.log
  echo "not ok 1 - fuzz: make fuzz failed"
  echo "0 passed, 1 failed"
  exit 1
fi
rm -f build-fuzz.log

if [ $# -gt 0 ]; then names=("$@"); else
  mapfile -t names < <(ls fuzz/*_fuzz.c | sed 's|fuzz/\(.*\)_fuzz.c|\1|')
fi

passed=0 failed=0 n=0
for name in "${names[@]}"; do
  n=$((n + 1))
  work=$(mktemp -d "${TMPDIR:-/tmp}/relaybus-fuzz.XXXXXX")
  mkdir -p "$work/corpus"
  seeds=fuzz/corpus/$name
  [ -d "$seeds" ] || seeds=
  log=$work/log
  # The first corpus directory receives new inputs; the committed seeds stay as they are.
  timeout -k 10 $((SECS + 120)) "build-fuzz/fuzz/$name" -max_total_time="$SECS" \
    -print_final_stats=1 -artifact_prefix="$ART/$name-" -timeout=10 -rss_limit_mb=2048 \
    "$work/corpus" ${seeds:+"$seeds"} >"$log" 2>&1 &
  wait $!
  rc=$?
  runs=$(awk '/stat::number_of_executed_units/ {print $2}' "$log")
  if [ "$rc" -eq 0 ]; then
    passed=$((passed + 1))
    echo "ok $n - fuzz $name: ${runs:-?} inputs in ${SECS}s, no crash"
  else
    failed=$((failed + 1))
    echo "not ok $n - fuzz $name (exit $rc)"
    grep -E 'ERROR|SUMMARY|runtime error|Test unit written' "$log" | head -n 10 | sed 's/^/# /'
  fi
  rm -rf "$work"
done
echo "1..$n"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
