-- process_spec.lua -- several `relaybus run` worker processes on one store, stopped (SIGSTOP),
-- killed (SIGKILL) and restarted: nothing is lost, a stale worker changes nothing, and no two
-- runs of one delivery overlap. Workers are spec/support/worker.lua; they log each run's start
-- and end on the monotonic clock, which this spec shares with them (relaybus.now()).
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local relaybus = S.relaybus()

local WORKER = S.support .. "/worker.lua"

local parse = S.parse_log

local function count(path, kind)
  local n = 0
  for _, f in ipairs(parse(path)) do if f[1] == kind then n = n + 1 end end
  return n
end

local function find(path, kind, id)
  for _, f in ipairs(parse(path)) do
    if f[1] == kind and (id == nil or f[2] == id) then return f end
  end
end

for _, entry in ipairs(S.list()) do
  describe("processes on " .. entry.name .. ":", function()
    local store, url, opts

    local function worker(log, env)
      return S.spawn(WORKER, { url, opts.table or "-", log }, { env = env })
    end

    before_each(function()
      store, url, opts = S.open(entry)
    end)
    after_each(S.reset)
    teardown(function() S.cleanup() end)

    it("a worker killed with SIGKILL mid-run has its deliveries taken over after the lease; nothing is lost", function()
      local items = {}
      for i = 1, 20 do items[i] = { "work", { i = i } } end
      local ids = assert(store:enqueue_many(items))
      local logA, logB = S.tmpfile("a") .. ".log", S.tmpfile("b") .. ".log"
      local A = worker(logA, { RB_SLEEP = "60", RB_CONC = "8", RB_LEASE = "1.5" })
      assert.truthy(S.wait_for(function() return count(logA, "S") >= 8 end, 20),
        "worker A did not start 8 runs: " .. (S.read(A.err) or ""))
      assert.equal(137, S.kill(A))
      local t_kill = relaybus.now()
      -- The leases A held, as the store has them once A is dead (no renewal can move them on):
      -- B may take each over once it ended, not before. (A's run start is later than its
      -- claim, so it cannot bound the lease: in a CI run on a loaded machine the lease ended
      -- 1.445 s after A's run started.)
      local held = {}
      for _, f in ipairs(parse(logA)) do
        if f[1] == "S" then
          local r = assert(store:get(f[2]))
          held[f[2]] = assert(r.lease_expires_at, "no lease on " .. f[2])
        end
      end
      local B = worker(logB, { RB_SLEEP = "0.01", RB_CONC = "8", RB_LEASE = "1.5" })
      assert.truthy(S.wait_for(function() return assert(store:stats()).completed == 20 end, 30),
        "not all 20 completed: " .. (S.read(B.err) or ""))
      assert.equal(0, S.term(B))
      local st = assert(store:stats())
      assert.equal(20, st.completed)
      assert.equal(0, st.pending + st.processing + st.buried)
      local starts = {}
      for _, f in ipairs(parse(logB)) do
        if f[1] == "S" then
          starts[f[2]] = { t = tonumber(f[3]), attempts = tonumber(f[5]), epoch = tonumber(f[6]) }
        end
      end
      for _, id in ipairs(ids) do
        local r = assert(store:get(id))
        assert.equal("completed", r.status)
        if held[id] then
          assert.equal(2, r.attempts)
          assert.is_table(starts[id], "B never ran " .. id)
          assert.equal(2, starts[id].attempts)
          assert.is_true(starts[id].t >= t_kill)
          -- (0.01: the stores keep the expiry to the millisecond)
          assert.is_true(starts[id].epoch >= held[id] - 0.01,
            string.format("B ran %s %.3f s before A's lease ended", id, held[id] - starts[id].epoch))
        else
          assert.equal(1, r.attempts)
        end
      end
    end)

    it("a worker frozen with SIGSTOP past its lease sees the abort (reason lease) when thawed, and its settle calls change nothing", function()
      local id = assert(store:enqueue("work", { frozen = true }))
      local logA, logB = S.tmpfile("a") .. ".log", S.tmpfile("b") .. ".log"
      local gate = S.tmpfile("gate")
      local A = worker(logA, { RB_MODE = "hold", RB_CONC = "1", RB_LEASE = "1" })
      assert.truthy(S.wait_for(function() return find(logA, "S", id) end, 20),
        "worker A did not start: " .. (S.read(A.err) or ""))
      local fenceA = tonumber(find(logA, "S", id)[4])
      assert.truthy(S.signal(A, "STOP"))
      local B = worker(logB, { RB_MODE = "gate", RB_GATE = gate, RB_CONC = "1", RB_LEASE = "1" })
      assert.truthy(S.wait_for(function() return find(logB, "S", id) end, 20),
        "worker B did not take the delivery over: " .. (S.read(B.err) or ""))
      local sB = find(logB, "S", id)
      local fenceB = tonumber(sB[4])
      assert.is_true(fenceB > fenceA)
      assert.equal("2", sB[5])
      assert.truthy(S.signal(A, "CONT"))
      local a = S.wait_for(function() return find(logA, "A", id) end, 20)
      assert.truthy(a, "thawed worker A logged no abort: " .. (S.read(A.err) or ""))
      assert.equal("lease", a[3])
      assert.equal("nil", a[4], "ctx:complete() after the abort")
      assert.equal("nil", a[5], "ctx:bury() after the abort")
      assert.equal("nil", a[6], "ctx:extend_lease() after the abort")
      local r = assert(store:get(id))
      assert.equal("processing", r.status)
      assert.equal(fenceB, r.fence)
      assert.is_nil(r.last_error)
      S.write(gate, "go")
      local c = S.wait_for(function() return find(logB, "C", id) end, 20)
      assert.truthy(c, "worker B did not complete")
      assert.equal("true", c[3])
      local done = assert(store:get(id))
      assert.equal("completed", done.status)
      assert.equal(2, done.attempts)
      assert.equal(fenceB, done.fence)
      assert.is_nil(done.last_error)
      assert.equal(0, S.term(A))
      assert.equal(0, S.term(B))
    end)

    it("10,000 deliveries (2,000 on FerretDB) with 3 workers and random SIGKILLs: none lost, no two runs of one delivery overlap", function()
      -- the clock the workers log with must be the one this process reads
      H.near(S.mono(), relaybus.now(), 0.5, "relaybus.now() against CLOCK_MONOTONIC")
      -- FerretDB runs a few hundred deliveries a second (several commands each, see
      -- runtime/stores/mongo/): there the same check runs on fewer, still enough for the kills to land
      -- mid-drain
      local N = tonumber(os.getenv("RELAYBUS_STRESS_N_" .. entry.name:upper()) or "")
        or tonumber(os.getenv("RELAYBUS_STRESS_N") or "")
        or (entry.name == "mongodb" and 2000 or 10000)
      local slow = entry.name == "mongodb"
      local lease = slow and "3" or "1.5"
      local all = {}
      local batch = {}
      for i = 1, N do
        batch[#batch + 1] = { "work", i }
        if #batch == 1000 or i == N then
          local ids = assert(store:enqueue_many(batch))
          for _, id in ipairs(ids) do all[#all + 1] = id end
          batch = {}
        end
      end
      assert.equal(N, #all)
      -- about 50 ms a run: even a fast store takes seconds to drain, so the kills land mid-run
      local env = { RB_SLEEP = "0.02", RB_JITTER = "0.06", RB_CONC = slow and "16" or "64", RB_LEASE = lease }
      local incarnations = {} -- {log=, proc=, ended_at=}
      local slots = {}
      local function start(slot)
        local inc = { log = S.tmpfile("w" .. slot) .. ".log" }
        inc.proc = worker(inc.log, env)
        incarnations[#incarnations + 1] = inc
        slots[slot] = inc
      end
      for slot = 1, 3 do start(slot) end
      local t0 = relaybus.now()
      -- kill a worker that is running deliveries right now (its log has starts without ends)
      local _, kills = H.chaos(store, N, slots, {
        gap = 0.3, busy = function(inc) return count(inc.log, "S") > count(inc.log, "E") end,
        restart = start, more = function(kills) return kills < 8 end,
      })
      for slot = 1, 3 do
        assert.equal(0, S.term(slots[slot].proc), "worker " .. slot .. " did not stop gracefully")
        slots[slot].ended_at = relaybus.now()
      end
      H.drained_through_kills(store, N, t0, kills)

      -- every run of every delivery, as an interval on the monotonic clock
      local runs = {}   -- id -> list of {s, e}
      local ended = {}  -- id -> true when a run logged its end
      for _, inc in ipairs(incarnations) do
        local open = {}
        for _, f in ipairs(parse(inc.log)) do
          if f[1] == "S" then
            open[f[2] .. " " .. f[3]] = { id = f[2], s = tonumber(f[3]) }
          elseif f[1] == "E" then
            local key = f[2] .. " " .. f[3]
            local run = open[key]
            assert.is_table(run, "an end without a start: " .. table.concat(f, " "))
            open[key] = nil
            run.e = tonumber(f[4])
            assert.is_true(run.e >= run.s)
            runs[run.id] = runs[run.id] or {}
            table.insert(runs[run.id], run)
            ended[run.id] = true
          end
        end
        for _, run in pairs(open) do
          -- killed mid-way: it ran until the kill at the latest
          run.e = assert(inc.ended_at)
          runs[run.id] = runs[run.id] or {}
          table.insert(runs[run.id], run)
        end
      end
      local overlaps, missing, reruns = {}, 0, 0
      for _, id in ipairs(all) do
        if not ended[id] then missing = missing + 1 end
        local list = runs[id] or {}
        if #list > 1 then reruns = reruns + 1 end
        table.sort(list, function(a, b) return a.s < b.s end)
        for i = 2, #list do
          if list[i].s < list[i - 1].e then
            overlaps[#overlaps + 1] = string.format("%s: [%.4f, %.4f] and [%.4f, %.4f]",
              id, list[i - 1].s, list[i - 1].e, list[i].s, list[i].e)
          end
        end
      end
      if os.getenv("RELAYBUS_SPEC_VERBOSE") then
        io.stderr:write(string.format("\n%s: %d deliveries in %.1f s, %d kills, %d ran more than once\n",
          entry.name, N, relaybus.now() - t0, kills, reruns))
      end
      assert.equal(0, missing, missing .. " completed deliveries have no finished run in the logs")
      assert.same({}, overlaps)
      assert.is_true(reruns > 0, "no delivery ran twice: the kills took nothing over")
    end)
  end)
end
