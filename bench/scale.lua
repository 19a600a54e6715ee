-- scale.lua -- what an operator waits for on a large table: a table of N settled deliveries
-- (completed, a few buried and cancelled, 20 topics) and 1,000 pending, then the median of 5
-- of: store:stats(), the counts per topic, a filtered page (the buried of one topic), and a
-- cold /metrics and /api/stats from relaybus.serve (a new server each time: no cached counts).
--   build/relaybus run bench/scale.lua URL N [LABEL]
-- Prints: LABEL scale N: stats X ms, per topic X ms, filtered page X ms, /metrics X ms,
-- /api/stats X ms (estimated: yes|no)
-- The rows are written with SQL in chunks of 1,000,000 (PostgreSQL then VACUUM ANALYZEs, as
-- autovacuum would): a few seconds per million.
local relaybus = require "relaybus"
local B = dofile((arg[0]:match("^(.*/)") or "./") .. "common.lua")

local url = assert(arg[1], "usage: scale.lua URL N [LABEL]")
local N = math.floor(tonumber(arg[2]) or 1000)
local label = arg[3] or url:match("^(%a+):") or "store"
local pg = url:match("^postgres") ~= nil

local opts = {}
if pg then opts.table = B.table_name("bench_scale") end
local store = B.open(url, opts)
local T = opts.table or "relaybus_deliveries"

-- status of row i: 1 in 1,000 buried, 1 in 997 cancelled, the rest completed
local STATUS = "CASE WHEN i % 1000 = 0 THEN 'buried' WHEN i % 997 = 0 THEN 'cancelled' ELSE 'completed' END"
local t0 = relaybus.now()
for first = 1, N, 1000000 do
  local last = math.min(N, first + 999999)
  assert(store:transaction(function(tx)
    if pg then
      assert(tx:exec(("INSERT INTO %s (topic, payload, status, attempts, fence, settled_at, created_at,"
        .. " run_at) SELECT 'topic' || (i %% 20), '{\"n\":1}'::jsonb, %s, 1, 1, now(), now(), now()"
        .. " FROM generate_series(%d, %d) AS i"):format(T, STATUS, first, last)))
    else
      assert(tx:exec(("WITH RECURSIVE g(i) AS (SELECT %d UNION ALL SELECT i + 1 FROM g WHERE i < %d)"
        .. " INSERT INTO %s (topic, payload, status, attempts, max_attempts, fence, run_at, created_at,"
        .. " settled_at) SELECT 'topic' || (i %% 20), '{\"n\":1}', %s, 1, 25, 1, %f, %f, %f FROM g")
        :format(first, last, T, STATUS, relaybus.time(), relaybus.time(), relaybus.time())))
    end
  end))
end
-- As autovacuum leaves a table of settled rows: its statistics read, its pages all-visible
-- (counts through an index then read no row). VACUUM runs outside a transaction: psql.
if pg then
  local ok = os.execute(("psql -X -q %q -c %q >/dev/null 2>&1"):format(url, "VACUUM ANALYZE " .. T))
  if not ok then
    print(string.format("%s scale: NOTE no psql: ANALYZE only (counts read the rows' pages)", label))
    assert(store:transaction(function(tx) assert(tx:exec("ANALYZE " .. T)) end))
  end
end
for i = 1, 1000 do assert(store:enqueue("topic" .. (i % 20), { i = i }, { delay = 3600 })) end
print(string.format("%s scale %s: filled in %.1f s (setup)", label, B.int(N), relaybus.now() - t0))

-- the median of 5 runs of fn, in ms
local function median_ms(fn)
  local times = {}
  for k = 1, 5 do
    local s = relaybus.now()
    fn()
    times[k] = (relaybus.now() - s) * 1000
  end
  table.sort(times)
  return times[3]
end

local estimated
local stats_ms = median_ms(function() estimated = assert(store:stats()).completed_estimated end)
local topics_ms = median_ms(function() assert(store:_topic_stats()) end)
local page_ms = median_ms(function() assert(#assert(store:list { status = "buried", topic = "topic0", limit = 50 }) > 0) end)
local function cold(path)
  return median_ms(function()
    local srv = assert(relaybus.serve { store = store, listen = "127.0.0.1:0" })
    local r = assert(relaybus.http.request { url = srv:url() .. path:sub(2) })
    assert(r.status == 200, r.body)
    srv:stop()
  end)
end
local metrics_ms, api_ms = cold("/metrics"), cold("/api/stats")
print(string.format("%s scale %s: stats %.1f ms, per topic %.1f ms, filtered page %.1f ms,"
  .. " /metrics %.1f ms, /api/stats %.1f ms (completed estimated: %s)", label, B.int(N), stats_ms,
  topics_ms, page_ms, metrics_ms, api_ms, estimated and "yes" or "no"))
if pg then B.drop_pg_table(store, T) end
store:close()
