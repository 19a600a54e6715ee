-- log_worker.lua STORE-URL -- one delivery that raises (a message with quotes, a newline and a
-- byte that is no UTF-8) and is buried at its first attempt, then stops.
local relaybus = require "relaybus"
local store = assert(relaybus.open(arg[1], { migrate = true }))
store:enqueue('top"ic', {}, { max_attempts = 1 })
local d = relaybus.dispatcher(store, { poll_interval = 0.05 })
d:handle('top"ic', function() error('bad "thing"\nsecond line \255', 0) end)
d:start()
relaybus.spawn(function()
  while store:stats().buried < 1 do relaybus.sleep(0.02) end
  d:stop()
end)
