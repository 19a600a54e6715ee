-- step_attacks.lua -- the stepped runtime misused, from plain lua5.4 (LUA_CPATH at relaybus.so):
--   lua5.4 step_attacks.lua URL
-- Prints one "name=value" line per attack; spec/hosts_spec.lua checks them.
local relaybus = require "relaybus"
local url = arg[1]
local function say(k, v) print(k .. "=" .. tostring(v)) end

-- Budgets that are not a number of seconds.
for name, b in pairs({ nan = 0 / 0, negative = -1, huge = math.huge }) do
  local ok, err = relaybus.step(b)
  say("budget_" .. name, ok and "accepted" or err)
end

local store = assert(relaybus.open(url))
local lease = 0.5
local d = relaybus.dispatcher(store, { lease_duration = lease, poll_interval = 0.02 })
local r = {}
d:handle("inside", function(_, ctx)
  local ok, err = relaybus.step()
  r.inside = ok and "accepted" or err
end)
-- A host that does not step for 2.5 lease durations: at its next step the run is aborted
-- before anything else, so the sleep (whose timer is long due too) ends "aborted".
d:handle("frozen", function(_, ctx)
  r.frozen_started = true
  local ok, err = ctx:sleep(0.05)
  r.frozen_sleep = ok and "ok" or err
  r.frozen_reason = ctx.signal.reason
end)
d:start()
assert(store:enqueue("inside", {}))

local function step_until(cond, secs)
  local limit = relaybus.now() + secs
  while not cond() and relaybus.now() < limit do
    local t = relaybus.timeout()
    if t > 0 then os.execute(string.format("sleep %.3f", math.min(t, 0.02))) end
    assert(relaybus.step())
  end
  return cond()
end
step_until(function() return r.inside end, 10)
say("inside", r.inside)

assert(store:enqueue("frozen", {}))
step_until(function() return r.frozen_started end, 10)
os.execute(string.format("sleep %.3f", 2.5 * lease))       -- the host hangs: no step
assert(relaybus.step())
step_until(function() return r.frozen_sleep end, 10)
say("frozen_sleep", r.frozen_sleep)
say("frozen_reason", r.frozen_reason)
d:stop(1)
step_until(function() return relaybus.busy() == 0 end, 10)
say("busy", relaybus.busy())
