-- fault_util.lua -- shared by the fault specs (faults_spec, effectively_once_spec, pg_errors_spec):
-- throwaway servers a spec starts and restarts itself (scripts/pg-test-server.sh,
-- scripts/mongo-test-server.sh), psql from the installed PostgreSQL, and the analysis of
-- worker logs (spec/support/worker.lua's and fault_txworker.lua's S/E lines): runs as
-- intervals on the monotonic clock, deliveries without a finished run, overlapping runs.
local S = require "spec.support.stores"

local F = {}

local root = os.getenv("PWD") or "."
F.root = root
F.ci = os.getenv("CI") == "true" or os.getenv("CI") == "1"

local q = S.quote

local function sh_ok(cmd)
  local ok = os.execute(cmd)
  return ok == true or ok == 0
end

-- ---- PostgreSQL ----------------------------------------------------------------------------
-- The installed server's bin directory (newest version), or nil.
function F.pg_bin()
  local p = io.popen("ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1")
  local d = p:read("*l")
  p:close()
  if d and d ~= "" and S.exists(d .. "/initdb") then return d end
  return nil
end

function F.pg_available() return F.pg_bin() ~= nil end

-- psql: the installed server's, else the one on PATH.
function F.psql_path()
  local bin = F.pg_bin()
  if bin and S.exists(bin .. "/psql") then return bin .. "/psql" end
  local p = io.popen("command -v psql 2>/dev/null")
  local path = p:read("*l")
  p:close()
  if path and path ~= "" then return path end
  return nil
end

-- Runs one SQL text with psql against `url`; returns ok, stdout (unaligned, tuples only), stderr.
function F.psql(url, sql)
  local psql = assert(F.psql_path(), "psql not found (install the PostgreSQL client)")
  -- env -u: the ASan run preloads libasan into the spec process; psql must not inherit it
  local code, out, err = S.run_command { "env", "-u", "LD_PRELOAD", psql, "-X", "-q", "-At",
                                         "-v", "ON_ERROR_STOP=1", "-d", url, "-c", sql }
  return code == 0, out, err
end

-- A server started by the spec itself: {kind=, dir=, url=}. `kind` is "pg" or "mongo".
-- Raises with the script's stderr when the start fails (a failure, never a skip).
local function script(kind)
  return root .. "/scripts/" .. (kind == "pg" and "pg-test-server.sh" or "mongo-test-server.sh")
end

function F.start_server(kind)
  local dir = S.tmpfile(kind .. "srv")
  local code, out, err = S.run_command { script(kind), "start", dir }
  local url = out:match("([^\n]+)")
  if code ~= 0 or not url then
    -- leave nothing running
    S.run_command { script(kind), "stop", dir }
    error(string.format("%s test server did not start (exit %s): %s", kind, tostring(code),
      (err:gsub("\n", " | "))), 2)
  end
  return { kind = kind, dir = dir, url = url }
end

-- Restarts it (same port, same data); returns ok, seconds taken, stderr.
function F.restart_server(srv)
  local t0 = S.mono()
  local code, _, err = S.run_command { script(srv.kind), "restart", srv.dir }
  return code == 0, S.mono() - t0, err
end

function F.stop_server(srv)
  if srv then S.run_command { script(srv.kind), "stop", srv.dir } end
end

-- FerretDB is available when the script can build (or find) its cached binary.
local ferret
function F.ferret_available()
  if ferret == nil then
    ferret = sh_ok(q(script("mongo")) .. " build >/dev/null 2>&1 </dev/null")
  end
  return ferret
end

-- ---- worker logs ---------------------------------------------------------------------------
-- A log as a list of word lists, complete lines only.
F.parse = S.parse_log

function F.count(path, kind)
  local n = 0
  for _, f in ipairs(F.parse(path)) do if f[1] == kind then n = n + 1 end end
  return n
end

-- Sums F.count over several logs.
function F.count_all(paths, kind)
  local n = 0
  for _, p in ipairs(paths) do n = n + F.count(p, kind) end
  return n
end

-- Analyses the logs of worker incarnations ({log=, ended_at=} each; ended_at: monotonic time
-- after the process was gone). A run is "S id start ..." closed by "E id start end" or, in the
-- transactional worker, "R id start end" (raised) or "X id start end err" (its write
-- failed). Returns {missing=, overlaps=, reruns=, runs=, cut=} for the ids in `all`: missing
-- counts ids without a run that ended by returning; cut lists the ids of runs that never
-- ended (their process was killed under them).
function F.analyse(incarnations, all)
  local runs, returned, cut = {}, {}, {}
  for _, inc in ipairs(incarnations) do
    local open = {}
    for _, f in ipairs(F.parse(inc.log)) do
      if f[1] == "S" then
        open[f[2] .. " " .. f[3]] = { id = f[2], s = tonumber(f[3]) }
      elseif f[1] == "E" or f[1] == "R" or f[1] == "X" then
        local key = f[2] .. " " .. f[3]
        local run = assert(open[key], "an end without a start: " .. table.concat(f, " "))
        open[key] = nil
        run.e = tonumber(f[4])
        assert(run.e >= run.s, "a run ended before it started: " .. table.concat(f, " "))
        runs[run.id] = runs[run.id] or {}
        table.insert(runs[run.id], run)
        if f[1] == "E" then returned[run.id] = true end
      end
    end
    for _, run in pairs(open) do
      -- killed (or stopped) mid-way: it ran until the process was gone at the latest
      run.e = assert(inc.ended_at, "an incarnation without ended_at: " .. inc.log)
      cut[#cut + 1] = run.id
      runs[run.id] = runs[run.id] or {}
      table.insert(runs[run.id], run)
    end
  end
  local res = { missing = 0, overlaps = {}, reruns = 0, runs = runs, cut = cut }
  for _, id in ipairs(all) do
    if not returned[id] then res.missing = res.missing + 1 end
    local list = runs[id] or {}
    if #list > 1 then res.reruns = res.reruns + 1 end
    table.sort(list, function(a, b) return a.s < b.s end)
    for i = 2, #list do
      if list[i].s < list[i - 1].e then
        res.overlaps[#res.overlaps + 1] = string.format("%s: [%.4f, %.4f] and [%.4f, %.4f]",
          id, list[i - 1].s, list[i - 1].e, list[i].s, list[i].e)
      end
    end
  end
  return res
end

-- The lines of a child's stderr that are not a one-line "relaybus: ..." message (a
-- continuation of a multi-line message, a traceback, a library's own chatter). Returns the
-- offending lines (empty when all is well) and the number of lines.
function F.stray_stderr(path)
  local bad, n = {}, 0
  for _, line in ipairs(S.lines(path)) do
    n = n + 1
    if not line:match("^relaybus: %S") then bad[#bad + 1] = line end
  end
  return bad, n
end

-- Enqueues n deliveries of `topic` (payload i) in batches of 1,000; returns the ids in order.
function F.enqueue_n(store, topic, n)
  local all, batch = {}, {}
  for i = 1, n do
    batch[#batch + 1] = { topic, i }
    if #batch == 1000 or i == n then
      local ids = assert(store:enqueue_many(batch))
      for _, id in ipairs(ids) do all[#all + 1] = id end
      batch = {}
    end
  end
  return all
end

return F
