-- faults_spec.lua -- the server goes away under running workers: a restart of the whole server
-- mid-drain (PostgreSQL: 5,000 deliveries; FerretDB: 3,000) and connections killed
-- on the server (pg_terminate_backend). Each runs on a server this spec starts itself in a
-- temporary directory (scripts/pg-test-server.sh, scripts/mongo-test-server.sh), so restarting
-- it disturbs no other spec, and stops it afterwards. Workers are spec/support/worker.lua: they
-- log each run's start and end on the monotonic clock, so the spec checks that nothing is lost,
-- that no two runs of one delivery overlap, and that the workers' stderr holds only one-line
-- "relaybus: ..." messages.
--
-- Each server kind runs only when it is installed (PostgreSQL: /usr/lib/postgresql/*/bin;
-- FerretDB: `scripts/mongo-test-server.sh build` works); with CI=true it always runs, and a
-- server that does not start fails the specs.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local F = require "spec.support.fault_util"
local relaybus = S.relaybus()

local WORKER = S.support .. "/worker.lua"

-- Starts two drain workers on (url, tbl) with `env`; returns the incarnations {log=, proc=}
-- once both are ready.
local function start_workers(n, url, tbl, env)
  local incs = {}
  for i = 1, n do
    local log = S.tmpfile("w" .. i) .. ".log"
    incs[i] = { log = log, proc = S.spawn(WORKER, { url, tbl, log }, { env = env }) }
  end
  for i, inc in ipairs(incs) do
    assert(S.wait_for(function() return F.count(inc.log, "READY") > 0 end, 20),
      "worker " .. i .. " did not start: " .. (S.read(inc.proc.err) or ""))
  end
  return incs
end

local function logs(incs)
  local out = {}
  for i, inc in ipairs(incs) do out[i] = inc.log end
  return out
end

local function alive(incs)
  for i, inc in ipairs(incs) do
    local rc = S.rc(inc.proc)
    assert.is_nil(rc, "worker " .. i .. " exited by itself (" .. tostring(rc) .. "): "
      .. (S.read(inc.proc.err) or ""))
  end
end

-- The store's completed count, or nil while it cannot reach the server.
local function completed(store)
  local st = store:stats()
  return st and st.completed
end

-- Stops the workers gracefully (SIGTERM, exit 0), then checks the store and the logs: all of
-- `all` completed, each with a run that returned, no two runs of one delivery overlapping,
-- and the workers' stderr only one-line relaybus: messages. Returns the log analysis.
local function finish_and_check(store, incs, all, what)
  for i, inc in ipairs(incs) do
    S.signal(inc.proc, "TERM")
    assert.equal(0, S.wait_exit(inc.proc, 20), "worker " .. i .. " did not stop gracefully: "
      .. (S.read(inc.proc.err) or ""))
    inc.ended_at = relaybus.now()
  end
  local N = #all
  local st = assert(S.wait_for(function() return store:stats() end, 20), "stats keeps failing")
  assert.equal(N, st.completed, what .. ": completed " .. st.completed .. " of " .. N)
  assert.equal(0, st.pending + st.processing + st.buried)
  local res = F.analyse(incs, all)
  assert.equal(0, res.missing, res.missing .. " deliveries have no run that returned in the logs")
  assert.same({}, res.overlaps)
  for i, inc in ipairs(incs) do
    local bad, n = F.stray_stderr(inc.proc.err)
    assert.same({}, bad, "worker " .. i .. " printed lines that are not one-line relaybus: errors ("
      .. n .. " lines in all)")
  end
  if os.getenv("RELAYBUS_SPEC_VERBOSE") then
    local lines = 0
    for _, inc in ipairs(incs) do lines = lines + #S.lines(inc.proc.err) end
    io.stderr:write(string.format("\n%s: %d deliveries, %d ran more than once, %d stderr lines\n",
      what, N, res.reruns, lines))
  end
  return res
end

-- Drains `all` with two workers and restarts the server once a quarter has run; asserts the
-- restart landed mid-drain and everything completes within `limit` s after it.
local function drain_through_restart(srv, store, tbl, all, env, limit, what)
  local N = #all
  local incs = start_workers(2, srv.url, tbl, env)
  local paths = logs(incs)
  assert.truthy(S.wait_for(function() return F.count_all(paths, "E") >= N // 4 end, 60),
    "a quarter of the deliveries did not run before the restart")
  local ok, took, err = F.restart_server(srv)
  assert.is_true(ok, "restart failed: " .. err)
  local done_at_restart = F.count_all(paths, "E")
  assert.is_true(done_at_restart < N, string.format(
    "the drain finished during the restart (%.1f s): it did not run mid-drain", took))
  alive(incs)
  local finished = S.wait_for(function()
    alive(incs)
    return completed(store) == N
  end, limit)
  assert.truthy(finished, string.format("%s: %s of %d completed %d s after the restart (%d ran before it)",
    what, tostring(completed(store)), N, limit, done_at_restart))
  return finish_and_check(store, incs, all, what)
end

-- The hooks of a describe that runs against a server of its own (`kind` "pg" or "mongo"):
-- started once, a fresh table and store per test. Returns the table the tests read
-- (X.srv, X.store, X.tbl).
local function own_server(kind)
  local X = {}
  setup(function()
    X.srv = F.start_server(kind)
  end)
  before_each(function()
    X.tbl = S.unique("rbf")
    X.store = assert(relaybus.open(X.srv.url, { table = X.tbl }))
  end)
  after_each(function()
    S.kill_all()
    if X.store then X.store:close() end
    X.store = nil
  end)
  teardown(function()
    S.kill_all()
    F.stop_server(X.srv)
    S.cleanup()
  end)
  return X
end

if F.pg_available() or F.ci then
  describe("faults on PostgreSQL (a cluster started by this spec):", function()
    local X = own_server("pg")

    it("a server restart while two workers drain 5,000 deliveries: all complete, none lost, no two runs of one delivery overlap, only one-line errors", function()
      H.near(S.mono(), relaybus.now(), 0.5, "relaybus.now() against CLOCK_MONOTONIC")
      local all = F.enqueue_n(X.store, "work", 5000)
      assert.equal(5000, #all)
      -- about 35 ms a run, 16 at once per worker: a drain of several seconds
      local env = { RB_SLEEP = "0.02", RB_JITTER = "0.03", RB_CONC = "16", RB_LEASE = "2" }
      drain_through_restart(X.srv, X.store, X.tbl, all, env, 90, "postgresql restart")
    end)

    it("connections killed on the server (pg_terminate_backend) under a running dispatcher: everything still completes", function()
      H.near(S.mono(), relaybus.now(), 0.5, "relaybus.now() against CLOCK_MONOTONIC")
      local N = 2000
      local all = F.enqueue_n(X.store, "work", N)
      local env = { RB_SLEEP = "0.02", RB_JITTER = "0.03", RB_CONC = "16", RB_LEASE = "2" }
      local incs = start_workers(2, X.srv.url, X.tbl, env)
      local paths = logs(incs)
      local kill_sql = "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        .. " WHERE datname = current_database() AND pid <> pg_backend_pid()"
      for _, share in ipairs { 0.2, 0.45, 0.7 } do
        assert.truthy(S.wait_for(function()
          alive(incs)
          return F.count_all(paths, "E") >= N * share
        end, 60), "the drain did not reach " .. share * 100 .. "%")
        local ok, out, err = F.psql(X.srv.url, kill_sql)
        assert.is_true(ok, "psql: " .. err)
        -- two workers, each with at least a pool connection and its listener
        local n = select(2, out:gsub("t\n", ""))
        assert.is_true(n >= 2, "only " .. n .. " backends were terminated")
      end
      assert.is_true(F.count_all(paths, "E") < N, "the drain ended before the last kill")
      local finished = S.wait_for(function()
        alive(incs)
        return completed(X.store) == N
      end, 60)
      assert.truthy(finished, tostring(completed(X.store)) .. " of " .. N .. " completed")
      finish_and_check(X.store, incs, all, "pg_terminate_backend")
    end)
  end)
end

if F.ci or F.ferret_available() then
  describe("faults on MongoDB (a FerretDB started by this spec):", function()
    local X = own_server("mongo")

    -- FerretDB serves its open connections for ~3 s after SIGTERM, and the workers (32 runs
    -- of 20-80 ms at once) keep draining meanwhile: what is left after the first quarter must
    -- outlast that, or the restart would land after the drain.
    it("a FerretDB restart while two workers drain 3,000 deliveries: all complete, none lost, no two runs of one delivery overlap, only one-line errors", function()
      H.near(S.mono(), relaybus.now(), 0.5, "relaybus.now() against CLOCK_MONOTONIC")
      local N = tonumber(os.getenv("RELAYBUS_FAULT_N_MONGODB") or "") or 3000
      local all = F.enqueue_n(X.store, "work", N)
      assert.equal(N, #all)
      local env = { RB_SLEEP = "0.02", RB_JITTER = "0.06", RB_CONC = "16", RB_LEASE = "3" }
      drain_through_restart(X.srv, X.store, X.tbl, all, env, 150, "ferretdb restart")
    end)
  end)
end
