-- luv_host.lua -- plain lua5.4 with luv (libuv) driving relaybus: relaybus.pollfd() in a
-- uv poll handle, relaybus.timeout() in a uv timer, relaybus.step() from their callbacks.
-- Loads relaybus.so through package.cpath (LUA_CPATH=build/?.so;;).
--
--   lua5.4 examples/luv_host.lua [--budget S] key=value...   (examples/workload.lua's options)
local uv = require "luv"
local relaybus = require "relaybus"
local W = dofile(os.getenv("RELAYBUS_WORKLOAD") or "examples/workload.lua")

local budget, args = W.budget_arg { ... }
local w = W.start(relaybus, table.unpack(args))

local poll = uv.new_poll(assert(relaybus.pollfd(), "no descriptor: the runtime is on a host loop"))
local timer = uv.new_timer()
local failed, steps = nil, 0

local function close()
  if not poll:is_closing() then poll:close() end
  if not timer:is_closing() then timer:close() end
end

-- One step; then the timer is armed for the runtime's next timeout (whole ms, rounded up).
local function step()
  steps = steps + 1
  local ok, err = relaybus.step(budget)
  if not ok then
    failed = err
    return close()
  end
  if relaybus.busy() == 0 then return close() end
  local t = relaybus.timeout()
  if t < 0 then timer:stop() else timer:start(math.ceil(t * 1000), 0, step) end
end

poll:start("r", function(err)
  if err then
    failed = err
    return close()
  end
  step()
end)
local t0 = relaybus.now()
step()
uv.run()
if failed then io.stderr:write("luv_host: ", tostring(failed), "\n") end
local line = w.report()
print(line)
print(string.format("steps=%d secs=%.2f", steps, relaybus.now() - t0))
os.exit((not failed and line:find("^result ok=1")) and 0 or 1)
