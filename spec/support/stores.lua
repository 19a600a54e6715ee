-- stores.lua -- the store matrix every spec runs against, and the helpers the specs share:
-- loading the module from the build directory, the command's path, temporary files, and
-- children of `relaybus run` (started through a small sh wrapper so a spec can signal them and
-- read their exit code without luaposix).
--
-- The matrix: SQLite (a new temp file per url() call) always; PostgreSQL when RELAYBUS_TEST_PG
-- is set and MongoDB when RELAYBUS_TEST_MONGO is set (a fresh table / collection name per call,
-- passed as opts.table). With CI=true an unset variable gives an entry whose url() raises
-- "server not available", so every spec of that store fails instead of being skipped.
-- Each entry has a `kind` (sqlite, postgresql, mongodb). M.list{dialects = true} (the
-- conformance spec) adds "mongodb-dialect": the same server with ?dialect=mongodb, so on
-- FerretDB the code path of a real MongoDB runs (docs/stores.md says what it cannot show).
local M = {}

local build = os.getenv("RELAYBUS_BUILD") or "build"
local cwd = os.getenv("PWD") or "."
if build:sub(1, 1) ~= "/" then build = cwd .. "/" .. build end
M.build = build
-- The command the specs start: scripts/test.sh may name a wrapper that runs build/relaybus
-- with LeakSanitizer on (RELAYBUS_BIN); the specs' own process is not checked.
M.bin = os.getenv("RELAYBUS_BIN") or build .. "/relaybus"
M.support = cwd .. "/spec/support"

-- The module, loaded once per Lua state: busted unloads what a spec file required, so the
-- module is kept in the registry and luaopen runs only once. relaybus_allocfail.so (the
-- allocation calls with testing.fail_alloc's failure, testing/alloc_faults.c) is loaded
-- globally first, so relaybus.so's allocation calls bind to it and not to its own.
function M.relaybus()
  local reg = debug.getregistry()
  if not reg.__relaybus_spec_module then
    assert(package.loadlib(build .. "/relaybus_allocfail.so", "*"))
    package.cpath = build .. "/?.so;" .. package.cpath
    reg.__relaybus_spec_module = require "relaybus"
  end
  return reg.__relaybus_spec_module
end

-- The specs' own module, relaybus_testing (testing/lua_testing.c: the fault-injecting store,
-- failing allocations), which ships in nothing. It calls relaybus's own functions, which plain
-- lua5.4 loaded from relaybus.so privately: that is made global first ("*" only links it).
function M.testing()
  local reg = debug.getregistry()
  if not reg.__relaybus_spec_testing then
    M.relaybus()
    -- (by a path string of its own: package.loadlib reuses the handle it keeps per string,
    -- and the one require made is the private one)
    local core = assert(package.searchpath("relaybus", package.cpath))
    assert(package.loadlib((core:gsub("([^/]+)$", "./%1")), "*"))
    local so = assert(package.searchpath("relaybus_testing", package.cpath))
    reg.__relaybus_spec_testing = assert(package.loadlib(so, "luaopen_relaybus_testing"))()
  end
  return reg.__relaybus_spec_testing
end

local ok_system, system = pcall(require, "system")

-- Sleeps in the spec process without running relaybus's loop (for polling children).
function M.sleep(s)
  if ok_system then system.sleep(s) else os.execute(string.format("sleep %.3f", s)) end
end

-- Monotonic seconds (CLOCK_MONOTONIC, comparable with relaybus.now() in other processes).
function M.mono()
  if ok_system then return system.monotime() end
  return M.relaybus().now()
end

