-- sleep_spec.lua -- the runtime's sleeps and its handler coroutines, attacked: sleepers wake in
-- order and never early whatever order they began in, sleep(0) gives the loop's other work its
-- turn, sleeps ended early by aborts leave the others on time, a run's data stays alive while
-- its handler has dropped every reference to ctx and delivery or its coroutine was closed, and
-- nothing of a run stays behind. The dispatcher cases run on every store.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local relaybus = S.relaybus()

local TOL = 0.3    -- scheduling slack on a loaded machine

describe("sleep", function()
  it("a sleep given no number is misuse that names sleep, however it is called (through pcall, a local, or ctx)", function()
    local sleep = relaybus.sleep
    for _, args in ipairs { { "x" }, {}, { {} }, { true } } do
      local err = H.raises_relaybus(sleep, table.unpack(args))
      assert.truthy(err:find("relaybus: sleep: seconds must be a number", 1, true), err)
      assert.is_nil(err:find("'?'", 1, true), err)
    end
    -- numeric strings are numbers, as elsewhere in Lua; a negative sleep is 0
    assert.is_true(sleep("0.001"))
    assert.is_true(sleep(-1))
    local store = S.open(S.list()[1])
    assert(store:enqueue("t", {}))
    local d = H.dispatcher(store)
    local stop = H.stopper(d)
    local errs = {}
    d:handle("t", function(_, ctx)
      errs[1] = select(2, pcall(ctx.sleep, ctx, "x"))
      errs[2] = select(2, pcall(ctx.sleep, ctx))
      stop()
    end)
    assert.is_true((H.run(d, 10)))
    assert.truthy(errs[1]:find("relaybus: sleep: seconds must be a number up to 100 years (got string)", 1, true), errs[1])
    assert.truthy(errs[2]:find("relaybus: sleep: seconds must be a number up to 100 years (got no value)", 1, true), errs[2])
    S.reset()
  end)

  it("1,000 sleepers of random lengths, begun in random order, each wake once, never early, in order of their ends", function()
    math.randomseed(7)
    local n, woke, order = 1000, {}, {}
    local ends = {}
    for i = 1, n do
      local secs = math.random() * 0.4
      relaybus.spawn(function()
        local t0 = relaybus.now()
        ends[i] = t0 + secs
        local ok = relaybus.sleep(secs)
        assert(ok == true, "sleep returned " .. tostring(ok))
        woke[i] = relaybus.now()
        order[#order + 1] = i
      end)
    end
    relaybus.run()
    assert.equal(n, #order)
    for i = 1, n do
      assert.is_true(woke[i] >= ends[i] - 1e-3,
        string.format("sleeper %d woke %.4f s early", i, ends[i] - woke[i]))
    end
    -- each woke no earlier than every sleeper woken before it was due (ties within a
    -- millisecond are the timer's granularity)
    for k = 2, n do
      assert.is_true(ends[order[k]] >= ends[order[k - 1]] - 1e-3,
        string.format("sleeper %d (due %.4f) woke after %d (due %.4f)", order[k - 1],
          ends[order[k - 1]], order[k], ends[order[k]]))
    end
  end)

  it("sleep(0) goes round the loop: two tasks alternate, and a timer's sleeper ends a loop of sleep(0)", function()
    local trace = {}
    for _, name in ipairs { "a", "b" } do
      relaybus.spawn(function()
        for _ = 1, 5 do
          trace[#trace + 1] = name
          relaybus.sleep(0)
        end
      end)
    end
    local flag, spins = false, 0
    relaybus.spawn(function()
      while not flag do
        spins = spins + 1
        relaybus.sleep(0)
      end
    end)
    relaybus.spawn(function()
      relaybus.sleep(0.05)
      flag = true
    end)
    relaybus.run()
    assert.equal("ababababab", table.concat(trace))
    assert.is_true(flag)
    assert.is_true(spins > 1, "the sleep(0) loop ran " .. spins .. " times")
  end)

  it("a bare coroutine.yield() goes round the loop beside a loop of sleep(0), and neither starves the other", function()
    -- (the yielded tasks were resumed by an idle watcher, which libev runs only when nothing
    -- else is pending: beside a loop of sleep(0) a yield never came back)
    local yields, spins, t0 = 0, 0, relaybus.now()
    relaybus.spawn(function()
      while yields < 100 and relaybus.now() - t0 < 10 do coroutine.yield(); yields = yields + 1 end
    end)
    relaybus.spawn(function()
      while yields < 100 and relaybus.now() - t0 < 10 do relaybus.sleep(0); spins = spins + 1 end
    end)
    relaybus.run()
    assert.equal(100, yields)
    assert.is_true(spins >= 99 and spins <= 101, "sleep(0) went round " .. spins .. " times for 100 yields")
  end)

  it("a sleep inside a sort comparator is refused, and leaves nothing behind to wake a later sleep or a freed task", function()
    -- (the refused wait once stayed in the heap: the next sleep of the task woke with its
    -- time, and when the task had ended, its wake-up wrote into freed memory)
    local errs, woke = {}, {}
    for i = 1, 20 do
      relaybus.spawn(function()
        relaybus.sleep(0)
        local ok, err = pcall(table.sort, { 2, 1 }, function(a, b) relaybus.sleep(0.05) return a < b end)
        errs[i] = not ok and err
        local t0 = relaybus.now()
        relaybus.sleep(0.2)
        woke[i] = relaybus.now() - t0
        if i % 2 == 0 then error("ends with an error: the task is freed, not pooled") end
      end)
    end
    relaybus.spawn(function() relaybus.sleep(0.5) end)
    relaybus.run()
    for i = 1, 20 do
      assert.truthy(tostring(errs[i]):find("relaybus: this call waits for I/O and cannot here", 1, true), tostring(errs[i]))
      assert.is_true(woke[i] >= 0.2 - 1e-3, string.format("task %d: sleep(0.2) woke after %.3f s", i, woke[i]))
    end
  end)

  it("coroutine.resume of a task waiting in a sleep does nothing: the sleep ends at its time with its own answer", function()
    local co, forged, got, slept
    relaybus.spawn(function()
      co = coroutine.running()
      local t0 = relaybus.now()
      got = { relaybus.sleep(0.2) }
      slept = relaybus.now() - t0
    end)
    relaybus.spawn(function()
      relaybus.sleep(0.05)
      forged = { coroutine.resume(co, "forged", "values") }
    end)
    relaybus.run()
    assert.same({ true }, forged)
    assert.same({ true }, got)
    assert.is_true(slept >= 0.2 - 1e-3, string.format("the sleep ended after %.3f s", slept))
  end)

  it("a sleep from the main chunk blocks until its end, beside sleeping tasks", function()
    local woke
    relaybus.spawn(function()
      relaybus.sleep(0.05)
      woke = relaybus.now()
    end)
    local t0 = relaybus.now()
    assert.is_true(relaybus.sleep(0.1))
    assert.is_true(relaybus.now() - t0 >= 0.1 - 1e-3)
    assert.is_truthy(woke, "the task's shorter sleep ended while the main chunk slept")
    relaybus.run()
  end)
end)

for _, entry in ipairs(S.list()) do
  describe("sleep on " .. entry.name .. ":", function()
    local store
    before_each(function() store = S.open(entry) end)
    after_each(S.reset)
    teardown(function() S.cleanup() end)

    it("sleeps ended early by aborts leave the other sleepers on time", function()
      -- 60 handlers: those with an odd payload sleep past their 0.2 s timeout (their sleeps
      -- leave the heap at the abort, from wherever they are in it), the others sleep 0.3-0.6 s
      math.randomseed(11)
      local batch = {}
      for i = 1, 60 do
        batch[i] = { i % 2 == 1 and "sl.abort" or "sl.keep", { i = i, secs = 0.3 + math.random() * 0.3 },
                     { max_attempts = 1 } }   -- a timeout is not run again
      end
      assert(store:enqueue_many(batch))
      local d = H.dispatcher(store, { concurrency = 60, lease_duration = 5 })
      local stop = H.stopper(d)
      local aborted, kept, early, done = 0, 0, {}, 0
      local function finish() done = done + 1; if done == 60 then stop() end end
      d:handle("sl.abort", function(delivery, ctx)
        local ok, err = ctx:sleep(10)
        if ok == nil and err == "aborted" then aborted = aborted + 1 end
        finish()
      end, { timeout = 0.2 })
      d:handle("sl.keep", function(delivery, ctx)
        local t0 = relaybus.now()
        local ok = ctx:sleep(delivery.payload.secs)
        local slept = relaybus.now() - t0
        if ok == true then kept = kept + 1 end
        if slept < delivery.payload.secs - 1e-3 or slept > delivery.payload.secs + TOL then
          early[#early + 1] = string.format("%d slept %.3f of %.3f s", delivery.payload.i, slept, delivery.payload.secs)
        end
        finish()
      end)
      assert.is_true(H.run(d, 20))
      assert.equal(30, aborted)
      assert.equal(30, kept)
      assert.same({}, early)
    end)

    it("a handler that drops its ctx and delivery and collects garbage while it sleeps still settles", function()
      local ids = H.fill(store, "sl.gc", 20)
      local d = H.dispatcher(store, { concurrency = 20 })
      local stop = H.stopper(d)
      local done = 0
      d:handle("sl.gc", function(delivery, ctx)
        local sleep = ctx.sleep
        local c = ctx
        ctx, delivery = nil, nil
        collectgarbage()
        collectgarbage()
        assert(sleep(c, 0.05))
        c = nil
        collectgarbage()
        done = done + 1
        if done == 20 then stop() end
      end)
      assert.is_true(H.run(d, 20))
      for _, id in ipairs(ids) do assert.equal("completed", assert(store:get(id)).status) end
    end)

    it("a task calling the store in a loop without sleeping lets the loop turn: a sleeper beside it wakes", function()
      -- (a store that answers at once, SQLite, gave the loop no turn at all: the sleeper, the
      -- timers of runs and every other task waited for ever)
      local t0, woke, calls = relaybus.now(), nil, 0
      relaybus.spawn(function()
        while not woke and relaybus.now() - t0 < 10 do
          assert(store:stats())
          calls = calls + 1
        end
      end)
      relaybus.spawn(function()
        relaybus.sleep(0.1)
        woke = relaybus.now() - t0
      end)
      relaybus.run()
      assert.is_truthy(woke, "the sleeper never woke while the store was called in a loop (" .. calls .. " calls)")
      assert.is_true(calls > 0)
    end)

    it("what the runtime holds does not grow with the deliveries it has run", function()
      -- each delivery carries 20 KB: a record kept anywhere by the runtime (once, each was
      -- left on the main Lua stack for as long as relaybus.run lasted) shows as megabytes
      local big = string.rep("x", 20000)
      local batch = {}
      for i = 1, 1000 do batch[i] = { "sl.mem", { i = i, pad = big } } end
      assert(store:enqueue_many(batch))
      local d = H.dispatcher(store, { concurrency = 16 })
      local stop = H.stopper(d)
      local done, kib = 0, {}
      local function heap()
        collectgarbage()
        collectgarbage()
        return collectgarbage("count")
      end
      d:handle("sl.mem", function()
        done = done + 1
        if done == 100 or done == 1000 then
          relaybus.spawn(function()
            kib[#kib + 1] = heap()
            if #kib == 2 then stop() end
          end)
        end
      end)
      assert.is_true(H.run(d, 60))
      assert.equal(2, #kib)
      assert.is_true(kib[2] - kib[1] < 5 * 1024,
        string.format("the heap grew by %.1f MiB over 900 deliveries of 20 KB", (kib[2] - kib[1]) / 1024))
    end)

    it("a handler's coroutine closed by another task while it sleeps fails the run, and nothing of the run is lost", function()
      local id = assert(store:enqueue("sl.close", {}, { max_attempts = 1 }))
      local d = H.dispatcher(store)
      local stop = H.stopper(d)
      local closed
      d:handle("sl.close", function(delivery, ctx)
        local co = coroutine.running()
        relaybus.spawn(function()
          relaybus.sleep(0.02)  -- the handler is asleep in ctx:sleep now
          closed = { coroutine.close(co) }
          collectgarbage()
          collectgarbage()      -- nothing may free the run's ctx under the runtime
          relaybus.sleep(0.2)
          stop()
        end)
        ctx:sleep(0.1)
      end)
      assert.is_true(H.run(d, 20))
      assert.same({ true }, closed)
      local r = assert(store:get(id))
      assert.equal("buried", r.status)
      assert.truthy(tostring(r.last_error):find("dead coroutine", 1, true), r.last_error)
    end)

    it("handlers that return values, raise, or yield bare leave coroutines that later runs use cleanly", function()
      -- a returned value must not stay on a reused coroutine's stack (the next run would get
      -- it as an argument), and one that raised is not reused
      local batch = {}
      for i = 1, 90 do batch[i] = { "sl.reuse", { i = i } } end
      assert(store:enqueue_many(batch))
      local d = H.dispatcher(store, { concurrency = 4 })
      local stop = H.stopper(d)
      local seen, bad = 0, {}
      d:handle("sl.reuse", function(delivery, ctx, extra)
        seen = seen + 1
        if seen == 120 then stop() end     -- 90 runs and the 30 retries of those that raised
        if extra ~= nil or type(delivery) ~= "table" or type(ctx) ~= "userdata" then
          bad[#bad + 1] = string.format("run %d got %s, %s, %s", seen, type(delivery), type(ctx), tostring(extra))
        end
        local i = delivery.payload.i
        if i % 3 == 0 then coroutine.yield() return "a", "b", "c" end
        if i % 3 == 1 and delivery.attempts == 1 then error("once") end
        return i
      end, {})
      assert.is_true(H.run(d, 30))
      assert.same({}, bad)
      local st = assert(store:stats())
      assert.equal(90, st.completed)
    end)
  end)
end
