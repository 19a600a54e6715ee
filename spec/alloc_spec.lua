-- alloc_spec.lua -- the allocation-failure run, as Lua's own test suite does it: for N over a
-- range, the Nth allocation of relaybus's C core fails (testing.fail_alloc) while a dispatcher
-- claims, runs and settles deliveries through the Lua binding. Nothing may crash (CI runs it
-- under ASan/UBSan too); an operation may fail with a clear error; and afterwards no delivery
-- is lost, and none is completed unless its handler returned.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local relaybus = S.relaybus()
local testing = S.testing()   -- the specs' own module (testing/lua_testing.c)

local function one_round(store, n, returned)
  local ids, errors = {}, {}
  testing.fail_alloc(n)
  local d
  local ok, err = pcall(function()
    for i = 1, 6 do
      local id, e = store:enqueue("al.t", { i = i })
      if id then ids[#ids + 1] = id else errors[#errors + 1] = e end
    end
    d = H.dispatcher(store, { lease_duration = 1, concurrency = 4 })
    d:handle("al.t", function(delivery, ctx)
      ctx:sleep(0.001)
      returned[delivery.id] = true
    end)
    d:start()
    local t0 = relaybus.now()
    while relaybus.now() - t0 < 0.4 do
      local st = store:stats()
      if st and st.pending + st.processing == 0 then break end
      relaybus.sleep(0.01)
    end
    d:stop{ timeout = 0.3 }:wait()
  end)
  testing.fail_alloc(0)
  if not ok then errors[#errors + 1] = err end
  -- whatever failed, a dispatcher that started can be stopped, and then it has stopped
  if d and d:stats().running then d:stop{ timeout = 0.3 }:wait() end
  assert.is_true(not d or not d:stats().running, "the dispatcher did not stop")
  for _, e in ipairs(errors) do
    assert.is_string(e)
    H.one_line(e)
  end
  return ids
end

for _, entry in ipairs(S.list()) do
  if entry.name ~= "mongodb" then   -- its worker threads allocate too; the C tests cover it
    describe("allocation failure on " .. entry.name .. ":", function()
      after_each(S.reset)
      teardown(function() S.cleanup() end)

      it("the Nth allocation failing, for every N to 250 (a round makes about 130), crashes nothing and loses nothing", function()
        local store = S.open(entry)
        local returned, all = {}, {}
        local last = tonumber(os.getenv("RELAYBUS_ALLOC_N") or "") or 250
        local failed = testing.fail_alloc(0)
        for n = 1, last do
          for _, id in ipairs(one_round(store, n, returned)) do all[#all + 1] = id end
        end
        -- every allocation of a round was made to fail once
        local landed = testing.fail_alloc(0) - failed
        assert.is_true(landed >= 100, "only " .. landed .. " of the Ns landed in a round")
        -- every delivery still exists; once leases run out a clean dispatcher finishes them all
        relaybus.sleep(1.2)
        local d = H.dispatcher(store, { lease_duration = 2, concurrency = 16 })
        d:handle("al.t", function(delivery) returned[delivery.id] = true end)
        d:start()
        local done = H.poll(function()
          local st = assert(store:stats())
          return st.pending + st.processing == 0
        end, 30)
        d:stop():wait()
        assert.truthy(done, "deliveries still pending or processing")
        for _, id in ipairs(all) do
          local r = assert(store:get(id), "delivery " .. id .. " is lost")
          if r.status == "completed" then
            assert.is_true(returned[id], "delivery " .. id .. " completed without its handler returning")
          else
            assert.equal("buried", r.status)   -- max attempts used up by failed runs
          end
        end
      end)
    end)
  end
end
