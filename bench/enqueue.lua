-- enqueue.lua -- enqueue rate: N single store:enqueue calls from the main chunk (each waits for
-- its commit), then N single calls from 64 tasks at once (concurrent writers, as handlers that
-- enqueue are: a store may commit them together), then N deliveries with store:enqueue_many in
-- chunks of CHUNK.
--   build/relaybus run bench/enqueue.lua URL [N] [CHUNK] [LABEL]
local relaybus = require "relaybus"
local B = dofile((arg[0]:match("^(.*/)") or "./") .. "common.lua")

local url = arg[1] or "sqlite:bench-enqueue.db"
local N = tonumber(arg[2]) or 20000
local CHUNK = tonumber(arg[3]) or 1000
local label = arg[4] or url:match("^(%a+):") or "store"

local opts = {}
if not url:match("^sqlite:") then opts.table = B.table_name("bench_enq") end
local store = B.open(url, opts)

local t0 = relaybus.now()
for i = 1, N do assert(store:enqueue("noop", { i = i })) end
local dt = relaybus.now() - t0
print(string.format("%s enqueue (single calls): %s in %.2f s = %s/s",
  label, B.int(N), dt, B.int(N / dt)))

local TASKS, left, t1 = 64, 64, nil
t0 = relaybus.now()
for k = 1, TASKS do
  relaybus.spawn(function()
    for i = k, N, TASKS do assert(store:enqueue("noop", { i = i })) end
    left = left - 1
    if left == 0 then t1 = relaybus.now() end
  end)
end
relaybus.run()
dt = (t1 or relaybus.now()) - t0
print(string.format("%s enqueue (single calls from %d tasks at once): %s in %.2f s = %s/s",
  label, TASKS, B.int(N), dt, B.int(N / dt)))

dt = B.fill(store, "noop", N, CHUNK)
print(string.format("%s enqueue_many (chunks of %d): %s in %.2f s = %s/s",
  label, CHUNK, B.int(N), dt, B.int(N / dt)))

local s = assert(store:stats())
if s.pending ~= 3 * N then
  print(string.format("%s enqueue: NOTE %d pending, expected %d", label, s.pending, 3 * N))
end
store:close()
