#!/usr/bin/env bash
# pg-test-server.sh -- a throwaway PostgreSQL cluster for the specs, made with the installed
# server's initdb and pg_ctl, listening on a free port on 127.0.0.1 (trust auth, fsync off).
#   start DIR    creates and starts it in DIR; prints ONLY its URL on stdout
#   stop DIR     stops it and removes DIR (and its data directory)
#   restart DIR  restarts it on the same port, keeping the data (server-restart specs)
#   url DIR      prints the URL of the cluster in DIR
set -euo pipefail
# The specs' ASan run preloads libasan into their processes; the servers must not inherit it
# (postgres hangs under it).
unset LD_PRELOAD

DB=relaybus_test

log() { echo "pg-test-server: $*" >&2; }
die() { log "$*"; exit 1; }

# The newest installed server's bin directory (Debian: /usr/lib/postgresql/VERSION/bin).
pg_bin() {
    if [ -n "${PG_BIN:-}" ]; then echo "$PG_BIN"; return; fi
    local d
    d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
    [ -n "$d" ] && [ -x "$d/initdb" ] && { echo "$d"; return; }
    command -v initdb >/dev/null 2>&1 && { dirname "$(command -v initdb)"; return; }
    die "no PostgreSQL server found (install the postgresql package)"
}

# initdb refuses to run as root: as root, everything runs as the postgres user.
as_pg() {
    if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

free_port() {
    python3 - <<'EOF' 2>/dev/null && return
import socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()
EOF
    local p
    for _ in $(seq 50); do
        p=$(( 20000 + RANDOM % 40000 ))
        port_open "$p" || { echo "$p"; return; }
    done
    die "no free port found"
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# The data directory: DIR/data when the server's user can reach DIR, else a private directory
# under /tmp whose path is kept in DIR/datadir (a caller's mktemp -d is mode 700, root-owned).
data_dir() { if [ -f "$1/datadir" ]; then cat "$1/datadir"; else echo "$1/data"; fi; }

make_data_dir() {
    local dir=$1
    if [ "$(id -u)" -ne 0 ]; then echo "$dir/data"; return; fi
    if runuser -u postgres -- test -w "$dir" 2>/dev/null || { chown postgres "$dir" 2>/dev/null &&
            runuser -u postgres -- test -w "$dir" 2>/dev/null; }; then
        echo "$dir/data"; return
    fi
    local d
    d=$(mktemp -d /tmp/relaybus-pg.XXXXXX)
    chown postgres "$d"
    echo "$d/data" >"$dir/datadir"
    echo "$d/data"
}

url() { echo "postgresql://postgres@127.0.0.1:$(cat "$1/port")/$DB"; }

# Tries ports until the server starts on one (another process may take a port between the
# check and the start).
launch_new() {
    local dir=$1 data=$2 bin=$3 port i
    for i in 1 2 3 4 5; do
        port=$(free_port)
        echo "port = $port" >"$data/port.conf"
        if as_pg "$bin/pg_ctl" -D "$data" -l "$data/server.log" -w -t 60 start >/dev/null 2>&1; then
            echo "$port" >"$dir/port"
            return 0
        fi
        log "start on port $port failed (try $i): $(tail -n 2 "$data/server.log" 2>/dev/null | tr '\n' ' ')"
    done
    die "the server did not start; see $data/server.log"
}

cmd_start() {
    local dir=$1 bin data
    bin=$(pg_bin)
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    [ -f "$dir/port" ] && die "a cluster already exists in $dir"
    data=$(make_data_dir "$dir")
    as_pg "$bin/initdb" -D "$data" -U postgres --auth=trust -E UTF8 --no-locale --no-sync \
        >"$dir/initdb.log" 2>&1 || die "initdb failed: $(tail -n 3 "$dir/initdb.log" | tr '\n' ' ')"
    # The socket lives in the data directory: /var/run/postgresql may not exist or be writable.
    as_pg tee -a "$data/postgresql.conf" >/dev/null <<EOF
listen_addresses = '127.0.0.1'
unix_socket_directories = '$data'
max_connections = 300
fsync = off
full_page_writes = off
include_if_exists = 'port.conf'
EOF
    launch_new "$dir" "$data" "$bin"
    local port
    port=$(cat "$dir/port")
    "$bin/psql" -X -q -h 127.0.0.1 -p "$port" -U postgres -d postgres \
        -c "CREATE DATABASE $DB" >/dev/null 2>"$dir/createdb.err" ||
        die "creating the database failed: $(tr '\n' ' ' <"$dir/createdb.err")"
    url "$dir"
}

cmd_restart() {
    local dir bin data
    dir=$(cd "$1" && pwd) || die "no such directory: $1"
    [ -f "$dir/port" ] || die "no cluster was started in $dir"
    bin=$(pg_bin)
    data=$(data_dir "$dir")
    as_pg "$bin/pg_ctl" -D "$data" -l "$data/server.log" -w -t 60 -m fast restart >/dev/null ||
        die "restart failed: $(tail -n 3 "$data/server.log" | tr '\n' ' ')"
    url "$dir"
}

cmd_stop() {
    local dir=$1 bin data
    [ -d "$dir" ] || return 0
    dir=$(cd "$dir" && pwd)
    data=$(data_dir "$dir")
    if [ -f "$data/postmaster.pid" ]; then
        bin=$(pg_bin)
        as_pg "$bin/pg_ctl" -D "$data" -w -t 30 -m immediate stop >/dev/null 2>&1 || true
    fi
    [ -f "$dir/datadir" ] && rm -rf "$(dirname "$data")"
    rm -rf "$dir"
}

case "${1:-}" in
    start)   [ $# -eq 2 ] || die "usage: $0 start DIR"; cmd_start "$2" ;;
    stop)    [ $# -eq 2 ] || die "usage: $0 stop DIR"; cmd_stop "$2" ;;
    restart) [ $# -eq 2 ] || die "usage: $0 restart DIR"; cmd_restart "$2" ;;
    url)     [ $# -eq 2 ] || die "usage: $0 url DIR"; url "$(cd "$2" && pwd)" ;;
    *)       die "usage: $0 start|stop|restart|url DIR" ;;
esac
