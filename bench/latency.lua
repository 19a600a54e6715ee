-- latency.lua -- delay from enqueue to handler start on an idle dispatcher, p50 / p99 / max over
-- N deliveries. Each payload carries relaybus.now() taken just before its enqueue (the monotonic
-- clock is the same across processes); the handler records now() minus that.
--   build/relaybus run bench/latency.lua URL [N] [MODE] [LABEL]
-- MODE "local": a relaybus.spawn task in this process enqueues one delivery, waits until its
--   handler has started and its completion has had time to settle (the dispatcher is idle
--   again), then enqueues the next.
-- MODE "child": another process (bench/latency_enqueue.lua) enqueues one every 20 ms, so the
--   wake-up has to cross processes (PostgreSQL: LISTEN/NOTIFY).
-- poll_interval is 1 s: a delivery that waits for the poll instead of a wake-up shows up as
-- hundreds of milliseconds.
local relaybus = require "relaybus"
local B = dofile((arg[0]:match("^(.*/)") or "./") .. "common.lua")

local url = arg[1] or "sqlite:bench-latency.db"
local N = tonumber(arg[2]) or 1000
local MODE = arg[3] or "local"
local label = arg[4] or url:match("^(%a+):") or "store"

local tname = B.table_name("bench_lat")
local opts = {}
if not url:match("^sqlite:") then opts.table = tname end
local store = B.open(url, opts)

local d = relaybus.dispatcher(store, { concurrency = 64, poll_interval = 1, lease_duration = 30 })
local delays, seen = {}, {}
local count = 0
d:handle("ping", function(delivery)
  local t = relaybus.now()
  local p = delivery.payload
  if not seen[p.i] then
    seen[p.i] = true
    count = count + 1
    delays[#delays + 1] = t - p.t
  end
  if count == N then relaybus.spawn(function() d:stop { timeout = 10 } end) end
end)
d:start()

local t0 = relaybus.now()
if MODE == "child" then
  local dir = arg[0]:match("^(.*/)") or "./"
  local exe = (arg[-1] == "run" and arg[-2]) or arg[-1] or "build/relaybus"
  local cmd = string.format("%q run %q %q %d %q 0.02 >/dev/null 2>&1 &", exe,
    dir .. "latency_enqueue.lua", url, N, url:match("^sqlite:") and "" or tname)
  os.execute(cmd)
  -- A watchdog: the run ends even if some deliveries are never seen.
  relaybus.spawn(function()
    relaybus.sleep(N * 0.02 + 30)
    if count < N then d:stop { timeout = 5 } end
  end)
else
  relaybus.spawn(function()
    relaybus.sleep(0.2)
    for i = 1, N do
      assert(store:enqueue("ping", { i = i, t = relaybus.now() }))
      local deadline = relaybus.now() + 5
      while not seen[i] and relaybus.now() < deadline do relaybus.sleep(0.001) end
      relaybus.sleep(0.01)   -- let the completion settle: the next enqueue finds it idle
    end
    if count < N then d:stop { timeout = 5 } end
  end)
end
relaybus.run()
local dt = relaybus.now() - t0

table.sort(delays)
local ms = function(s) return s * 1000 end
print(string.format("%s enqueue-to-start (%s, idle, poll_interval 1 s): p50 %.2f ms, p99 %.2f ms, max %.2f ms over %d deliveries (%.1f s)",
  label, MODE == "child" and "enqueued by another process" or "enqueued in-process",
  ms(B.percentile(delays, 50)), ms(B.percentile(delays, 99)), ms(delays[#delays] or 0 / 0),
  #delays, dt))
if #delays < N then print(string.format("%s enqueue-to-start: NOTE only %d of %d handlers started", label, #delays, N)) end
store:close()
