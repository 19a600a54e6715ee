-- lanes_spec.lua -- lanes under attack: a quiet lane of a higher priority must not keep a
-- backlog behind it from ever being claimed (its claims in flight reserve slots), and the
-- dispatcher's concurrency holds with several lanes.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local relaybus = S.relaybus()

for _, entry in ipairs(S.list()) do
  describe("lanes under attack on " .. entry.name .. ":", function()
    local store
    before_each(function() store = S.open(entry) end)
    after_each(S.reset)
    teardown(function() S.cleanup() end)

    -- concurrency 1 and one quiet urgent lane: the urgent lane claims first at every pass, and
    -- while its (empty) claim is in flight it holds the only slot.
    it("a quiet higher-priority lane does not starve a backlog at concurrency 1", function()
      H.fill(store, "rl.bulk", 5)
      local d = H.dispatcher(store, { concurrency = 1 })
      local stop = H.stopper(d)
      local done = 0
      d:handle("rl.bulk", function() done = done + 1; if done == 5 then stop() end end)
      d:handle("rl.urgent", function() end, { priority = 10 })
      H.run(d, 20)
      assert.equal(5, done, "backlog runs done behind a quiet urgent lane")
    end)

    -- as many quiet lanes of their own as the dispatcher has slots, each of a higher priority
    it("quiet lanes as many as the slots, in front of a backlog, do not starve it", function()
      H.fill(store, "rl.bulk2", 6)
      local d = H.dispatcher(store, { concurrency = 3 })
      local stop = H.stopper(d)
      local done = 0
      d:handle("rl.bulk2", function() done = done + 1; if done == 6 then stop() end end)
      for i = 1, 3 do d:handle("rl.quiet" .. i, function() end, { concurrency = 1, priority = 10 + i }) end
      H.run(d, 20)
      assert.equal(6, done, "backlog runs done behind quiet lanes")
    end)

    it("several lanes never run more than the dispatcher's concurrency at once", function()
      local batch = {}
      for l = 1, 4 do for i = 1, 10 do batch[#batch + 1] = { "rl.c" .. l, { i = i } } end end
      assert(store:enqueue_many(batch))
      local d = H.dispatcher(store, { concurrency = 3 })
      local stop = H.stopper(d)
      local now, most, done = 0, 0, 0
      for l = 1, 4 do
        d:handle("rl.c" .. l, function(_, ctx)
          now = now + 1; most = math.max(most, now)
          ctx:sleep(0.01)
          now = now - 1
          done = done + 1
          if done == 40 then stop() end
        end, { concurrency = 2, priority = l })
      end
      H.run(d, 30)
      assert.equal(40, done)
      assert.is_true(most <= 3, "ran " .. most .. " at once")
    end)

    it("40 topics of a concurrency of their own, one delivery each, beside a concurrency of 4: all run", function()
      local batch = {}
      for l = 1, 40 do batch[#batch + 1] = { "rl.many" .. l, { l = l } } end
      assert(store:enqueue_many(batch))
      local d = H.dispatcher(store, { concurrency = 4 })
      local stop = H.stopper(d)
      local done = 0
      for l = 1, 40 do
        d:handle("rl.many" .. l, function() done = done + 1; if done == 40 then stop() end end,
          { concurrency = 1, priority = l })
      end
      H.run(d, 30)
      assert.equal(40, done)
    end)
  end)
end
