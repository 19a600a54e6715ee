-- limited.lua -- a limited topic beside an unlimited one: N no-op deliveries of a free topic
-- and M of a topic limited to K running at once (each run takes 10 ms), enqueued first and
-- drained by one dispatcher; times the free topic's drain, and the limited one's.
--   build/relaybus run bench/limited.lua URL [N] [CONCURRENCY] [LABEL] [M] [K]
-- Prints: LABEL limited: N unlimited beside M limited (concurrency K) in S s = R/s ...
-- The free topic should drain as fast as the plain drain (drain.lua) at the same concurrency:
-- the limited topic's waiting deliveries are left out of the claims, not stepped over.
local relaybus = require "relaybus"
local B = dofile((arg[0]:match("^(.*/)") or "./") .. "common.lua")

local url = arg[1] or "sqlite:bench-limited.db"
local N = tonumber(arg[2]) or 50000
local C = tonumber(arg[3]) or 256
local label = arg[4] or url:match("^(%a+):") or "store"
local M = tonumber(arg[5]) or 2000
local K = tonumber(arg[6]) or 4
local LIMIT = 300

local opts = {}
if not url:match("^sqlite:") then opts.table = B.table_name("bench_limited") end
local store = B.open(url, opts)
assert(store:limit("limited", { concurrency = K }))
-- the limited deliveries first: a claim in enqueue order would meet them before the free ones
local tfill = B.fill(store, "limited", M, 1000) + B.fill(store, "free", N, 1000)
print(string.format("%s limited: enqueued %s + %s with enqueue_many in %.2f s (setup)", label,
  B.int(M), B.int(N), tfill))

local d = relaybus.dispatcher(store, { concurrency = C, poll_interval = 0.05, lease_duration = 60,
                                        shutdown_timeout = 30 })
local free, limited, running, most = 0, 0, 0, 0
local t_free, t_limited
local t0 = relaybus.now()
d:handle("free", function()
  free = free + 1
  if free == N then t_free = relaybus.now() end
end)
d:handle("limited", function(_, ctx)
  running = running + 1
  most = math.max(most, running)
  ctx:sleep(0.01)
  running = running - 1
  limited = limited + 1
  if limited == M then
    t_limited = relaybus.now()
    relaybus.spawn(function() d:stop { timeout = 30 } end)
  end
end)
relaybus.spawn(function()
  while limited < M do
    if relaybus.now() - t0 >= LIMIT then
      print(string.format("%s limited: NOTE stopped by the watchdog after %d s: %s free, %s limited run",
        label, LIMIT, B.int(free), B.int(limited)))
      d:stop { timeout = 10 }
      return
    end
    relaybus.sleep(0.5)
  end
end)

t0 = relaybus.now()      -- (the watchdog above reads it from its first look)
d:start()
relaybus.run()
if not t_free or not t_limited then os.exit(1) end
local df, dl = t_free - t0, t_limited - t0
print(string.format("%s limited: %s unlimited beside %s limited (concurrency %d) in %.2f s = %s/s (concurrency %d)",
  label, B.int(N), B.int(M), K, df, B.int(N / df), C))
print(string.format("%s limited: the limited topic: %s in %.2f s = %s/s, at most %d running (its bound: %d x 100/s)",
  label, B.int(M), dl, B.int(M / dl), most, K))
if most > K then
  print(string.format("%s limited: NOTE the limit was exceeded: %d running at once", label, most))
end
store:close()
