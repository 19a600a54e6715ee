#!/usr/bin/env bash
# mongo-test-server.sh -- a throwaway MongoDB-wire server for the specs: FerretDB on its SQLite
# backend, built once from the Go module and cached outside the repo, bound to a free loopback port.
#   start DIR    builds (once) and starts it with its data in DIR; prints ONLY its URL on stdout
#   stop DIR     stops it and removes DIR
#   restart DIR  stops and starts it again on the same port, keeping the data (restart specs)
#   url DIR      prints the URL of the server running in DIR
#   build        only builds (or finds) the cached binary and prints its path
set -euo pipefail
# The specs' ASan run preloads libasan into their processes; the servers must not inherit it
# (postgres hangs under it).
unset LD_PRELOAD

FERRETDB_VERSION=${FERRETDB_VERSION:-v1.24.2}
CACHE_DIR=${XDG_CACHE_HOME:-$HOME/.cache}/relaybus
# The suffix names our patch of the source (see build()): a new patch gets a new suffix, so a
# binary cached before it is built again rather than reused.
BIN=$CACHE_DIR/ferretdb-$FERRETDB_VERSION-relaybus1
DB=relaybus_test

log() { echo "mongo-test-server: $*" >&2; }
die() { log "$*"; exit 1; }

# /usr/local/go first: a distribution's go on PATH may be older than FerretDB needs.
find_go() {
    [ -x /usr/local/go/bin/go ] && { echo /usr/local/go/bin/go; return; }
    if command -v go >/dev/null 2>&1; then command -v go; return; fi
    die "Go is needed to build FerretDB (not found in /usr/local/go or PATH)"
}

