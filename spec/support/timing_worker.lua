-- timing_worker.lua -- a worker for spec/timing_spec.lua, run as
--   relaybus run spec/support/timing_worker.lua STORE_URL TABLE LOGFILE
-- Its handlers act only after a wait told them to go on, as a careful handler does, and log
-- every step as one flushed line "<event> <id> <pid> <fence> <monotonic>":
--   S  a run started            X  a side effect (made only after a wait returned true)
--   W  a wait returned nil (a sixth field: ctx.signal.reason)   E  the handler returned
-- The spec then checks that no run made a side effect after a later run of the same delivery
-- (higher fence) had started: a takeover never overlaps the work of the run it replaced.
-- Environment:
--   RB_MODE   victim (default): RB_STEPS times sleep RB_STEP s, then a side effect
--             cbound: the first run of a delivery (fence 1): a side effect after every
--             string.rep of 32 MB, forever (time in C); later runs as victim
--             every: d:every("tick", RB_INTERVAL, fn) with fn as victim
--             luabusy: the first run: Lua arithmetic with a wait of 0 now and then, until a
--             wait fails; later runs as victim
--   RB_BLOCK  also handle topic "block": os.execute("sleep RB_BLOCK") holds the loop
--   RB_SIDE   a table: "work" is transactional, and each run inserts (id, fence) there first
--   RB_LEASE, RB_CONC, RB_POLL, RB_STEPS, RB_STEP, RB_INTERVAL
local relaybus = require "relaybus"
local C = dofile((arg[0]:match("^(.*/)") or "./") .. "child.lua")

local url, tbl, logpath = ...
assert(url and logpath, "usage: timing_worker.lua STORE_URL TABLE LOGFILE")
local store = C.open(url, tbl)
local say, t = C.logger(logpath), C.t
local pid = tostring(os.getenv("RB_PID") or "?")

local function num(name, default) return tonumber(os.getenv(name) or "") or default end
local mode = os.getenv("RB_MODE") or "victim"
local steps, step = num("RB_STEPS", 10), num("RB_STEP", 0.1)

local d = relaybus.dispatcher(store, {
  lease_duration = num("RB_LEASE", 1),
  concurrency = num("RB_CONC", 4),
  poll_interval = num("RB_POLL", 0.05),
  shutdown_timeout = 2,
  backoff = function() return 0 end,
})

local function careful(id, fence, sleep, signal)
  for _ = 1, steps do
    local ok = sleep(step)
    if not ok then
      say("W", id, pid, fence, t(relaybus.now()), tostring(signal.reason))
      return
    end
    say("X", id, pid, fence, t(relaybus.now()))
  end
end

local side = os.getenv("RB_SIDE")
d:handle("work", function(delivery, ctx)
  local id, fence = delivery.id, delivery.fence
  say("S", id, pid, fence, t(relaybus.now()))
  if side then
    assert(ctx.transaction:exec("INSERT INTO " .. side .. " (id, fence) VALUES ($1, $2)", id, fence))
  end
  if mode == "luabusy" and fence == 1 then
    -- Lua arithmetic most of the time (a freeze lands in it), a wait of 0 now and then
    while true do
      local x = 0
      for i = 1, 200000 do x = x + i % 7 end
      if not ctx:sleep(0) then
        say("W", id, pid, fence, t(relaybus.now()), tostring(ctx.signal.reason))
        return
      end
      say("X", id, pid, fence, t(relaybus.now()))
    end
  end
  if mode == "cbound" and fence == 1 then
    while true do
      local s = string.rep("x", 32 * 1024 * 1024)
      s = nil
      say("X", id, pid, fence, t(relaybus.now()))
    end
  end
  careful(id, fence, function(s) return ctx:sleep(s) end, ctx.signal)
  say("E", id, pid, fence, t(relaybus.now()))
end, { transactional = side ~= nil })

local block = num("RB_BLOCK", 0)
if block > 0 then
  d:handle("block", function()
    os.execute(string.format("sleep %.3f", block))
  end)
end

if mode == "every" then
  local n = 0
  d:every("tick", num("RB_INTERVAL", 1), function(ctx)
    n = n + 1
    local id, fence = "tick", pid .. "." .. n
    say("S", id, pid, fence, t(relaybus.now()))
    careful(id, fence, function(s) return ctx:sleep(s) end, ctx.signal)
    say("E", id, pid, fence, t(relaybus.now()))
  end)
end

d:start()
say("READY", "-", pid, 0, t(relaybus.now()))
