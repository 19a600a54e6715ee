-- api_limits_spec.lua -- the API at its limits, on every store (attacks that once broke relaybus's
-- guarantees, kept): closing a store under a dispatcher or a transaction, waits from coroutines of
-- a handler's own, store calls inside a SQLite transaction, texts a store cannot take, durations
-- that are not finite, dispatchers that never went away, extensions that shortened a lease.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local relaybus = S.relaybus()

local function count(t) local n = 0 for _ in pairs(t) do n = n + 1 end return n end

for _, entry in ipairs(S.list()) do
  describe("the API at its limits on " .. entry.name .. ":", function()
    local store, url, opts
    before_each(function() store, url, opts = S.open(entry) end)
    after_each(S.reset)
    teardown(function() S.cleanup() end)

    describe("close", function()
      it("close() while a dispatcher runs on the store is a misuse error, and the dispatcher goes on", function()
        local id = assert(store:enqueue("cl.run", {}))
        local d = H.dispatcher(store)
        local stop = H.stopper(d)
        local err, after
        d:handle("cl.run", function(delivery, ctx)
          err = select(2, pcall(store.close, store))
          after = store:get(delivery.id)
          stop()
        end)
        assert.is_true(H.run(d, 10))
        assert.truthy(tostring(err):match("^relaybus: close: the store is in use by a running dispatcher"), err)
        assert.equal("processing", after.status)
        assert.equal("completed", assert(store:get(id)).status)
        store:close()   -- stopped: now it closes
        H.raises_relaybus(store.get, store, id)
      end)

      it("close() inside store:transaction is a misuse error and the transaction still commits", function()
        local err
        local ok = store:transaction(function(tx)
          err = select(2, pcall(store.close, store))
          assert(tx:enqueue("cl.tx", {}))
        end)
        if entry.name == "mongodb" and not ok then return end  -- transactions need a replica set
        assert.is_true(ok)
        assert.truthy(tostring(err):match("^relaybus: close: the store has an open transaction"), err)
        assert.equal(1, #assert(store:list{topic = "cl.tx"}))
      end)

      it("close() right after a stop that abandoned a settling run closes once the run is done, and loses nothing", function()
        local ids = {}
        for i = 1, 20 do ids[i] = assert(store:enqueue("cl.abandon", { i = i })) end
        local d = H.dispatcher(store, { concurrency = 20, lease_duration = 2 })
        local started = 0
        d:handle("cl.abandon", function(delivery, ctx)
          started = started + 1
          ctx:sleep(5)          -- ends with the stop's abort
        end)
        d:start()
        relaybus.spawn(function()
          H.poll(function() return started == 20 end, 5)
          d:stop{ timeout = 0 }  -- aborts and abandons at once: releases may be in flight
          store:close()
        end)
        relaybus.run()
        H.raises_relaybus(store.stats, store)
        relaybus.sleep(0.3)     -- late answers and the deferred close run here
        local again = assert(relaybus.open(url, opts))
        for _, id in ipairs(ids) do
          local r = assert(again:get(id), "delivery " .. id .. " is gone")
          assert.is_true(r.status == "pending" or r.status == "processing", r.status)
        end
        again:close()
      end)
    end)

    describe("waits where they cannot wait", function()
      it("a store call from a coroutine of the handler's own raises a misuse error instead of hanging", function()
        local id = assert(store:enqueue("nw.co", {}))
        local d = H.dispatcher(store)
        local stop = H.stopper(d)
        local ok, err, own
        d:handle("nw.co", function(delivery, ctx)
          ok, err = pcall(coroutine.wrap(function() return store:get(delivery.id) end))
          own = store:get(delivery.id)      -- the handler's own coroutine still may
          stop()
        end)
        assert.is_true(H.run(d, 10))
        assert.is_false(ok)
        assert.truthy(tostring(err):find("relaybus: this call waits for I/O and cannot here", 1, true), err)
        assert.equal(id, own.id)
      end)

      it("a store call inside a function Lua calls from C (a string.gsub replacement, a sort comparator) is refused before it writes", function()
        -- (it once wrote, then failed to yield back: a kick that raised had kicked all the same)
        local id = assert(store:enqueue("nw.c2", {}))
        local d = H.dispatcher(store)
        local stop = H.stopper(d)
        local gsub_ok, gsub_err, sort_ok, sort_err, after
        d:handle("nw.c2", function(delivery, ctx)
          gsub_ok, gsub_err = pcall(string.gsub, "x", "x", function() return tostring(store:enqueue("nw.c3", {})) end)
          sort_ok, sort_err = pcall(table.sort, { 2, 1, 3 }, function(a, b) store:get(delivery.id) return a < b end)
          after = store:get(delivery.id)    -- the handler's own calls still work
          stop()
        end)
        assert.is_true(H.run(d, 10))
        for _, e in ipairs { { gsub_ok, gsub_err }, { sort_ok, sort_err } } do
          assert.is_false(e[1])
          assert.truthy(tostring(e[2]):find("relaybus: this call waits for I/O and cannot here: inside a function that Lua calls from C", 1, true), tostring(e[2]))
          H.one_line(tostring(e[2]))
        end
        assert.same({}, assert(store:list { topic = "nw.c3" }))
        assert.equal(id, after.id)
      end)

      it("an error value whose __tostring raises fails the run like any error, and the runtime goes on", function()
        -- (describing it once raised inside the loop: relaybus.run raised and the run hung)
        local id = assert(store:enqueue("nw.tostr", {}, { max_attempts = 1 }))
        local d = H.dispatcher(store)
        local stop = H.stopper(d)
        d:handle("nw.tostr", function()
          stop()
          error(setmetatable({}, { __tostring = function() error("boom") end }))
        end)
        local task_done
        relaybus.spawn(function()
          relaybus.spawn(function() error(setmetatable({}, { __tostring = function() error("boom") end })) end)
          task_done = true
        end)
        assert.is_true(H.run(d, 10))
        assert.is_true(task_done)
        local r = assert(store:get(id))
        assert.equal("buried", r.status)
        assert.equal("error (a value whose __tostring raised)", r.last_error)
        assert.equal(0, d:stats().active)
      end)

      it("in the main chunk, outside the loop, a coroutine of one's own may still block", function()
        local id = assert(store:enqueue("nw.main", {}))
        local r = coroutine.wrap(function() return store:get(id) end)()
        assert.equal(id, r.id)
      end)

      it("a wait inside the backoff function (a loop callback) is refused and the retry still happens", function()
        local id = assert(store:enqueue("nw.backoff", {}, { max_attempts = 3 }))
        local refused
        local d = H.dispatcher(store, { backoff = function()
          local ok, err = pcall(store.stats, store)
          refused = not ok and err
          return 0
        end })
        local stop = H.stopper(d)
        local runs = 0
        d:handle("nw.backoff", function()
          runs = runs + 1
          if runs == 1 then error("first fails") end
          stop()
        end)
        assert.is_true(H.run(d, 10))
        assert.equal(2, runs)
        assert.truthy(tostring(refused):find("relaybus: this call waits", 1, true), tostring(refused))
        assert.equal("completed", assert(store:get(id)).status)
      end)

      if entry.name == "sqlite" then
        it("store calls inside a SQLite transactional handler raise the misuse error of store:transaction", function()
          assert(store:enqueue("nw.txh", {}))
          local d = H.dispatcher(store)
          local stop = H.stopper(d)
          local e1, e2, t0
          d:handle("nw.txh", function(delivery, ctx)
            t0 = relaybus.now()
            e1 = select(2, pcall(store.enqueue, store, "nw.other", {}))
            e2 = select(2, pcall(store.transaction, store, function() end))
            stop()
          end, { transactional = true })
          assert.is_true(H.run(d, 10))
          for _, e in ipairs { e1, e2 } do
            assert.truthy(tostring(e):find("^relaybus: this sqlite store is inside a transaction here"), tostring(e))
          end
          assert.is_true(relaybus.now() - t0 < 2, "the calls waited for the transaction")
        end)
      end
    end)

    describe("explicit settles", function()
      it("after ctx:release() or ctx:reschedule() the run holds nothing: its waits end with nil, \"aborted\"", function()
        for _, how in ipairs { "release", "reschedule" } do
          local id = assert(store:enqueue("es." .. how, {}, { max_attempts = 5 }))
          local d = H.dispatcher(store, { lease_duration = 5 })
          local stop = H.stopper(d)
          local settled, slept, why, reason, runs = nil, nil, nil, nil, 0
          d:handle("es." .. how, function(delivery, ctx)
            runs = runs + 1
            if runs > 1 then stop(); return end   -- (a release takes its attempt back)
            settled = how == "release" and ctx:release() or ctx:reschedule(0, "later")
            slept, why = ctx:sleep(0.5)
            reason = ctx.signal.reason
          end)
          assert.is_true(H.run(d, 10))
          assert.is_true(settled)
          assert.is_nil(slept)
          assert.equal("aborted", why)
          assert.equal("lease", reason)
          assert.equal("completed", assert(store:get(id)).status)
        end
      end)
    end)

    describe("a ctx used wrongly", function()
      it("ctx.transaction in a handler not declared transactional is a clear misuse error", function()
        assert(store:enqueue("cx.tx", {}))
        local d = H.dispatcher(store)
        local stop = H.stopper(d)
        local err
        d:handle("cx.tx", function(_, ctx)
          err = select(2, pcall(function() return ctx.transaction:exec("SELECT 1") end))
          stop()
        end)
        assert.is_true(H.run(d, 10))
        assert.truthy(tostring(err):find("^relaybus: ctx.transaction: this handler is not transactional"), tostring(err))
      end)

      it("a ctx kept after its run ended: ctx:sleep and every settle return nil, \"aborted\"", function()
        assert(store:enqueue("cx.kept", {}))
        local d = H.dispatcher(store)
        local stop = H.stopper(d)
        local kept
        d:handle("cx.kept", function(_, ctx) kept = ctx; stop() end)
        assert.is_true(H.run(d, 10))
        local t0 = relaybus.now()
        local ok, why = kept:sleep(1)
        assert.is_nil(ok)
        assert.equal("aborted", why)
        assert.is_true(relaybus.now() - t0 < 0.5, "the sleep slept")
        for _, call in ipairs { "complete", "bury", "release", "extend_lease" } do
          local r, e = kept[call](kept, call == "bury" and "x" or nil)
          assert.is_nil(r)
          assert.equal("aborted", e)
        end
      end)
    end)

    describe("texts", function()
      it("an error text that is not UTF-8 settles as valid text, and the runs batched with it settle too", function()
        local bad = assert(store:enqueue("tx.bad", {}, { max_attempts = 1 }))
        local good = {}
        for i = 1, 20 do good[i] = assert(store:enqueue("tx.good", { i = i })) end
        local d = H.dispatcher(store, { concurrency = 32 })
        local stop = H.stopper(d)
        local done = 0
        local function finished() done = done + 1; if done == 21 then stop() end end
        d:handle("tx.bad", function() finished(); error("caf\233 \255\0 end", 0) end)
        d:handle("tx.good", function() finished() end)
        assert.is_true(H.run(d, 15))
        local r = assert(store:get(bad))
        assert.equal("buried", r.status)
        assert.equal("caf\239\191\189 \239\191\189\239\191\189 end", r.last_error)
        for _, id in ipairs(good) do assert.equal("completed", assert(store:get(id)).status) end
      end)

      it("a huge error text is kept short, at a character boundary", function()
        local id = assert(store:enqueue("tx.huge", {}, { max_attempts = 1 }))
        assert.is_true(H.run((function()
          local d = H.dispatcher(store)
          local stop = H.stopper(d)
          d:handle("tx.huge", function() stop(); error(string.rep("\226\130\172", 400000), 0) end)
          return d
        end)(), 10))
        local e = assert(store:get(id)).last_error
        assert.is_true(#e <= 2000 + #" [truncated]", #e)
        assert.truthy(e:find(" %[truncated%]$"))
        assert.truthy(utf8.len(e), "not valid UTF-8")
      end)
    end)

    describe("durations", function()
      it("refuses every duration, age and time that is not finite or out of range", function()
        local inf, nan = math.huge, 0 / 0
        for _, o in ipairs { { lease_duration = inf }, { lease_duration = nan }, { lease_duration = -1 },
                             { shutdown_timeout = inf }, { poll_interval = inf }, { poll_interval = 0 },
                             { retention = inf }, { retention = -1 }, { concurrency = inf },
                             { listen_poll_interval = inf }, { listen_poll_interval = nan },
                             { listen_poll_interval = 0 }, { listen_poll_interval = -1 },
                             { listen_poll_interval = 3.2e9 }, { listen_poll_interval = "5" },
                             { listen_poll_interval = "\xff" } } do
          H.raises_relaybus(relaybus.dispatcher, store, o)
        end
        for _, o in ipairs { { run_at = -1 }, { run_at = nan }, { run_at = inf }, { delay = inf },
                             { delay = -1 }, { delay = nan } } do
          H.raises_relaybus(store.enqueue, store, "du.t", {}, o)
        end
        H.raises_relaybus(store.purge, store, { status = "completed", older_than = inf })
        H.raises_relaybus(store.purge, store, { status = "completed", older_than = nan })
        H.raises_relaybus(store.purge, store, { status = "completed", older_than = 1, limit = inf })
        H.raises_relaybus(store.list, store, { topic = {} })
        H.raises_relaybus(store.list, store, { limit = inf })
        H.raises_relaybus(store.list, store, { limit = nan })
        H.raises_relaybus(store.try_acquire, store, "du.lease", inf)
        H.raises_relaybus(relaybus.sleep, nan)
        H.raises_relaybus(relaybus.sleep, inf)
        local d = H.dispatcher(store)
        H.raises_relaybus(d.handle, d, "du.h", function() end, { timeout = inf })
        H.raises_relaybus(d.every, d, "du.every", inf, function() end)
        H.raises_relaybus(d.stop, d, { timeout = nan })
      end)

      it("purge{older_than = a century} deletes nothing recent", function()
        local id = assert(store:enqueue("du.purge", {}))
        assert.is_true(H.run((function()
          local d = H.dispatcher(store)
          local stop = H.stopper(d)
          d:handle("du.purge", function() stop() end)
          return d
        end)(), 10))
        assert.equal(0, assert(store:purge{ status = "completed", older_than = 3155760000 }))
        assert.equal("completed", assert(store:get(id)).status)
      end)

      it("ctx:extend_lease(math.huge) and reschedule(math.huge) are refused; a backoff of infinity waits the longest", function()
        local id = assert(store:enqueue("du.ctx", {}, { max_attempts = 5 }))
        local e1, e2
        local d = H.dispatcher(store, { backoff = function() return math.huge end })
        local stop = H.stopper(d)
        d:handle("du.ctx", function(delivery, ctx)
          e1 = select(2, pcall(ctx.extend_lease, ctx, math.huge))
          e2 = select(2, pcall(ctx.reschedule, ctx, math.huge))
          stop()
          error("retry me")
        end)
        assert.is_true(H.run(d, 10))
        assert.truthy(tostring(e1):match("^relaybus: extend_lease"), tostring(e1))
        assert.truthy(tostring(e2):match("^relaybus: reschedule"), tostring(e2))
        local r = assert(store:get(id))
        assert.equal("pending", r.status)
        assert.is_true(r.run_at > relaybus.time() + 50 * 365 * 86400, "retried at " .. r.run_at)
      end)

      it("ctx:extend_lease(5) under a 30 s lease does not shorten it", function()
        local id = assert(store:enqueue("du.ext", {}))
        local before, after, ok, expires0, expires1, slept
        local d = H.dispatcher(store, { lease_duration = 30 })
        local stop = H.stopper(d)
        d:handle("du.ext", function(delivery, ctx)
          before = ctx.deadline
          expires0 = store:get(delivery.id).lease_expires_at
          ok = ctx:extend_lease(5)
          after = ctx.deadline
          expires1 = store:get(delivery.id).lease_expires_at
          slept = ctx:sleep(6)    -- past now + 5: the 30 s lease still holds
          stop()
        end)
        assert.is_true(H.run(d, 20))
        assert.is_true(ok)
        assert.is_true(after >= before, string.format("deadline moved back %.2f s", before - after))
        assert.is_true(expires1 >= expires0 - 0.01, string.format("store expiry moved back %.2f s", expires0 - expires1))
        assert.is_true(slept)
        assert.equal("completed", assert(store:get(id)).status)
      end)
    end)

    describe("lifetimes", function()
      it("a dispatcher runs at most once: start after a stop (even one before the start) is a misuse error", function()
        local d = H.dispatcher(store)
        d:handle("lt.once", function() end)
        d:stop()
        H.raises_relaybus(d.start, d)
        assert.is_false(d:stats().running)
        local d2 = H.dispatcher(store)
        d2:handle("lt.once", function() end)
        d2:start()
        d2:stop():wait()
        H.raises_relaybus(d2.start, d2)
        assert.is_false(d2:stats().running)
        store:close()   -- nothing runs on it
      end)

      it("stopped dispatchers are freed: 300 start/stop cycles leave none behind", function()
        local live = setmetatable({}, { __mode = "k" })
        for i = 1, 300 do
          local d = H.dispatcher(store)
          d:handle("lt.cycle", function() end)
          d:start()
          d:stop():wait()
          live[d] = true
        end
        -- they let go of themselves from the loop, once their last store answers are in
        local t0 = relaybus.now()
        repeat
          relaybus.sleep(0.05)
          collectgarbage(); collectgarbage()
        until count(live) <= 2 or relaybus.now() - t0 > 10
        assert.is_true(count(live) <= 2, count(live) .. " stopped dispatchers are still alive")
      end)
    end)

    if entry.kind == "sqlite" then  -- the other stores' columns are typed
      describe("rows written by hand", function()
        it("run as they are shown: processing without a lease, a BLOB topic, attempts past int", function()
          local t = opts.table or "relaybus_deliveries"
          local ids = {}
          for i = 1, 3 do ids[i] = assert(store:enqueue("by.hand", { i = i })) end
          assert(store:transaction(function(tx)
            -- (a statement of the application's own, on the deliveries table)
            assert(tx:exec("UPDATE " .. t .. " SET status = 'processing', lease_token = NULL,"
              .. " lease_expires_at = NULL, lease_boot = NULL, lease_until = NULL WHERE id = $1", ids[1]))
            assert(tx:exec("UPDATE " .. t .. " SET topic = CAST('by.hand' AS BLOB) WHERE id = $1", ids[2]))
            assert(tx:exec("UPDATE " .. t .. " SET attempts = 9223372036854775807,"
              .. " max_attempts = 9223372036854775807 WHERE id = $1", ids[3]))
          end))
          local r3 = assert(store:get(ids[3]))
          assert.equal(2147483647, r3.attempts)    -- shown as the claim compares it
          assert.equal(2147483647, r3.max_attempts)
          assert.equal("by.hand", assert(store:get(ids[2])).topic)
          local ran = {}
          local d = H.dispatcher(store, { poll_interval = 0.05 })
          local stop = H.stopper(d)
          d:handle("by.hand", function(delivery)
            ran[delivery.payload.i] = true
            if ran[1] and ran[2] then stop() end
          end)
          assert.is_true(H.run(d, 10))
          assert.is_true(ran[1], "processing without a lease was never reclaimed")
          assert.is_true(ran[2], "a BLOB topic was never claimed")
          assert.equal("completed", assert(store:get(ids[1])).status)
          assert.equal("completed", assert(store:get(ids[2])).status)
          local r = assert(store:get(ids[3]))
          assert.equal("buried", r.status)
          assert.equal("max attempts exceeded", r.last_error)
        end)
      end)

      describe("a transactional handler's transaction", function()
        it("ended under it by INSERT OR ROLLBACK keeps its lease: another worker never runs the delivery meanwhile", function()
          local t = S.unique("u")
          assert(store:transaction(function(tx)
            assert(tx:exec("CREATE TABLE " .. t .. " (x INTEGER PRIMARY KEY)"))
            assert(tx:exec("INSERT INTO " .. t .. " VALUES (1)"))
          end))
          local id = assert(store:enqueue("rollback.under", {}, { max_attempts = 5 }))
          local other = assert(relaybus.open(url, opts))   -- a second worker
          local first_end, later_start, d2
          local dopts = { lease_duration = 0.6, poll_interval = 0.05, backoff = function() return 0 end }
          local d1 = H.dispatcher(store, dopts)
          local stop1 = H.stopper(d1)
          local stop2
          local function later_run()   -- any run after the first, by either worker
            later_start = later_start or relaybus.now()
            stop1()
            stop2()
          end
          d1:handle("rollback.under", function(delivery, ctx)
            if delivery.attempts > 1 then return later_run() end
            relaybus.spawn(function() d2:start() end)   -- the second worker starts now
            assert(ctx:extend_lease(30))   -- while the lock is held: ctx.deadline alone
            local n, err = ctx.transaction:exec("INSERT OR ROLLBACK INTO " .. t .. " VALUES (1)")
            assert(n == nil and err:find("UNIQUE", 1, true), err)
            for _ = 1, 15 do           -- 1.5 s: two and a half leases
              if not ctx:sleep(0.1) then break end
            end
            first_end = relaybus.now()
          end, { transactional = true })
          d2 = H.dispatcher(other, dopts)
          stop2 = H.stopper(d2)
          d2:handle("rollback.under", function() later_run() end, { transactional = true })
          assert.is_true(H.run(d1, 20))
          other:close()
          assert.is_number(first_end, "the first run never ended")
          assert.is_number(later_start, "no later run")
          assert.is_true(later_start >= first_end,
            string.format("a later run started %.2f s before the first ended", first_end - later_start))
          assert.equal("completed", assert(store:get(id)).status)
        end)

        it("begins while a task keeps the store busy with enqueues", function()
          local id = assert(store:enqueue("busy.begin", {}))
          local ran_at
          local d = H.dispatcher(store, { lease_duration = 1, poll_interval = 0.05 })
          local stop = H.stopper(d)
          d:handle("busy.begin", function() ran_at = relaybus.now(); stop() end, { transactional = true })
          local t0 = relaybus.now()
          local n = 0
          relaybus.spawn(function()
            while not ran_at and relaybus.now() - t0 < 10 do
              assert(store:enqueue("busy.other", {}))
              n = n + 1
            end
          end)
          assert.is_true(H.run(d, 15))
          assert.truthy(ran_at and ran_at - t0 < 3,
            string.format("the transactional handler waited %.1f s behind %d enqueues", (ran_at or relaybus.now()) - t0, n))
          assert.equal("completed", assert(store:get(id)).status)
        end)
      end)
    end
    if entry.kind == "postgresql" then
      it("a row made processing by hand without a lease is mended by the retention's purge and runs", function()
        local t = opts.table
        local id = assert(store:enqueue("by.hand", {}))
        assert(store:transaction(function(tx)
          assert(tx:exec("UPDATE " .. t .. " SET status = 'processing', lease_token = NULL,"
            .. " lease_expires_at = NULL WHERE id = $1", id))
        end))
        assert.equal(0, store:purge { status = "completed", older_than = 3600 })
        local d = H.dispatcher(store, { poll_interval = 0.05 })
        local stop = H.stopper(d)
        d:handle("by.hand", function() stop() end)
        assert.is_true(H.run(d, 10))
        assert.equal("completed", assert(store:get(id)).status)
      end)
    end
  end)
end
