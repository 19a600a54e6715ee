-- relaybus-scm-1.rockspec -- the Lua module `relaybus` (a C module, relaybus.so) for a Lua 5.4
-- tree. In a checkout: `luarocks --lua-version 5.4 make` (or `luarocks-5.4 make`; Debian's
-- luarocks defaults to Lua 5.1) builds it with the project's Makefile (`make lua-module`,
-- which needs the libraries scripts/install-deps.sh installs) and installs build/relaybus.so
-- as the module `relaybus`, with its optional parts beside it (relaybus_pg.so and the like:
-- docs/lua.md, "Optional parts"); `--tree DIR` installs into DIR instead.
rockspec_format = "3.0"
package = "relaybus"
version = "scm-1"
source = {
  url = "git+file://.",   -- built where it is: `luarocks make` in the checkout
}
description = {
  summary = "Durable delivery of work from a database (SQLite, PostgreSQL, MongoDB) to Lua handlers on a libev loop",
  detailed = [[
relaybus claims deliveries from a table of your own database under fenced, renewed leases
and runs them through Lua handlers in coroutines on a libev loop: retries with backoff,
burial, transactional handlers, named leases, HTTP and webhooks. The module is written in C
on libev, SQLite and Jansson; its optional parts, loaded on first use, on libpq (PostgreSQL),
libmongoc (MongoDB), libcurl and OpenSSL's libcrypto (HTTP) and libmicrohttpd (the dashboard).]],
  license = "unspecified",  -- the project has no license file yet
}
dependencies = {
  "lua >= 5.4, < 5.5",
}
external_dependencies = {
  EV = { header = "ev.h" },
  SQLITE3 = { header = "sqlite3.h" },
}
build = {
  type = "make",
  build_target = "lua-module",
  build_variables = { CC = "$(CC)", CFLAGS = "$(CFLAGS)" },
  install_pass = false,
  install = {
    -- the module and its optional parts (loaded on first use from beside it)
    lib = {
      relaybus = "build/relaybus.so",
      relaybus_pg = "build/relaybus_pg.so",
      relaybus_mongo = "build/relaybus_mongo.so",
      relaybus_http = "build/relaybus_http.so",
      relaybus_serve = "build/relaybus_serve.so",
    },
  },
}
