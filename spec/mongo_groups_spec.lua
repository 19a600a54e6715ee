-- mongo_groups_spec.lua -- ordered groups on the MongoDB store (runtime/stores/mongo/groups.c)
-- when an enqueue linked a delivery into its group and died before inserting it: planted
-- directly (spec/support/mongo_plant.lua), since no kill lands there on purpose. A missing
-- predecessor counts as live for GROUP_GRACE_S (300 s) after its id was made, so the group
-- never runs two at once; after that the group goes on from the one it was linked behind.
-- (The conformance suite has the rest, on every store.)
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local P = require "spec.support.mongo_plant"
local relaybus = S.relaybus()

for _, entry in ipairs(S.list { dialects = true }) do
  if entry.kind ~= "mongodb" then goto continue end
  describe("ordered groups on " .. entry.name .. " after a crashed enqueue:", function()
    local store, url, opts

    before_each(function()
      store, url, opts = S.open(entry)
    end)
    after_each(S.reset)
    teardown(function() S.cleanup() end)

    -- The group's document as a crashed enqueue leaves it: its tail `ghost`, never inserted,
    -- linked behind `before` (or nothing).
    local function plant_tail(group, ghost, before)
      P.insert(url, opts.table .. "_groups", { {
        _id = P.group_doc_id(group), tail = ghost, v = 1, recent = before and { before, ghost } or { ghost } } })
    end

    it("a delivery after a tail never inserted waits while that one may still come", function()
      plant_tail("g", P.oid(relaybus.time()))
      local id = assert(store:enqueue("mg.g", { n = 1 }, { group = "g" }))
      local r = assert(store:get(id))
      assert.equal("pending", r.status)
      assert.equal(0, assert(store:stats()).due)
      H.near(relaybus.time(), r.run_at, 3, "its own run_at")
    end)

    it("one after a tail never inserted long ago goes on from the one that tail was linked behind", function()
      -- the head runs; the crashed enqueue's ghost came after it; the next one waits for the head
      local head
      local started, ended, most, running = {}, {}, 0, 0
      local d = H.dispatcher(store, { concurrency = 4 })
      local stop = H.stopper(d)
      d:handle("mg.b", function(delivery, ctx)
        running = running + 1
        most = math.max(most, running)
        started[#started + 1] = delivery.payload.n
        if delivery.payload.n == 1 then ctx:sleep(0.8) end
        running = running - 1
        ended[#ended + 1] = delivery.payload.n
        if delivery.payload.n == 2 then stop() end
      end)
      relaybus.spawn(function()
        -- (the group document is planted before the head's enqueue moves it: the head is
        -- linked behind an old ghost that is gone; then a second old ghost after the head)
        local ghost0 = P.oid(relaybus.time() - 3600)
        plant_tail("h", ghost0)
        head = assert(store:enqueue("mg.b", { n = 1 }, { group = "h" }))
        assert(H.poll(function() return #started == 1 end, 10), "the head did not start")
        -- a second enqueue died after linking ghost1 behind the head: planted as its own group
        -- document would read (tail ghost1, recent head then ghost1) under a fresh name
        local ghost1 = P.oid(relaybus.time() - 3600)
        plant_tail("h2", ghost1, head)
        assert(store:enqueue("mg.b", { n = 2 }, { group = "h2" }))
      end)
      assert.is_true((H.run(d, 20)))
      assert.same({ 1, 2 }, started)
      assert.same({ 1, 2 }, ended)
      assert.equal(1, most)
    end)

    -- (found by reading: the sweep read the first 500 markers every time, so one behind them
    -- was never looked at; a group makes a marker per held delivery)
    it("the sweep reaches a marker behind 600 others: a settle whose look never came still releases the one after it", function()
      local now = relaybus.time()
      local live = {}
      for i = 1, 600 do live[i] = assert(store:enqueue("mg.s", { i = i }, { delay = 3600 })) end
      local marks = {}
      for i, id in ipairs(live) do marks[i] = { _id = id, at = now, gnext = P.oid(now) } end
      -- the head settled in a process that died before its look: completed, its marker
      -- (sorted last: its id's time is the latest) names the held one after it
      local head, after = P.oid(now + 1000), P.oid(now)
      marks[#marks + 1] = { _id = head, at = now, gnext = after }
      P.insert(url, opts.table .. "_deps", marks)
      local function doc(id, fields)
        local d = { _id = { ["$oid"] = id }, topic = "mg.s2", payload = { n = 1 }, payload_format = "bson",
                    group = "s", attempts = 0, max_attempts = 25, fence = 0, v = 0, created_at = now,
                    lease_expires_at = 0 }
        for k, v in pairs(fields) do d[k] = v end
        return d
      end
      P.insert(url, opts.table, {
        doc(head, { status = "completed", run_at = now, settled_at = now }),
        doc(after, { status = "pending", run_at = 1e300, held_run_at = now, gprev = head }),
      })
      local ran
      local d = H.dispatcher(store, { poll_interval = 0.2 })
      local stop = H.stopper(d)
      d:handle("mg.s2", function(delivery) ran = delivery.id; stop() end)
      assert.is_true((H.run(d, 25)), "the held one was never released")
      assert.equal(after, ran)
    end)
  end)
  ::continue::
end
