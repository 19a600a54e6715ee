-- drain.lua -- drain rate: enqueue N no-op deliveries (enqueue_many, chunks of 1,000), then time
-- one dispatcher running them all to completion.
--   build/relaybus run bench/drain.lua URL [N] [CONCURRENCY] [LABEL] [LIMIT] [GROUPS]
-- Prints: LABEL drain: N deliveries in S s = R/s (concurrency C)
-- GROUPS > 0: the deliveries are spread round robin over that many ordered groups (each group
-- runs one at a time), and the line says "in G groups".
-- LIMIT (seconds, default 300): a watchdog stops the dispatcher then and prints what was done.
local relaybus = require "relaybus"
local B = dofile((arg[0]:match("^(.*/)") or "./") .. "common.lua")

local url = arg[1] or "sqlite:bench-drain.db"
local N = tonumber(arg[2]) or 50000
local C = tonumber(arg[3]) or 128
local label = arg[4] or url:match("^(%a+):") or "store"
local LIMIT = tonumber(arg[5]) or 300
local GROUPS = tonumber(arg[6]) or 0
local grouped = GROUPS > 0 and string.format(" in %s groups", B.int(GROUPS)) or ""

local opts = {}
if not url:match("^sqlite:") then opts.table = B.table_name("bench_drain") end
local store = B.open(url, opts)

local tfill = B.fill(store, "noop", N, 1000, GROUPS)
print(string.format("%s drain: enqueued %s with enqueue_many in %.2f s (setup)", label, B.int(N), tfill))

local d = relaybus.dispatcher(store, { concurrency = C, poll_interval = 1, lease_duration = 60,
                                        shutdown_timeout = 30 })
local done, t_last = 0, nil
d:handle("noop", function()
  done = done + 1
  if done == N then
    t_last = relaybus.now()
    relaybus.spawn(function() d:stop { timeout = 30 } end)
  end
end)

local stopped_early = false
relaybus.spawn(function()
  local t = relaybus.now()
  while done < N do
    if relaybus.now() - t >= LIMIT then
      stopped_early = true
      print(string.format("%s drain: NOTE stopped by the watchdog after %d s with %s of %s handlers run",
        label, LIMIT, B.int(done), B.int(N)))
      d:stop { timeout = 10 }
      return
    end
    relaybus.sleep(0.5)
  end
end)

local t0 = relaybus.now()
d:start()
relaybus.run()
local t1 = relaybus.now()   -- the stop has flushed the last completions
if stopped_early then
  local dt = (t_last or t1) - t0
  print(string.format("%s drain: INCOMPLETE %s of %s deliveries in %.2f s = %s/s (concurrency %d)",
    label, B.int(done), B.int(N), dt, B.int(done / dt), C))
  os.exit(1)
end

local s = assert(store:stats())
local dt = t1 - t0
print(string.format("%s drain: %s deliveries%s in %.2f s = %s/s (concurrency %d)",
  label, B.int(N), grouped, dt, B.int(N / dt), C))
if s.pending ~= 0 or s.processing ~= 0 or s.completed ~= N then
  print(string.format("%s drain: NOTE after the stop: pending %d, processing %d, completed %d, buried %d (expected %d completed)",
    label, s.pending, s.processing, s.completed, s.buried, N))
end
store:close()
