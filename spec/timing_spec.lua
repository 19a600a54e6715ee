-- timing_spec.lua -- leases against time itself, on every store: a worker frozen past its lease
-- (SIGSTOP), a loop held by a sibling handler, a handler busy inside C, a claim answered late,
-- a wall clock that steps or is skewed (libfaketime), a server that refuses writes and a full
-- disk. After each, the shared log of runs (spec/support/timing_worker.lua) must show that no
-- run made a side effect once a later run of the same delivery had started.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local D = require "spec.support.dash"
local relaybus = S.relaybus()

local WORKER = S.support .. "/timing_worker.lua"
local FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"

-- Every run in the logs: {id=, pid=, fence=, s=, xs={...}, e=, w=}, by delivery id.
local function runs_of(logs)
  local by_id = {}
  for _, log in ipairs(logs) do
    local open = {}
    for _, f in ipairs(S.parse_log(log)) do
      local ev, id, pid, fence, at = f[1], f[2], f[3], f[4], tonumber(f[5])
      if ev ~= "READY" then
        local key = id .. " " .. pid .. " " .. fence
        if ev == "S" then
          open[key] = { id = id, pid = pid, fence = fence, s = at, xs = {} }
          by_id[id] = by_id[id] or {}
          table.insert(by_id[id], open[key])
        elseif open[key] then
          if ev == "X" then table.insert(open[key].xs, at)
          elseif ev == "E" then open[key].e = at
          elseif ev == "W" then open[key].w = at end
        end
      end
    end
  end
  return by_id
end

