-- processes_worker.lua -- one worker of bench/processes.lua: no-op handlers at concurrency C;
-- it writes READY_FILE, waits for GO_FILE, then drains until SIGTERM, and prints how many it
-- ran, the wall time of its last completion (the coordinator's end of the drain) and its CPU
-- seconds from the start of the drain.
--   build/relaybus run bench/processes_worker.lua URL TABLE|- C GO_FILE READY_FILE
local relaybus = require "relaybus"
local url, tbl, C, go, ready = arg[1], arg[2], tonumber(arg[3]), arg[4], arg[5]
local store = assert(relaybus.open(url, tbl ~= "-" and { table = tbl } or nil))
local d = relaybus.dispatcher(store, { concurrency = C, lease_duration = 60 })
local ran, last, first = 0, 0, nil
d:handle("noop", function() ran = ran + 1; last = relaybus.time(); first = first or last end)
io.open(ready, "w"):close()
while not io.open(go) do relaybus.sleep(0.005) end
local cpu0 = os.clock()
d:start()
relaybus.run()
print(string.format("RAN %d LAST %.6f FIRST %.6f CPU %.3f", ran, last, first or 0, os.clock() - cpu0))
