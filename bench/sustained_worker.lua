-- sustained_worker.lua -- one worker of bench/sustained.lua: handlers that take 1 to 20 ms
-- (a sleep, as a handler waiting on I/O), the dispatcher's defaults but for the retention. It
-- counts start delays (handler start less the payload's enqueue time, on the monotonic clock
-- every process shares) in a histogram per minute since T0, and at SIGTERM prints them as JSON.
--   build/relaybus run bench/sustained_worker.lua URL TABLE T0 RETENTION READY_FILE
local relaybus = require "relaybus"
local url, tbl, T0, retention, ready = arg[1], arg[2], tonumber(arg[3]), tonumber(arg[4]), arg[5]
local store = assert(relaybus.open(url, { table = tbl }))
local d = relaybus.dispatcher(store, { retention = retention })

-- Buckets of 2 % in width from 0.1 ms: bucket k holds delays in [0.1 ms * 1.02^k, ... * 1.02^(k+1)).
local LOG_STEP = math.log(1.02)
local function bucket(delay)
  if delay < 1e-4 then return 0 end
  return math.floor(math.log(delay / 1e-4) / LOG_STEP) + 1
end
local minutes = {}   -- minute -> {bucket -> count}
local ran = 0
d:handle("work", function(delivery, ctx)
  local now = relaybus.now()
  local m = math.floor((now - T0) / 60)
  local h = minutes[m]
  if not h then h = {}; minutes[m] = h end
  local k = bucket(now - delivery.payload.t)
  h[k] = (h[k] or 0) + 1
  ran = ran + 1
  ctx:sleep(0.001 + math.random() * 0.019)
end)
d:start()
io.open(ready, "w"):close()
relaybus.run()   -- until SIGTERM stops the dispatcher
local out = {}
for m, h in pairs(minutes) do
  local list = {}
  for k, n in pairs(h) do list[#list + 1] = { k, n } end
  out[#out + 1] = { m = m, h = list }
end
print("HIST " .. relaybus.json.encode { ran = ran, minutes = out })
store:close()