-- No side effect of a run after a later run of the same delivery started; fences grow.
local function check_no_overlap(logs, numeric_fences)
  local bad = {}
  for id, list in pairs(runs_of(logs)) do
    table.sort(list, function(a, b) return a.s < b.s end)
    for i = 2, #list do
      local later = list[i]
      for j = 1, i - 1 do
        for _, x in ipairs(list[j].xs) do
          if x > later.s then
            bad[#bad + 1] = string.format("%s: run %s/%s acted at %.4f after run %s/%s started at %.4f",
              id, list[j].pid, list[j].fence, x, later.pid, later.fence, later.s)
          end
        end
      end
      if numeric_fences and tonumber(later.fence) <= tonumber(list[i - 1].fence) then
        bad[#bad + 1] = string.format("%s: fence %s after %s", id, later.fence, list[i - 1].fence)
      end
    end
  end
  assert.same({}, bad)
  return runs_of(logs)
end

-- CPU seconds (user + system) a process has used, from /proc.
local function cpu_seconds(pid)
  local stat = S.read("/proc/" .. pid .. "/stat")
  if not stat then return nil end
  local fields = {}
  for w in stat:gsub("^.*%) ", ""):gmatch("%S+") do fields[#fields + 1] = w end
  return (tonumber(fields[12]) + tonumber(fields[13])) / 100   -- utime, stime (ticks of 1/100 s)
end

for _, entry in ipairs(S.list()) do
  describe("timing on " .. entry.name .. ":", function()
    local store, url, opts
    local logs
    before_each(function()
      store, url, opts = S.open(entry)
      logs = {}
    end)
    after_each(S.reset)
    teardown(function() S.cleanup() end)

    local function worker(env, argv_prefix)
      local log = S.tmpfile("tw") .. ".log"
      logs[#logs + 1] = log
      local e = { RB_PID = tostring(#logs) }
      for k, v in pairs(env or {}) do e[k] = v end
      local argv = {}
      for _, a in ipairs(argv_prefix or {}) do argv[#argv + 1] = a end
      argv[#argv + 1] = S.bin
      argv[#argv + 1] = "run"
      argv[#argv + 1] = WORKER
      local p = S.spawn(WORKER, { url, opts.table or "-", log }, { env = e, argv = argv })
      p.log = log
      assert.truthy(S.wait_for(function()
        for _, f in ipairs(S.parse_log(log)) do if f[1] == "READY" then return true end end
      end, 20), "worker did not start: " .. (S.read(p.err) or ""))
      return p
    end

    local function first(log, ev, id)
      for _, f in ipairs(S.parse_log(log)) do
        if f[1] == ev and (not id or f[2] == id) then return f end
      end
    end

    local function term(p)
      S.signal(p, "TERM")
      return S.wait_exit(p, 15)
    end

    -- Workers A and B on short leases; after 0.5 s A is killed (kill -9) and B frozen
    -- (SIGSTOP) past its leases while C starts and takes over; B thaws; returns A, B, C once
    -- nothing is pending or processing.
    local function kill_one_freeze_one()
      local env = { RB_LEASE = "1", RB_CONC = "4", RB_STEPS = "3", RB_STEP = "0.1" }
      local A, B = worker(env), worker(env)
      S.sleep(0.5)
      S.signal(A, "KILL")
      S.signal(B, "STOP")
      local C = worker(env)
      S.sleep(1.6)
      S.signal(B, "CONT")
      assert.truthy(S.wait_for(function()
        local st = store:stats()
        return st.pending + st.processing == 0
      end, 60), "the deliveries did not drain")
      return A, B, C
    end

    it("a worker frozen (SIGSTOP) past its lease acts no more when thawed: its wait returns nil", function()
      local id = assert(store:enqueue("work", {}))
      local A = worker { RB_LEASE = "1", RB_STEPS = "40", RB_STEP = "0.1" }
      assert.truthy(S.wait_for(function() return first(A.log, "X", id) end, 20))
      S.signal(A, "STOP")
      local B = worker { RB_LEASE = "1", RB_STEPS = "5", RB_STEP = "0.1" }
      assert.truthy(S.wait_for(function() return first(B.log, "E", id) end, 30), "B did not take over")
      S.signal(A, "CONT")
      assert.truthy(S.wait_for(function() return first(A.log, "W", id) end, 20), "A's wait did not fail")
      local runs = check_no_overlap(logs, true)
      assert.equal(2, #runs[id])
      assert.truthy(S.wait_for(function() return assert(store:get(id)).status == "completed" end, 10))
      assert.equal(0, term(A))
      assert.equal(0, term(B))
    end)

    it("a worker frozen (SIGSTOP) in the middle of Lua code past its lease: thawed, its next wait returns nil; it is not interrupted", function()
      local id = assert(store:enqueue("work", {}))
      local A = worker { RB_LEASE = "1", RB_MODE = "luabusy" }
      assert.truthy(S.wait_for(function() return first(A.log, "X", id) end, 20))
      S.signal(A, "STOP")
      S.sleep(2)        -- past the lease, its margin and the grace, by far
      S.signal(A, "CONT")
      assert.truthy(S.wait_for(function() return first(A.log, "W", id) end, 10), "A's wait did not fail: "
        .. tostring(S.read(A.err)))
      assert.is_nil((S.read(A.err) or ""):find("did not return", 1, true), "A was interrupted")
      assert.equal(0, term(A))
    end)

    it("a delivery whose worker is frozen (SIGSTOP) past its lease counts as stalled in stats, then not once taken over", function()
      local id = assert(store:enqueue("work", {}))
      local A = worker { RB_LEASE = "1", RB_STEPS = "100", RB_STEP = "0.1" }
      assert.truthy(S.wait_for(function() return first(A.log, "X", id) end, 20))
      local st = assert(store:stats())
      assert.equal(1, st.processing)
      assert.equal(0, st.stalled)         -- its lease is live
      S.signal(A, "STOP")
      assert.truthy(S.wait_for(function() return assert(store:stats()).stalled == 1 end, 10), "never stalled")
      st = assert(store:stats())
      assert.equal(1, st.processing)
      assert.equal(1, st.due)             -- a claim would take it over
      local B = worker { RB_LEASE = "5", RB_STEPS = "30", RB_STEP = "0.1" }
      assert.truthy(S.wait_for(function() return first(B.log, "S", id) end, 20), "B did not take over")
      st = assert(store:stats())
      assert.equal(1, st.processing)
      assert.equal(0, st.stalled)
      S.signal(A, "KILL")
      S.wait_exit(A, 5)
      assert.equal(0, term(B))
    end)

    it("a delivery cancelled while its worker is frozen (SIGSTOP): thawed, its handler sees reason cancelled and nothing it settles is written", function()
      local id = assert(store:enqueue("work", {}))
      local A = worker { RB_LEASE = "3", RB_STEPS = "100", RB_STEP = "0.1" }
      assert.truthy(S.wait_for(function() return first(A.log, "X", id) end, 20))
      S.signal(A, "STOP")
      assert.is_true(assert(store:cancel(id)))
      S.sleep(0.3)
      S.signal(A, "CONT")
      assert.truthy(S.wait_for(function() return first(A.log, "E", id) end, 20), "A's handler did not end")
      local w = first(A.log, "W", id)
      assert.truthy(w, "A's wait never failed")
      assert.equal("cancelled", w[6])
      S.sleep(0.3)                    -- (its completion, had it been sent, is answered by now)
      local r = assert(store:get(id))
      assert.equal("cancelled", r.status)
      assert.equal(1, r.attempts)
      assert.equal(0, term(A))
    end)

    it("two workers, one killed (kill -9) and one frozen, while deliveries are cancelled: each cancelled one stays cancelled, every other completes", function()
      local ids = {}
      for i = 1, 24 do ids[i] = assert(store:enqueue("work", { i = i })) end
      local env = { RB_LEASE = "1", RB_CONC = "4", RB_STEPS = "4", RB_STEP = "0.1" }
      local A, B = worker(env), worker(env)
      local cancelled = {}
      for i = 1, #ids, 2 do
        if i == 7 then S.signal(A, "KILL") end
        if i == 13 then S.signal(B, "STOP") end
        if i == 17 then S.signal(B, "CONT") end
        local done, err = store:cancel(ids[i])
        assert.is_boolean(done, err)
        if done then cancelled[ids[i]] = true end     -- false: it had completed already
        S.sleep(0.1)
      end
      local C = worker(env)           -- takes over what A held when it died
      assert.truthy(S.wait_for(function()
        local st = store:stats()
        return st.pending + st.processing == 0
      end, 60), "the deliveries did not all settle")
      for i, id in ipairs(ids) do
        local r = assert(store:get(id))
        if cancelled[id] then
          assert.equal("cancelled", r.status, id)
        else
          assert.equal("completed", r.status, id .. " (" .. i .. "): " .. tostring(r.last_error))
        end
      end
      assert.is_true(next(cancelled) ~= nil, "nothing was cancelled")
      assert.equal(0, term(B))
      assert.equal(0, term(C))
      S.wait_exit(A, 5)
    end)

    it("a concurrency limit under three workers, one killed (kill -9) and one frozen past its lease: never more than M act at once", function()
      assert(store:limit("work", { concurrency = 2 }))
      local ids = {}
      for i = 1, 16 do ids[i] = assert(store:enqueue("work", { i = i })) end
      local A, B, C = kill_one_freeze_one()
      for _, id in ipairs(ids) do assert.equal("completed", assert(store:get(id)).status, id) end
      local runs = check_no_overlap(logs, true)
      -- each run acts from its start to its last side effect; at no moment more than 2
      local edges = {}
      for _, list in pairs(runs) do
        for _, r in ipairs(list) do
          local last = r.s
          for _, x in ipairs(r.xs) do last = math.max(last, x) end
          edges[#edges + 1] = { r.s, 1 }
          edges[#edges + 1] = { last, -1 }
        end
      end
      table.sort(edges, function(p, q) return p[1] < q[1] or (p[1] == q[1] and p[2] < q[2]) end)
      local now, most = 0, 0
      for _, e in ipairs(edges) do
        now = now + e[2]
        most = math.max(most, now)
      end
      assert.is_true(most <= 2, most .. " runs acted at once")
      assert.equal(2, most)
      assert.equal(0, term(B))
      assert.equal(0, term(C))
      S.wait_exit(A, 5)
    end)

    it("ordered groups under three workers, one killed (kill -9) and one frozen past its lease: no two of a group overlap, each group in order", function()
      local group_of, ids, order_of = {}, {}, {}
      for i = 1, 6 do
        for _, g in ipairs { "a", "b", "c", "d", "e", "f" } do
          local id = assert(store:enqueue("work", { i = i }, { group = g }))
          group_of[id] = g
          ids[#ids + 1] = id
          order_of[id] = #ids
        end
      end
      local A, B, C = kill_one_freeze_one()
      for _, id in ipairs(ids) do assert.equal("completed", assert(store:get(id)).status, id) end
      local runs = check_no_overlap(logs, true)
      -- within a group, every side effect of a delivery comes before the first start of the
      -- next delivery of the group, in enqueue order
      local by_group = {}
      for id, list in pairs(runs) do
        local g = group_of[id]
        if g then
          local first_s, last_x = math.huge, -math.huge
          for _, r in ipairs(list) do
            first_s = math.min(first_s, r.s)
            for _, x in ipairs(r.xs) do last_x = math.max(last_x, x) end
          end
          by_group[g] = by_group[g] or {}
          table.insert(by_group[g], { id = id, n = order_of[id], s = first_s, x = last_x })
        end
      end
      local bad = {}
      for g, list in pairs(by_group) do
        assert.equal(6, #list, "group " .. g)
        table.sort(list, function(p, q) return p.n < q.n end)
        for k = 2, #list do
          if not (list[k - 1].x < list[k].s) then
            bad[#bad + 1] = string.format("group %s: %s acted at %.4f, %s started at %.4f", g,
              list[k - 1].id, list[k - 1].x, list[k].id, list[k].s)
          end
        end
      end
      assert.same({}, bad)
      assert.equal(0, term(B))
      assert.equal(0, term(C))
      S.wait_exit(A, 5)
    end)

    it("a schedule under three workers, one killed (kill -9) and one frozen past its lease: each tick enqueued once, none missed", function()
      local A, B = worker { RB_LEASE = "1" }, worker { RB_LEASE = "1" }
      assert(store:schedule("tk", { every = 1, topic = "tick", payload = { n = 1 } }))
      local first = assert(store:schedules())[1].next_at
      S.sleep(1.3)
      S.signal(A, "KILL")
      S.signal(B, "STOP")
      local C = worker { RB_LEASE = "1" }
      S.sleep(2.2)
      S.signal(B, "CONT")
      S.sleep(2)
      local last = assert(store:schedules())[1].next_at
      assert.equal(0, term(B))
      assert.equal(0, term(C))
      S.wait_exit(A, 5)
      local ticks = assert(store:list { topic = "tick", limit = 1000 })
      table.sort(ticks, function(p, q) return p.run_at < q.run_at end)
      local keys = {}
      for _, r in ipairs(ticks) do
        assert.is_nil(keys[r.key], "tick enqueued twice: " .. r.key)
        keys[r.key] = true
      end
      -- every tick from the first to the one before next_at, one second apart: none missed
      -- (a catch-up after the freeze would leave a gap; C ran all along)
      assert.is_true(#ticks >= 4, #ticks .. " ticks")
      for i, r in ipairs(ticks) do
        assert.is_true(math.abs(r.run_at - (first + i - 1)) < 0.001,
          string.format("tick %d at %.3f, want %.3f", i, r.run_at, first + i - 1))
      end
      assert.is_true(math.abs(last - (first + #ticks)) < 0.001, "next_at follows the last tick")
    end)

    it("a loop held by a sibling handler past a lease: the waiting run acts no more when the loop frees", function()
      local id = assert(store:enqueue("work", {}))
      local A = worker { RB_LEASE = "1", RB_STEPS = "60", RB_STEP = "0.1", RB_BLOCK = "3" }
      assert.truthy(S.wait_for(function() return first(A.log, "X", id) end, 20))
      assert(store:enqueue("block", {}))
      local B = worker { RB_LEASE = "1", RB_STEPS = "5", RB_STEP = "0.1" }
      assert.truthy(S.wait_for(function() return first(B.log, "E", id) end, 30), "B did not take over")
      assert.truthy(S.wait_for(function() return first(A.log, "W", id) end, 20), "A's wait did not fail")
      check_no_overlap(logs, true)
      assert.truthy(S.wait_for(function() return assert(store:get(id)).status == "completed" end, 10))
      assert.equal(0, term(A))
      assert.equal(0, term(B))
    end)

    it("a handler busy inside C past its lease is stopped before anyone can take the delivery over", function()
      local id = assert(store:enqueue("work", {}, { max_attempts = 5 }))
      local A = worker { RB_LEASE = "1", RB_MODE = "cbound" }
      assert.truthy(S.wait_for(function() return first(A.log, "X", id) end, 20))
      local B = worker { RB_LEASE = "1", RB_STEPS = "3", RB_STEP = "0.05" }
      -- the next run may be B's or A's own (both poll once the lease expired), as long as it
      -- started only after the busy one was stopped
      assert.truthy(S.wait_for(function() return first(B.log, "E", id) or first(A.log, "E", id) end, 30),
        "nobody took over")
      local runs = check_no_overlap(logs, true)
      local acted = false
      for _, r in ipairs(runs[id]) do if r.pid == "1" and #r.xs > 0 then acted = true end end
      assert.is_true(acted, "A's busy run left no side effect in the log")
      assert.truthy(S.wait_for(function() return assert(store:get(id)).status == "completed" end, 10))
      assert.equal(0, term(A))
      assert.equal(0, term(B))
    end)

    -- A container restored by CRIU runs in a time namespace of its own: its boot clock is
    -- offset from the host's, on the same boot.
    it("a worker in another time namespace (boot clock 3600 s ahead) never takes over a live lease, and takes over a dead one", function()
      local ns = { "unshare", "--time", "--boottime", "3600" }
      local probe = io.popen("unshare --time --boottime 3600 true 2>&1; echo $?")
      local said = probe:read("a")
      probe:close()
      assert.truthy(said:match("0%s*$"), "unshare --time is not available (needs root): " .. said)
      local ids = {}
      for i = 1, 4 do ids[i] = assert(store:enqueue("work", { i = i })) end
      local A = worker { RB_LEASE = "2", RB_STEPS = "30", RB_STEP = "0.1" }
      assert.truthy(S.wait_for(function()
        for _, id in ipairs(ids) do if not first(A.log, "X", id) then return false end end
        return true
      end, 20))
      local B = worker({ RB_LEASE = "2", RB_STEPS = "2", RB_STEP = "0.05" }, ns)
      assert.truthy(S.wait_for(function()
        for _, id in ipairs(ids) do if not first(A.log, "E", id) then return false end end
        return true
      end, 30), "A did not finish")
      local runs = check_no_overlap(logs, true)
      for _, id in ipairs(ids) do assert.equal(1, #runs[id], "the worker in the namespace ran it too") end
      -- a dead holder's lease: taken over by the worker in the namespace once it expired
      assert.equal(0, term(A))
      S.signal(B, "STOP")   -- so that C claims it
      local dead = assert(store:enqueue("work", {}))
      local C = worker { RB_LEASE = "2", RB_STEPS = "100", RB_STEP = "0.1" }
      assert.truthy(S.wait_for(function() return first(C.log, "X", dead) end, 20))
      S.signal(C, "KILL")
      S.wait_exit(C, 10)
      S.signal(B, "CONT")
      assert.truthy(S.wait_for(function() return first(B.log, "E", dead) end, 30),
        "the worker in the namespace did not take over a dead lease")
      check_no_overlap(logs, true)
      assert.equal(0, term(B))
    end)

    if entry.kind ~= "mongodb" then  -- transactional handlers need SQL here
      -- The side table of transactional runs: (id, fence) of every run that committed.
      local function side_table()
        local side = S.unique("side")
        assert(store:transaction(function(tx)
          assert(tx:exec("CREATE TABLE " .. side .. " (id TEXT, fence INTEGER)"))
        end))
        return side
      end
      local function side_rows(side)
        local ok, rows = store:transaction(function(tx)
          return tx:query("SELECT id, count(*) AS n FROM " .. side .. " GROUP BY id")
        end)
        assert.is_true(ok, rows)
        local by_id = {}
        for _, r in ipairs(rows) do by_id[r.id] = r.n end
        return by_id
      end

      it("transactional handlers of three workers contending for the store: each delivery runs once, none is buried", function()
        local side = side_table()
        local ids = {}
        for i = 1, 45 do ids[i] = assert(store:enqueue("work", { i = i }, { max_attempts = 3 })) end
        -- 45 runs of 0.1 s hold SQLite's one write lock in turn for 4.5 s, past the 1.5 s
        -- lease of the 15 that each worker claims at once
        local env = { RB_LEASE = "1.5", RB_CONC = "15", RB_STEPS = "1", RB_STEP = "0.1", RB_SIDE = side }
        local ws = { worker(env), worker(env), worker(env) }
        assert.truthy(S.wait_for(function()
          local st = store:stats()
          return st.pending + st.processing == 0
        end, 60), "the deliveries did not all settle")
        check_no_overlap(logs, true)
        local rows = side_rows(side)
        for _, id in ipairs(ids) do
          local r = assert(store:get(id))
          assert.equal("completed", r.status, id .. ": " .. tostring(r.last_error))
          assert.equal(1, rows[id], id)
        end
        for _, w in ipairs(ws) do assert.equal(0, term(w)) end
      end)

      it("a transactional handler running three times its lease is renewed and completes, and nobody takes over", function()
        local side = side_table()
        local id = assert(store:enqueue("work", {}, { max_attempts = 1 }))
        local A = worker { RB_LEASE = "1", RB_STEPS = "30", RB_STEP = "0.1", RB_SIDE = side }
        assert.truthy(S.wait_for(function() return first(A.log, "X", id) end, 20))
        local B = worker { RB_LEASE = "1", RB_STEPS = "1", RB_STEP = "0.1", RB_SIDE = side }
        assert.truthy(S.wait_for(function() return first(A.log, "E", id) end, 30),
          "A did not finish: " .. (S.read(A.err) or ""))
        assert.truthy(S.wait_for(function() return assert(store:get(id)).status ~= "processing" end, 10))
        local runs = check_no_overlap(logs, true)
        assert.equal(1, #runs[id])
        local r = assert(store:get(id))
        assert.equal("completed", r.status, tostring(r.last_error))
        assert.equal(1, r.attempts)
        assert.same({ [id] = 1 }, side_rows(side))
        assert.equal(0, term(A))
        assert.equal(0, term(B))
      end)
    end

    if entry.name ~= "mongodb" then  -- MongoDB has no locks; the fault-injection spec answers late there
      it("a claim answered after its lease was timed out uses no attempt: max_attempts = 1 still runs", function()
        local id = assert(store:enqueue("work", {}, { max_attempts = 1 }))
        -- another session holds the table (PostgreSQL) or the write lock (SQLite) for 3 s
        local ready = S.tmpfile("locked")
        local locker = S.spawn(S.support .. "/locker.lua", { url, opts.table or "-", "3", ready })
        assert.truthy(S.wait_for(function() return S.exists(ready) end, 20), "the locker did not lock")
        local A = worker { RB_LEASE = "1", RB_STEPS = "2", RB_STEP = "0.05" }
        assert.truthy(S.wait_for(function() return first(A.log, "E", id) end, 30),
          "the delivery never ran: " .. (S.read(A.err) or ""))
        S.wait_exit(locker, 20)
        assert.truthy(S.wait_for(function() return assert(store:get(id)).status ~= "processing" end, 10))
        local r = assert(store:get(id))
        assert.equal("completed", r.status)
        assert.is_nil(r.last_error)
        assert.equal(0, term(A))
      end)
    end

    describe("wall clocks (libfaketime)", function()
      -- The command prefix that runs a worker with its wall clock moved: by an offset ("+60s"),
      -- or by what a file says, read at every call (the spec rewrites it to step the clock).
      -- The monotonic and boot clocks stay true, as an NTP step leaves them.
      local function faked(offset_or_file)
        local pre = os.getenv("RELAYBUS_PRELOAD")   -- the ASan runtime must stay first
        -- Through test.sh's LeakSanitizer wrapper (RELAYBUS_BIN) the preload is handed to the
        -- wrapper, which sets it for relaybus alone: its shell hangs under libfaketime + ASan.
        local var = os.getenv("RELAYBUS_BIN") and "RELAYBUS_CHILD_PRELOAD=" or "LD_PRELOAD="
        local argv = { "env", var .. (pre and pre ~= "" and (pre .. ":") or "") .. FAKETIME_LIB,
                       "FAKETIME_DONT_FAKE_MONOTONIC=1", "FAKETIME_NO_CACHE=1" }
        if offset_or_file:sub(1, 1) == "/" then
          argv[#argv + 1] = "FAKETIME_TIMESTAMP_FILE=" .. offset_or_file
        else
          argv[#argv + 1] = "FAKETIME=" .. offset_or_file
        end
        return argv
      end

      before_each(function()
        assert(S.exists(FAKETIME_LIB), "libfaketime is missing (Debian's faketime)")
      end)

      it("a worker whose clock runs 60 s ahead never takes over a live lease", function()
        local id = assert(store:enqueue("work", {}))
        local A = worker { RB_LEASE = "2", RB_STEPS = "30", RB_STEP = "0.1" }
        assert.truthy(S.wait_for(function() return first(A.log, "X", id) end, 20))
        local B = worker({ RB_LEASE = "2", RB_STEPS = "2", RB_STEP = "0.05" }, faked("+60s"))
        assert.truthy(S.wait_for(function() return first(A.log, "E", id) end, 30), "A did not finish")
        local runs = check_no_overlap(logs, true)
        assert.equal(1, #runs[id], "the skewed worker ran it too")
        assert.truthy(S.wait_for(function() return assert(store:get(id)).status == "completed" end, 10))
        assert.equal(0, term(A))
        assert.equal(0, term(B))
      end)

      it("a worker whose clock steps 60 s forward mid-run keeps its lease, and nobody takes over", function()
        local id = assert(store:enqueue("work", {}))
        local clock = S.tmpfile("clock")
        S.write(clock, "+0\n")
        local A = worker({ RB_LEASE = "2", RB_STEPS = "30", RB_STEP = "0.1" }, faked(clock))
        assert.truthy(S.wait_for(function() return first(A.log, "X", id) end, 20))
        S.write(clock, "+60s\n")
        local B = worker { RB_LEASE = "2", RB_STEPS = "2", RB_STEP = "0.05" }
        assert.truthy(S.wait_for(function() return first(A.log, "E", id) end, 30),
          "A did not finish: " .. (S.read(A.err) or ""))
        local runs = check_no_overlap(logs, true)
        assert.equal(1, #runs[id], "someone took over")
        assert.truthy(S.wait_for(function() return assert(store:get(id)).status == "completed" end, 10))
        assert.equal(0, term(A))
        assert.equal(0, term(B))
      end)

      it("a delivery buried and kicked while its worker is frozen runs again only after the old lease, on a clock 60 s ahead too", function()
        local id = assert(store:enqueue("work", {}))
        local A = worker { RB_LEASE = "3", RB_STEPS = "60", RB_STEP = "0.1" }
        assert.truthy(S.wait_for(function() return first(A.log, "X", id) end, 20))
        S.signal(A, "STOP")     -- it can neither renew nor learn of the bury
        D.with_server(store, { token = D.TOKEN }, function(_, call)
          assert.equal(200, (call("POST", "/api/deliveries/" .. id .. "/bury", D.auth)))
          assert.equal(200, (call("POST", "/api/deliveries/" .. id .. "/kick", D.auth)))
        end)
        -- on SQLite only the boot clock keeps this one out: its wall clock is past run_at
        local B = worker({ RB_LEASE = "3", RB_STEPS = "2", RB_STEP = "0.05" }, faked("+60s"))
        S.sleep(0.5)
        S.signal(A, "CONT")     -- thawed inside its lease: it acts until it learns the lease is gone
        assert.truthy(S.wait_for(function() return first(A.log, "W", id) end, 20), "A's wait did not fail")
        assert.equal(0, term(A))  -- B alone may run it again: the one whose clock is ahead
        assert.truthy(S.wait_for(function() return first(B.log, "E", id) end, 30),
          "the kicked delivery never ran again: " .. (S.read(B.err) or ""))
        local runs = check_no_overlap(logs, true)
        assert.equal(2, #runs[id])
        assert.truthy(S.wait_for(function() return assert(store:get(id)).status == "completed" end, 10))
        assert.equal(0, term(B))
      end)

      it("d:every in two processes, one 60 s ahead, never runs twice at once", function()
        local env = { RB_MODE = "every", RB_INTERVAL = "0.6", RB_STEPS = "4", RB_STEP = "0.1", RB_LEASE = "2" }
        local A = worker(env)
        local B = worker(env, faked("+60s"))
        S.sleep(5)
        assert.equal(0, term(A), S.read(A.err))
        assert.equal(0, term(B), S.read(B.err))
        local bad = {}
        local all = {}
        for _, list in pairs(runs_of(logs)) do for _, r in ipairs(list) do all[#all + 1] = r end end
        table.sort(all, function(a, b) return a.s < b.s end)
        for i = 2, #all do
          local prev_end = all[i - 1].e or all[i - 1].w or math.huge
          if all[i].s < prev_end then
            bad[#bad + 1] = string.format("%s/%s [%.3f, %.3f] overlaps %s/%s from %.3f", all[i - 1].pid,
              all[i - 1].fence, all[i - 1].s, prev_end, all[i].pid, all[i].fence, all[i].s)
          end
        end
        assert.same({}, bad)
        assert.is_true(#all >= 4, "every ran only " .. #all .. " times in 5 s")
      end)
    end)

    describe("a store that refuses writes", function()
      -- Each makes every settle fail for a while, then lets them through: meanwhile the worker
      -- tries again with backoff (little CPU, few log lines), and afterwards nothing is lost.
      local function refusing(refuse, allow)
        local ids = {}
        for i = 1, 20 do ids[i] = assert(store:enqueue("work", { i = i })) end
        refuse()
        local A = worker { RB_LEASE = "20", RB_STEPS = "1", RB_STEP = "0.01", RB_CONC = "20" }
        local pid = tonumber(S.read(A.pidfile):match("%d+"))
        S.sleep(1)
        local cpu0 = cpu_seconds(pid)
        S.sleep(3)
        local cpu = cpu_seconds(pid) - cpu0
        allow()
        assert.truthy(S.wait_for(function() return assert(store:stats()).completed == 20 end, 30),
          "not all completed once writes were allowed again")
        assert.is_true(cpu < 0.6, string.format("the worker spun: %.2f s of CPU in 3 s", cpu))
        local lines = 0
        for line in (S.read(A.err) or ""):gmatch("[^\n]+") do
          lines = lines + 1
          assert.is_nil(line:find("\r"))
        end
        assert.is_true(lines <= 20, lines .. " log lines in 4 s")
        assert.equal(0, term(A))
        return ids
      end

      if entry.name == "postgresql" then
        it("a read-only PostgreSQL (every settle refused) is waited out with backoff, and nothing is lost", function()
          local t = opts.table
          local admin = assert(relaybus.open(url, opts))
          local function sql(q)
            assert(admin:transaction(function(tx) tx:exec(q) end))
          end
          refusing(function()
            sql("CREATE OR REPLACE FUNCTION " .. t .. "_ro() RETURNS trigger LANGUAGE plpgsql AS $$"
              .. " BEGIN RAISE EXCEPTION 'cannot execute UPDATE in a read-only transaction'; END $$")
            sql("CREATE TRIGGER " .. t .. "_ro BEFORE UPDATE ON " .. t .. " FOR EACH ROW"
              .. " WHEN (OLD.status = 'processing' AND NEW.status <> 'processing')"
              .. " EXECUTE FUNCTION " .. t .. "_ro()")
          end, function()
            sql("DROP TRIGGER " .. t .. "_ro ON " .. t)
          end)
          admin:close()
        end)
      end

      if entry.name == "sqlite" then
        it("a full disk under SQLite is waited out with backoff, and nothing is lost", function()
          local dir = S.tmpfile("disk")
          os.execute("mkdir -p " .. S.quote(dir))
          assert.is_true(os.execute("mount -t tmpfs -o size=4m tmpfs " .. S.quote(dir) .. " 2>/dev/null")
            or os.getenv("CI") ~= "true", "cannot mount a small tmpfs for the full-disk test")
          local path = dir .. "/full.db"
          store = assert(relaybus.open("sqlite:" .. path))
          url, opts = "sqlite:" .. path, {}
          local filler = dir .. "/filler"
          refusing(function()
            os.execute("dd if=/dev/zero of=" .. S.quote(filler) .. " bs=64k 2>/dev/null")
          end, function()
            os.remove(filler)
          end)
          store:close()
          os.execute("umount " .. S.quote(dir) .. " 2>/dev/null")
        end)
      end
    end)
  end)
end
