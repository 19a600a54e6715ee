-- pg_wakeups_spec.lua -- idle dispatchers on PostgreSQL sleep until the next delivery falls due
-- (docs/stores.md, "Wake-ups"): with the LISTEN connection up, each claim reads when the
-- earliest live delivery falls due, and every insert and every update that makes a delivery due
-- sooner notifies. The dispatchers here poll every 30 s at most (poll_interval and
-- listen_poll_interval), so a delivery that starts within seconds was woken for, not polled
-- for. Attacks: a retry scheduled by another process that then stops, a lease left to expire, a
-- kick, an UPDATE by hand, the LISTEN connection killed while an insert commits, notifications
-- that never come (noticed: it then polls), rows parked at infinite times. RELAYBUS_TEST_PG only: the other stores poll every
-- poll_interval, as before.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local relaybus = S.relaybus()

local entry
for _, e in ipairs(S.list()) do if e.name == "postgresql" then entry = e end end

-- Far longer than any wait below: a start within WOKEN s of its cause was woken for.
local SLEEPY = { poll_interval = 30, listen_poll_interval = 30, lease_duration = 20 }
local WOKEN = 8

-- Gives `sleeper` (a dispatcher) its handler of topic "t", which notes each run in the list it
-- returns ({ at = start time, attempt =, id = }) and stops it after `want` runs.
local function note_runs(sleeper, want)
  local runs = {}
  local stop = H.stopper(sleeper)
  sleeper:handle("t", function(delivery)
    runs[#runs + 1] = { at = relaybus.now(), attempt = delivery.attempts, id = delivery.id }
    if #runs >= want then stop() end
  end)
  return runs
end

-- Runs `sleeper` and the task act(runs) until the sleeper has run `want` deliveries of topic
-- "t" or `limit` s passed. Returns the runs.
local function watch(sleeper, want, limit, act)
  local runs = note_runs(sleeper, want)
  relaybus.spawn(act, runs)
  H.run(sleeper, limit)
  return runs
end

-- One statement (and its rows) on `store`, in a transaction of its own.
local function sql(store, text, ...)
  local args = table.pack(...)
  local ok, rows = store:transaction(function(tx) return tx:query(text, table.unpack(args, 1, args.n)) end)
  assert.is_true(ok, rows)
  return rows
end

-- The sleepers' stores: their sessions are told apart from those of the other stores by
-- their application_name.
local function open_sleepy(t)
  local url = entry.url()
  return assert(relaybus.open(url .. (url:find("?", 1, true) and "&" or "?") .. "application_name=sleeper",
    { table = t }))
end

-- Inside a task: waits until the sleeper's claim connection has claimed once since `since` (a
-- relaybus.now(); the sleeper's session that last ran table t's claim function went idle
-- after it), so it has read when the next delivery falls due and is asleep. `store` is
-- another store: a statement of the sleeper's own would take the place of its claim.
local function asleep_after(store, t, since)
  local function last_claim()
    local rows = sql(store, "SELECT extract(epoch FROM max(state_change)) AS at FROM pg_stat_activity"
      .. " WHERE application_name = 'sleeper' AND state = 'idle' AND query LIKE $1", '%"' .. t .. '_claim"%')
    return tonumber(rows[1] and rows[1].at)
  end
  local now_rows = sql(store, "SELECT extract(epoch FROM clock_timestamp()) AS now")
  -- (less half a second: a claim sent as the sleeper started may be answered before the task
  -- calling this first runs)
  local server_since = tonumber(now_rows[1].now) - (relaybus.now() - since) - 0.5
  assert.truthy(H.poll(function()
    local at = last_claim()
    return at and at >= server_since
  end, 5), "the sleeper never claimed")
  relaybus.sleep(0.3)
end

