-- lease_frozen.lua -- a lease holder the spec freezes (SIGSTOP) past its deadline, run as
--   relaybus run spec/support/lease_frozen.lua STORE_URL TABLE LOGFILE NAME DURATION
-- It takes NAME, logs "H <start> <deadline>", and waits (short sleeps) until its signal is
-- aborted. Then it tries to extend and to release the lease and logs
--   A <time_seen> <aborted> <reason> <extend_ok> <extend_err> <release_ok> <release_err>
-- (errors with blanks as _). "NOLEASE" when the name was taken at the start.
local relaybus = require "relaybus"
local C = dofile((arg[0]:match("^(.*/)") or "./") .. "child.lua")

local url, tbl, logpath, name, duration = ...
assert(url and logpath and name and duration,
  "usage: lease_frozen.lua STORE_URL TABLE LOGFILE NAME DURATION")
local store = C.open(url, tbl)
local say, t = C.logger(logpath, "_"), C.t

local h, err = store:try_acquire(name, tonumber(duration))
if not h then
  say("NOLEASE", err)
  os.exit(3)
end
say("H", t(relaybus.now()), t(h.deadline))
while not h.signal.aborted do relaybus.sleep(0.01) end
local seen = relaybus.now()
local eok, eerr = h:extend()
local rok, rerr = h:release()
say("A", t(seen), h.signal.aborted, h.signal.reason, eok, eerr, rok, rerr)
store:close()
