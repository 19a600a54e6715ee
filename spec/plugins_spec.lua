-- plugins_spec.lua -- the optional parts (runtime/plugin/plugin.h): the command and the Lua module load
-- the PostgreSQL and MongoDB stores, the HTTP client and the dashboard's server from
-- relaybus_NAME.so on first use. A worker on SQLite maps none of their libraries; a part that
-- is missing or broken is a one-line error of the call that needed it, and the rest runs; the
-- Lua module under a stock lua5.4 finds the parts beside it.
local S = require "spec.support.stores"

local q = S.quote
-- the command itself (S.bin may be a wrapper that runs it: scripts/test.sh on build-asan)
local COMMAND = S.build .. "/relaybus"
local PARTS = { "relaybus_pg.so", "relaybus_mongo.so", "relaybus_http.so", "relaybus_serve.so" }
-- libraries only the optional parts link
local OPTIONAL_LIBS = { "libpq", "libmongoc", "libbson", "libcurl", "libmicrohttpd", "libcrypto",
                        "libssl", "libgnutls" }

-- Runs a Lua script with `bin` (default the command under test); returns ok, stdout, stderr.
local function run_script(source, bin, argv)
  local script = S.tmpfile("plug") .. ".lua"
  S.write(script, source)
  local out, err = S.tmpfile("plug_out"), S.tmpfile("plug_err")
  local line = table.concat(argv or { q(bin or S.bin), "run" }, " ") .. " " .. q(script)
    .. " >" .. q(out) .. " 2>" .. q(err) .. " </dev/null"
  local ok = os.execute(line)
  return ok, S.read(out) or "", S.read(err) or ""
end

