-- pg_ceiling_setup.lua -- makes relaybus's table under the name relaybus_bench_ceiling (our own
-- migrations, so the columns and indexes are the real ones) and fills it with N pending rows
-- for bench/sql_ceiling.sql.
--   build/relaybus run bench/pg_ceiling_setup.lua URL N
local relaybus = require "relaybus"
local url, N = arg[1], tonumber(arg[2]) or 200000
local store = assert(relaybus.open(url, { table = "relaybus_bench_ceiling" }))
assert(store:transaction(function(tx)
  tx:exec("TRUNCATE relaybus_bench_ceiling")
  tx:exec("INSERT INTO relaybus_bench_ceiling (topic, payload)" ..
          " SELECT 'noop', jsonb_build_object('i', i) FROM generate_series(1, $1::integer) AS i", N)
end))
store:close()
