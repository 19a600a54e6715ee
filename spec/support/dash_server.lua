-- dash_server.lua STORE-URL TOKEN -- a worker for the browser spec: deliveries in every status
-- (completed, buried with an error, pending later, one held processing, an XSS topic), a
-- dispatcher that keeps running, and relaybus.serve on a free port; prints the URL.
local relaybus = require "relaybus"
local url, token = arg[1], arg[2]
local table_name = os.getenv("RELAYBUS_SPEC_TABLE")
local store = assert(relaybus.open(url, { migrate = true, table = table_name ~= "" and table_name or nil }))
local d = relaybus.dispatcher(store, { poll_interval = 0.1, shutdown_timeout = 1,
                                       backoff = function() return 3600 end })
local topics = { "orders.created", "email.send", "invoice.render" }
for i = 1, 24 do
  store:enqueue(topics[i % 3 + 1], { n = i, customer = "c-" .. (1000 + i), items = { "a", "b" } })
end
for i = 1, 3 do
  store:enqueue("payments.charge", { order = 4200 + i, amount = 19.99 * i }, { max_attempts = 1 })
end
for i = 1, 4 do store:enqueue("email.send", { n = i }, { delay = 3600 }) end
store:enqueue("<img src=x onerror=alert(1)>", { note = "<script>alert(2)</script>" }, { delay = 3600 })
store:enqueue("reports.slow", { report = "monthly" })
assert(store:schedule("<b>nightly</b>", { cron = "0 3 * * *", timezone = "Europe/Berlin", topic = "reports.nightly" }))
assert(store:schedule("heartbeat", { every = 3600, topic = "ops.heartbeat" }))
for _, t in ipairs(topics) do d:handle(t, function() relaybus.sleep(0.01) end) end
-- Burials by a dispatcher of their own, stopped once they are buried: a kicked one stays pending.
local d2 = relaybus.dispatcher(store, { poll_interval = 0.1, shutdown_timeout = 1 })
d2:handle("payments.charge", function() error("card declined: insufficient funds <b>42</b>") end)
d2:start()
d:handle("reports.slow", function() relaybus.sleep(3600) end)
d:start()
relaybus.spawn(function()
  while store:stats().buried < 3 or store:stats().processing < 1 do relaybus.sleep(0.05) end
  d2:stop()
  local srv = assert(relaybus.serve { store = store, listen = "127.0.0.1:0", token = token })
  io.stdout:write(srv:url(), "\n")
  io.stdout:flush()
end)
