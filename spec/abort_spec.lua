-- abort_spec.lua -- a run stops at its deadline: pending waits end at once with nil, "aborted"
-- and new ones fail the same way, Lua that spins is interrupted by the count hook, ctx.deadline,
-- ctx.signal:check(), on_abort, and ctx:extend_lease. Run per store.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local relaybus = S.relaybus()
local testing = S.testing()   -- the specs' own module (testing/lua_testing.c)

local GRACE = 0.1  -- the grace (docs/guarantees.md) between an abort and the interruption of spinning Lua
local TOL = 0.3    -- scheduling slack on a loaded machine

for _, entry in ipairs(S.list()) do
  describe("abort on " .. entry.name .. ":", function()
    local store, url, opts
    before_each(function() store, url, opts = S.open(entry) end)
    after_each(S.reset)
    teardown(function() S.cleanup() end)

    -- One delivery on `topic`, one handler; the dispatcher stops when the run has settled.
    local function run_one(topic, handler, hopts, dopts, enq)
      local id = assert(store:enqueue(topic, 1, enq or { max_attempts = 1 }))
      local d = H.dispatcher(store, dopts)
      local stop = H.stopper(d, 10)
      d:handle(topic, function(delivery, ctx)
        stop()
        return handler(delivery, ctx)
      end, hopts)
      local ok = H.run(d, 30)
      assert.is_true(ok, "the run did not settle")
      return id
    end

    it("ctx:sleep returns nil, \"aborted\" at the deadline of the run's timeout", function()
      local a, b, t0, t1, deadline
      run_one("ab.sleep", function(delivery, ctx)
        t0 = relaybus.now()
        deadline = ctx.deadline
        a, b = ctx:sleep(5)
        t1 = relaybus.now()
      end, { timeout = 0.3 })
      assert.is_nil(a)
      assert.equal("aborted", b)
      assert.is_true(t1 - t0 >= 0.25 and t1 - t0 <= 0.3 + TOL,
        string.format("sleep ended %.3f s in, the timeout is 0.3", t1 - t0))
      H.near(deadline, t1, 0.1 + TOL, "end of the sleep against ctx.deadline")
    end)

    it("ctx.deadline is monotonic: start + timeout with a timeout, within the lease without", function()
      local with, without
      local id1 = assert(store:enqueue("ab.dl1", 1))
      local id2 = assert(store:enqueue("ab.dl2", 1))
      local d = H.dispatcher(store, { lease_duration = 3 })
      local stop = H.stopper(d)
      local n = 0
      local function count() n = n + 1; if n == 2 then stop() end end
      d:handle("ab.dl1", function(delivery, ctx) with = ctx.deadline - relaybus.now(); count() end,
        { timeout = 0.5 })
      d:handle("ab.dl2", function(delivery, ctx) without = ctx.deadline - relaybus.now(); count() end)
      assert.is_true(H.run(d, 10))
      assert.is_true(with > 0.3 and with <= 0.5, "deadline - now with a 0.5 s timeout: " .. with)
      assert.is_true(without > 1 and without <= 3, "deadline - now with a 3 s lease: " .. without)
      assert.equal("completed", assert(store:get(id1)).status)
      assert.equal("completed", assert(store:get(id2)).status)
    end)

    it("after an abort, store calls, sleeps and settles return nil, \"aborted\" at once", function()
      local res = {}
      local id = run_one("ab.after", function(delivery, ctx)
        ctx:sleep(5)
        local t0 = relaybus.now()
        res.get = table.pack(store:get(delivery.id))
        res.enqueue = table.pack(store:enqueue("ab.other", 1))
        res.stats = table.pack(store:stats())
        res.sleep = table.pack(ctx:sleep(1))
        res.rsleep = table.pack(relaybus.sleep(1))
        res.complete = table.pack(ctx:complete())
        res.took = relaybus.now() - t0
      end, { timeout = 0.2 })
      for _, k in ipairs { "get", "enqueue", "stats", "sleep", "rsleep", "complete" } do
        assert.is_nil(res[k][1], k .. " returned a result")
        assert.equal("aborted", res[k][2], k)
      end
      assert.is_true(res.took < 0.5, "the calls after the abort took " .. res.took .. " s")
      local r = assert(store:get(id))
      assert.equal("buried", r.status)
      assert.equal("timeout", r.last_error)
      assert.equal(1, (H.total(store)), "the aborted run's enqueue was written")
    end)

    -- A run whose ctx:complete() is answered `delay` s late, with `timeout`; `before` runs in
    -- the handler first. Returns what the handler saw, and checks what must hold either way:
    -- the answer is true, the Lua after it runs (well within the grace), the delivery is done.
    local function late_complete(topic, delay, timeout, before)
      local slow = testing.faults(store, { ops = { settle = { late = 1 } }, min_delay = delay, max_delay = delay })
      local res = {}
      local id = assert(store:enqueue(topic, 1, { max_attempts = 1 }))
      local d = H.dispatcher(slow)
      local stop = H.stopper(d, 10)
      d:handle(topic, function(delivery, ctx)
        stop()
        if before then before() end
        res.complete = table.pack(ctx:complete())
        res.aborted = ctx.signal.aborted
        local n = 0
        for i = 1, 20000 do n = n + i end   -- some Lua after the answer, well within the grace
        res.after = n
      end, { timeout = timeout })
      assert.is_true(H.run(d, 30), "the run did not settle")
      assert.is_true(res.complete ~= nil and res.complete[1], "the settle's answer: "
        .. tostring(res.complete and res.complete[2]))
      assert.equal(200010000, res.after, "the code after the answer did not run")
      assert.equal("completed", assert(store:get(id)).status)
      slow:close()
      return res
    end

    -- Found by faults_random: a settle sent before the abort and answered long after it (a
    -- slow store, a loop held by a blocked call) resumed a run already past its grace, so it
    -- was stopped before it could read the answer; the grace counts from the answer.
    it("a run aborted while its settle was on the way gets the grace from the answer: it reads it and returns", function()
      local res = late_complete("ab.late_settle", 0.6, 0.1)
      assert.is_true(res.aborted, "the run was not aborted by its timeout while it waited")
    end)

    -- The loop is held (as in a frozen process) past the answer's due time and then past the
    -- deadline: after it libev runs the expired timers in order, the answer's before the
    -- deadline's. The run must still get its grace from that answer, not be stopped at once
    -- for a deadline long past (faults_random saw a complete written and its run never end).
    it("a run whose loop was held past its deadline and its settle's answer gets the grace from the answer", function()
      local res = late_complete("ab.held_settle", 0.2, 0.5, function()
        relaybus.spawn(function()
          relaybus.sleep(0.05)
          os.execute("sleep 1.5")     -- holds the loop past the deadline and the answer
        end)
      end)
      assert.is_true(res.aborted, "the answer came after the deadline, and the run was told nothing")
    end)

    -- Runs `call(ctx)` in a handler with a 1 s timeout while another process holds the store
    -- locked for 3 s (spec/support/locker.lua); returns the delivery's id, what the call
    -- returned, ctx.deadline and when the call returned. The locker commits and exits by
    -- itself (killed, under LeakSanitizer it could be cut in the middle of its exit report).
    local function call_on_locked_store(topic, call)
      local ready = S.tmpfile("locked")
      local got, t_end, deadline, locker
      local id = run_one(topic, function(delivery, ctx)
        locker = S.spawn(S.support .. "/locker.lua", { url, opts.table or "-", "3", ready })
        H.poll(function() return S.exists(ready) end, 5)
        deadline = ctx.deadline
        got = table.pack(call(ctx))
        t_end = relaybus.now()
      end, { timeout = 1.0 })
      assert.equal(0, S.wait_exit(locker, 20), "the locker failed: " .. (S.read(locker.err) or ""))
      return id, got, deadline, t_end
    end

    if entry.name ~= "mongodb" then
      it("a store call waiting on a locked store ends at the deadline with nil, \"aborted\"", function()
        local _, got, deadline, t_end = call_on_locked_store("ab.locked", function()
          return store:enqueue("ab.blocked", 1)
        end)
        assert.is_nil(got[1], "the enqueue went through a locked store")
        assert.equal("aborted", got[2])
        H.near(deadline, t_end, 0.15 + TOL, "end of the blocked call against ctx.deadline")
      end)

      -- Found by faults_random: an extension held up behind the write lock of a frozen process
      -- was answered long after the run's deadline, and only then did the run's code learn of
      -- its abort, while another process already ran the delivery. An extension's answer is
      -- not waited for past the deadline (unlike a settle's: the run is over either way).
      it("ctx:extend_lease waiting on a locked store ends at the deadline with nil, \"aborted\"", function()
        local id, got, deadline, t_end = call_on_locked_store("ab.locked_extend", function(ctx)
          return ctx:extend_lease(30)
        end)
        assert.is_nil(got[1], "the extension was answered through a locked store")
        assert.equal("aborted", got[2])
        H.near(deadline, t_end, 0.15 + TOL, "end of the blocked extension against ctx.deadline")
        local r = assert(store:get(id))
        assert.equal("buried", r.status, "the run settles as its timeout, after the extension")
        assert.equal("timeout", r.last_error)
      end)
    end

    -- The same on every store (MongoDB has no lock to hold): the extension is written at once
    -- and only its answer comes late, after the deadline. The run still ends at the deadline,
    -- and its final write (the timeout) lands after the extension; a settle after the abort
    -- is refused without reaching the store.
    it("ctx:extend_lease answered after the deadline ends at the deadline; the timeout still settles", function()
      local slow = testing.faults(store, { ops = { settle = { late = 1 } }, min_delay = 2, max_delay = 2 })
      local id = assert(store:enqueue("ab.late_extend", 1, { max_attempts = 1 }))
      local d = H.dispatcher(slow)
      local stop = H.stopper(d, 15)
      local got, after, deadline, t_end
      d:handle("ab.late_extend", function(delivery, ctx)
        stop()
        deadline = ctx.deadline
        got = table.pack(ctx:extend_lease(30))
        t_end = relaybus.now()
        after = table.pack(ctx:complete())
      end, { timeout = 0.5 })
      assert.is_true(H.run(d, 30), "the run did not settle")
      slow:close()
      assert.is_nil(got[1], "the late extension's answer was waited for")
      assert.equal("aborted", got[2])
      H.near(deadline, t_end, 0.15 + TOL, "end of the late extension against ctx.deadline")
      assert.same({ n = 2, nil, "aborted" }, after)
      local r = assert(store:get(id))
      assert.equal("buried", r.status)
      assert.equal("timeout", r.last_error)
    end)

    it("a handler spinning in pure Lua is interrupted after its timeout, as a raise with last_error \"timeout\"", function()
      local t0
      local id = run_one("ab.spin", function(delivery, ctx)
        t0 = relaybus.now()
        while true do end
      end, { timeout = 0.3 })
      local took = relaybus.now() - t0
      assert.is_true(took <= 0.3 + GRACE + TOL + 0.2, string.format("the spin ran %.3f s", took))
      local r = assert(store:get(id))
      assert.equal("buried", r.status)
      assert.equal("timeout", r.last_error)
    end)

    -- Each spins past a 0.3 s timeout inside something that would catch an error, and would
    -- write after it; the stop must come regardless, and nothing after it may run.
    -- The longest single C call of the C hideout: the stop comes after one. Measured here,
    -- outside any run, as the stop may land within the first call (a 48 MB string.rep takes
    -- seconds under ASan), so the handler alone would never see one end.
    local function rep_seconds()
      local most = 0
      for _ = 1, 3 do
        local t0 = relaybus.now()
        local s = string.rep("x", 48 * 1024 * 1024); s = nil
        most = math.max(most, relaybus.now() - t0)
      end
      collectgarbage()
      return most
    end
    local c_call = 0
    local hideouts = {
      pcall = function(spin) pcall(spin) end,
      xpcall = function(spin) xpcall(spin, function() return "caught" end) end,
      ["pcall in a loop"] = function(spin) while true do pcall(spin) end end,
      ["a coroutine of its own"] = function(spin)
        local co = coroutine.create(spin)
        coroutine.resume(co)
      end,
      ["a coroutine.wrap inside pcall, resumed again and again"] = function(spin)
        local f = coroutine.wrap(function() while true do pcall(spin); coroutine.yield() end end)
        while true do pcall(f) end
      end,
      ["time spent in C (string.rep of 48 MB in a loop)"] = function()
        while true do
          local t0 = relaybus.now()
          local s = string.rep("x", 48 * 1024 * 1024); s = nil
          c_call = math.max(c_call, relaybus.now() - t0)
        end
      end,
    }
    for name, hide in pairs(hideouts) do
      it("a handler spinning inside " .. name .. " is stopped for good after the grace: nothing after it runs, nothing is written", function()
        local after, t0
        -- a call may begin just as the stop comes (up to two past it), and load varies
        if name:find("string.rep", 1, true) then c_call = 3 * rep_seconds() end
        local id = run_one("ab.hide", function(delivery, ctx)
          t0 = relaybus.now()
          hide(function() while true do end end)
          after = true
          store:enqueue("ab.hide.after", {})
          while true do end
        end, { timeout = 0.3 })
        local took = relaybus.now() - t0
        assert.is_nil(after, "code after the hideout ran")
        -- a call into C is not cut: the stop comes at the first instruction after the call
        -- running at the kill time, or after one more when the watchdog thread that sets the
        -- hook is itself kept from a CPU for a while (ASan on a loaded machine)
        assert.is_true(took <= 0.3 + GRACE + TOL + 0.2 + 2 * c_call, string.format("the run went on %.3f s"
          .. " (longest C call %.3f s)", took, c_call))
        local r = assert(store:get(id))
        assert.equal("buried", r.status)
        assert.equal("timeout", r.last_error)
        assert.equal(0, #assert(store:list{topic = "ab.hide.after"}))
      end)
    end

    it("a handler spinning past its lease is aborted with reason lease and writes nothing", function()
      local reason, fence
      local id = run_one("ab.lease", function(delivery, ctx)
        fence = delivery.fence
        ctx.signal:on_abort(function(r) reason = r end)
        while true do end
      end, nil, { lease_duration = 0.6 }, { max_attempts = 5 })
      assert.equal("lease", reason)
      local r = assert(store:get(id))
      assert.equal("processing", r.status, "the run that lost its lease wrote its outcome")
      assert.equal(fence, r.fence)
      assert.is_nil(r.last_error)
    end)

    it("ctx.signal:check() does nothing before the abort and raises after it", function()
      local before, after, aborted_flag
      run_one("ab.check", function(delivery, ctx)
        before = pcall(ctx.signal.check, ctx.signal)
        assert.is_false(ctx.signal.aborted)
        ctx:sleep(5)
        aborted_flag = ctx.signal.aborted
        after = table.pack(pcall(ctx.signal.check, ctx.signal))
      end, { timeout = 0.2 })
      assert.is_true(before)
      assert.is_true(aborted_flag)
      assert.is_false(after[1])
      assert.is_not_nil(after[2])
    end)

    it("on_abort calls fn(reason) once, on abort, and never for a run that ends well", function()
      local calls = {}
      run_one("ab.hook", function(delivery, ctx)
        ctx.signal:on_abort(function(reason) calls[#calls + 1] = reason end)
        ctx:sleep(5)
        ctx:sleep(1)
        ctx.signal:check()
      end, { timeout = 0.2 })
      assert.same({ "timeout" }, calls)
      local quiet = 0
      run_one("ab.nohook", function(delivery, ctx)
        ctx.signal:on_abort(function() quiet = quiet + 1 end)
      end)
      assert.equal(0, quiet)
    end)

    it("ctx:extend_lease renews the lease and moves ctx.deadline; after an abort it returns nil", function()
      local before, after, ok, expires, t0, late
      local id = run_one("ab.extend", function(delivery, ctx)
        before = ctx.deadline - relaybus.now()
        t0 = relaybus.time()
        ok = ctx:extend_lease(20)
        after = ctx.deadline - relaybus.now()
        expires = assert(store:get(delivery.id)).lease_expires_at
        ctx:sleep(5)
        late = table.pack(ctx:extend_lease(20))
      end, { timeout = 2.5 }, { lease_duration = 1 })
      assert.is_true(ok)
      assert.is_true(before <= 1)
      H.near(t0 + 20, expires, 2, "lease_expires_at after extend_lease(20)")
      -- the timeout still bounds the run
      assert.is_true(after > 1 and after <= 2.5, "deadline - now after extend_lease: " .. after)
      assert.is_nil(late[1])
      assert.is_not_nil(late[2])
      assert.equal("timeout", assert(store:get(id)).last_error)
    end)
  end)
end
