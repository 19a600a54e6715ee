-- cqueues_host.lua -- plain lua5.4 with cqueues driving relaybus: a cqueues coroutine waits in
-- cqueues.poll() on relaybus's descriptor (a pollable object) and timeout, then steps.
-- Loads relaybus.so through package.cpath (LUA_CPATH=build/?.so;;).
--
--   lua5.4 examples/cqueues_host.lua [--budget S] key=value...   (workload.lua's options)
local cqueues = require "cqueues"
local relaybus = require "relaybus"
local W = dofile(os.getenv("RELAYBUS_WORKLOAD") or "examples/workload.lua")

local budget, args = W.budget_arg { ... }
local w = W.start(relaybus, table.unpack(args))

-- What cqueues.poll waits on: an object with :pollfd() and :events() (readable).
local fd = assert(relaybus.pollfd(), "no descriptor: the runtime is on a host loop")
local runtime = {
  pollfd = function() return fd end,
  events = function() return "r" end,
}

local failed, steps = nil, 0
local t0 = relaybus.now()
local cq = cqueues.new()
cq:wrap(function()
  while relaybus.busy() > 0 do
    local t = relaybus.timeout()
    if t < 0 then cqueues.poll(runtime) elseif t > 0 then cqueues.poll(runtime, t) end
    steps = steps + 1
    local ok, err = relaybus.step(budget)
    if not ok then
      failed = err
      return
    end
  end
end)
local ok, err = cq:loop()
if not ok then failed = failed or err end
if failed then io.stderr:write("cqueues_host: ", tostring(failed), "\n") end
local line = w.report()
print(line)
print(string.format("steps=%d secs=%.2f", steps, relaybus.now() - t0))
os.exit((not failed and line:find("^result ok=1")) and 0 or 1)
