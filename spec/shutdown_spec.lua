-- shutdown_spec.lua -- each clause of docs/lua.md "Shutdown" (d:stop), with the times measured
-- against the stop's timeout T: stop claiming; wait for running handlers up to 4/5 of T; abort
-- the rest (reason "shutdown") and release them without consuming an attempt; end by T, and
-- abandon what the store could not confirm; `relaybus run` stops on SIGINT/SIGTERM and exits at
-- once on a second signal.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local relaybus = S.relaybus()

local TOL = 0.3 -- how far past T a stop may end (scheduling, a loaded 2-core machine)

for _, entry in ipairs(S.list()) do
  describe("shutdown on " .. entry.name .. ":", function()
    local store, url, opts, tbl
    before_each(function()
      store, url, opts, tbl = S.open(entry)
    end)
    after_each(S.reset)
    teardown(function() S.cleanup() end)

    it("stop stops claiming: deliveries not yet started stay pending with no attempt", function()
      local ids = assert(store:enqueue_many {
        { "sd.claim", 1 }, { "sd.claim", 2 }, { "sd.claim", 3 }, { "sd.claim", 4 },
      })
      local d = H.dispatcher(store, { concurrency = 1 })
      local stop = H.stopper(d)
      local runs = 0
      d:handle("sd.claim", function(delivery, ctx)
        runs = runs + 1
        stop(5)
        ctx:sleep(0.2)
      end)
      assert.is_true(H.run(d, 10))
      assert.equal(1, runs)
      local st = assert(store:stats())
      assert.equal(1, st.completed)
      assert.equal(3, st.pending)
      for _, id in ipairs(ids) do
        local r = assert(store:get(id))
        if r.status == "pending" then assert.equal(0, r.attempts) end
      end
    end)

    it("deliveries claimed ahead of the slots are handed back by the stop at once, unrun, with no attempt", function()
      local items = {}
      for i = 1, 400 do items[i] = { "sd.ahead", i } end
      local ids = assert(store:enqueue_many(items))
      -- A long lease: runs claimed ahead wait for a slot up to a third of it before they are
      -- handed back, and the stop below must find them still waiting however slow the machine.
      local d = H.dispatcher(store, { concurrency = 2, lease_duration = 30 })
      local stop = H.stopper(d)
      local starts, hanging, seen_ahead, stopped_at, at_stop, released = 0, 0, 0, nil, nil, nil
      local ran = {}
      d:handle("sd.ahead", function(delivery, ctx)
        starts = starts + 1
        assert(not ran[delivery.id], "a delivery ran twice")
        ran[delivery.id] = true
        -- The first 100 are fast: the dispatcher learns to claim ahead. Then one hangs, and a
        -- second hangs as soon as one starts with others claimed ahead waiting behind it (how
        -- many are claimed ahead when depends on the machine's speed: waiting for the state
        -- to test, not assuming it, keeps a loaded CI from missing it).
        if starts <= 100 or (hanging == 1 and d:stats().ahead == 0) then return end
        hanging = hanging + 1
        while not ctx.signal.aborted do
          local st = d:stats()
          if hanging == 2 and st.ahead > 0 and not stopped_at then
            seen_ahead, stopped_at = st.ahead, relaybus.now()
            stop(5)
            at_stop = d:stats()     -- handed back at once: nothing waits for a slot
            -- their releases land while the 2 hanging runs go on (until 4/5 of T); the
            -- time they take is the store's, so it is watched, not bounded
            relaybus.spawn(function()
              while d:stats().active > 2 do relaybus.sleep(0.01) end
              released = { active = d:stats().active, hanging_on = not ctx.signal.aborted }
            end)
          end
          ctx:sleep(0.005)
        end
      end)
      assert.is_true(H.run(d, 20))
      assert.is_true(seen_ahead > 0, "nothing was claimed ahead of the 2 hanging runs")
      assert.equal(2, hanging)
      assert.equal(0, at_stop.ahead)
      assert.is_true(at_stop.stopping)
      assert.is_table(released, "the releases of the runs claimed ahead never landed")
      assert.equal(2, released.active)      -- only the hanging runs are left
      assert.is_true(released.hanging_on)   -- and they were not cut short for the releases
      local completed, pending = 0, 0
      for _, id in ipairs(ids) do
        local r = assert(store:get(id))
        if r.status == "completed" then
          completed = completed + 1
          assert.equal(1, r.attempts)
          assert.is_true(ran[id])
        else
          pending = pending + 1
          assert.equal("pending", r.status)
          assert.equal(0, r.attempts)
        end
      end
      assert.equal(starts - 2, completed)   -- all but the two hanging
      assert.equal(400 - completed, pending)
      assert.is_true(starts >= 102)
    end)

    it("handlers that finish within 4/5 of T complete, and stop returns once they have", function()
      local ids = assert(store:enqueue_many { { "sd.fin", 0.2 }, { "sd.fin", 0.5 }, { "sd.fin", 1.0 } })
      local d = H.dispatcher(store, { concurrency = 3 })
      local stop = H.stopper(d)
      local started, aborted = 0, 0
      d:handle("sd.fin", function(delivery, ctx)
        started = started + 1
        ctx.signal:on_abort(function() aborted = aborted + 1 end)
        if started == 3 then stop(2) end
        local ok = ctx:sleep(delivery.payload)
        assert(ok, "the sleep was cut short")
      end)
      assert.is_true(H.run(d, 10))
      assert.equal(3, started)
      assert.equal(0, aborted)
      for _, id in ipairs(ids) do assert.equal("completed", assert(store:get(id)).status) end
      assert.is_number(stop.elapsed)
      assert.is_true(stop.elapsed >= 0.8 and stop.elapsed <= 1.0 + TOL,
        string.format("stop took %.3f s for a 1 s handler (T = 2)", stop.elapsed))
    end)

    it("handlers still running at 4/5 of T are aborted with reason shutdown and released, the attempt not counted", function()
      local fast = assert(store:enqueue("sd.mix", 0.3, { max_attempts = 5 }))
      local slow = assert(store:enqueue("sd.mix", 30, { max_attempts = 5 }))
      local d = H.dispatcher(store, { concurrency = 2, backoff = function() return 100 end })
      local stop = H.stopper(d)
      local started, t_stop = 0, nil
      local abort_at, reasons, hooks = nil, {}, 0
      d:handle("sd.mix", function(delivery, ctx)
        started = started + 1
        if started == 2 then t_stop = relaybus.now(); stop(1) end
        ctx.signal:on_abort(function(reason) hooks = hooks + 1; reasons[#reasons + 1] = reason end)
        local ok, why = ctx:sleep(delivery.payload)
        if not ok then
          abort_at = relaybus.now()
          assert.equal("aborted", why)
          assert.equal("shutdown", ctx.signal.reason)
        end
      end)
      assert.is_true(H.run(d, 10))
      assert.equal(2, started)
      assert.equal("completed", assert(store:get(fast)).status)
      local r = assert(store:get(slow))
      assert.equal("pending", r.status)
      assert.equal(0, r.attempts)
      assert.is_nil(r.last_error)
      assert.is_number(abort_at, "the slow handler was not aborted")
      local at = abort_at - t_stop
      assert.is_true(at >= 0.75 and at <= 0.8 + TOL,
        string.format("aborted %.3f s into a stop with T = 1 (want 0.8)", at))
      assert.equal(1, hooks)
      assert.same({ "shutdown" }, reasons)
      assert.is_true(stop.elapsed <= 1 + TOL, string.format("stop took %.3f s, T = 1", stop.elapsed))
    end)

    it("a handler that ignores the abort and keeps running Lua is interrupted, released, and stop ends by T", function()
      local id = assert(store:enqueue("sd.spin", 1, { max_attempts = 5 }))
      local d = H.dispatcher(store)
      local stop = H.stopper(d)
      local after_abort = false
      d:handle("sd.spin", function(delivery, ctx)
        stop(1)
        ctx:sleep(30)
        after_abort = true
        while true do end -- never yields, never returns
      end)
      assert.is_true(H.run(d, 10))
      assert.is_true(after_abort)
      assert.is_true(stop.elapsed <= 1 + TOL, string.format("stop took %.3f s, T = 1", stop.elapsed))
      local r = assert(store:get(id))
      assert.equal("pending", r.status)
      assert.equal(0, r.attempts)
    end)

    it("a handler that ignores the abort and keeps calling ctx:sleep is interrupted, released, and stop ends by T", function()
      local id = assert(store:enqueue("sd.loop", 1, { max_attempts = 5 }))
      local d = H.dispatcher(store)
      local stop = H.stopper(d)
      local failed_sleeps = 0
      d:handle("sd.loop", function(delivery, ctx)
        stop(1)
        while true do
          if not ctx:sleep(0.05) then failed_sleeps = failed_sleeps + 1 end
        end
      end)
      assert.is_true(H.run(d, 10))
      assert.is_true(failed_sleeps > 0)
      assert.is_true(stop.elapsed <= 1 + TOL, string.format("stop took %.3f s, T = 1", stop.elapsed))
      local r = assert(store:get(id))
      assert.equal("pending", r.status)
      assert.equal(0, r.attempts)
    end)

    it("stop() without a timeout uses shutdown_timeout", function()
      local id = assert(store:enqueue("sd.default", 1))
      local d = H.dispatcher(store, { shutdown_timeout = 1 })
      local t_stop, abort_at, elapsed
      d:handle("sd.default", function(delivery, ctx)
        relaybus.spawn(function()
          t_stop = relaybus.now()
          d:stop()
          elapsed = relaybus.now() - t_stop
        end)
        ctx:sleep(30)
        abort_at = relaybus.now()
      end)
      assert.is_true(H.run(d, 10))
      assert.is_number(abort_at)
      local at = abort_at - t_stop
      assert.is_true(at >= 0.75 and at <= 0.8 + TOL, string.format("aborted at %.3f s, want 0.8", at))
      assert.is_true(elapsed <= 1 + TOL, string.format("stop took %.3f s, T = 1", elapsed))
      assert.equal("pending", assert(store:get(id)).status)
    end)

    if entry.name ~= "mongodb" then
      -- (MongoDB: no portable way to hold a write lock against the store from outside)
      it("a delivery whose release cannot be confirmed by T is abandoned, and runs again after the lease", function()
        local id = assert(store:enqueue("sd.locked", 1, { max_attempts = 5 }))
        local ready = S.tmpfile("locked")
        -- concurrency 1: no claim is tried while the lock is held, only the release
        local d = H.dispatcher(store, { lease_duration = 6, concurrency = 1 })
        local stop = H.stopper(d)
        local claimed_at, locked
        d:handle("sd.locked", function(delivery, ctx)
          claimed_at = relaybus.now()
          S.spawn(S.support .. "/locker.lua", { url, opts.table or "-", "3", ready })
          locked = H.poll(function() return S.exists(ready) end, 5)
          stop(1)
          ctx:sleep(30)
        end)
        assert.is_true(H.run(d, 15))
        assert.truthy(locked, "the locker did not take the lock")
        assert.is_true(stop.elapsed <= 1 + TOL,
          string.format("stop took %.3f s with the store locked, T = 1", stop.elapsed))
        -- after the locker let go, another dispatcher (new connection) gets the delivery again:
        -- at once when the late release landed, else after the abandoned lease expired
        local other = assert(relaybus.open(url, opts))
        local d2 = H.dispatcher(other)
        local stop2 = H.stopper(d2)
        local rerun
        d2:handle("sd.locked", function(delivery, ctx)
          rerun = { at = relaybus.now(), attempts = delivery.attempts }
          stop2()
        end)
        assert.is_true(H.run(d2, 20))
        assert.is_table(rerun, "the abandoned delivery never ran again")
        local r = assert(other:get(id))
        assert.equal("completed", r.status)
        if rerun.attempts == 2 then
          -- not released: it waited for the lease
          assert.is_true(rerun.at >= claimed_at + 6 - 0.1,
            string.format("rerun %.3f s after the claim, the lease is 6 s", rerun.at - claimed_at))
        else
          assert.equal(1, rerun.attempts)
        end
        other:close()
      end)
    end

    describe("relaybus run", function()
      local WORKER = S.support .. "/worker.lua"
      local function worker(log, env)
        return S.spawn(WORKER, { url, opts.table or "-", log }, { env = env })
      end
      local function starts(log)
        local n = 0
        for _, l in ipairs(S.lines(log)) do if l:match("^S ") then n = n + 1 end end
        return n
      end

      for _, sig in ipairs { "TERM", "INT" } do
        it("stops gracefully on SIG" .. sig .. ": releases running deliveries by T and exits 0", function()
          local ids = assert(store:enqueue_many { { "work", 1 }, { "work", 2 } })
          local log = S.tmpfile("w") .. ".log"
          local p = worker(log, { RB_SLEEP = "60", RB_CONC = "2", RB_SHUTDOWN = "1" })
          assert.truthy(S.wait_for(function() return starts(log) == 2 end, 20),
            "the worker did not start both: " .. (S.read(p.err) or ""))
          local t0 = relaybus.now()
          S.signal(p, sig)
          local rc = S.wait_exit(p, 10)
          local took = relaybus.now() - t0
          assert.equal(0, rc)
          assert.is_true(took >= 0.75 and took <= 1 + TOL + 0.2,
            string.format("exited %.3f s after SIG%s, shutdown_timeout = 1", took, sig))
          for _, id in ipairs(ids) do
            local r = assert(store:get(id))
            assert.equal("pending", r.status)
            assert.equal(0, r.attempts)
          end
        end)
      end

      it("completes running deliveries that finish within 4/5 of T on SIGTERM", function()
        local id = assert(store:enqueue("work", 1))
        local log = S.tmpfile("w") .. ".log"
        local p = worker(log, { RB_SLEEP = "0.5", RB_SHUTDOWN = "5" })
        assert.truthy(S.wait_for(function() return starts(log) == 1 end, 20))
        S.signal(p, "TERM")
        assert.equal(0, S.wait_exit(p, 10))
        assert.equal("completed", assert(store:get(id)).status)
      end)

      it("exits at once on a second signal, and the abandoned delivery runs again after the lease", function()
        local id = assert(store:enqueue("work", 1, { max_attempts = 5 }))
        local log = S.tmpfile("w") .. ".log"
        local p = worker(log, { RB_SLEEP = "60", RB_SHUTDOWN = "30", RB_LEASE = "1.5" })
        assert.truthy(S.wait_for(function() return starts(log) == 1 end, 20))
        S.signal(p, "TERM")
        S.sleep(0.3)
        assert.is_nil(S.rc(p), "the first signal did not wait for the running handler")
        local t0 = relaybus.now()
        S.signal(p, "TERM")
        local rc = S.wait_exit(p, 5)
        local took = relaybus.now() - t0
        assert.is_number(rc)
        assert.are_not.equal(0, rc)
        assert.is_true(took <= 0.5, string.format("exited %.3f s after the second signal", took))
        local log2 = S.tmpfile("w") .. ".log"
        local p2 = worker(log2, { RB_SLEEP = "0", RB_LEASE = "1.5" })
        assert.truthy(S.wait_for(function() return assert(store:get(id)).status == "completed" end, 20),
          "the abandoned delivery was not run again")
        assert.equal(2, assert(store:get(id)).attempts)
        assert.equal(0, (function() S.signal(p2, "TERM"); return S.wait_exit(p2, 10) end)())
      end)
    end)
  end)
end
