-- latency_enqueue.lua -- the other process of bench/latency.lua's "child" mode: enqueues N
-- deliveries, one every GAP seconds, each carrying relaybus.now() taken just before it.
--   build/relaybus run bench/latency_enqueue.lua URL N TABLE GAP
local relaybus = require "relaybus"
local url, N, tname, gap = arg[1], tonumber(arg[2]) or 1000, arg[3], tonumber(arg[4]) or 0.02
local opts = {}
if tname and tname ~= "" then opts.table = tname end
local store = assert(relaybus.open(url, opts))
relaybus.sleep(0.5)   -- the dispatcher is started and idle
for i = 1, N do
  assert(store:enqueue("ping", { i = i, t = relaybus.now() }))
  relaybus.sleep(gap)
end
store:close()
