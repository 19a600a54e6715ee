-- huge_table.lua -- claims on a huge table against an empty one (PostgreSQL). Two tables: one
-- empty, one seeded with SETTLED completed deliveries (settled a day ago, so the default 7-day
-- retention keeps them) and FUTURE pending ones due in a day (one INSERT ... generate_series per
-- million rows, then VACUUM ANALYZE and CHECKPOINT through psql). On each, with the
-- dispatcher's defaults: the drain of N no-ops (three rounds, the tables in turn), and the
-- enqueue-to-start delay of an idle dispatcher (each start needs a claim), SAMPLES on each table
-- taken in turn.
--   build/relaybus run bench/huge_table.lua URL [SETTLED] [FUTURE] [N] [SAMPLES]
-- Prints "huge table: ..." lines and the ratios (goal: within 10 % of the empty table).
local relaybus = require "relaybus"
local B = dofile((arg[0]:match("^(.*/)") or "./") .. "common.lua")

local url = assert(arg[1], "usage: huge_table.lua URL [SETTLED] [FUTURE] [N] [SAMPLES]")
local SETTLED = tonumber(arg[2]) or 10000000
local FUTURE = tonumber(arg[3]) or 1000000
local N = tonumber(arg[4]) or 50000
local SAMPLES = tonumber(arg[5]) or 1000
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

-- The rate of a drain of N no-ops on a store, with the dispatcher's defaults.
local function drain_rate(store)
  B.fill(store, "noop", N, 1000)
  local d = relaybus.dispatcher(store)
  local done, t_last = 0, nil
  d:handle("noop", function()
    done = done + 1
    if done == N then t_last = relaybus.now(); d:stop { timeout = 10 } end
  end)
  local t0 = relaybus.now()
  d:start()
  relaybus.run()
  return t_last and N / (t_last - t0) or 0
end

-- The enqueue-to-start delays of idle dispatchers, one on each store, their samples taken in
-- turn (one ping on each store, then the next), so both see the same moments of the machine:
-- each start needs a NOTIFY and a claim. Returns a sorted list of delays per store.
local function idle_delays(stores)
  local delays, seen, ds = {}, {}, {}
  for k, store in ipairs(stores) do
    delays[k], seen[k] = {}, {}
    ds[k] = relaybus.dispatcher(store)
    ds[k]:handle("ping", function(delivery)
      local p = delivery.payload
      if not seen[k][p.i] then seen[k][p.i] = true; delays[k][#delays[k] + 1] = relaybus.now() - p.t end
    end)
    ds[k]:start()
  end
  relaybus.spawn(function()
    relaybus.sleep(0.5)      -- every dispatcher idle
    for i = 1, SAMPLES do
      for k, store in ipairs(stores) do
        assert(store:enqueue("ping", { i = i, t = relaybus.now() }))
        local deadline = relaybus.now() + 10
        while not seen[k][i] and relaybus.now() < deadline do relaybus.sleep(0.001) end
        relaybus.sleep(0.005)
      end
    end
    for _, d in ipairs(ds) do d:stop { timeout = 10 } end
  end)
  relaybus.run()
  for k = 1, #stores do table.sort(delays[k]) end
  return delays
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

-- Each drain leaves dead entries at the head of its table's due index (a claim and a completion
-- each leave one), which claims walk over until VACUUM removes them. Autovacuum does within its
-- next round (a minute at most, with the table's settings: docs/stores.md), at a time of its
-- choosing: so both tables are vacuumed before each measurement, or the figures would say
-- when autovacuum last ran, not what the table's size costs.
local function vacuum_both()
  if not os.execute(string.format("psql -X -q '%s' -c 'VACUUM \"%s\"' -c 'VACUUM \"%s\"' >/dev/null 2>&1",
      url, empty_t, huge_t)) then
    print("huge table: NOTE VACUUM through psql failed: dead entries of the drains stay in the claims' way")
  end
end

-- The drains in turn, three rounds, and their medians: single drains moved by 10-20% from run
-- to run on the shared machine.
local rates = { {}, {} }
for _ = 1, 3 do
  vacuum_both()
  rates[1][#rates[1] + 1] = drain_rate(empty)
  vacuum_both()
  rates[2][#rates[2] + 1] = drain_rate(huge)
end
vacuum_both()
for k = 1, 2 do table.sort(rates[k]) end
local r0, r1 = rates[1][2], rates[2][2]
local what = B.int(SETTLED) .. " settled + " .. B.int(FUTURE) .. " future rows"
print(string.format("huge table: drain of %s no-ops (defaults), medians of 3: empty table %s/s, %s %s/s",
  B.int(N), B.int(r0), what, B.int(r1)))
local delays = idle_delays { empty, huge }
local p50_0, p99_0 = B.percentile(delays[1], 50), B.percentile(delays[1], 99)
local p50_1, p99_1 = B.percentile(delays[2], 50), B.percentile(delays[2], 99)
print(string.format("huge table: idle enqueue-to-start over %d samples each, taken in turn: empty table p50 %.2f ms, p99 %.2f ms; %s p50 %.2f ms, p99 %.2f ms",
  #delays[1], p50_0 * 1000, p99_0 * 1000, what, p50_1 * 1000, p99_1 * 1000))
print(string.format("huge table: the huge table drains at %.0f%% of the empty one's rate; its idle claim p50 is %.0f%%, p99 %.0f%% of the empty one's (goal: within 10%%)",
  100 * r1 / r0, 100 * p50_1 / p50_0, 100 * p99_1 / p99_0))
B.drop_pg_table(empty, empty_t)
B.drop_pg_table(huge, huge_t)
empty:close()
huge:close()
