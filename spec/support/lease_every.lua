-- lease_every.lua -- a process running d:every(NAME, INTERVAL, fn) on a store, run as
--   relaybus run spec/support/lease_every.lua STORE_URL TABLE LOGFILE NAME INTERVAL
-- fn logs its start and end on the monotonic clock, flushed at once (a SIGKILL loses no
-- finished line), and works (ctx:sleep) for 10 % to 50 % of the interval:
--   S <start> <deadline>
--   E <start> <end> <sleep_ok> <sleep_err>
-- READY once the dispatcher runs. SIGTERM stops it gracefully.
local relaybus = require "relaybus"
local C = dofile((arg[0]:match("^(.*/)") or "./") .. "child.lua")

local url, tbl, logpath, name, interval = ...
assert(url and logpath and name and interval,
  "usage: lease_every.lua STORE_URL TABLE LOGFILE NAME INTERVAL")
interval = tonumber(interval)
local store = C.open(url, tbl)

local say, t = C.logger(logpath), C.t

math.randomseed(os.time() + math.floor(relaybus.now() * 1e6) % 100000)

local d = relaybus.dispatcher(store, {
  lease_duration = 2, poll_interval = 0.05, shutdown_timeout = 2,
})
d:every(name, interval, function(ctx)
  local start = relaybus.now()
  say("S", t(start), t(ctx.deadline))
  local ok, err = ctx:sleep(interval * (0.1 + 0.4 * math.random()))
  say("E", t(start), t(relaybus.now()), ok, err)
end)
d:start()
say("READY", t(relaybus.now()))
