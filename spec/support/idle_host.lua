-- idle_host.lua -- a stepped runtime with nothing to do (a started dispatcher on an empty
-- store) under a host that sleeps in cqueues.poll() until relaybus's descriptor or timeout,
-- then steps. Prints the CPU the process used over SECS seconds of wall time:
--   idle cpu_pct=0.12 steps=4 secs=3.00
-- Run with plain lua5.4 and LUA_CPATH pointing at relaybus.so: lua5.4 idle_host.lua URL SECS
local cqueues = require "cqueues"
local relaybus = require "relaybus"
local url, secs = arg[1], tonumber(arg[2] or "3")
local store = assert(relaybus.open(url))
local d = relaybus.dispatcher(store, {})          -- default poll_interval: 1 s
d:handle("never", function() end)
d:start()
local fd = assert(relaybus.pollfd())
local runtime = { pollfd = function() return fd end, events = function() return "r" end }
-- let the start settle (first claim, the retention task's first try) before measuring
local warm = relaybus.now() + 0.5
while relaybus.now() < warm do
  local t = relaybus.timeout()
  cqueues.poll(runtime, (t >= 0 and t < 0.05) and t or 0.05)
  assert(relaybus.step())
end
local steps, c0, t0 = 0, os.clock(), relaybus.now()
local cq = cqueues.new()
cq:wrap(function()
  while relaybus.now() - t0 < secs do
    local t = relaybus.timeout()
    local left = secs - (relaybus.now() - t0)
    if t < 0 or t > left then t = left end
    if t > 0 then cqueues.poll(runtime, t) end
    steps = steps + 1
    assert(relaybus.step())
  end
end)
assert(cq:loop())
local cpu, wall = os.clock() - c0, relaybus.now() - t0
print(string.format("idle cpu_pct=%.3f steps=%d secs=%.2f", 100 * cpu / wall, steps, wall))
d:stop(0.5):wait()
store:close()
