-- observe.lua -- what seeing the work costs: the drain rate with lifecycle events and metrics
-- off and on, and /metrics latency over a big table.
--   build/relaybus run bench/observe.lua URL [N] [CONCURRENCY] [ROUNDS] [ROWS] [MODE]
-- MODE both (default), off or on: bench/run.sh runs off and on processes in turn, so a
-- machine that warms up or gets busier does not favour one of them.
-- Runs ROUNDS drains of N no-op deliveries with nothing observing (off), then ROUNDS with
-- relaybus.serve running (on: every event is counted for /metrics), and prints the median of
-- each and their ratio. Off rounds go first: the first serve attaches the metrics to every
-- dispatcher of the process from then on. Then, with ROWS settled rows in the table (0: skip),
-- times uncached scrapes of /metrics and /api/stats.
local relaybus = require "relaybus"
local B = dofile((arg[0]:match("^(.*/)") or "./") .. "common.lua")

local url = arg[1] or "sqlite:bench-observe.db"
local N = tonumber(arg[2]) or 20000
local C = tonumber(arg[3]) or 64
local ROUNDS = tonumber(arg[4]) or 3
local ROWS = tonumber(arg[5]) or 0
local label = url:match("^(%a+):") or "store"
local MODE = arg[6] or "both"

local opts = {}
if not url:match("^sqlite:") then opts.table = B.table_name("bench_observe") end
local store = B.open(url, opts)

local function drain()
  B.fill(store, "noop", N, 1000)
  local d = relaybus.dispatcher(store, { concurrency = C, poll_interval = 1, lease_duration = 60 })
  local done = 0
  d:handle("noop", function()
    done = done + 1
    if done == N then relaybus.spawn(function() d:stop { timeout = 30 } end) end
  end)
  local t0 = relaybus.now()
  d:start()
  relaybus.run()
  local rate = N / (relaybus.now() - t0)
  store:purge { status = "completed", older_than = 0 }
  return rate
end

local function median(t)
  table.sort(t)
  return t[math.floor((#t + 1) / 2)]
end

local off, on = {}, {}
if MODE ~= "on" then for i = 1, ROUNDS do off[i] = drain() end end
local server
if MODE ~= "off" or ROWS > 0 then server = assert(relaybus.serve { store = store, listen = "127.0.0.1:0" }) end
if MODE ~= "off" then for i = 1, ROUNDS do on[i] = drain() end end
local moff, mon = median(off), median(on)
if MODE ~= "both" then
  print(string.format("%s observe: drain of %s, concurrency %d, events+metrics %s: %s/s (median of %d)",
    label, B.int(N), C, MODE, B.int(moff or mon), ROUNDS))
else print(string.format("%s observe: drain of %s, concurrency %d: events+metrics off %s/s, on %s/s (median of %d): on/off = %.3f",
  label, B.int(N), C, B.int(moff), B.int(mon), ROUNDS, mon / moff))
end

if ROWS > 0 then
  B.fill(store, "settled", ROWS, 5000)
  local d = relaybus.dispatcher(store, { concurrency = 512, poll_interval = 1, lease_duration = 60 })
  local done = 0
  d:handle("settled", function()
    done = done + 1
    if done == ROWS then relaybus.spawn(function() d:stop { timeout = 30 } end) end
  end)
  d:start()
  relaybus.run()
  relaybus.spawn(function()
    for _, path in ipairs { "metrics", "api/stats" } do
      local times = {}
      for i = 1, 5 do
        relaybus.sleep(1.1)          -- past the stats cache: each scrape asks the store
        local t0 = relaybus.now()
        local r = assert(relaybus.http.request { url = server:url() .. path, timeout = 120 })
        assert(r.status == 200, r.body)
        times[i] = (relaybus.now() - t0) * 1000
      end
      print(string.format("%s observe: /%s with %s rows in the table: median %.1f ms, max %.1f ms (uncached)",
        label, path, B.int(ROWS), median(times), math.max(table.unpack(times))))
    end
    server:stop()
  end)
  relaybus.run()
elseif server then
  server:stop()
end
store:close()
