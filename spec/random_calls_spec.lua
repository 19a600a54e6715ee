-- random_calls_spec.lua -- the Lua API driven by random sequences of calls, on every store: stores
-- opened and closed, dispatchers started, stopped and started again, handlers that settle
-- twice, keep their ctx and tx and use them after their end, raise odd values, close the store
-- or stop their dispatcher from inside, transactions left open, leases released twice,
-- garbage collected at any point. Every call must either work, fail with a one-line "relaybus:"
-- misuse error, or return nil and a one-line error; nothing may crash (CI runs this on the
-- ASan/UBSan build too); and afterwards no delivery is lost or stuck under a lease.
-- Seeds are printed on failure; RELAYBUS_MISUSE_SEED replays one, RELAYBUS_MISUSE_RUNS sets
-- how many sequences run.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local relaybus = S.relaybus()

local LEASE = 0.6

-- The outcome of one call: "ok", "misuse" (raised relaybus: ...), "error" (returned nil, err);
-- anything else (a crash of the test itself, an error without relaybus:) is a finding.
local function outcome(findings, what, ok, a, b)
  if not ok then
    local e = tostring(a)
    if not e:match("^relaybus: ") or e:find("\n") then
      findings[#findings + 1] = what .. " raised an error that is not a one-line misuse: " .. e
    end
    return "misuse"
  end
  if a == nil and b ~= nil then
    if type(b) ~= "string" or b == "" or b:find("\n") then
      findings[#findings + 1] = what .. " returned an error that is not one line: " .. tostring(b)
    end
    return "error"
  end
  return "ok"
end

-- One random sequence against a store URL; returns the ids it enqueued and its findings.
local function sequence(seed, url, opts, steps)
  local rnd = math.random
  math.randomseed(seed)
  local findings, ids = {}, {}
  local stores, ds, kept_ctx, kept_tx, leases = {}, {}, {}, {}, {}
  local function pick(list) if #list > 0 then return list[rnd(#list)] end end
  local function call(what, fn, ...)
    local r = table.pack(pcall(fn, ...))
    outcome(findings, what, r[1], r[2], r[3])
    return r[1] and r[2], r
  end
  local function keep_id(id) if type(id) == "string" then ids[#ids + 1] = id end end

  local handlers = {
    function() end,
    function() error("plain failure") end,
    function() error({ not_a = "string" }) end,
    function() error() end,
    function(_, ctx) ctx:complete(); ctx:complete() end,
    function(_, ctx) ctx:bury("first"); return "ignored" end,
    function(_, ctx) ctx:reschedule(0, "again"); ctx:release() end,
    function(_, ctx) kept_ctx[#kept_ctx + 1] = ctx end,
    function(_, ctx) ctx:sleep(rnd() * 0.05) end,
    function(_, ctx) ctx:extend_lease(); ctx:extend_lease(5) end,
    function(_, ctx) ctx.signal:on_abort(function() error("in on_abort") end); ctx:sleep(LEASE * 2) end,
    function(_, ctx) relaybus.spawn(function() relaybus.sleep(0.02); ctx:complete(); ctx:sleep(0.01) end) end,
    function() coroutine.yield(); coroutine.yield("x") end,
    function(del, ctx) local s = pick(stores); if s then pcall(s.cancel, s, del.id) end; ctx:sleep(0.05); ctx:complete() end,
    function() local s = pick(stores); if s then pcall(s.close, s) end end,
    function() local d = pick(ds); if d then pcall(d.stop, d, { timeout = 0 }) end end,
    function() pcall(coroutine.wrap(function() local s = pick(stores); if s then s:stats() end end)) end,
  }

  local actions = {
    function() -- open
      local s = relaybus.open(url, opts)
      if s then stores[#stores + 1] = s end
    end,
    function() local s = pick(stores); if s then call("close", s.close, s) end end,
    function()
      local s = pick(stores); if not s then return end
      keep_id(call("enqueue", s.enqueue, s, "m.t", { n = rnd(1000) }, { max_attempts = rnd(1, 3) }))
    end,
    function()
      local s = pick(stores); if not s then return end
      local res = call("enqueue_many", s.enqueue_many, s, { { "m.t", { a = 1 } }, { "m.t", { b = 2 }, { delay = 0 } } })
      if type(res) == "table" then for _, id in ipairs(res) do keep_id(id) end end
    end,
    -- grouped, and keyed with replace
    function()
      local s = pick(stores); if not s then return end
      keep_id(call("enqueue(group)", s.enqueue, s, "m.t", { n = rnd(1000) },
        { group = pick { "ga", "gb" }, max_attempts = rnd(1, 3) }))
    end,
    function()
      local s = pick(stores); if not s then return end
      keep_id(call("enqueue(replace)", s.enqueue, s, "m.t", { r = rnd(1000) },
        { key = pick { "ka", "kb" }, replace = true, delay = pick { 0, 0.05 } }))
    end,
    -- after ids of any status, unknown ones, its own kind
    function()
      local s = pick(stores); if not s then return end
      keep_id(call("enqueue(after)", s.enqueue, s, "m.t", { a = rnd(1000) },
        { after = { pick(ids) or "1", pick(ids) or "999999", pick { "1", "x", "99999999999" } } }))
    end,
    -- limits and pauses of the topic, set, replaced and cleared in any order, some bad
    -- (cleared before the drain at the end)
    function()
      local s = pick(stores); if not s then return end
      local lim = pick { { concurrency = rnd(1, 3) }, { rate = rnd(1, 5), per = rnd() * 0.3 + 0.01 },
                         { rate = 2, per = 0.1, concurrency = 1 }, "clear", { concurrency = 0 }, { rate = 1 } }
      call("limit", s.limit, s, "m.t", lim ~= "clear" and lim or nil)
    end,
    function() local s = pick(stores); if s then call("limits", s.limits, s) end end,
    function()
      local s = pick(stores); if not s then return end
      local f = pick { "pause", "resume" }
      call(f, s[f], s, "m.t")
    end,
    -- schedules made, replaced with other timings, listed, removed (their ticks go to m.t)
    function()
      local s = pick(stores); if not s then return end
      call("schedule", s.schedule, s, "m.s" .. rnd(2), pick {
        { every = 1, topic = "m.t", payload = { s = 1 } }, { cron = "* * * * * *", topic = "m.t" },
        { cron = "*/2 * * * * *", timezone = "Europe/Berlin", topic = "m.t" }, { every = 0.5, topic = "m.t" },
        { cron = "61 * * * *", topic = "m.t" }, { every = 1 }, { topic = "m.t" } })
    end,
    function() local s = pick(stores); if s then call("unschedule", s.unschedule, s, "m.s" .. rnd(2)) end end,
    function() local s = pick(stores); if s then call("schedules", s.schedules, s) end end,
    function() local s = pick(stores); if s then call("enqueue(bad)", s.enqueue, s, "", nil) end end,
    function() local s = pick(stores); if s then call("enqueue(bad opts)", s.enqueue, s, "m.t", {}, { nope = 1 }) end end,
    function() local s = pick(stores); if s then call("list", s.list, s, { status = pick { "pending", "buried", "nope" }, limit = rnd(1, 5) }) end end,
    function() local s = pick(stores); if s then call("stats", s.stats, s) end end,
    function() local s = pick(stores); if s then call("get", s.get, s, pick(ids) or "42") end end,
    function() local s = pick(stores); if s then call("kick", s.kick, s, { status = "buried" }) end end,
    -- a cancel of a delivery that may be running anywhere here, settled, or not an id at all
    function() local s = pick(stores); if s then call("cancel", s.cancel, s, pick(ids) or pick { "42", "", "x\0y" }) end end,
    -- (an hour old: what this sequence completed stays, to be counted at the end)
    function() local s = pick(stores); if s then call("purge", s.purge, s, { status = "completed", older_than = 3600, limit = 1 }) end end,
    function() -- a dispatcher with random, sometimes bad, options
      local s = pick(stores); if not s then return end
      local o = pick { { lease_duration = LEASE, poll_interval = 0.02, shutdown_timeout = 0.3, backoff = function() return 0 end },
                       { lease_duration = LEASE, concurrency = rnd(1, 4), poll_interval = 0.02, shutdown_timeout = 0.2 },
                       { lease_duration = LEASE, claim_ahead = rnd(0, 4), poll_interval = 0.02, shutdown_timeout = 0.2 },
                       { lease_duration = -1 }, { concurrency = 0.5 }, { claim_ahead = -1 }, { claim_ahead = 0.5 },
                       { claim_ahead = 101 }, { claim_ahead = 0 / 0 }, { claim_ahead = "4" }, { nope = true } }
      local d = call("dispatcher", relaybus.dispatcher, s, o)
      if d then
        call("handle", d.handle, d, "m.t", pick(handlers), pick { nil, { timeout = 0.2 }, { transactional = rnd() < 0.3 } })
        ds[#ds + 1] = d
      end
    end,
    function() local d = pick(ds); if d then call("handle(late)", d.handle, d, "m.other", function() end) end end,
    function() local d = pick(ds); if d then call("start", d.start, d) end end,
    function() local d = pick(ds); if d then call("stop", d.stop, d, { timeout = rnd() * 0.3 }) end end,
    function() local d = pick(ds); if d then call("stop(bad)", d.stop, d, { timeout = -1 }) end end,
    function() local d = pick(ds); if d then call("every", d.every, d, "m.every" .. rnd(3), 0.1, function(ctx) ctx:sleep(0.05) end) end end,
    function() -- a kept ctx, used after its run
      local c = pick(kept_ctx); if not c then return end
      call("ctx:complete", c.complete, c)
      call("ctx:sleep", c.sleep, c, 0.001)
      call("ctx:extend_lease", c.extend_lease, c)
      local _ = c.signal.aborted, c.deadline
    end,
    function() -- a transaction, sometimes left open, sometimes raising, sometimes kept
      local s = pick(stores); if not s then return end
      local mine = {}
      local committed = call("transaction", s.transaction, s, function(tx)
        mine[#mine + 1] = tx:enqueue("m.t", { tx = true })
        if rnd() < 0.3 then kept_tx[#kept_tx + 1] = tx end
        if rnd() < 0.3 then error("roll back") end
        if rnd() < 0.2 then pcall(s.close, s) end
      end)
      if committed == true then for _, id in ipairs(mine) do keep_id(id) end end
    end,
    function() local tx = pick(kept_tx); if tx then call("tx after end", tx.enqueue, tx, "m.t", {}) end end,
    function() -- named leases
      local s = pick(stores); if not s then return end
      local h = call("try_acquire", s.try_acquire, s, "m.lease" .. rnd(2), rnd() * 0.5 + 0.1)
      if h then leases[#leases + 1] = h end
    end,
    function() local h = pick(leases); if h then call("release", h.release, h); call("release twice", h.release, h) end end,
    function() local h = pick(leases); if h then call("extend", h.extend, h, rnd() * 0.3) end end,
    function() relaybus.spawn(function() error("task raises") end) end,
    function() collectgarbage() end,
    function() kept_ctx, kept_tx = {}, {}; collectgarbage() end,
    function() call("sleep", relaybus.sleep, rnd() * 0.05) end,
  }

  local trace = os.getenv("RELAYBUS_MISUSE_TRACE")
  for step = 1, steps do
    local k = rnd(#actions)
    if trace then io.stderr:write(string.format("seed %d step %d: action %d\n", seed, step, k)) end
    local ok, err = pcall(actions[k])
    if not ok then findings[#findings + 1] = "the sequence itself failed: " .. tostring(err) end
  end
  -- wind down: every dispatcher stops, every store closes
  for _, d in ipairs(ds) do pcall(d.stop, d, { timeout = 0.3 }) end
  local t0 = relaybus.now()
  while relaybus.now() - t0 < 2 do
    local busy = false
    for _, d in ipairs(ds) do if d:stats().running then busy = true end end
    if not busy then break end
    relaybus.sleep(0.02)
  end
  for i, d in ipairs(ds) do
    local st = d:stats()
    if st.running then
      findings[#findings + 1] = string.format("dispatcher %d still running 2 s after a stop of 0.3 s (stopping %s, %d active)",
        i, tostring(st.stopping), st.active)
    end
  end
  for _, s in ipairs(stores) do
    local ok, err = pcall(s.close, s)
    if not ok then findings[#findings + 1] = "close after the stops: " .. tostring(err) end
  end
  stores, ds, kept_ctx, kept_tx, leases = nil, nil, nil, nil, nil
  collectgarbage(); collectgarbage()
  return ids, findings
end

for _, entry in ipairs(S.list()) do
  describe("misuse on " .. entry.name .. ":", function()
    after_each(S.reset)
    teardown(function() S.cleanup() end)

    it("random sequences of calls never crash, every failure is one clear line, and no delivery is lost", function()
      local runs = tonumber(os.getenv("RELAYBUS_MISUSE_RUNS") or "") or (entry.name == "mongodb" and 4 or 12)
      local base = tonumber(os.getenv("RELAYBUS_MISUSE_SEED") or "") or os.time()
      for r = 1, runs do
        local seed = base + r
        local _, url, opts = S.open(entry)
        local ids, findings = sequence(seed, url, opts, 60)
        assert.same({}, findings, "seed " .. seed)
        -- nothing lost, nothing stuck: once the leases have run out, a clean dispatcher
        -- settles every delivery that is still due
        local store = assert(relaybus.open(url, opts))
        for k = 1, 2 do store:unschedule("m.s" .. k) end     -- no more ticks while it drains
        assert(store:limit("m.t", nil))
        assert(store:resume("m.t") ~= nil)
        relaybus.sleep(LEASE + 0.3)
        local d = H.dispatcher(store, { lease_duration = 2 })
        d:handle("m.t", function() end)
        d:start()
        local settled = H.poll(function()
          local st = assert(store:stats())
          return st.due == 0 and st.processing == 0
        end, 10)
        d:stop():wait()
        for _, id in ipairs(ids) do
          local rec = store:get(id)
          assert.is_table(rec, "seed " .. seed .. ": delivery " .. id .. " is lost")
          assert.is_true(rec.status ~= "processing", "seed " .. seed .. ": " .. id .. " is stuck processing")
        end
        assert.truthy(settled, "seed " .. seed .. ": deliveries left due or processing")
        store:close()
      end
    end)
  end)
end
