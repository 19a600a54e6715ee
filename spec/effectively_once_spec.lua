-- effectively_once_spec.lua -- transactional handlers under raises and SIGKILLs: 1,000
-- deliveries whose handlers each insert one row, keyed by the delivery id, into an application
-- table through ctx.transaction (no unique constraint: a second commit of one delivery would show
-- as a duplicate row), then raise at random (20%, after the insert) while three worker processes
-- are killed at random and restarted. At the end there is exactly one row per delivery, written by
-- the run that completed it (its fence), and every delivery completed.
--
-- Stores: SQLite and PostgreSQL through the matrix; MongoDB only when RELAYBUS_TEST_MONGO is a
-- replica set (transactions need one; FerretDB has none), otherwise no test for it.
-- Workers are spec/support/fault_txworker.lua.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local F = require "spec.support.fault_util"
local relaybus = S.relaybus()

local WORKER = S.support .. "/fault_txworker.lua"

-- The application table's rows per delivery id: id -> {n=, fence=}, and the total.
local function app_rows(entry, store, app, all)
  local per, total = {}, 0
  if entry.name == "mongodb" then
    -- tx:collection has no count: find each id's row, then delete its rows one by one
    for from = 1, #all, 100 do
      local ok, err = store:transaction(function(tx)
        local c = tx:collection(app)
        for i = from, math.min(from + 99, #all) do
          local id = all[i]
          local doc = c:find_one { delivery_id = id }
          local n = 0
          while assert(c:delete_one { delivery_id = id }) > 0 do n = n + 1 end
          if n > 0 then per[id] = { n = n, fence = doc and doc.fence } end
          total = total + n
        end
      end)
      assert.is_true(ok, err)
    end
    local ok, rest = store:transaction(function(tx) return tx:collection(app):find_one {} end)
    assert.is_true(ok, rest)
    assert.is_nil(rest, "rows of no delivery of this spec are left")
    return per, total
  end
  local ok, rows = store:transaction(function(tx)
    return tx:query("SELECT delivery_id, count(*) AS n, min(fence) AS fence FROM " .. app
      .. " GROUP BY delivery_id")
  end)
  assert.is_true(ok, rows)
  for _, r in ipairs(rows) do
    per[r.delivery_id] = { n = math.tointeger(r.n) or r.n, fence = math.tointeger(r.fence) or r.fence }
    total = total + r.n
  end
  return per, total
end

for _, entry in ipairs(S.list()) do
  if entry.name ~= "mongodb" or H.mongo_rs(entry) then
    describe("effectively-once on " .. entry.name .. ":", function()
      local store, url, opts, tbl, app

      before_each(function()
        store, url, opts, tbl = S.open(entry)
        app = tbl .. "_app"
        if entry.name ~= "mongodb" then
          assert(store:transaction(function(tx)
            tx:exec("CREATE TABLE " .. app .. " (delivery_id TEXT NOT NULL, fence BIGINT)")
          end))
        end
      end)
      after_each(S.reset)
      teardown(function() S.cleanup() end)

      it("1,000 transactional handlers inserting one row each, with random raises after the insert and random worker SIGKILLs: exactly one row per delivery, and all complete", function()
        H.near(S.mono(), relaybus.now(), 0.5, "relaybus.now() against CLOCK_MONOTONIC")
        local N = tonumber(os.getenv("RELAYBUS_ONCE_N") or "") or 1000
        -- runs hold their transaction open for about RB_SLEEP s, so kills land inside them.
        -- SQLite: a restarted worker retries its open (RB_OPEN_RETRY), which can starve while
        -- another process runs transactional handlers; the next describe shows that on its own
        -- On SQLite the runs of all workers take the write lock in turn, so at most one is in
        -- flight, for about 10 ms: in one CI run under ASan every kill chosen from the logs
        -- landed after the run it saw had ended. One run in 50 holds its transaction 0.25 s.
        local env = { RB_KIND = entry.name, RB_RAISE = "0.2",
                      RB_LONG = entry.name == "sqlite" and "0.02" or "0",
                      RB_SLEEP = os.getenv("RELAYBUS_ONCE_SLEEP") or (entry.name == "sqlite" and "0.01" or "0.05"),
                      RB_LEASE = "1.5", RB_CONC = "8",
                      RB_OPEN_RETRY = entry.name == "sqlite" and "60" or "0" }
        local incarnations, slots = {}, {}
        local function start(slot)
          local inc = { log = S.tmpfile("tx" .. slot) .. ".log" }
          inc.proc = S.spawn(WORKER, { url, opts.table or "-", app, inc.log }, { env = env })
          incarnations[#incarnations + 1] = inc
          slots[slot] = inc
          return inc
        end
        for slot = 1, 3 do start(slot) end
        for slot = 1, 3 do
          assert.truthy(S.wait_for(function() return F.count(slots[slot].log, "READY") > 0 end, 20),
            "worker " .. slot .. " did not start: " .. (S.read(slots[slot].proc.err) or ""))
        end
        -- enqueued once all three are up (an open on SQLite can starve behind a busy worker)
        local all = F.enqueue_n(store, "work", N)
        assert.equal(N, #all)
        local function busy(inc)
          local s, ended = 0, 0
          for _, f in ipairs(F.parse(inc.log)) do
            if f[1] == "S" then s = s + 1
            elseif f[1] == "E" or f[1] == "R" or f[1] == "X" then ended = ended + 1 end
          end
          return s > ended
        end
        local t0 = relaybus.now()
        -- kill workers with runs (open transactions) in flight: at least 8 kills, and more (up
        -- to 20) until one has cut a run in flight (its log has a run that never ended)
        local cuts = 0
        local _, kills = H.chaos(store, N, slots, {
          gap = 0.2, poll = 0.02, busy = busy, restart = start,
          more = function(kills) return kills < 8 or (cuts == 0 and kills < 20) end,
          on_kill = function(inc) if busy(inc) then cuts = cuts + 1 end end,
        })
        for slot = 1, 3 do
          if F.count(slots[slot].log, "READY") > 0 then
            S.signal(slots[slot].proc, "TERM")
            assert.equal(0, S.wait_exit(slots[slot].proc, 20), "worker " .. slot .. " did not stop gracefully")
          else
            S.kill(slots[slot].proc) -- still retrying its open: it ran nothing
          end
          slots[slot].ended_at = relaybus.now()
        end

        H.drained_through_kills(store, N, t0, kills)

        local logs = {}
        for i, inc in ipairs(incarnations) do logs[i] = inc.log end
        local raises = F.count_all(logs, "R")
        assert.is_true(raises > 0, "no handler raised after its insert")
        local res = F.analyse(incarnations, all)
        assert.equal(0, res.missing, res.missing .. " deliveries have no run that returned")
        assert.same({}, res.overlaps)
        assert.is_true(#res.cut > 0, "no kill landed on a run in flight")

        -- the application table: one row per delivery, from the run that completed it
        local per, total = app_rows(entry, store, app, all)
        local records = {}
        for _, r in ipairs(assert(store:list { status = "completed", limit = N + 10 })) do
          records[r.id] = r
        end
        local absent, dup, stale = {}, {}, {}
        for _, id in ipairs(all) do
          local row = per[id]
          if not row then absent[#absent + 1] = id
          elseif row.n ~= 1 then dup[#dup + 1] = id .. " x" .. row.n
          elseif not records[id] or row.fence ~= records[id].fence then
            stale[#stale + 1] = string.format("%s: row fence %s, delivery fence %s", id,
              tostring(row.fence), tostring(records[id] and records[id].fence))
          end
        end
        assert.same({}, absent, #absent .. " deliveries have no row")
        assert.same({}, dup, #dup .. " deliveries have more than one row")
        assert.equal(N, total)
        assert.same({}, stale, "rows not written by the completing run")
        if os.getenv("RELAYBUS_SPEC_VERBOSE") then
          io.stderr:write(string.format("\n%s: %d deliveries in %.1f s, %d kills, %d raises, %d ran more than once, %d runs cut by kills, %d write failures, %d failed opens\n",
            entry.name, N, relaybus.now() - t0, kills, raises, res.reruns, #res.cut, F.count_all(logs, "X"),
            F.count_all(logs, "OPENFAIL")))
        end
      end)

      -- A worker's runs hold a transaction open (here about 10 ms each, back to back). Other
      -- processes must still get in: a worker restarted after a crash opens the store, and a
      -- second worker on the same backlog gets deliveries too.
      local function txworker(log, env)
        local e = { RB_KIND = entry.name, RB_RAISE = "0", RB_SLEEP = "0.01", RB_LEASE = "3", RB_CONC = "8" }
        for k, v in pairs(env or {}) do e[k] = v end
        return S.spawn(WORKER, { url, opts.table or "-", app, log }, { env = e })
      end
      local function ready(log, proc, limit)
        return S.wait_for(function() return F.count(log, "READY") > 0 or S.rc(proc) end, limit)
          and F.count(log, "READY") > 0
      end

      it("a worker started while another process runs transactional handlers opens the store within 5 s", function()
        F.enqueue_n(store, "work", 2000)
        local logA, logB = S.tmpfile("a") .. ".log", S.tmpfile("b") .. ".log"
        local A = txworker(logA)
        assert.truthy(S.wait_for(function() return F.count(logA, "E") >= 30 end, 20),
          "worker A did not get going: " .. (S.read(A.err) or ""))
        local t0 = relaybus.now()
        local B = txworker(logB)
        local ok = ready(logB, B, 5)
        assert.is_true(ok, string.format("worker B was not ready %.1f s after its start (exit %s): %s",
          relaybus.now() - t0, tostring(S.rc(B)), S.read(B.err) or ""))
      end)

      it("two workers running transactional handlers on one backlog both get deliveries", function()
        local logA, logB = S.tmpfile("a") .. ".log", S.tmpfile("b") .. ".log"
        local A, B = txworker(logA), txworker(logB)
        assert.is_true(ready(logA, A, 20), "worker A did not start: " .. (S.read(A.err) or ""))
        assert.is_true(ready(logB, B, 20), "worker B did not start: " .. (S.read(B.err) or ""))
        F.enqueue_n(store, "work", 1000)
        assert.truthy(S.wait_for(function() return F.count_all({ logA, logB }, "E") >= 300 end, 60),
          "300 runs did not end within 60 s")
        local a, b = F.count(logA, "S"), F.count(logB, "S")
        assert.is_true(math.min(a, b) >= 0.1 * (a + b), string.format(
          "one worker starved: A started %d runs, B %d", a, b))
      end)
    end)
  end
end