-- On a new table: prepare(other, t) sets it up (its answer is passed on as `made`), a sleeper
-- (SLEEPY) starts, and once it is asleep act(other, t, made) makes a delivery due by another
-- store and returns when it falls due (nil: now). Checks that the sleeper ran it once, not
-- before that and within WOKEN s of it; returns the run and `made`.
local function woken(name, act, prepare)
  local t = S.unique(name)
  local store, other = open_sleepy(t), assert(relaybus.open(entry.url(), { table = t }))
  local made = prepare and prepare(other, t)
  local due
  local runs = watch(H.dispatcher(store, SLEEPY), 1, 30, function()
    asleep_after(other, t, relaybus.now())
    due = act(other, t, made) or relaybus.now()
  end)
  store:close(); other:close()
  assert.equal(1, #runs)
  local late = runs[1].at - due
  assert.truthy(late > -0.2, "started " .. -late .. " s before it was due")
  assert.truthy(late < WOKEN, "started " .. late .. " s after it was due")
  return runs[1], made
end

describe("idle dispatchers on PostgreSQL sleep until the next delivery falls due #postgresql", function()
  if not entry then
    it("needs RELAYBUS_TEST_PG", function() assert.is_nil(entry, "no PostgreSQL to test against") end)
    return
  end
  teardown(function() S.cleanup() end)

  it("an idle dispatcher with nothing live does not poll every poll_interval: its claim session stays idle", function()
    local t = S.unique("quiet")
    local store, other = open_sleepy(t), assert(relaybus.open(entry.url(), { table = t }))
    local d = H.dispatcher(store, { poll_interval = 0.05, listen_poll_interval = 30 })
    local states
    d:handle("t", function() end)
    relaybus.spawn(function()
      local t0 = relaybus.now()
      asleep_after(other, t, t0)
      -- (past the check for topics nobody handles, 2 s after the start)
      relaybus.sleep(math.max(0, 2.5 - (relaybus.now() - t0)))
      local function claim_state()
        return sql(other, "SELECT pid, query, state_change::text AS at FROM pg_stat_activity"
          .. " WHERE application_name = 'sleeper' ORDER BY pid")
      end
      local before = claim_state()
      relaybus.sleep(2)     -- forty polls at poll_interval 0.05
      states = { before = before, after = claim_state() }
      d:stop { timeout = 1 }
    end)
    assert.is_true((H.run(d, 15)))
    assert.truthy(#states.before >= 1)
    assert.same(states.before, states.after)
    store:close(); other:close()
  end)

  it("a delivery enqueued for later by another process starts when it falls due", function()
    woken("later", function(other)
      assert(other:enqueue("t", {}, { delay = 1.5 }))
      return relaybus.now() + 1.5
    end)
  end)

  it("a schedule made by another process is read at once (NOTIFY), not a listen_poll_interval later", function()
    woken("sched", function(other)
      assert(other:schedule("s", { every = 2, topic = "t" }))
      return assert(other:schedules())[1].next_at - relaybus.time() + relaybus.now()
    end)
  end)

  it("a retry scheduled by another dispatcher that then stops runs when it falls due, not a lease or a poll later", function()
    local t = S.unique("retry")
    local store, other = open_sleepy(t), assert(relaybus.open(entry.url(), { table = t }))
    local failing = H.dispatcher(other, { lease_duration = 20, backoff = function() return 1.5 end })
    local failed_at
    local sleeper = H.dispatcher(store, SLEEPY)
    local runs = note_runs(sleeper, 1)
    failing:handle("t", function()
      -- the sleeper starts now: its first claim finds this run's lease, 20 s away
      sleeper:start()
      asleep_after(other, t, relaybus.now())
      relaybus.spawn(function() failing:stop { timeout = 5 } end)
      failed_at = relaybus.now()
      error("boom")
    end)
    local id = assert(other:enqueue("t", {}))
    failing:start()
    relaybus.spawn(function()   -- the guard: the loop ends whatever happens
      local t0 = relaybus.now()
      while #runs == 0 and relaybus.now() - t0 < 30 do relaybus.sleep(0.05) end
      failing:stop { timeout = 1 }
      sleeper:stop { timeout = 1 }
    end)
    relaybus.run()
    assert.equal(1, #runs)
    assert.equal(id, runs[1].id)
    assert.equal(2, runs[1].attempt)
    assert.truthy(runs[1].at >= failed_at + 1.4, "ran before its retry was due")
    assert.truthy(runs[1].at - failed_at < WOKEN, "ran " .. (runs[1].at - failed_at) .. " s after the failure")
    store:close(); other:close()
  end)

  it("a delivery whose lease another process left to expire is taken over at the expiry", function()
    local run = woken("lease", function(other, t)
      -- what a process that claimed it and died leaves: processing, its lease 2 s away
      sql(other, 'INSERT INTO "' .. t .. '" (topic, status, attempts, lease_token, lease_expires_at)'
        .. " VALUES ('t', 'processing', 1, 'dead', now() + interval '2 seconds') RETURNING id")
      return relaybus.now() + 2
    end)
    assert.equal(2, run.attempt)
  end)

  it("a kick of a buried delivery wakes it", function()
    local run, id = woken("kick", function(other, _, id)
      assert.equal(1, assert(other:kick(id)))
    end, function(other, t)
      local id = assert(other:enqueue("t", {}))
      sql(other, 'UPDATE "' .. t .. "\" SET status = 'buried', settled_at = now() WHERE id = $1", id)
      return id
    end)
    assert.equal(id, run.id)
  end)

  it("an UPDATE by hand that brings a delivery forward wakes it", function()
    local run, id = woken("hand", function(other, t, id)
      sql(other, 'UPDATE "' .. t .. '" SET run_at = now() WHERE id = $1', id)
    end, function(other) return assert(other:enqueue("t", {}, { delay = 3600 })) end)
    assert.equal(id, run.id)
  end)

  it("rows parked at run_at 'infinity' or '-infinity' (or leases ending then) at the head of the table stop no claim", function()
    local t = S.unique("inf")
    local store, other = open_sleepy(t), assert(relaybus.open(entry.url(), { table = t }))
    local sleeper = H.dispatcher(store, { poll_interval = 0.2, listen_poll_interval = 30, lease_duration = 20 })
    local runs = watch(sleeper, 4, 40, function(runs)
      for round, park in ipairs { "'infinity'", "'-infinity'" } do
        -- a row of a topic nobody handles, parked; and one of a lease that never ends
        sql(other, 'DELETE FROM "' .. t .. "\" WHERE topic = 'parked'")
        sql(other, 'INSERT INTO "' .. t .. "\" (topic, run_at) VALUES ('parked', " .. park .. ") RETURNING id")
        sql(other, 'INSERT INTO "' .. t .. "\" (topic, status, lease_token, lease_expires_at)"
          .. " VALUES ('parked', 'processing', 'x', " .. park .. ") RETURNING id")
        for _ = 1, 2 do assert(other:enqueue("t", {})) end
        H.poll(function() return #runs >= 2 * round end, WOKEN)
      end
    end)
    assert.equal(4, #runs)
    store:close(); other:close()
  end)

  it("notifications that never come (a pooler that drops them) are noticed: after two deliveries found at the end of a sleep it claims every poll_interval", function()
    local t = S.unique("deaf")
    local store, other = open_sleepy(t), assert(relaybus.open(entry.url(), { table = t }))
    -- what a pooler in transaction mode does to LISTEN: the insert's notification never comes
    sql(other, 'ALTER TABLE "' .. t .. '" DISABLE TRIGGER "' .. t .. '_notify"')
    local sleeper = H.dispatcher(store, { poll_interval = 0.2, listen_poll_interval = 4, lease_duration = 20 })
    local inserted = {}
    local runs = watch(sleeper, 3, 60, function(runs)
      local since = relaybus.now()
      for round = 1, 3 do
        asleep_after(other, t, since)
        sql(other, 'INSERT INTO "' .. t .. "\" (topic) VALUES ('t') RETURNING id")
        inserted[round] = relaybus.now()
        H.poll(function() return #runs >= round end, 10)
        since = runs[round] and runs[round].at or relaybus.now()
      end
    end)
    assert.equal(3, #runs)
    -- the first two waited for the end of the sleep, 4 s after the claim before them; the third
    -- came within a poll_interval, not 3.7 s later
    local late = runs[3].at - inserted[3]
    assert.truthy(late < 1.5, "the third ran " .. late .. " s after its insert")
    store:close(); other:close()
  end)

  it("an insert that commits while the LISTEN connection is killed still runs at once", function()
    local t = S.unique("relisten")
    local store, other = open_sleepy(t), assert(relaybus.open(entry.url(), { table = t }))
    local sleeper = H.dispatcher(store, SLEEPY)
    local inserted = {}
    local runs = watch(sleeper, 3, 60, function(runs)
      local since = relaybus.now()
      for round = 1, 3 do
        asleep_after(other, t, since)
        local killed = sql(other, "SELECT count(pg_terminate_backend(pid)) AS n FROM pg_stat_activity WHERE query = $1",
          'LISTEN "' .. t .. '"')
        assert.equal(1, tonumber(killed[1].n))
        sql(other, 'INSERT INTO "' .. t .. "\" (topic) VALUES ('t') RETURNING id")
        inserted[round] = relaybus.now()
        H.poll(function() return #runs >= round end, WOKEN + 2)
        since = runs[round] and runs[round].at or relaybus.now()
      end
    end)
    assert.equal(3, #runs)
    for round = 1, 3 do
      local late = runs[round].at - inserted[round]
      assert.truthy(late < WOKEN, "round " .. round .. ": ran " .. late .. " s after the insert")
    end
    store:close(); other:close()
  end)
end)
