-- enqueuer.lua -- relaybus run spec/support/enqueuer.lua STORE_URL LOGFILE: 32
-- tasks enqueue in a loop (group commit on SQLite) and log "OK <id>" for every enqueue that
-- returned an id, flushed at once, until killed.
local relaybus = require "relaybus"
local url, logpath = ...
local store = assert(relaybus.open(url))
local log = assert(io.open(logpath, "a"))
log:setvbuf("line")
for t = 1, 32 do
  relaybus.spawn(function()
    for i = 1, 100000 do
      local id = store:enqueue("rk.t", { t = t, i = i })
      if id then log:write("OK ", id, "\n") end
    end
  end)
end
relaybus.run()
