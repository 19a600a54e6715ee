-- lease_inflight.lua -- ends its main chunk while lease operations are still in flight, run as
--   relaybus run spec/support/lease_inflight.lua STORE_URL TABLE NAME
-- The store is wrapped by testing.faults so that every lease operation is answered 3 s late;
-- daemon tasks start an acquire, an extend and a release, and the script returns at once: the
-- state closes with all three waiting (LeakSanitizer checks that each one's record is freed).
-- Prints "STARTED" once the three are under way.
local relaybus = require "relaybus"
local testing = require "relaybus_testing"
local C = dofile((arg[0]:match("^(.*/)") or "./") .. "child.lua")

local url, tbl, name = ...
assert(url and tbl and name, "usage: lease_inflight.lua STORE_URL TABLE NAME")
local inner = C.open(url, tbl)
local late = { late = 1 }
local slow_keep = assert(testing.faults(inner, {
  ops = { lease_extend = late, lease_release = late }, min_delay = 3, max_delay = 3,
}))
local slow_take = assert(testing.faults(inner, {
  ops = { lease_acquire = late }, min_delay = 3, max_delay = 3,
}))
local h = assert(slow_keep:try_acquire(name .. ".x", 30))
local h2 = assert(slow_keep:try_acquire(name .. ".r", 30))
local begun = 0
testing.daemon(function() begun = begun + 1; slow_take:try_acquire(name .. ".a", 30) end)
testing.daemon(function() begun = begun + 1; h:extend() end)
testing.daemon(function() begun = begun + 1; h2:release() end)
while begun < 3 do relaybus.sleep(0.01) end
io.stdout:write("STARTED\n")
io.stdout:flush()
