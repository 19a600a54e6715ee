-- idle_worker.lua -- one idle worker for bench/run.sh's idle figure: a dispatcher with a handler
-- on an empty topic, waiting (LISTEN on PostgreSQL) until SIGTERM.
--   build/relaybus run bench/idle_worker.lua URL TABLE
local relaybus = require "relaybus"
local store = assert(relaybus.open(arg[1], { table = arg[2] }))
local d = relaybus.dispatcher(store)
d:handle("idle.nothing", function() end)
d:start()
relaybus.run()