-- What a script prints of the libraries it has mapped, one per line.
local MAPPED = [[
local function mapped()
  local seen, list = {}, {}
  for line in io.lines("/proc/self/maps") do
    local path = line:match("(/%S+)$")
    local name = path and path:match("([^/]+)$")
    if name and not seen[name] then seen[name] = true; list[#list + 1] = name end
  end
  return table.concat(list, " ")
end
]]

-- Script text: runs the one delivery of topic "t" in `store` on a dispatcher and counts it
-- in `done` (the SQLite path every script takes, which must need no optional part).
local RUN_ONE = [[
local d = relaybus.dispatcher(store)
local done = 0
d:handle("t", function() done = done + 1; relaybus.spawn(function() d:stop() end) end)
d:start()
relaybus.run()
]]

local function maps_any(mapped, libs)
  for _, lib in ipairs(libs) do
    if mapped:find(lib, 1, true) then return lib end
  end
  return nil
end

describe("optional parts", function()
  teardown(S.cleanup)

  it("a dispatcher on SQLite maps none of the optional parts' libraries; a PostgreSQL open loads relaybus_pg.so and libpq", function()
    local db = S.tmpfile("plug") .. ".db"
    local ok, out, err = run_script(MAPPED .. [[
local relaybus = require "relaybus"
local store = assert(relaybus.open("sqlite:]] .. db .. [["))
assert(store:enqueue("t", { n = 1 }))
]] .. RUN_ONE .. [[
print("done " .. done)
print("before " .. mapped())
local pg, perr = relaybus.open("postgresql://127.0.0.1:1/none?connect_timeout=2")
print("pg " .. tostring(pg) .. " " .. tostring(perr))
print("after " .. mapped())
]])
    assert.is_true(ok, err)
    assert.truthy(out:find("done 1\n", 1, true), out)
    local before = out:match("before ([^\n]*)")
    local after = out:match("after ([^\n]*)")
    assert.truthy(before and after, out)
    assert.is_nil(maps_any(before, OPTIONAL_LIBS), "an SQLite worker mapped " ..
      tostring(maps_any(before, OPTIONAL_LIBS)) .. ": " .. before)
    for _, part in ipairs(PARTS) do assert.is_nil(before:find(part, 1, true), before) end
    -- the store's own error comes from libpq: the part was loaded and used
    assert.truthy(out:find("pg nil postgresql: connection to server", 1, true), out)
    assert.truthy(after:find("relaybus_pg.so", 1, true), after)
    assert.truthy(after:find("libpq", 1, true), after)
    assert.is_nil(after:find("relaybus_mongo.so", 1, true), after)
  end)

  -- A script that needs every part, printing each answer on one line.
  local NEEDS_ALL = [[
local relaybus = require "relaybus"
local function say(what, a, b) print(what .. " " .. tostring(a) .. " " .. tostring(b)) end
say("pg", relaybus.open("postgresql://127.0.0.1:1/none?connect_timeout=2"))
say("mongo", relaybus.open("mongodb://127.0.0.1:1/none?serverSelectionTimeoutMS=200"))
say("request", relaybus.http.request { url = "http://127.0.0.1:1/" })
say("hmac", pcall(relaybus.http.hmac_sha256, "key", "data"))
say("equal", pcall(relaybus.http.equal, "a", "a"))
local store = assert(relaybus.open("sqlite::memory:"))
local sv, serr = relaybus.serve { store = store, listen = "127.0.0.1:0" }
say("serve", sv and "server", serr)
if sv then sv:stop() end
assert(store:enqueue("t", {}))
]] .. RUN_ONE .. [[
print("sqlite done " .. done)
]]

  -- The line of `out` that starts with `what`.
  local function answer(out, what)
    return out:match("\n" .. what .. " ([^\n]*)") or out:match("^" .. what .. " ([^\n]*)")
  end

  it("without the parts beside the command, each call that needs one fails with one line naming the file, and SQLite runs", function()
    local dir = S.tmpdir() .. "/bare"
    assert(os.execute("mkdir -p " .. q(dir) .. " && cp " .. q(COMMAND) .. " " .. q(dir .. "/relaybus")))
    local ok, out, err = run_script(NEEDS_ALL, dir .. "/relaybus")
    assert.is_true(ok, err)
    local function missing(what, file, thing)
      local a = answer(out, what)
      assert.truthy(a, "no answer for " .. what .. ": " .. out)
      assert.truthy(a:find(thing .. " is not installed: " .. file .. " is not beside relaybus", 1, true), what .. ": " .. a)
      assert.truthy(a:find(dir, 1, true), what .. ": " .. a)
    end
    missing("pg", "relaybus_pg.so", "the PostgreSQL store")
    missing("mongo", "relaybus_mongo.so", "the MongoDB store")
    missing("request", "relaybus_http.so", "the HTTP client")
    missing("hmac", "relaybus_http.so", "the HTTP client")
    missing("equal", "relaybus_http.so", "the HTTP client")
    missing("serve", "relaybus_serve.so", "the dashboard's server")
    assert.truthy(answer(out, "hmac"):find("^false relaybus: http.hmac_sha256: "), out)
    assert.truthy(out:find("sqlite done 1\n", 1, true), out)
  end)

  it("a part that is not a shared object cannot be loaded: one line, and the other parts load", function()
    local dir = S.tmpdir() .. "/broken"
    assert(os.execute("mkdir -p " .. q(dir) .. " && cp " .. q(COMMAND) .. " " .. q(dir .. "/relaybus")))
    for _, part in ipairs(PARTS) do
      assert(os.execute("cp " .. q(S.build .. "/" .. part) .. " " .. q(dir .. "/" .. part)))
    end
    S.write(dir .. "/relaybus_pg.so", "not an ELF file\n")
    local ok, out, err = run_script(NEEDS_ALL, dir .. "/relaybus")
    assert.is_true(ok, err)
    assert.truthy(answer(out, "pg"):find("^nil the PostgreSQL store cannot be loaded: " .. dir:gsub("%p", "%%%0")
      .. "/relaybus_pg.so: "), out)
    assert.truthy(answer(out, "mongo"):find("^nil mongodb: cannot reach the server"), out)
    assert.truthy(answer(out, "request"):find("^nil connection refused"), out)
    assert.equal("true 5031fe3d989c6d1537a013fa6e739da23463fdaec3b70137d828e36ace221bd0", answer(out, "hmac"))
    assert.equal("true true", answer(out, "equal"))
    assert.equal("server nil", answer(out, "serve"))
    assert.truthy(out:find("sqlite done 1\n", 1, true), out)
  end)

  it("the Lua module under a stock lua5.4 loads the parts beside it", function()
    local have = os.execute("command -v lua5.4 >/dev/null")
    if not have and os.getenv("CI") ~= "true" then pending("lua5.4 is not installed") return end
    assert.is_true(have, "lua5.4 is not installed")
    local cpath = S.build .. "/?.so;" .. package.cpath
    local ok, out, err = run_script(NEEDS_ALL, nil,
      { "env", "LUA_CPATH=" .. q(cpath), "lua5.4" })   -- (a sanitized build's preload stays)
    assert.is_true(ok, err)
    assert.truthy(answer(out, "pg"):find("^nil postgresql: connection to server"), out)
    assert.truthy(answer(out, "request"):find("^nil connection refused"), out)
    assert.equal("true 5031fe3d989c6d1537a013fa6e739da23463fdaec3b70137d828e36ace221bd0", answer(out, "hmac"))
    assert.equal("server nil", answer(out, "serve"))
    assert.truthy(out:find("sqlite done 1\n", 1, true), out)
  end)
end)
