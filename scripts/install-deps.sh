#!/usr/bin/env bash
# install-deps.sh -- installs the Debian packages relaybus needs to build and test, only those
# missing (checked with dpkg-query; `apt-get update` runs once, and only if something must be
# installed). Idempotent. Runs as root, or through sudo when not root.
set -euo pipefail

PACKAGES=(
  build-essential pkg-config
  lua5.4 liblua5.4-dev lua-busted
  luarocks                          # relaybus-scm-1.rockspec (spec/rockspec_spec.lua)
  libjansson-dev                    # relaybus.json parses with Jansson
  lua-cjson                         # only bench/json.lua, which compares against it
  libcmocka-dev                     # the C tests (spec/c, make ctest)
  libev-dev
  libsqlite3-dev sqlite3
  libpq-dev postgresql
  libmongoc-dev libbson-dev
  libcurl4-openssl-dev libssl-dev
  clang libclang-rt-14-dev          # the libFuzzer targets (make fuzz)
  faketime                          # the timing spec steps and skews wall clocks
  libuv1-dev                        # examples/uv_host.c (make examples)
  lua-luv lua-cqueues               # examples/luv_host.lua, examples/cqueues_host.lua
  libmicrohttpd-dev                 # the dashboard's HTTP server (runtime/serve/dashboard.c)
  lua-socket                        # spec/dashboard_spec.lua: raw and slow HTTP clients
  prometheus                        # promtool checks the /metrics text (spec/dashboard_spec.lua)
  chromium                          # the browser spec (spec/browser_spec.lua, playwright-core)
  gnuplot-nox                       # make bench: bench/sustained.lua's chart
)

# Node and npm run playwright-core; a node of another origin (which ships its own npm and
# conflicts with Debian's) is kept.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  PACKAGES+=(nodejs npm)
fi

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

# playwright-core (npm) drives Debian's chromium in the browser spec. It lives in a cache
# outside the work tree (RELAYBUS_NODE_CACHE, default ~/.cache/relaybus-node); it downloads no
# browser of its own.
NODE_CACHE=${RELAYBUS_NODE_CACHE:-$HOME/.cache/relaybus-node}
install_playwright() {
  if [ -d "$NODE_CACHE/node_modules/playwright-core" ]; then
    return 0
  fi
  echo "install-deps: npm install playwright-core into $NODE_CACHE"
  mkdir -p "$NODE_CACHE"
  PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm install --prefix "$NODE_CACHE" --no-audit --no-fund \
    --silent playwright-core@1
}

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  install_playwright
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
install_playwright
echo "install-deps: done"
