-- lease_contend.lua -- one of several processes contending for one named lease, run as
--   relaybus run spec/support/lease_contend.lua STORE_URL TABLE LOGFILE NAME DURATION UNTIL SEED
-- Until the monotonic time UNTIL it tries to take NAME for DURATION seconds; each time it gets
-- it, it holds it for a random fraction of the lease, and then releases it, extends it (up to
-- three times, then decides again) or lets it expire. One line per holding, flushed at once:
--   I <start> <end> <how> <extends> <late_release>
-- start: when try_acquire returned the handle; end: min(when release was called, deadline);
-- how: release | expire | lost (an extend that failed before the deadline); late_release: what
-- release() returned after an expiry ("nil" expected: a late release is refused).
-- Other lines: READY <seed>, ERR <message>, SIGNAL <aborted> <reason> (after an expiry, when the
-- signal was not aborted with reason lease), DONE <holdings> <misses>.
local relaybus = require "relaybus"
local C = dofile((arg[0]:match("^(.*/)") or "./") .. "child.lua")

local url, tbl, logpath, name, duration, until_, seed = ...
assert(url and logpath and name and duration and until_ and seed,
  "usage: lease_contend.lua STORE_URL TABLE LOGFILE NAME DURATION UNTIL SEED")
duration, until_, seed = tonumber(duration), tonumber(until_), tonumber(seed)
local store = C.open(url, tbl)

local say, t = C.logger(logpath), C.t

math.randomseed(seed)
say("READY", seed)

-- sleeps a random fraction (lo..hi) of what is left of the lease
local function hold_for(h, lo, hi)
  local left = h.deadline - relaybus.now()
  if left > 0 then relaybus.sleep(left * (lo + math.random() * (hi - lo))) end
end

local holdings, misses = 0, 0
while relaybus.now() < until_ do
  local h, err = store:try_acquire(name, duration)
  if h then
    local start = relaybus.now()
    holdings = holdings + 1
    local extends, how, stop, late = 0, nil, nil, "-"
    while not how do
      local r = math.random()
      if r < 0.35 then
        hold_for(h, 0, 0.9)
        -- the holding ends when the holder stops its work and asks to release; the release's
        -- answer may come back after a successor already took the name
        stop = math.min(relaybus.now(), h.deadline)
        local ok, rerr = h:release()
        if ok then how = "release" else how = "release-refused"; say("ERR", "release: " .. tostring(rerr)) end
      elseif r < 0.6 and extends < 3 then
        hold_for(h, 0, 0.8)
        local ok = h:extend()
        if ok then extends = extends + 1
        else how, stop = "lost", h.deadline end
      else
        -- let it expire: wait for the signal (it fires at the deadline)
        while not h.signal.aborted do
          local left = h.deadline - relaybus.now()
          relaybus.sleep(left > 0.005 and left or 0.005)
        end
        stop = h.deadline
        if h.signal.reason ~= "lease" then say("SIGNAL", h.signal.aborted, h.signal.reason) end
        late = tostring((h:release()))
        how = "expire"
      end
    end
    say("I", t(start), t(stop), how, extends, late)
    relaybus.sleep(math.random() * 0.15)
  elseif err then
    say("ERR", "try_acquire: " .. tostring(err))
    relaybus.sleep(0.05)
  else
    misses = misses + 1
    relaybus.sleep(0.005 + math.random() * 0.025)
  end
end
say("DONE", holdings, misses)
store:close()
