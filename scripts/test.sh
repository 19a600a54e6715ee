#!/usr/bin/env bash
# test.sh -- the test command: builds, starts throwaway PostgreSQL and MongoDB-wire servers
# (unless RELAYBUS_TEST_PG / RELAYBUS_TEST_MONGO name them), runs the busted specs in spec/
# with TAP output, then the C tests (spec/c, cmocka, built by `make ctest`), and ends with the
# line `N passed, N failed` (non-zero exit on any failure).
#
#   scripts/test.sh [BUSTED ARGS...]   with args: one busted run with them (e.g. a spec file)
#   scripts/test.sh --ctest [NAME...]  only the C tests (all, or $RELAYBUS_BUILD/ctest/NAME_test)
#   scripts/test.sh --tsan   only the ThreadSanitizer runs of threads_host (make tsan)
#   CI=true             a server that cannot start is a failure, never a skip
#   RELAYBUS_BUILD      build directory the specs load and spawn from (default build;
#                       build-asan is built with `make asan`)
#   RELAYBUS_PRELOAD    LD_PRELOAD for the spec processes only (the ASan runtime)
#   RELAYBUS_SPEC_TIMEOUT  seconds one spec file may run (default 1500)
#   RELAYBUS_TEST_BUDGET   seconds all spec runs may take together (default: no limit)
#   RELAYBUS_FUZZ_SECONDS  seconds per fuzz target (default 60; 0 leaves fuzzing out). The
#                       fuzz targets run only in the plain build's run: they carry ASan/UBSan
#                       themselves.
#   RELAYBUS_CTEST_TIMEOUT seconds one C test program may run (default 300)
#   RELAYBUS_TSAN       0 leaves out the ThreadSanitizer runs (make tsan, build-tsan/threads_host:
#                       four runtimes on four threads, own SQLite files, then one shared
#                       PostgreSQL table); they run only in the plain build's full run
#   RELAYBUS_LSAN       1 (the default on build-asan): LeakSanitizer checks the C tests and
#                       every child `relaybus` the specs start, with spec/lsan.supp; busted's
#                       own interpreter stays unchecked. 0 turns it off.
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
export RELAYBUS_BUILD=${RELAYBUS_BUILD:-build}
# libmongoc keeps counters in /dev/shm/mongoc-PID unless told not to; killed children would
# leave those files behind (the command turns them off itself; busted and the servers too).
export MONGOC_DISABLE_SHM=1
CI=${CI:-false}
[ "$CI" = "1" ] && CI=true
SPEC_TIMEOUT=${RELAYBUS_SPEC_TIMEOUT:-1500}
BUDGET=${RELAYBUS_TEST_BUDGET:-0}
START=$(date +%s)

passed=0
failed=0
pending=0
runs=0
problems=()

say() { echo "test.sh: $*" >&2; }
problem() { problems+=("$*"); failed=$((failed + 1)); say "FAILED: $*"; }