-- ---- temporary files ---------------------------------------------------------------------
local tmpdir
function M.tmpdir()
  if not tmpdir then
    local p = assert(io.popen("mktemp -d \"${TMPDIR:-/tmp}/relaybus-spec.XXXXXX\""))
    tmpdir = p:read("*l")
    p:close()
    assert(tmpdir and #tmpdir > 0, "mktemp -d failed")
  end
  return tmpdir
end

local counter = 0
local salt = string.format("%x%04x", os.time() % 0x100000, math.random(0, 0xffff))
-- A name unique in this run and across runs: for temp files and table names.
function M.unique(prefix)
  counter = counter + 1
  return string.format("%s_%s_%d", prefix or "t", salt, counter)
end

function M.tmpfile(name)
  return M.tmpdir() .. "/" .. M.unique(name or "f")
end

function M.read(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

function M.write(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

function M.exists(path)
  local f = io.open(path, "rb")
  if f then f:close() return true end
  return false
end

function M.cleanup()
  M.kill_all()
  if os.getenv("RELAYBUS_SPEC_KEEP") then
    if tmpdir then io.stderr:write("\nspec files kept in " .. tmpdir .. "\n") end
    return
  end
  if tmpdir then
    os.execute("rm -rf '" .. tmpdir .. "'")
    tmpdir = nil
  end
end

-- ---- the matrix ----------------------------------------------------------------------------
local ci = os.getenv("CI") == "true" or os.getenv("CI") == "1"

local function unavailable(name, var)
  return {
    name = name,
    kind = name:match("^%a+"),
    unavailable = true,
    url = function()
      error(name .. ": server not available (" .. var .. " is not set and CI=true)", 2)
    end,
  }
end

local function server_store(name, var, prefix)
  local url = os.getenv(var)
  if url and url ~= "" then
    return {
      name = name,
      kind = name,
      server = url,
      sql = name == "postgresql",
      url = function()
        local t = M.unique(prefix)
        return url, { table = t }
      end,
    }
  elseif ci then
    return unavailable(name, var)
  end
end

-- The MongoDB entry again, with the MongoDB dialect forced.
local function mongodb_dialect(entry)
  if not entry or entry.unavailable then return entry and unavailable("mongodb-dialect", "RELAYBUS_TEST_MONGO") end
  local sep = entry.server:find("?", 1, true) and "&" or "?"
  return {
    name = "mongodb-dialect",
    kind = "mongodb",
    dialect = "mongodb",
    server = entry.server .. sep .. "dialect=mongodb",
    url = function()
      local u, opts = entry.url()
      return u .. sep .. "dialect=mongodb", opts
    end,
  }
end

function M.list(opts)
  local list = {
    {
      name = "sqlite",
      kind = "sqlite",
      sql = true,
      url = function()
        -- the default table name: the command's subcommands (which take no table) see it
        return "sqlite:" .. M.tmpfile("store") .. ".db", {}
      end,
    },
  }
  list[#list + 1] = server_store("postgresql", "RELAYBUS_TEST_PG", "rb")
  local mongo = server_store("mongodb", "RELAYBUS_TEST_MONGO", "rb")
  list[#list + 1] = mongo
  if opts and opts.dialects then list[#list + 1] = mongodb_dialect(mongo) end
  -- RELAYBUS_SPEC_STORES=sqlite,postgresql narrows the matrix for a local run.
  local only = os.getenv("RELAYBUS_SPEC_STORES")
  if only and only ~= "" then
    local keep = {}
    for _, s in ipairs(list) do
      if ("," .. only .. ","):find("," .. s.name .. ",", 1, true) then keep[#keep + 1] = s end
    end
    list = keep
  end
  return list
end

M.default_table = "relaybus_deliveries"

local opened = {}

-- Opens a fresh store of `entry`; returns store, url, opts, table name. M.reset closes it.
function M.open(entry, extra)
  local relaybus = M.relaybus()
  local url, opts = entry.url()
  opts = opts or {}
  for k, v in pairs(extra or {}) do opts[k] = v end
  local store, err = relaybus.open(url, opts)
  assert(store, "open " .. tostring(url) .. ": " .. tostring(err))
  opened[#opened + 1] = store
  return store, url, opts, opts.table or M.default_table
end

-- ---- children --------------------------------------------------------------------------------
local function q(s)
  return "'" .. tostring(s):gsub("'", "'\\''") .. "'"
end
M.quote = q

local procs = {}

-- Starts `relaybus run SCRIPT ARGS...` (or any argv when opts.argv) in the background.
-- opts.env: table of environment variables. Returns a proc: {pid=, out=, err=, rcfile=}.
function M.spawn(script, args, opts)
  opts = opts or {}
  local base = M.tmpfile("proc")
  local p = { out = base .. ".out", err = base .. ".err", rcfile = base .. ".rc",
              pidfile = base .. ".pid" }
  local argv = opts.argv or { M.bin, "run", script }
  local parts = {}
  for _, a in ipairs(argv) do parts[#parts + 1] = q(a) end
  for _, a in ipairs(args or {}) do parts[#parts + 1] = q(a) end
  local env = {}
  for k, v in pairs(opts.env or {}) do env[#env + 1] = k .. "=" .. q(v) end
  local wrapper = table.concat({
    "#!/bin/sh",
    -- children run in the temp dir: a stray default store or a core file stays out of the repo
    "cd " .. q(M.tmpdir()) .. " || exit 99",
    (os.getenv("RELAYBUS_SPEC_CORES") and "ulimit -c unlimited" or ":"),
    (#env > 0 and ("export " .. table.concat(env, " ")) or ":"),
    table.concat(parts, " ") .. " >" .. q(p.out) .. " 2>" .. q(p.err) .. " </dev/null &",
    "echo $! >" .. q(p.pidfile .. ".tmp") .. " && mv " .. q(p.pidfile .. ".tmp") .. " " .. q(p.pidfile),
    "wait $!",
    "echo $? >" .. q(p.rcfile .. ".tmp") .. " && mv " .. q(p.rcfile .. ".tmp") .. " " .. q(p.rcfile),
    "",
  }, "\n")
  M.write(base .. ".sh", wrapper)
  os.execute("sh " .. q(base .. ".sh") .. " >/dev/null 2>&1 </dev/null &")
  local ok = M.wait_for(function() return M.exists(p.pidfile) end, 10)
  assert(ok, "child did not start: " .. table.concat(parts, " "))
  p.pid = tonumber(M.read(p.pidfile):match("%d+"))
  procs[#procs + 1] = p
  return p
end

function M.signal(p, sig)
  return os.execute("kill -" .. sig .. " " .. p.pid .. " 2>/dev/null")
end

-- The exit code once the child has ended, else nil.
function M.rc(p)
  local s = M.read(p.rcfile)
  return s and tonumber(s:match("%d+"))
end

-- Waits for the child to end; returns its exit code, or nil after `timeout` s.
function M.wait_exit(p, timeout)
  if M.wait_for(function() return M.rc(p) ~= nil end, timeout or 30) then return M.rc(p) end
  return nil
end

-- SIGTERMs the child (a graceful stop) and returns its exit code, or nil after 15 s.
function M.term(p)
  M.signal(p, "TERM")
  return M.wait_exit(p, 15)
end

-- SIGKILLs the child and waits until it is gone.
function M.kill(p)
  M.signal(p, "KILL")
  M.signal(p, "CONT")
  return M.wait_exit(p, 10)
end

function M.kill_all()
  for _, p in ipairs(procs) do
    if not M.rc(p) then M.signal(p, "KILL"); M.signal(p, "CONT") end
  end
  for _, p in ipairs(procs) do
    if not M.rc(p) then M.wait_exit(p, 5) end
  end
  procs = {}
end

-- The after_each of every spec: kills the children it started, then closes every store
-- M.open gave it (close is idempotent, so a test may have closed one itself).
function M.reset()
  M.kill_all()
  for _, store in ipairs(opened) do store:close() end
  opened = {}
end

-- Polls `cond` every 10 ms until it returns a true value (returned) or `timeout` s pass (nil).
function M.wait_for(cond, timeout)
  local deadline = M.mono() + (timeout or 10)
  while true do
    local v = cond()
    if v then return v end
    if M.mono() > deadline then return nil end
    M.sleep(0.01)
  end
end

-- Lines of a file, complete lines only (a killed writer may leave half a line).
function M.lines(path)
  local s = M.read(path) or ""
  local out = {}
  for line in s:gmatch("([^\n]*)\n") do out[#out + 1] = line end
  return out
end

-- The words of every complete, non-empty line of a child's log (see child.lua).
function M.parse_log(path)
  local out = {}
  for _, line in ipairs(M.lines(path)) do
    local f = {}
    for w in line:gmatch("%S+") do f[#f + 1] = w end
    if #f > 0 then out[#out + 1] = f end
  end
  return out
end

-- A shell command line for a tool that is not ours (curl, promtool, node and Chromium): run
-- without the ASan runtime the specs' processes preload on the ASan build, under which some of
-- them hang. relaybus processes keep it.
function M.foreign(cmdline) return "env -u LD_PRELOAD " .. cmdline end

-- Runs a command to completion; returns exit code, stdout, stderr.
function M.run_command(argv, env)
  local base = M.tmpfile("cmd")
  local parts = {}
  for k, v in pairs(env or {}) do parts[#parts + 1] = k .. "=" .. q(v) end
  for _, a in ipairs(argv) do parts[#parts + 1] = q(a) end
  local cmd = table.concat(parts, " ") .. " >" .. q(base .. ".out") .. " 2>" .. q(base .. ".err") .. " </dev/null"
  local _, _, code = os.execute(cmd)
  return code, M.read(base .. ".out") or "", M.read(base .. ".err") or ""
end

return M