# `go install ...ferretdb@v1.24.2` alone yields a binary that panics at start: the release
# embeds build/version/version.txt, which only FerretDB's own build task generates. So the
# module is fetched the same way (go mod download), copied to a writable place, given that
# file, and built there with the module's own go.sum. The binary is renamed into place so
# concurrent callers never run half a file.
build() {
    [ -x "$BIN" ] && return 0
    mkdir -p "$CACHE_DIR"
    local go src work
    go=$(find_go)
    log "building FerretDB $FERRETDB_VERSION (once; cached in $CACHE_DIR)"
    src=$(cd "$CACHE_DIR" && "$go" mod download -json \
            "github.com/FerretDB/FerretDB@$FERRETDB_VERSION" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
    [ -n "$src" ] && [ -d "$src" ] || die "go mod download of FerretDB $FERRETDB_VERSION failed"
    work=$(mktemp -d "$CACHE_DIR/build.XXXXXX")
    cp -r "$src/." "$work/"
    chmod -R u+w "$work"
    echo "$FERRETDB_VERSION" >"$work/build/version/version.txt"
    # One patch, for speed only: FerretDB's SQLite backend finds a document by _id (find,
    # update and delete with a filter of just {_id: X}) with `WHERE _ferretdb_sjson->'$._id' = ?`
    # (metadata.IDColumn), while the unique index it makes for _id, like every index it makes,
    # is on `_ferretdb_sjson->"_id"`. SQLite uses an expression index only for the very same
    # expression, so every lookup by _id scanned the whole collection (EXPLAIN QUERY PLAN:
    # SCAN, not SEARCH ... USING INDEX ..__id_) and every claim and settle slowed as the
    # collection grew. Both expressions extract the same value; the patch gives IDColumn the
    # index's spelling, so the lookups become index searches (data files stay as they are).
    local meta="$work/internal/backends/sqlite/metadata/metadata.go"
    if grep -q "IDColumn = DefaultColumn + \"->'\$._id'\"" "$meta" 2>/dev/null; then
        sed -i "s|IDColumn = DefaultColumn + \"->'\$._id'\"|IDColumn = DefaultColumn + \`->\"_id\"\`|" "$meta"
        grep -q 'IDColumn = DefaultColumn + `->"_id"`' "$meta" || {
            rm -rf "$work"
            die "patching $meta failed"
        }
    else
        log "NOTE: $meta has no IDColumn line to patch: built as it is (lookups by _id may scan)"
    fi
    # -p 1: the machine is small and shared; the build is a one-off.
    if ! (cd "$work" && GOFLAGS=-buildvcs=false "$go" build -p 1 -o "$work/ferretdb.bin" \
            ./cmd/ferretdb) >&2; then
        rm -rf "$work"
        die "building FerretDB $FERRETDB_VERSION failed"
    fi
    mv -f "$work/ferretdb.bin" "$BIN"
    rm -rf "$work"
}

free_port() {
    python3 - <<'EOF' 2>/dev/null && return
import socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()
EOF
    # No python: pick a random high port that nothing listens on.
    local p
    for _ in $(seq 50); do
        p=$(( 20000 + RANDOM % 40000 ))
        (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || { echo "$p"; return; }
    done
    die "no free port found"
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

running() { [ -f "$1/ferretdb.pid" ] && kill -0 "$(cat "$1/ferretdb.pid")" 2>/dev/null; }

launch() {
    local dir=$1 port=$2
    # synchronous(normal): in WAL mode a commit no longer waits for fsync; a killed or
    # restarted server still loses nothing (only a power cut could), and the throwaway
    # server's writes are what every claim and settle waits for.
    # GOGC=400 (FERRETDB_GOGC overrides): FerretDB allocates heavily per command, and at Go's
    # default of 100 its collector made a drain cost ~4 ms of server CPU per delivery; at 400
    # it is ~2.8 ms and the server stays under 100 MB.
    GOGC=${FERRETDB_GOGC:-400} nohup "$BIN" --handler=sqlite --sqlite-url="file:$dir/?_pragma=synchronous(normal)" \
        --listen-addr="127.0.0.1:$port" --state-dir="$dir" \
        --debug-addr=127.0.0.1:0 --telemetry=disable --log-level=warn \
        >>"$dir/ferretdb.log" 2>&1 </dev/null &
    echo $! >"$dir/ferretdb.pid"
    echo "$port" >"$dir/ferretdb.port"
    local i
    for i in $(seq 150); do
        port_open "$port" && return 0
        kill -0 "$(cat "$dir/ferretdb.pid")" 2>/dev/null ||
            die "FerretDB exited at start: $(tail -n 3 "$dir/ferretdb.log" | tr '\n' ' ')"
        sleep 0.1
    done
    halt "$dir"
    die "FerretDB did not accept connections on 127.0.0.1:$port within 15 s"
}

# Stops the process, waiting for it to exit so the port and files are free again.
halt() {
    local dir=$1 pid i
    [ -f "$dir/ferretdb.pid" ] || return 0
    pid=$(cat "$dir/ferretdb.pid")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        for i in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$dir/ferretdb.pid"
}

url() { echo "mongodb://127.0.0.1:$(cat "$1/ferretdb.port")/$DB"; }

cmd_start() {
    local dir=$1
    build
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    running "$dir" && die "a server is already running in $dir"
    launch "$dir" "$(free_port)"
    url "$dir"
}

cmd_restart() {
    local dir
    dir=$(cd "$1" && pwd) || die "no such directory: $1"
    [ -f "$dir/ferretdb.port" ] || die "no server was started in $dir"
    build
    halt "$dir"
    # The old socket may linger for a moment after the process exits.
    local i
    for i in $(seq 50); do port_open "$(cat "$dir/ferretdb.port")" || break; sleep 0.1; done
    launch "$dir" "$(cat "$dir/ferretdb.port")"
    url "$dir"
}

cmd_stop() {
    local dir=$1
    [ -d "$dir" ] || return 0
    halt "$dir"
    rm -rf "$dir"
}

case "${1:-}" in
    start)   [ $# -eq 2 ] || die "usage: $0 start DIR"; cmd_start "$2" ;;
    stop)    [ $# -eq 2 ] || die "usage: $0 stop DIR"; cmd_stop "$2" ;;
    restart) [ $# -eq 2 ] || die "usage: $0 restart DIR"; cmd_restart "$2" ;;
    url)     [ $# -eq 2 ] || die "usage: $0 url DIR"; url "$(cd "$2" && pwd)" ;;
    build)   build; echo "$BIN" ;;
    *)       die "usage: $0 start|stop|restart|url DIR, or $0 build" ;;
esac
