-- store_faults_spec.lua -- testing.faults itself: what each kind of fault does to the wrapped
-- store, that a seed replays the same faults, that transactions always end, how closing works,
-- and the misuse errors. On every store of the matrix (transactions on the SQL stores).
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local relaybus = S.relaybus()
local testing = S.testing()   -- the specs' own module (testing/lua_testing.c)

-- Runs fn inside a relaybus task (store calls yield) and returns what it returned.
local function task(fn)
  local res
  relaybus.spawn(function() res = table.pack(fn()) end)
  relaybus.run()
  assert(res, "the task did not end")
  return table.unpack(res, 1, res.n)
end

local function total(store)
  return (H.total(store))
end

for _, entry in ipairs(S.list()) do
  describe("testing.faults on " .. entry.name .. ":", function()
    local store, app
    before_each(function()
      local s, _, _, tbl = S.open(entry)
      store = s
      app = tbl .. "_app"     -- unique: a server's tables outlive the test
    end)
    after_each(S.reset)
    teardown(S.cleanup)

    it("without faults every operation reaches the store and answers as the store does", function()
      local f = assert(testing.faults(store, { seed = 1 }))
      assert.equal(store:kind(), f:kind())
      local id = assert(f:enqueue("t", { x = 1 }, { key = "k" }))
      assert.equal(id, f:enqueue("t", { x = 2 }, { key = "k" }))
      assert.equal("pending", f:get(id).status)
      assert.equal(1, #f:list())
      assert.equal(1, f:stats().pending)
      assert.equal(0, f:kick { status = "buried" })
      assert.equal(0, f:purge { status = "completed", older_than = 0 })
      local h = assert(f:try_acquire("name", 5))
      assert.is_nil(f:try_acquire("name", 5))
      assert.is_true(h:release())
      local st = testing.fault_stats(f)
      assert.equal(0, st.faults)
      assert.equal(0, st.waiting)
      assert.same({ twice = 0, wrong_thread = 0, multiline = 0, err_with_result = 0, stuck = 0,
                    unanswered = 0 }, st.violations)
      assert.equal(2, st.calls.enqueue)
    end)

    it("fail answers an error and nothing happens; lost answers an error after the write happened", function()
      local failing = testing.faults(store, { ops = { enqueue = { fail = 1 } } })
      local id, err = failing:enqueue("t", {})
      assert.is_nil(id)
      assert.equal("injected fault: enqueue failed", err)
      assert.equal(0, total(store))
      local losing = testing.faults(store, { ops = { enqueue = { lost = 1 } } })
      id, err = losing:enqueue("t", {})
      assert.is_nil(id)
      assert.equal("injected fault: enqueue answer lost", err)
      assert.equal(1, total(store))
      assert.equal(1, testing.fault_stats(losing).injected.lost.enqueue)
      assert.equal(1, testing.fault_stats(failing).injected.fail.enqueue)
      assert.equal(1, losing:stats().pending)   -- other operations are left alone
    end)

    it("late delays the answer up to max_delay and loses nothing", function()
      local f = testing.faults(store, { seed = 3, late = 1, max_delay = 0.1 })
      local ids = task(function()
        local out = {}
        for i = 1, 5 do out[i] = assert(f:enqueue("t", { i = i })) end
        return out
      end)
      assert.equal(5, #ids)
      assert.equal(5, total(store))
      local st = testing.fault_stats(f)
      assert.equal(5, st.injected.late.enqueue)
      assert.equal(0, st.held)
    end)

    it("the same seed draws the same faults for the same calls", function()
      local function outcomes(seed)
        local f = testing.faults(store, { seed = seed, fail = 0.3, lost = 0.3 })
        local out = {}
        for i = 1, 40 do
          local id, err = f:get("nonexistent")
          out[i] = id == nil and (err or "none") or "found"
        end
        return table.concat(out, ",")
      end
      assert.equal(outcomes(42), outcomes(42))
      assert.are_not.equal(outcomes(42), outcomes(43))
      assert.equal(42, testing.fault_stats(testing.faults(store, { seed = 42 })).seed)
    end)

    it("a dispatcher on a faulty store claims, runs and settles", function()
      local f = testing.faults(store, { seed = 5, fail = 0.1, lost = 0.1, late = 0.3 })
      for i = 1, 30 do assert(store:enqueue("t", { i = i })) end
      local d = H.dispatcher(f, { lease_duration = 1 })
      d:handle("t", function() end)
      local stop = H.stopper(d)
      relaybus.spawn(function()
        H.poll(function() return store:stats().completed == 30 end, 20)
        stop()
      end)
      assert.is_true(H.run(d, 30))
      assert.equal(30, store:stats().completed)
      -- a late answer may still be on its way (the retention task's lease calls): it comes
      assert.truthy(task(function()
        return H.poll(function() return testing.fault_stats(f).waiting == 0 end, 2)
      end), "operations still unanswered after the stop")
    end)

    if entry.sql then
      it("a failed commit rolls the transaction back; a lost one committed; either way it has ended", function()
        assert(store:transaction(function(tx) tx:exec("CREATE TABLE " .. app .. " (x INTEGER)") end))
        local failing = testing.faults(store, { ops = { commit = { fail = 1 } } })
        local ok, err = failing:transaction(function(tx)
          tx:exec("INSERT INTO " .. app .. " VALUES (1)")
          tx:enqueue("t", {})
        end)
        assert.is_nil(ok)
        assert.equal("injected fault: commit failed", err)
        local losing = testing.faults(store, { ops = { commit = { lost = 1 } } })
        ok, err = losing:transaction(function(tx)
          tx:exec("INSERT INTO " .. app .. " VALUES (2)")
          tx:enqueue("t", {})
        end)
        assert.is_nil(ok)
        assert.equal("injected fault: commit answer lost", err)
        -- the store is free again (SQLite: a transaction left open would block this)
        local _, rows = assert(store:transaction(function(tx) return tx:query("SELECT x FROM " .. app) end))
        assert.equal(1, #rows)
        assert.equal(2, rows[1].x)
        assert.equal(1, total(store))
      end)
    end

    it("closing the wrapper leaves the store open; a closed store makes the wrapper answer store closed", function()
      local f = testing.faults(store, {})
      f:close()
      assert.equal(0, total(store))
      local g = testing.faults(store, {})
      store:close()
      local id, err = g:enqueue("t", {})
      assert.is_nil(id)
      assert.equal("store closed", err)
      g:close()
    end)

    it("misuse raises relaybus: errors", function()
      H.raises_relaybus(testing.faults, store, { fail = 2 })
      H.raises_relaybus(testing.faults, store, { fail = 0.6, lost = 0.6 })
      H.raises_relaybus(testing.faults, store, { ops = { nosuchop = { fail = 1 } } })
      H.raises_relaybus(testing.faults, store, { ops = { claim = 0.5 } })
      H.raises_relaybus(testing.faults, store, { seed = 1.5 })
      H.raises_relaybus(testing.faults, store, { speed = 1 })
      H.raises_relaybus(testing.faults, "sqlite:x.db")
      H.raises_relaybus(testing.fault_stats, store)
    end)
  end)
end

describe("testing.faults' contract checks:", function()
  it("count a store that answers twice, never, from another thread, in two lines or with results beside an error, and answer each caller once", function()
    local code, out, err = S.run_command { S.build .. "/faults_contract" }
    assert.equal(0, code, err)
    local got = {}
    for line in out:gmatch("[^\n]+") do
      local k, v = line:match("^(%S+) (.*)$")
      got[k] = tonumber(v) or v
    end
    assert.same({
      twice = 1, wrong_thread = 1, multiline = 1, err_with_result = 1, stuck = 1,
      waiting_before_close = 1, unanswered = 1, inner_closed = 1,
      answers_enqueue = 1, answers_get = 1, answers_stats = 1, answers_kick = 1, answers_claim = 1,
      answers_list_before_close = 0, answers_list = 1, list_err = "store closed",
    }, got)
  end)
end)
