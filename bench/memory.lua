-- memory.lua -- resident memory with N handlers sleeping at once: N deliveries, a dispatcher with
-- concurrency C (default N) whose handlers each ctx:sleep(SLEEP). VmRSS is read when the N-th
-- concurrent handler starts; a sampler (every 50 ms) also keeps the peak, in case fewer than N
-- ever run at once (then the line says how many did).
--   build/relaybus run bench/memory.lua URL [N] [SLEEP] [LABEL] [CONCURRENCY]
local relaybus = require "relaybus"
local B = dofile((arg[0]:match("^(.*/)") or "./") .. "common.lua")

local url = arg[1] or "sqlite:bench-memory.db"
local N = tonumber(arg[2]) or 10000
local SLEEP = tonumber(arg[3]) or 5
local label = arg[4] or url:match("^(%a+):") or "store"
local C = tonumber(arg[5]) or N

local opts = {}
if not url:match("^sqlite:") then opts.table = B.table_name("bench_mem") end
local store = B.open(url, opts)
B.fill(store, "sleepy", N, 1000)
collectgarbage()
local rss0 = B.rss_kib()

local d = relaybus.dispatcher(store, { concurrency = C, poll_interval = 1, lease_duration = 60 })
local lua_kib, anon_all
local running, finished, peak, peak_rss, t_all, rss_all = 0, 0, 0, 0, nil, nil
local t0
d:handle("sleepy", function(_, ctx)
  running = running + 1
  if running == N then
    t_all = relaybus.now() - t0
    rss_all = B.rss_kib()
    lua_kib = collectgarbage("count")
    anon_all = B.anon_kib()
  end
  ctx:sleep(SLEEP)
  running = running - 1
  finished = finished + 1
  if finished == N then relaybus.spawn(function() d:stop { timeout = 30 } end) end
end)

relaybus.spawn(function()
  while finished < N do
    local r = running
    if r >= peak then
      local kib = B.rss_kib()
      if r > peak or kib > peak_rss then peak, peak_rss = r, math.max(kib, r == peak and peak_rss or 0) end
    end
    relaybus.sleep(0.05)
  end
end)

t0 = relaybus.now()
d:start()
relaybus.run()
local dt = relaybus.now() - t0

if rss_all then
  print(string.format("%s memory: %s handlers sleeping at once: VmRSS %.1f MiB (%.1f MiB before the dispatcher; all %s running %.2f s after start)",
    label, B.int(N), B.mib(rss_all), B.mib(rss0), B.int(N), t_all))
  print(string.format("%s memory: then RssAnon %.1f MiB (VmRSS less mapped files), the Lua heap %.1f MiB",
    label, B.mib(anon_all), lua_kib / 1024))
else
  print(string.format("%s memory: NOTE at most %s of %s handlers ever ran at once (concurrency %s): VmRSS %.1f MiB at that peak (%.1f MiB before the dispatcher)",
    label, B.int(peak), B.int(N), B.int(C), B.mib(peak_rss), B.mib(rss0)))
end
local s = assert(store:stats())
print(string.format("%s memory: all %s done in %.2f s (handlers sleep %g s); completed %d",
  label, B.int(N), dt, SLEEP, s.completed))
store:close()
