-- webhook.lua -- webhook throughput: N deliveries, each POSTed by a relaybus.webhook handler to a
-- local receiver (build/http_receiver, answering /status/200), at concurrency C; and the
-- process's resident memory while it runs (VmRSS sampled every 100 ms; the peak is printed).
--   build/relaybus run bench/webhook.lua STORE_URL RECEIVER_BASE_URL [N] [C] [LABEL]
local relaybus = require "relaybus"
local B = dofile((arg[0]:match("^(.*/)") or "./") .. "common.lua")

local url = arg[1] or "sqlite:bench-webhook.db"
local base = assert(arg[2], "usage: webhook.lua STORE_URL RECEIVER_BASE_URL [N] [C] [LABEL]")
local N = tonumber(arg[3]) or 10000
local C = tonumber(arg[4]) or 256
local label = arg[5] or "http"

local opts = {}
if not url:match("^sqlite:") then opts.table = B.table_name("bench_hook") end
local store = B.open(url, opts)
B.fill(store, "hook", N, 1000)
collectgarbage()
local rss0 = B.rss_kib()

local hook = relaybus.webhook { url = base .. "/status/200", timeout = 30 }
local d = relaybus.dispatcher(store, { concurrency = C, poll_interval = 1, lease_duration = 60 })
local done = 0
d:handle("hook", function(delivery, ctx)
  hook(delivery, ctx)
  done = done + 1
  if done == N then relaybus.spawn(function() d:stop { timeout = 30 } end) end
end)

local peak = rss0
relaybus.spawn(function()
  while done < N do
    local kib = B.rss_kib()
    if kib and kib > peak then peak = kib end
    relaybus.sleep(0.1)
  end
end)

local t0 = relaybus.now()
d:start()
relaybus.run()
local dt = relaybus.now() - t0

local s = assert(store:stats())
print(string.format("%s webhook: %s deliveries POSTed in %.2f s = %s/s (concurrency %d, %s store)",
  label, B.int(N), dt, B.int(N / dt), C, url:match("^(%a+):")))
print(string.format("%s webhook: VmRSS peak %.1f MiB during the run (%.1f MiB before the dispatcher)",
  label, B.mib(peak), B.mib(rss0)))
if s.completed ~= N then
  print(string.format("%s webhook: NOTE completed %d of %d (pending %d, processing %d, buried %d)",
    label, s.completed, N, s.pending, s.processing, s.buried))
end
store:close()
