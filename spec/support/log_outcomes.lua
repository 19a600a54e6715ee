-- log_outcomes.lua STORE-URL CASE [URL] -- one failure of each kind that the relaybus
-- command's default level (info) must log, then stops:
--   bury      a handler buries its delivery with ctx:bury("no such user")
--   webhook   relaybus.webhook to URL (a receiver's /status/404 or /status/503), one delivery
--   timeout   a handler passes its timeout (0.2 s) at attempt 1 of 3: retried
--   many      twelve deliveries that raise, each buried at its first attempt: more lines than
--             the log's limit lets through in 10 s
local relaybus = require "relaybus"
local url, case, target = arg[1], arg[2], arg[3]
local store = assert(relaybus.open(url))
local d = relaybus.dispatcher(store, { poll_interval = 0.05, backoff = function() return 60 end })
local runs = 1                      -- settled runs that end the process
if case == "bury" then
  store:enqueue("user.sync", { user = 7 })
  d:handle("user.sync", function(_, ctx) assert(ctx:bury("no such user")) end)
elseif case == "webhook" then
  store:enqueue("order.push", { order = 1 })
  d:handle("order.push", relaybus.webhook { url = target })
elseif case == "timeout" then
  store:enqueue("slow.job", {}, { max_attempts = 3 })
  d:handle("slow.job", function(_, ctx) ctx:sleep(5) end, { timeout = 0.2 })
elseif case == "many" then
  for i = 1, 12 do store:enqueue("bad.job", { i = i }, { max_attempts = 1 }) end
  d:handle("bad.job", function(delivery) error("bad job " .. delivery.payload.i, 0) end)
  runs = 12
else
  error("unknown case " .. tostring(case))
end
d:on("settled", function()
  runs = runs - 1
  if runs == 0 then d:stop() end
end)
d:start()
