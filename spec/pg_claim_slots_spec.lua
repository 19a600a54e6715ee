-- pg_claim_slots_spec.lua -- the PostgreSQL claim's slots (docs/stores.md, "Claim slots"): at
-- most relaybus.claim_slots claims run at once on a table, each holding a transaction-scoped
-- advisory lock. Attacks: the slots held by another session (claims wait, then go on without a
-- slot after a second or the session's lock_timeout; nothing is lost or run twice), a claim
-- waiting for a slot must hold no row (a keyed enqueue of a delivery it settles would wait), a
-- table of the same name in another schema has slots of its own, dispatchers racing for one
-- slot, a dispatcher whose claims wait (one in flight when they get the slot, two when they
-- give up), and settings that are not a number of slots (claims go on). RELAYBUS_TEST_PG only: the slots are PostgreSQL's.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local F = require "spec.support.fault_util"
local relaybus = S.relaybus()

local entry
for _, e in ipairs(S.list()) do if e.name == "postgresql" then entry = e end end

-- The URL with these settings for its connections (libpq's `options`, which replaces
-- relaybus's default `-c jit=off`, so it is kept).
local function with_options(url, settings)
  local opt = ("-c jit=off " .. settings):gsub("[^%w._-]", function(c) return string.format("%%%02X", c:byte()) end)
  return url .. (url:find("?", 1, true) and "&" or "?") .. "options=" .. opt
end
local function with_slots(url, value, more)
  return with_options(url, "-c relaybus.claim_slots=" .. value .. (more or ""))
end

-- Runs one dispatcher per store (concurrency 4) until `want` deliveries have run, or `limit` s
-- passed (then it stops them: ok is false). With `first`, they start only when first(go), run
-- in a task, calls go(): a spec takes its locks there before any claim can be sent. Returns ok,
-- the ids run in order, and the times they started.
local function drain(stores, want, limit, first)
  local ran, starts, ds = {}, {}, {}
  local stopping, timed_out = false, false
  local function stop_all()
    stopping = true
    relaybus.spawn(function() for _, d in ipairs(ds) do d:stop { timeout = 2 } end end)
  end
  for i, s in ipairs(stores) do
    ds[i] = H.dispatcher(s, { concurrency = 4 })
    ds[i]:handle("t", function(delivery)
      ran[#ran + 1] = delivery.id
      starts[#starts + 1] = relaybus.now()
      if #ran >= want and not stopping then stop_all() end
    end)
  end
  local function go() for _, d in ipairs(ds) do d:start() end end
  local t0 = relaybus.now()
  relaybus.spawn(function()
    while not stopping and relaybus.now() - t0 < limit do relaybus.sleep(0.05) end
    if not stopping then timed_out = true; stop_all() end
  end)
  if first then relaybus.spawn(first, go) else go() end
  relaybus.run()
  return not timed_out, ran, starts
end

local function each_once(ids, ran)
  local seen = {}
  for _, id in ipairs(ran) do
    assert.is_nil(seen[id], "delivery " .. tostring(id) .. " ran twice")
    seen[id] = true
  end
  for _, id in ipairs(ids) do assert.is_true(seen[id], "delivery " .. tostring(id) .. " never ran") end
end

-- The SQL that takes the slots numbered in `slots` of the table named by $1 (qualified or
-- found on the search path), as docs/stores.md gives their keys.
local function slot_locks_sql(slots)
  local locks = {}
  for i, slot in ipairs(slots) do
    locks[i] = "pg_advisory_xact_lock((($1)::regclass::oid::bigint - 2147483648)::integer, " .. slot .. ")"
  end
  return "SELECT " .. table.concat(locks, ", ")
end

-- Drains `want` deliveries with `store` while another session (`holder`) holds the slots
-- numbered in `slots` of table `t` for `seconds`; the dispatcher starts once they are held.
-- Returns ok, the ids run, their start times, and held: held.from (when they were held) and
-- held.released (when the holder let go: nil if it had not yet when the drain ended; the next
-- relaybus.run() runs its transaction out).
local function drain_while_held(store, holder, t, slots, seconds, want, limit)
  local held = {}
  local ok, ran, starts = drain({ store }, want, limit, function(go)
    assert(holder:transaction(function(tx)
      assert(tx:query(slot_locks_sql(slots), t))
      held.from = relaybus.now()
      go()
      relaybus.sleep(seconds)
      held.released = relaybus.now()
    end))
  end)
  return ok, ran, starts, held
end

if entry then
  describe("postgresql claim slots:", function()
    after_each(S.reset)
    teardown(function() S.cleanup() end)

    it("while another session holds the only slot nothing is claimed; when it ends, each delivery runs once", function()
      local store, url, opts, t = S.open(entry)
      local slotted = assert(relaybus.open(with_slots(url, "1"), opts))
      local holder = assert(relaybus.open(url, opts))
      local ids = H.fill(store, "t", 40)
      -- held for less than the second a claim waits for a slot
      local ok, ran, starts, held = drain_while_held(slotted, holder, t, { 0 }, 0.3, 40, 15)
      assert.is_true(ok, "the drain did not end")
      assert.is_number(held.released, "the claims ended before the slot was released")
      each_once(ids, ran)
      -- the first start came after the holder's commit (a claim that waited for the slot)
      assert.is_true(starts[1] >= held.released - 0.005,
        string.format("a delivery started %.3f s before the slot was released", held.released - starts[1]))
      slotted:close()
      holder:close()
    end)

    it("slots held for longer than a second delay claims by that second, then they go on without one", function()
      local store, url, opts, t = S.open(entry)
      local holder = assert(relaybus.open(url, opts))
      local ids = H.fill(store, "t", 3)
      local ok, ran, starts, held = drain_while_held(store, holder, t, { 0, 1 }, 8, 3, 15)
      assert.is_true(ok, "the drain did not end")
      assert.is_nil(held.released, "the claims waited for the holder to end")
      each_once(ids, ran)
      assert.is_true(starts[1] >= held.from + 0.9,
        string.format("the first delivery started %.3f s after the slots were taken", starts[1] - held.from))
      relaybus.run()      -- runs out the holder's transaction
      assert.is_number(held.released)
      holder:close()
    end)

    it("a setting of 0 or less is no limit: a held slot does not stop claims", function()
      local store, url, opts, t = S.open(entry)
      for _, value in ipairs { "0", "-3", "-1000000" } do
        local unlimited = assert(relaybus.open(with_slots(url, value), opts))
        local holder = assert(relaybus.open(url, opts))
        local ids = H.fill(store, "t", 10)
        local ok, ran, starts, held = drain_while_held(unlimited, holder, t, { 0 }, 3, 10, 10)
        assert.is_true(ok)
        assert.is_nil(held.released, value .. ": the claims waited for the held slot")
        assert.is_true(starts[1] < held.from + 0.5,
          string.format("%s: the first delivery started %.3f s after the slot was taken", value, starts[1] - held.from))
        each_once(ids, ran)
        relaybus.run()      -- runs out the holder's transaction before the next value
        assert.is_number(held.released)
        unlimited:close()
        holder:close()
      end
    end)

    it("settings that are not a number of slots count as the default: claims go on, and two slots held stop them", function()
      local store, url, opts, t = S.open(entry)
      -- (a no-break space and an em space: a pattern's \s matches them in some locales, and the
      -- integer cast does not take them)
      for _, value in ipairs { "abc", "", "1e3", "0x10", "99999999999", "2;DROP", "--1", "2\u{A0}", "2\u{2003}",
                              "\xFF", "2\xC3\x28" } do      -- (and bytes that are not UTF-8)
        local s = assert(relaybus.open(with_slots(url, value), opts))
        local ids = H.fill(store, "t", 5)
        local ok, ran = drain({ s }, 5, 10)
        assert.is_true(ok, value .. ": the drain did not end")
        each_once(ids, ran)
        s:close()
      end
      -- the default is 2: both held keep a claim of the garbage setting waiting
      local s = assert(relaybus.open(with_slots(url, "abc"), opts))
      local holder = assert(relaybus.open(url, opts))
      local ids = H.fill(store, "t", 5)
      local ok, ran, starts, held = drain_while_held(s, holder, t, { 0, 1 }, 0.3, 5, 15)
      assert.is_true(ok)
      assert.is_number(held.released, "the claims ended before both default slots were released")
      each_once(ids, ran)
      assert.is_true(starts[1] >= held.released - 0.005, "a claim ran while both default slots were held")
      s:close()
      holder:close()
    end)

    it("in a database of locale C.UTF-8 a setting with a Unicode space around its digits counts as the default", function()
      local _, url, opts = S.open(entry)
      local db = S.unique("rbutf")
      local okc, _, err = F.psql(url, "CREATE DATABASE " .. db .. " TEMPLATE template0 LOCALE 'C.UTF-8' ENCODING UTF8")
      assert(okc, "CREATE DATABASE: " .. tostring(err))
      local dburl = url:gsub("^(%a+://[^/]*/)[^?]*", "%1" .. db)
      for _, value in ipairs { "2\u{A0}", "2\u{2003}", "\u{2003}2", "\u{3000}1" } do
        local s = assert(relaybus.open(with_slots(dburl, value), opts))
        local ids = H.fill(s, "t", 5)
        local ok, ran = drain({ s }, 5, 10)
        assert.is_true(ok, "the drain did not end with the setting " .. value)
        each_once(ids, ran)
        s:close()
      end
      assert(F.psql(url, "DROP DATABASE " .. db .. " WITH (FORCE)"))
    end)

    it("a claim waiting for a slot holds no row: a keyed enqueue of a delivery whose completion it carries does not wait for it", function()
      local store, url, opts, t = S.open(entry)
      local s = assert(relaybus.open(with_slots(url, "1"), opts))
      local holder = assert(relaybus.open(url, opts))
      local id = assert(store:enqueue("t", { n = 1 }, { key = "k1" }))
      local d = H.dispatcher(s, { concurrency = 1, claim_ahead = 0, lease_duration = 10 })
      local stop = H.stopper(d)
      local ran, took, again = 0, nil, nil
      d:handle("t", function()
        ran = ran + 1
        -- the slot is taken while this runs: the claim after it, carrying its completion, waits
        relaybus.spawn(function()
          assert(holder:transaction(function(tx)
            assert(tx:query(slot_locks_sql { 0 }, t))
            relaybus.sleep(0.9)
          end))
        end)
        relaybus.spawn(function()
          relaybus.sleep(0.3)
          local t0 = relaybus.now()
          again = store:enqueue("t", { n = 2 }, { key = "k1" })
          took = relaybus.now() - t0
          stop()
        end)
        relaybus.sleep(0.05)
      end)
      assert.is_true((H.run(d, 15)))
      relaybus.run()
      assert.equal(1, ran)
      assert.is_number(took)
      -- still live when asked (its completion waited for the slot), so the key gave its id
      assert.equal(id, again)
      assert.is_true(took < 0.4, string.format("the keyed enqueue waited %.3f s", took))
      s:close()
      holder:close()
    end)

    it("a table of the same name in another schema has slots of its own", function()
      local _, url = S.open(entry)
      local a, b, t = S.unique("sa"), S.unique("sb"), S.unique("same")
      local admin = assert(relaybus.open(url, { table = S.unique("adm") }))
      assert(admin:transaction(function(tx)
        assert(tx:exec("CREATE SCHEMA " .. a))
        return tx:exec("CREATE SCHEMA " .. b)
      end))
      local sa = assert(relaybus.open(with_options(url, "-c search_path=" .. a), { table = t }))
      local sb = assert(relaybus.open(with_options(url, "-c search_path=" .. b), { table = t }))
      -- every slot of a's table held: a's claims wait (for the second), b's do not
      local ids = H.fill(sa, "t", 5)
      local ok, ran, starts, held = drain_while_held(sa, admin, a .. "." .. t, { 0, 1 }, 3, 5, 10)
      assert.is_true(ok)
      each_once(ids, ran)
      assert.is_true(starts[1] >= held.from + 0.9, "a's claims did not wait for a's slots")
      relaybus.run()
      ids = H.fill(sb, "t", 5)
      ok, ran, starts, held = drain_while_held(sb, admin, a .. "." .. t, { 0, 1 }, 3, 5, 10)
      assert.is_true(ok)
      assert.is_nil(held.released, "b's claims waited for a's slots")
      assert.is_true(starts[1] < held.from + 0.5)
      each_once(ids, ran)
      relaybus.run()
      sa:close()
      sb:close()
      assert(admin:transaction(function(tx)
        assert(tx:exec("DROP SCHEMA " .. a .. " CASCADE"))
        return tx:exec("DROP SCHEMA " .. b .. " CASCADE")
      end))
      admin:close()
    end)

    -- lock_timeout ends the wait (the claim goes on without a slot); statement_timeout ends
    -- the claim (it fails, and the completions it carried are written alone)
    for _, timeout in ipairs { "lock_timeout=100", "statement_timeout=500" } do
      it("a " .. timeout .. " shorter than the wait for a slot loses nothing: every delivery completes once, on its first attempt", function()
        local store, url, opts, t = S.open(entry)
        local s = assert(relaybus.open(with_slots(url, "1", " -c " .. timeout), opts))
        local holder = assert(relaybus.open(url, opts))
        local ids = H.fill(store, "t", 60)
        local held_from, released
        local ran = {}
        local d = H.dispatcher(s, { concurrency = 4 })
        local stop = H.stopper(d)
        d:handle("t", function(delivery)
          ran[#ran + 1] = delivery.id
          relaybus.sleep(0.05)
          if #ran == 60 then stop() end
        end)
        relaybus.spawn(function()
          relaybus.sleep(0.3)     -- the first claims are in, handlers run and settle
          assert(holder:transaction(function(tx)
            assert(tx:query(slot_locks_sql { 0 }, t))
            held_from = relaybus.now()
            relaybus.sleep(1.5)
            released = relaybus.now()
          end))
        end)
        assert.is_true((H.run(d, 30)), "the drain did not end")
        assert.is_number(held_from)
        each_once(ids, ran)
        local done = assert(store:list { status = "completed", limit = 100 })
        assert.equal(60, #done)
        for _, r in ipairs(done) do assert.equal(1, r.attempts, "delivery " .. r.id .. " ran again") end
        relaybus.run()
        assert.is_number(released)
        s:close()
        holder:close()
      end)
    end

    -- Drains `want` deliveries with a dispatcher on store s (claim_slots 1) while
    -- `hold(go, state)`, run in a task, holds the slot in its own way (it calls go() once it
    -- holds it first; state.draining is true until the drain ends), and samples every 50 ms how
    -- many claims of table t wait for a slot. Returns the most seen at once.
    local function claims_waiting(s, store, t, ids, want, hold)
      local most, waited, samples = 0, 0, 0
      local sampling = true
      relaybus.spawn(function()
        while sampling do
          local ok, rows = store:transaction(function(tx)
            return tx:query("SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
              .. " AND wait_event = 'advisory' AND query LIKE $1", '%"' .. t .. '_claim"%')
          end)
          assert.is_true(ok, rows)
          local n = tonumber(rows[1].n)
          samples = samples + 1
          if n > most then most = n end
          if n > 0 then waited = waited + 1 end
          relaybus.sleep(0.05)
        end
      end)
      local state = { draining = true }
      local ok, ran = drain({ s }, want, 30, function(go) hold(go, state) end)
      sampling, state.draining = false, false
      assert.is_true(ok, "the drain did not end")
      each_once(ids, ran)
      relaybus.run()      -- the holder's last transaction ends
      assert.is_true(waited >= 10, string.format("claims were seen waiting in %d of %d samples", waited, samples))
      return most
    end

    it("a dispatcher whose claims wait for a slot and get it (another session takes it in turns) keeps one claim in flight, not two", function()
      local store, url, opts, t = S.open(entry)
      local s = assert(relaybus.open(with_slots(url, "1"), opts))
      local holder = assert(relaybus.open(url, opts))
      local ids = H.fill(store, "t", 100)
      local most = claims_waiting(s, store, t, ids, 100, function(go, state)
        -- held for 0.2 s at a time, less than the second a claim waits: each claim that
        -- waits gets the slot, and the holder's next turn waits behind it
        local first = true
        while state.draining do
          assert(holder:transaction(function(tx)
            assert(tx:query(slot_locks_sql({ 0 }), t))
            if first then first = false; go() end
            relaybus.sleep(0.2)
          end))
        end
      end)
      assert.equal(1, most, "claims of one dispatcher waited for a slot side by side")
      s:close()
      holder:close()
    end)

    it("a dispatcher whose claims give up waiting for a slot (held by a stuck session) keeps two claims in flight", function()
      local store, url, opts, t = S.open(entry)
      local s = assert(relaybus.open(with_slots(url, "1"), opts))
      local holder = assert(relaybus.open(url, opts))
      local ids = H.fill(store, "t", 60)
      -- each claim waits a second for the slot, then claims without it: behind a stuck holder
      -- one claim in flight would only halve what gets claimed
      local most = claims_waiting(s, store, t, ids, 60, function(go)
        assert(holder:transaction(function(tx)
          assert(tx:query(slot_locks_sql({ 0 }), t))
          go()
          relaybus.sleep(5)
        end))
      end)
      assert.equal(2, most, "the claims of one dispatcher never waited for a slot side by side")
      s:close()
      holder:close()
    end)

    it("three dispatchers on their own connections racing for one slot run 600 deliveries each once", function()
      local store, url, opts = S.open(entry)
      local ids = H.fill(store, "t", 600)
      local stores = {}
      for i = 1, 3 do stores[i] = assert(relaybus.open(with_slots(url, "1"), opts)) end
      local ok, ran = drain(stores, 600, 30)
      assert.is_true(ok, "the drain did not end")
      assert.equal(600, #ran)
      each_once(ids, ran)
      assert.equal(600, assert(store:stats()).completed)
      for _, s in ipairs(stores) do s:close() end
    end)
  end)
end
