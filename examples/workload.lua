-- workload.lua -- the work every example host runs (frame_host, uv_host, luv_host, cqueues_host,
-- threads_host), so that one spec checks them all alike. The host only drives the loop; this
-- file enqueues, handles and checks, and prints one machine-checkable line at the end:
--
--   result ok=1 completed=200 expected=200 dup=0 drain_secs=0.84 rate=238.1 long_kept=1 ...
--
-- Loaded as a module table: W.start(relaybus, args...) starts the work in a runtime (args are
-- "key=value" strings, below) and returns a handle w with w.report() (the line) and w.log()
-- (one "id start end" line per handler run, for threads_host's overlap check); W.check(text,
-- n) checks such logs merged from several runtimes.
--
-- Options (key=value):
--   url=STORE       the store (required)
--   n=200           deliveries of topic "job" to enqueue and drain
--   enqueue=1       0: enqueue nothing (another runtime enqueues into a shared store)
--   expect=N        stop once the store counts N completed (a shared store; default: n)
--   sleep=0.02      a job sleeps up to this long (uniformly), as if calling a service
--   work=0.001      then computes this long, yielding every 0.2 ms (ctx:sleep(0))
--   concurrency=200 the dispatcher's
--   lease=1         lease_duration: the "long" job sleeps two of these and must keep its lease
--   checks=1        0: drain only (the benchmarks); 1: also the lease, signal and shutdown checks
--   poll=0.05       poll_interval
--   table=NAME      the store's table (a shared PostgreSQL database; default relaybus's)
local W = {}

local function opts_of(args)
  local o = { n = 200, enqueue = 1, sleep = 0.02, work = 0.001, concurrency = 200, lease = 1,
              checks = 1, poll = 0.05 }
  for _, a in ipairs(args) do
    local k, v = tostring(a):match("^([%w_]+)=(.*)$")
    if not k then error("workload: an option is key=value, not " .. tostring(a)) end
    o[k] = tonumber(v) or v
  end
  assert(o.url, "workload: url=STORE is required")
  return o
end

