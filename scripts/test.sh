#!/usr/bin/env bash
# test.sh -- the test command: builds, starts throwaway PostgreSQL and MongoDB-wire servers
# (unless RELAYBUS_TEST_PG / RELAYBUS_TEST_MONGO name them), runs the busted specs in spec/
# with TAP output, and ends with the line `N passed, N failed` (non-zero exit on any failure).
#
#   scripts/test.sh [BUSTED ARGS...]   with args: one busted run with them (e.g. a spec file)
#   CI=true             a server that cannot start is a failure, never a skip
#   RELAYBUS_BUILD      build directory the specs load and spawn from (default build;
#                       build-asan is built with `make asan`)
#   RELAYBUS_PRELOAD    LD_PRELOAD for the spec processes only (the ASan runtime)
#   RELAYBUS_SPEC_TIMEOUT  seconds one spec file may run (default 1500)
#   RELAYBUS_TEST_BUDGET   seconds all spec runs may take together (default: no limit)
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
  make_cmd=(make BUILD="$RELAYBUS_BUILD" all examples)
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
trap 'say "interrupted"; [ -n "$BPID" ] && kill -TERM "$BPID" 2>/dev/null; cleanup; exit 130' INT TERM

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
}

if [ $# -gt 0 ]; then
  run_busted "$*" "$@"
else
  mapfile -t files < <(find spec -name '*_spec.lua' -type f | sort)
  if [ ${#files[@]} -eq 0 ]; then
    problem "no spec files found in spec/"
  fi
  for f in "${files[@]}"; do
    run_busted "$f" "$f"
  done
  if [ "$passed" -eq 0 ] && [ "$failed" -eq 0 ]; then
    problem "no test ran"
  fi
fi

finish
