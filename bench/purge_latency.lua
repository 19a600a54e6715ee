-- purge_latency.lua -- retention (issue 5): claim latency while settled rows are purged. Seeds
-- ROWS completed deliveries settled 8 days ago (one INSERT ... generate_series), measures the
-- enqueue-to-handler-start delay of an idle dispatcher (each start needs a claim round trip)
-- first without a purge, then while a task deletes those rows with store:purge{status =
-- "completed", older_than = 7 days, limit = BATCH} in a loop until nothing is left (what the
-- dispatcher's retention does, one batch after another).
--   build/relaybus run bench/purge_latency.lua URL [ROWS] [BATCH] [LABEL]
local relaybus = require "relaybus"
local B = dofile((arg[0]:match("^(.*/)") or "./") .. "common.lua")

local url = arg[1] or "sqlite:bench-purge.db"
local ROWS = tonumber(arg[2]) or 1000000
local BATCH = tonumber(arg[3]) or 1000   -- the dispatcher's retention uses 1,000
local label = arg[4] or url:match("^(%a+):") or "store"
local pg = url:match("^postgres") ~= nil

local tname = B.table_name("bench_purge")
local store = B.open(url, pg and { table = tname } or nil)
local T = pg and tname or "relaybus_deliveries"

local t = relaybus.now()
local ok, err = store:transaction(function(tx)
  if pg then
    tx:exec("INSERT INTO \"" .. T .. "\" (topic, payload, status, attempts, fence, run_at, created_at, settled_at)" ..
            " SELECT 'old', jsonb_build_object('i', i), 'completed', 1, 1, now() - interval '8 days'," ..
            " now() - interval '8 days', now() - interval '8 days' FROM generate_series(1, $1::integer) AS i", ROWS)
    tx:exec("ANALYZE \"" .. T .. "\"")
  else
    error("purge_latency.lua seeds rows with PostgreSQL SQL only")
  end
end)
if not ok then io.stderr:write("bench: seeding failed: ", tostring(err), "\n"); os.exit(1) end
print(string.format("%s purge: seeded %s completed rows in %.1f s (setup)", label, B.int(ROWS), relaybus.now() - t))

-- retention = 0: the dispatcher's own retention task stays off, so the purge measured is ours.
local d = relaybus.dispatcher(store, { concurrency = 16, poll_interval = 1, lease_duration = 30,
                                        retention = 0 })
local started = {}
local seq = 0
d:handle("ping", function(delivery)
  local p = delivery.payload
  if not started[p.i] then started[p.i] = relaybus.now() - p.t end
end)
d:start()

-- One sample: enqueue, wait for the handler's start, let the completion settle.
local function sample(into)
  seq = seq + 1
  local i = seq
  assert(store:enqueue("ping", { i = i, t = relaybus.now() }))
  local deadline = relaybus.now() + 10
  while not started[i] and relaybus.now() < deadline do relaybus.sleep(0.001) end
  if started[i] then into[#into + 1] = started[i] end
  relaybus.sleep(0.01)
end

local function summary(xs)
  table.sort(xs)
  return string.format("p50 %.2f ms, p99 %.2f ms, max %.2f ms over %d claims",
    B.percentile(xs, 50) * 1000, B.percentile(xs, 99) * 1000, (xs[#xs] or 0 / 0) * 1000, #xs)
end

local purged, batches, purge_time, purging = 0, {}, nil, true
relaybus.spawn(function()
  relaybus.sleep(0.2)
  local quiet = {}
  for _ = 1, 200 do sample(quiet) end
  print(string.format("%s purge: enqueue-to-start with no purge running: %s", label, summary(quiet)))

  relaybus.spawn(function()
    local t0 = relaybus.now()
    while true do
      local tb = relaybus.now()
      local n, perr = store:purge { status = "completed", older_than = 7 * 86400, limit = BATCH }
      if not n then print(label .. " purge: NOTE purge failed: " .. tostring(perr)); break end
      batches[#batches + 1] = relaybus.now() - tb
      purged = purged + n
      if n == 0 then break end
    end
    purge_time = relaybus.now() - t0
    purging = false
  end)

  local during = {}
  while purging do sample(during) end
  local bt = {}
  for k, v in ipairs(batches) do bt[k] = v end
  table.sort(bt)
  print(string.format("%s purge: %s rows purged in %.1f s = %s rows/s, %d batches of <= %s (batch p50 %.0f ms, max %.0f ms)",
    label, B.int(purged), purge_time, B.int(purged / purge_time), #batches, B.int(BATCH),
    B.percentile(bt, 50) * 1000, (bt[#bt] or 0 / 0) * 1000))
  print(string.format("%s purge: enqueue-to-start during the purge: %s", label, summary(during)))
  d:stop { timeout = 10 }
end)
relaybus.run()
store:close()