function W.start(relaybus, ...)
  local o = opts_of({ ... })
  local now = relaybus.now
  local store = assert(relaybus.open(o.url, { table = o.table }))
  local d = relaybus.dispatcher(store, { concurrency = o.concurrency, lease_duration = o.lease,
                                         poll_interval = o.poll, shutdown_timeout = 2 })
  local r = { completed = 0, expected = o.expect or o.n, dup = 0 }
  local seen, log = {}, {}
  local t_start, t_last

  -- The jobs: a second run of an id in this runtime counts as dup.
  -- Every run is logged with its start and end, aborted ones too: two runs of one delivery
  -- (a lease lost under load, then a claim elsewhere) must never overlap.
  local function job(ctx)
    if o.sleep > 0 then assert(ctx:sleep(math.random() * o.sleep)) end
    local stop = now() + o.work
    while now() < stop do
      local slice = now() + 0.0002
      while now() < slice do end
      assert(ctx:sleep(0))
    end
  end
  d:handle("job", function(delivery, ctx)
    local t0 = now()
    if seen[delivery.id] then r.dup = r.dup + 1 end
    seen[delivery.id] = true
    local ok, err = pcall(job, ctx)
    local t1 = now()
    log[#log + 1] = string.format("%s %.6f %.6f", delivery.id, t0, t1)
    if not ok then error(err, 0) end
    t_last = t1
    r.completed = r.completed + 1
  end)

  -- Two lease durations asleep: the renewals must keep the lease (ctx.deadline moves on, and the
  -- time left before it never runs out).
  d:handle("long", function(_, ctx)
    local d0, margin = ctx.deadline, math.huge
    local stop = now() + 2 * o.lease
    while now() < stop do
      if not ctx:sleep(o.lease / 20) then break end
      margin = math.min(margin, ctx.deadline - now())
    end
    r.long_kept = (now() >= stop and not ctx.signal.aborted) and 1 or 0
    r.long_renewed = ctx.deadline > d0 + o.lease / 2 and 1 or 0
    r.long_margin = margin
  end)

  -- A handler past its timeout: ctx.signal says "timeout", on_abort hears it, the sleep ends.
  d:handle("timeout", function(_, ctx)
    local t0 = now()
    ctx.signal:on_abort(function(reason) r.on_abort = reason end)
    local ok, err = ctx:sleep(30)
    r.signal = ok and "none" or (ctx.signal.reason or err)
    r.signal_after = now() - t0
  end, { timeout = 0.3 })

  -- Shutdown: one run ends within the stop's grace and completes, one is aborted ("shutdown").
  d:handle("slow", function(delivery, ctx)
    r["slow_" .. delivery.payload.name .. "_started"] = 1
    local ok = ctx:sleep(delivery.payload.secs)
    r["slow_" .. delivery.payload.name] = ok and "done" or ctx.signal.reason
  end)

  local function wait_for(cond, secs)
    local limit = now() + secs
    while not cond() do
      if now() > limit then return false end
      relaybus.sleep(0.01)
    end
    return true
  end

  if o.enqueue ~= 0 then
    for i = 1, o.n, 1000 do
      local batch = {}
      for k = i, math.min(i + 999, o.n) do batch[#batch + 1] = { "job", { k = k } } end
      assert(store:enqueue_many(batch))
    end
  end
  t_start = now()
  d:start()

  relaybus.spawn(function()
    -- The store decides: a run that returned may still lose its settle (a lease lost under load).
    wait_for(function()
      local st = store:stats()
      return st and st.completed >= (o.expect or o.n)
    end, 600)
    r.drain_secs = (t_last or now()) - t_start
    if o.checks ~= 0 then
      local long_id = assert(store:enqueue("long", {}))
      local to_id = assert(store:enqueue("timeout", {}))
      wait_for(function() return r.long_kept and r.signal end, 10 * o.lease + 10)
      wait_for(function()     -- the handlers have returned; their settles may be in flight
        local a, b = store:get(long_id), store:get(to_id)
        return a and b and a.status ~= "processing" and b.status ~= "processing"
      end, 10)
      local long = store:get(long_id)
      r.long_status = long and long.status
      r.long_attempts = long and long.attempts
      local to = store:get(to_id)
      r.timeout_error = to and to.last_error
      assert(store:enqueue("slow", { name = "quick", secs = 0.2 }))
      local stuck = assert(store:enqueue("slow", { name = "stuck", secs = 30 }))
      wait_for(function() return r.slow_quick_started and r.slow_stuck_started end, 10)
      local t0 = now()
      d:stop({ timeout = 1.5 })   -- in a task it waits until stopped
      r.stop_secs = now() - t0
      local rec = store:get(stuck)
      r.stuck_status = rec and rec.status
      r.stuck_attempts = rec and rec.attempts
    else
      d:stop()
    end
    r.finished = 1
  end)

  local w = {}
  function w.finished() return r.finished == 1 end
  function w.log() return table.concat(log, "\n") .. (#log > 0 and "\n" or "") end
  function w.report()
    -- dup (a delivery run again here after a lost lease) is at-least-once, not a failure
    local ok = r.finished == 1 and r.completed >= (o.expect and 0 or o.n)
    if ok and o.checks ~= 0 then
      ok = r.long_kept == 1 and r.long_renewed == 1 and r.long_status == "completed"
           and r.long_attempts == 1 and r.signal == "timeout" and r.on_abort == "timeout"
           and r.slow_quick == "done" and r.slow_stuck == "shutdown"
           and r.stuck_status == "pending" and r.stuck_attempts == 0
    end
    local parts = { "result ok=" .. (ok and 1 or 0) }
    local keys = { "completed", "expected", "dup", "drain_secs", "rate", "long_kept", "long_renewed",
                   "long_margin", "long_status", "long_attempts", "signal", "on_abort", "signal_after",
                   "timeout_error", "slow_quick", "slow_stuck", "stuck_status", "stuck_attempts",
                   "stop_secs" }
    if r.drain_secs and r.drain_secs > 0 then r.rate = r.completed / r.drain_secs end
    for _, k in ipairs(keys) do
      local v = r[k]
      if v ~= nil then
        if math.type(v) == "float" then v = string.format("%.3f", v) end
        parts[#parts + 1] = k .. "=" .. tostring(v):gsub("%s", "_")
      end
    end
    return table.concat(parts, " ")
  end
  return w
end

-- Checks "id start end" lines merged from several runtimes: every one of n ids ran, and no id
-- ran twice at once (two runs of one id whose times overlap). Returns the line
-- "check ok=1 ids=N runs=R missing=0 overlaps=0 reruns=0".
-- A Lua host's arguments: an optional leading `--budget S` (the step budget, seconds; 0 when
-- not given), then workload options. Returns the budget and the rest.
function W.budget_arg(args)
  local budget = 0
  if args[1] == "--budget" then
    budget = assert(tonumber(args[2]), "--budget takes seconds")
    table.remove(args, 1)
    table.remove(args, 1)
  end
  return budget, args
end

function W.check(text, n)
  local runs, ids, nids = {}, {}, 0
  local count = 0
  for id, t0, t1 in text:gmatch("(%S+) (%S+) (%S+)\n") do
    count = count + 1
    local list = runs[id]
    if not list then
      list = {}
      runs[id] = list
      nids = nids + 1
      ids[#ids + 1] = id
    end
    list[#list + 1] = { tonumber(t0), tonumber(t1) }
  end
  local overlaps, reruns = 0, 0
  for _, id in ipairs(ids) do
    local list = runs[id]
    if #list > 1 then
      reruns = reruns + #list - 1
      table.sort(list, function(a, b) return a[1] < b[1] end)
      for i = 2, #list do
        if list[i][1] < list[i - 1][2] then overlaps = overlaps + 1 end
      end
    end
  end
  local missing = math.max(0, n - nids)
  return string.format("check ok=%d ids=%d runs=%d missing=%d overlaps=%d reruns=%d",
                       (missing == 0 and overlaps == 0) and 1 or 0, nids, count, missing, overlaps, reruns)
end

return W
