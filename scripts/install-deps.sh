#!/usr/bin/env bash
# install-deps.sh -- installs the Debian packages relaybus needs to build and test, only those
# missing (checked with dpkg-query; `apt-get update` runs once, and only if something must be
# installed). Idempotent. Runs as root, or through sudo when not root.
set -euo pipefail

PACKAGES=(
  build-essential pkg-config
  lua5.4 liblua5.4-dev lua-cjson lua-busted
  libev-dev
  libsqlite3-dev sqlite3
  libpq-dev postgresql
  libmongoc-dev libbson-dev
  libcurl4-openssl-dev libssl-dev
)

# FerretDB (the throwaway MongoDB-compatible test server) is built with Go.
if [ ! -x /usr/local/go/bin/go ] && ! command -v go >/dev/null 2>&1; then
  PACKAGES+=(golang-go)
fi

installed() {
  [ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null)" = "installed" ]
}

missing=()
for p in "${PACKAGES[@]}"; do
  installed "$p" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  SUDO=()
elif command -v sudo >/dev/null 2>&1; then
  SUDO=(sudo)
else
  echo "install-deps: not root and no sudo; install these yourself: ${missing[*]}" >&2
  exit 1
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -q
"${SUDO[@]}" apt-get install -y -q "${missing[@]}"

still=()
for p in "${missing[@]}"; do
  installed "$p" || still+=("$p")
done
if [ ${#still[@]} -ne 0 ]; then
  echo "install-deps: still missing after install: ${still[*]}" >&2
  exit 1
fi
echo "install-deps: done"