finish() {
  cleanup
  if [ ${#problems[@]} -ne 0 ]; then
    echo "---- failures outside the specs:"
    printf '  %s\n' "${problems[@]}"
  fi
  [ "$pending" -gt 0 ] && echo "($pending pending)"
  echo "$passed passed, $failed failed"
  [ "$failed" -eq 0 ]
  exit $?
}

# ---- build -----------------------------------------------------------------------------
if [ "$(basename "$RELAYBUS_BUILD")" = "build-asan" ]; then
  make_cmd=(make asan)
else
  make_cmd=(make BUILD="$RELAYBUS_BUILD" all examples ctest)
fi
say "${make_cmd[*]}"
if ! "${make_cmd[@]}" >&2; then
  problem "build: '${make_cmd[*]}' failed"
  cleanup() { :; }
  finish
fi

# ---- throwaway servers -----------------------------------------------------------------
TMP=$(mktemp -d "${TMPDIR:-/tmp}/relaybus-test.XXXXXX")
chmod 755 "$TMP"   # the PostgreSQL cluster runs as the postgres user, below this directory
started=()         # "script dir" pairs to stop
cleaned=false
cleanup() {
  $cleaned && return 0
  cleaned=true
  local s
  for s in "${started[@]}"; do
    # shellcheck disable=SC2086
    scripts/$s >/dev/null 2>&1 || true
  done
  rm -rf "$TMP"
}
trap 'cleanup' EXIT
BPID=""            # the running busted (its timeout process), stopped on interrupt
CPIDS=()           # the running C test programs (their subshells), stopped on interrupt
trap 'say "interrupted"; [ -n "$BPID" ] && kill -TERM "$BPID" 2>/dev/null
      [ ${#CPIDS[@]} -gt 0 ] && kill -TERM "${CPIDS[@]}" 2>/dev/null; cleanup; exit 130' INT TERM

# start_server NAME SCRIPT ENVVAR TIMEOUT
start_server() {
  local name=$1 script=$2 var=$3 limit=$4 dir url
  if [ -n "${!var:-}" ]; then
    say "$name: using $var=${!var}"
    return 0
  fi
  dir=$TMP/$name
  local why=""
  if [ ! -x "scripts/$script" ]; then
    why="scripts/$script is missing"
  else
    say "$name: starting a throwaway server (scripts/$script start $dir)"
    started+=("$script stop $dir")
    if url=$(timeout -k 10 "$limit" "scripts/$script" start "$dir" 2>"$TMP/$name.err"); then
      url=$(printf '%s\n' "$url" | awk 'NF { last = $0 } END { print last }')
      [ -n "$url" ] || why="scripts/$script start printed no URL"
    else
      why="scripts/$script start failed: $(tail -n 3 "$TMP/$name.err" | tr '\n' ' ')"
    fi
  fi
  if [ -n "$why" ]; then
    if [ "$CI" = true ]; then
      problem "$name server cannot start: $why"
    else
      say "WARNING: $name server cannot start, its specs are left out: $why"
    fi
    return 0
  fi
  export "$var=$url"
  say "$name: $var=$url"
}

start_server pg pg-test-server.sh RELAYBUS_TEST_PG 300
start_server mongo mongo-test-server.sh RELAYBUS_TEST_MONGO 1800

# ---- specs -----------------------------------------------------------------------------
case "$RELAYBUS_BUILD" in
  /*) build_abs=$RELAYBUS_BUILD ;;
  *) build_abs=$ROOT/$RELAYBUS_BUILD ;;
esac
export LUA_CPATH="$build_abs/?.so;;"
BUSTED=(lua5.4 /usr/bin/busted -o TAP)

# ---- LeakSanitizer for our own processes ------------------------------------------------
# On the ASan build the specs' busted runs with leak detection off (the interpreter is not
# ours), so the command the specs start is reached through a wrapper that turns it on for that
# child alone. Reports go to files in $LSAN_DIR (the specs read the children's stderr), and
# each report found after a spec file is a failure of that file.
LSAN=${RELAYBUS_LSAN:-}
if [ -z "$LSAN" ]; then
  if [ "$(basename "$RELAYBUS_BUILD")" = "build-asan" ]; then LSAN=1; else LSAN=0; fi
fi
LSAN_DIR=$TMP/lsan
LSAN_ENV=()
if [ "$LSAN" = 1 ]; then
  mkdir -p "$LSAN_DIR" "$TMP/bin"
  chmod 1777 "$LSAN_DIR"     # children that a spec runs as another user write here too
  cp spec/lsan.supp "$TMP/lsan.supp" && chmod 644 "$TMP/lsan.supp"
  # later flags win: ours come after whatever ASAN_OPTIONS the caller gave
  LSAN_ENV=("ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=1"
            "LSAN_OPTIONS=suppressions=$TMP/lsan.supp:print_suppressions=0")
  {
    echo '#!/bin/sh'
    echo "# relaybus with LeakSanitizer on (scripts/test.sh)"
    printf 'export %q %q\n' "${LSAN_ENV[0]}" "${LSAN_ENV[1]}:log_path=$LSAN_DIR/relaybus"
    # A preload meant for the child (the timing spec's libfaketime) is set here, past the
    # shell: sh itself under libasan and libfaketime hangs at start.
    echo '[ -n "${RELAYBUS_CHILD_PRELOAD:-}" ] && export LD_PRELOAD="$RELAYBUS_CHILD_PRELOAD"'
    printf 'exec %q "$@"\n' "$build_abs/relaybus"
  } >"$TMP/bin/relaybus"
  chmod 755 "$TMP/bin/relaybus"
  export RELAYBUS_BIN=$TMP/bin/relaybus
  say "LeakSanitizer on for the C tests and for every relaybus the specs start ($RELAYBUS_BIN)"
fi

# lsan_reports LABEL: each sanitizer report a child left since the last call is a failure.
lsan_reports() {
  [ "$LSAN" = 1 ] || return 0
  local f
  for f in "$LSAN_DIR"/*; do
    [ -e "$f" ] || continue
    if [ ! -s "$f" ]; then
      # Opened and never written: the child was killed (the specs SIGKILL children on
      # purpose) as its exit check began. An empty file holds no finding to report.
      echo "---- $1: an empty sanitizer log of a relaybus child killed at its exit ($(basename "$f")), not a finding"
      rm -f "$f"
      continue
    fi
    echo "---- $1: sanitizer report of a relaybus child ($(basename "$f")):"
    head -n 60 "$f"
    problem "$1: a relaybus child reported $(grep -m1 -o 'ERROR: [A-Za-z]*Sanitizer: [a-z -]*[a-z]' "$f" || echo 'a sanitizer error') ($(basename "$f"))"
    rm -f "$f"
  done
}

# run_busted LABEL ARGS... : one busted process; adds its TAP results to the totals.
run_busted() {
  local label=$1
  shift
  local limit=$SPEC_TIMEOUT
  if [ "$BUDGET" -gt 0 ]; then
    local left=$((BUDGET - ($(date +%s) - START)))
    if [ "$left" -le 0 ]; then
      problem "$label: not run, the time budget of ${BUDGET}s is spent"
      return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  runs=$((runs + 1))
  local out=$TMP/tap.$runs.out   # a new file each run: tail shows nothing stale
  : >"$out"                      # and it exists before tail opens it
  say "busted $label"
  local t0=$SECONDS
  # Output goes to a file, shown live by tail: a stray child that keeps the spec's stdout
  # open cannot hang the run.
  local pre=()
  [ -n "${RELAYBUS_PRELOAD:-}" ] && pre=(env "LD_PRELOAD=$RELAYBUS_PRELOAD")
  timeout -k 10 "$limit" "${pre[@]}" "${BUSTED[@]}" "$@" </dev/null >"$out" 2>&1 &
  BPID=$!
  tail -n +1 -f --pid="$BPID" "$out" &
  local tpid=$!
  wait "$BPID"
  local rc=$?
  BPID=""
  wait "$tpid" 2>/dev/null
  # TAP lines count only in busted's own sequence (1, 2, 3...), so a spec that prints
  # something like "ok 7 - ..." cannot skew the totals.
  local p f s plan
  read -r p s f plan < <(awk '
    /^ok [0-9]+ - / || /^not ok [0-9]+ / {
      k = ($1 == "not") ? $3 : $2
      if (k + 0 != n + 1) next
      n = k + 0
      if ($1 == "not") f++; else if ($0 ~ /^ok [0-9]+ - # SKIP/) s++; else p++
    }
    /^1\.\.[0-9]+$/ { plan = 1 }
    END { print p + 0, s + 0, f + 0, plan + 0 }' "$out")
  say "$label: $p passed, $f failed, $s pending ($((SECONDS - t0))s)"
  passed=$((passed + p))
  failed=$((failed + f))
  pending=$((pending + s))
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    problem "$label: timed out after ${limit}s"
  elif [ "$plan" -eq 0 ]; then
    problem "$label: busted ended without its summary (exit $rc; a crash?)"
  elif [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    problem "$label: busted exited $rc with no failed test"
  fi
  lsan_reports "$label"
}

# run_ctests [NAME...]: the C test programs (cmocka, TAP output); each test counts like a
# busted one. A program that crashes or ends without cmocka's group summary is a failure, and
# so is one that exits non-zero with no failed test (LeakSanitizer's report at exit). The
# programs mostly wait on timers (timeouts, leases), so RELAYBUS_CTEST_JOBS of them (default
# 4) run at once; their outputs are shown one program after another.
run_ctests() {
  local dir=$RELAYBUS_BUILD/ctest bins=() name
  if [ $# -gt 0 ]; then
    for name in "$@"; do bins+=("$dir/${name%_test}_test"); done
  else
    for name in "$dir"/*_test; do [ -x "$name" ] && bins+=("$name"); done
  fi
  if [ ${#bins[@]} -eq 0 ]; then
    problem "no C tests in $dir ('make BUILD=$RELAYBUS_BUILD ctest' builds them)"
    return
  fi
  local env=(CMOCKA_MESSAGE_OUTPUT=TAP)
  [ "$LSAN" = 1 ] && env+=("${LSAN_ENV[@]}")
  local jobs=${RELAYBUS_CTEST_JOBS:-4} bin outs=() limits=() t0=$SECONDS
  say "C tests: ${#bins[@]} programs, $jobs at a time"
  for bin in "${bins[@]}"; do
    local label="ctest $(basename "$bin")" out=""
    local limit=${RELAYBUS_CTEST_TIMEOUT:-300}
    if [ ! -x "$bin" ]; then
      problem "$label: $bin is missing"
    elif [ "$BUDGET" -gt 0 ] && [ $((BUDGET - ($(date +%s) - START))) -le 0 ]; then
      problem "$label: not run, the time budget of ${BUDGET}s is spent"
    else
      if [ "$BUDGET" -gt 0 ]; then
        local left=$((BUDGET - ($(date +%s) - START)))
        [ "$left" -lt "$limit" ] && limit=$left
      fi
      runs=$((runs + 1))
      out=$TMP/tap.$runs.out
      while [ ${#CPIDS[@]} -ge "$jobs" ]; do
        wait -n 2>/dev/null
        ctest_reap
      done
      (
        s0=$SECONDS
        timeout -k 10 "$limit" env "${env[@]}" "$bin" </dev/null >"$out" 2>&1 &
        tp=$!
        trap 'kill -TERM "$tp" 2>/dev/null' TERM
        wait "$tp"
        echo "$? $((SECONDS - s0))" >"$out.rc"
      ) &
      CPIDS+=($!)
    fi
    outs+=("$out")
    limits+=("$limit")
  done
  while [ ${#CPIDS[@]} -gt 0 ]; do
    wait -n 2>/dev/null
    ctest_reap
  done
  local i
  for i in "${!bins[@]}"; do
    local out=${outs[$i]} label="ctest $(basename "${bins[$i]}")" rc secs
    [ -n "$out" ] || continue
    cat "$out"
    read -r rc secs <"$out.rc" || { rc=1; secs=0; }
    # cmocka's TAP: "1..N", "ok K - name", "not ok K - name", "not ok K # SKIP name", then
    # "# ok - GROUP" or "# not ok - GROUP" once the group has run to its end.
    local p f s plan summary
    read -r p s f plan summary < <(awk '
      /^ok [0-9]+ - / || /^not ok [0-9]+[ #]/ {
        k = ($1 == "not") ? $3 : $2
        if (k + 0 != n + 1) next
        n = k + 0
        if ($1 == "ok") p++; else if ($0 ~ /^not ok [0-9]+ # SKIP/) s++; else f++
      }
      /^1\.\.[0-9]+$/ { plan = substr($0, 4) + 0 }
      /^# (not )?ok - / { summary = 1 }
      END { print p + 0, s + 0, f + 0, plan + 0, summary + 0 }' "$out")
    say "$label: $p passed, $f failed, $s pending (${secs}s)"
    passed=$((passed + p))
    failed=$((failed + f))
    pending=$((pending + s))
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      problem "$label: timed out after ${limits[$i]}s"
    elif [ "$summary" -eq 0 ] || [ $((p + f + s)) -ne "$plan" ]; then
      problem "$label: ended after $((p + f + s)) of $plan tests without its summary (exit $rc; a crash?)"
    elif [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
      problem "$label: exited $rc with no failed test (a leak reported at exit?)"
    fi
  done
  say "C tests: $((SECONDS - t0))s"
}

# ctest_reap: forgets the C test programs that have ended.
ctest_reap() {
  local keep=() pid
  for pid in "${CPIDS[@]}"; do kill -0 "$pid" 2>/dev/null && keep+=("$pid"); done
  CPIDS=("${keep[@]}")
}

# run_fuzz: the libFuzzer targets for a bounded time each (scripts/fuzz.sh); each target is
# one test.
run_fuzz() {
  local secs=${RELAYBUS_FUZZ_SECONDS:-60}
  [ "$secs" = 0 ] && return
  [ "$(basename "$RELAYBUS_BUILD")" = "build-asan" ] && return
  local out=$TMP/fuzz.out line
  say "scripts/fuzz.sh (${secs}s per target)"
  RELAYBUS_FUZZ_SECONDS=$secs scripts/fuzz.sh 2>&1 | tee "$out"
  line=$(tail -n 1 "$out")
  if [[ $line =~ ^([0-9]+)\ passed,\ ([0-9]+)\ failed$ ]]; then
    passed=$((passed + BASH_REMATCH[1]))
    failed=$((failed + BASH_REMATCH[2]))
  else
    problem "scripts/fuzz.sh ended without its summary line"
  fi
}

# run_tsan: threads_host built with ThreadSanitizer, on SQLite files and on the shared
# PostgreSQL table; each run is one test, failed by any report (halt_on_error) or a bad result.
run_tsan() {
  [ "${RELAYBUS_TSAN:-1}" = 0 ] && return
  [ "$(basename "$RELAYBUS_BUILD")" = "build-asan" ] && return
  say "make tsan"
  if ! make tsan >"$TMP/tsan-build.out" 2>&1; then
    tail -n 30 "$TMP/tsan-build.out"
    problem "make tsan failed"
    return
  fi
  local env=(TSAN_OPTIONS="halt_on_error=1:exitcode=66:second_deadlock_stack=1")
  local label dir out rc
  for mode in sqlite pg; do
    label="tsan threads_host $mode"
    out=$TMP/tsan.$mode.out
    if [ "$mode" = sqlite ]; then
      dir=$TMP/tsan-sqlite && mkdir -p "$dir"
      # ThreadSanitizer slows everything several times: a 1 s lease with 200 runs claimed at
      # once cannot start them all in time, and deliveries end buried after 25 claims
      timeout -k 10 600 env "${env[@]}" build-tsan/threads_host --sqlite "$dir" n=300 lease=3 \
        concurrency=32 >"$out" 2>&1
    elif [ -n "${RELAYBUS_TEST_PG:-}" ]; then
      timeout -k 10 600 env "${env[@]}" build-tsan/threads_host --pg "$RELAYBUS_TEST_PG" \
        --table "tsan_$$_$RANDOM" n=2000 lease=3 concurrency=32 >"$out" 2>&1
    else
      say "$label: left out (no PostgreSQL server)"
      continue
    fi
    rc=$?
    if [ "$rc" -eq 0 ] && grep -q '^check ok=1' "$out"; then
      echo "ok - $label: $(grep '^check ' "$out")"
      passed=$((passed + 1))
    else
      head -n 80 "$out"
      problem "$label: exit $rc (a ThreadSanitizer report, or a result not ok)"
    fi
  done
}

if [ "${1:-}" = "--ctest" ]; then
  shift
  run_ctests "$@"
elif [ "${1:-}" = "--tsan" ]; then
  run_tsan
elif [ $# -gt 0 ]; then
  run_busted "$*" "$@"
else
  mapfile -t files < <(find spec -name '*_spec.lua' -type f | sort)
  if [ ${#files[@]} -eq 0 ]; then
    problem "no spec files found in spec/"
  fi
  for f in "${files[@]}"; do
    # These build, install and read the project (make install, luarocks, the docs) with the
    # plain toolchain and run no C of ours that the other specs do not: they run in the plain
    # build's run only, where they are counted; under ASan they would only add half an hour.
    # The process fault loops (kill -9, SIGSTOP past the lease, stepped and skewed clocks) run
    # in the plain build's run too: under ASan the C they reach is the claim, renewal,
    # takeover and settle paths that conformance_spec, faults_spec, faults_random_spec,
    # effectively_once_spec and the C tests take there, and they would add 4 minutes of waits.
    # browser_spec drives the dashboard's page, whose C is the API that dashboard_spec calls
    # under ASan too; pg_claim_slots_spec measures the claim function's slots inside the
    # server (the store's C is conformance_spec's).
    if [ "$(basename "$RELAYBUS_BUILD")" = "build-asan" ]; then
      case $f in spec/docs_spec.lua|spec/install_spec.lua|spec/newcomer_spec.lua|spec/rockspec_spec.lua|\
                 spec/timing_spec.lua|spec/process_spec.lua|spec/browser_spec.lua|\
                 spec/pg_claim_slots_spec.lua)
        say "$f: runs in the plain build's run only"; continue ;;
      esac
    fi
    run_busted "$f" "$f"
  done
  run_ctests
  run_tsan
  if [ "$passed" -eq 0 ] && [ "$failed" -eq 0 ]; then
    problem "no test ran"
  fi
  run_fuzz
fi

finish
