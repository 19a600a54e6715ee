-- processes_worker.lua -- one worker of bench/processes.lua: no-op handlers at concurrency C
-- for the topics "warm" (the untimed warm-up) and "noop" (the timed burst). It starts, writes
-- READY_FILE, and drains until SIGTERM; then it prints how many "noop" deliveries it ran and
-- the wall times of its first and last ("noop") completions.
--   build/relaybus run bench/processes_worker.lua URL TABLE|- C READY_FILE
local relaybus = require "relaybus"
local url, tbl, C, ready = arg[1], arg[2], tonumber(arg[3]), arg[4]
local store = assert(relaybus.open(url, tbl ~= "-" and { table = tbl } or nil))
local d = relaybus.dispatcher(store, { concurrency = C, lease_duration = 60 })
local ran, last, first = 0, 0, nil
d:handle("warm", function() end)
d:handle("noop", function() ran = ran + 1; last = relaybus.time(); first = first or last end)
d:start()
io.open(ready, "w"):close()
relaybus.run()
print(string.format("RAN %d LAST %.6f FIRST %.6f", ran, last, first or 0))
