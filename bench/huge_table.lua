-- huge_table.lua -- claims on a huge table against an empty one (PostgreSQL). Two tables: one
-- empty, one seeded with SETTLED completed deliveries (settled a day ago, so the default 7-day
-- retention keeps them) and FUTURE pending ones due in a day (one INSERT ... generate_series per
-- million rows, then VACUUM ANALYZE and CHECKPOINT through psql). On each, with the dispatcher's defaults: the drain of N
-- no-ops, and the enqueue-to-start delay of an idle dispatcher (each start needs a claim).
--   build/relaybus run bench/huge_table.lua URL [SETTLED] [FUTURE] [N] [SAMPLES]
-- Prints "huge table: ..." lines and the ratios (goal: within 10 % of the empty table).
local relaybus = require "relaybus"
local B = dofile((arg[0]:match("^(.*/)") or "./") .. "common.lua")

local url = assert(arg[1], "usage: huge_table.lua URL [SETTLED] [FUTURE] [N] [SAMPLES]")
local SETTLED = tonumber(arg[2]) or 10000000
local FUTURE = tonumber(arg[3]) or 1000000
local N = tonumber(arg[4]) or 50000
local SAMPLES = tonumber(arg[5]) or 300
assert(url:match("^postgres"), "huge_table.lua seeds rows with PostgreSQL SQL: give a postgresql:// URL")

local CHUNK = 1000000
local function seed(store, T, n, status, sql_tail)
  local done = 0
  while done < n do
    local k = math.min(CHUNK, n - done)
    local ok, err = store:transaction(function(tx)
      assert(tx:exec('INSERT INTO "' .. T .. '" (topic, payload, status, attempts, fence, run_at, created_at, settled_at)'
        .. " SELECT 'old', jsonb_build_object('i', i), '" .. status .. "', " .. sql_tail
        .. " FROM generate_series(1, $1::integer) AS i", k))
    end)
    if not ok then io.stderr:write("bench: seeding failed: ", tostring(err), "\n"); os.exit(1) end
    done = done + k
  end
end

local function size_of(store, T)
  local _, rows = store:transaction(function(tx)
    return tx:query("SELECT pg_total_relation_size($1::regclass) AS total, pg_indexes_size($1::regclass) AS idx",
      '"' .. T .. '"')
  end)
  return rows and rows[1] or { total = 0, idx = 0 }
end

-- The drain rate and the idle claim latency on table T.
local function measure(store, label)
  B.fill(store, "noop", N, 1000)
  local d = relaybus.dispatcher(store)
  local done, t_last = 0, nil
  d:handle("noop", function()
    done = done + 1
    if done == N then t_last = relaybus.now() end
  end)
  local delays, seen, seq = {}, {}, 0
  d:handle("ping", function(delivery)
    local p = delivery.payload
    if not seen[p.i] then seen[p.i] = true; delays[#delays + 1] = relaybus.now() - p.t end
  end)
  local t0 = relaybus.now()
  d:start()
  relaybus.spawn(function()
    while done < N and relaybus.now() - t0 < 300 do relaybus.sleep(0.01) end
    relaybus.sleep(0.5)      -- the last completions settle: the dispatcher is idle again
    for _ = 1, SAMPLES do
      seq = seq + 1
      local i = seq
      assert(store:enqueue("ping", { i = i, t = relaybus.now() }))
      local deadline = relaybus.now() + 10
      while not seen[i] and relaybus.now() < deadline do relaybus.sleep(0.001) end
      relaybus.sleep(0.01)
    end
    d:stop { timeout = 10 }
  end)
  relaybus.run()
  table.sort(delays)
  local rate = t_last and N / (t_last - t0) or 0
  print(string.format("huge table: %s: drain of %s no-ops %s/s (defaults); idle enqueue-to-start p50 %.2f ms, p99 %.2f ms over %d",
    label, B.int(N), B.int(rate), B.percentile(delays, 50) * 1000, B.percentile(delays, 99) * 1000, #delays))
  return rate, B.percentile(delays, 50), B.percentile(delays, 99)
end

local empty_t, huge_t = B.table_name("bench_empty"), B.table_name("bench_huge")
local empty = B.open(url, { table = empty_t })
local huge = B.open(url, { table = huge_t })

local t = relaybus.now()
seed(huge, huge_t, SETTLED, "completed",
  "1, 1, now() - interval '1 day', now() - interval '1 day', now() - interval '1 day'")
seed(huge, huge_t, FUTURE, "pending", "0, 0, now() + interval '1 day', now(), NULL")
-- A table that holds settled rows has been vacuumed long since: vacuum it now (with psql:
-- VACUUM cannot run in a transaction) and checkpoint, so neither autovacuum's first pass over
-- the fresh rows nor the checkpoint of the seeding runs during the measurement.
local psql = string.format("psql -X -q '%s' -c 'VACUUM ANALYZE \"%s\"' -c CHECKPOINT", url, huge_t)
if not os.execute(psql .. " >/dev/null 2>&1") then
  print("huge table: NOTE VACUUM through psql failed; autovacuum may run during the measurement")
  huge:transaction(function(tx) tx:exec('ANALYZE "' .. huge_t .. '"') end)
end
local sz = size_of(huge, huge_t)
print(string.format("huge table: seeded %s completed and %s future rows in %.0f s: %.0f MiB with %.0f MiB of indexes (setup)",
  B.int(SETTLED), B.int(FUTURE), relaybus.now() - t, sz.total / 1048576, sz.idx / 1048576))

local r0, p50_0, p99_0 = measure(empty, "empty table")
local r1, p50_1, p99_1 = measure(huge, B.int(SETTLED) .. " settled + " .. B.int(FUTURE) .. " future rows")
print(string.format("huge table: the huge table drains at %.0f%% of the empty one's rate; its idle claim p50 is %.0f%%, p99 %.0f%% of the empty one's (goal: within 10%%)",
  100 * r1 / r0, 100 * p50_1 / p50_0, 100 * p99_1 / p99_0))
B.drop_pg_table(empty, empty_t)
B.drop_pg_table(huge, huge_t)
empty:close()
huge:close()
