-- worker.lua -- a worker process for the multi-process specs, run as
--   relaybus run spec/support/worker.lua STORE_URL TABLE LOGFILE
-- It handles one topic and appends one line per event to LOGFILE, flushed at once so a
-- SIGKILL loses no finished line:
--   READY <pid>
--   S <id> <start_monotonic> <fence> <attempts> <start_epoch>
--                                                      a run started (epoch: relaybus.time())
--   E <id> <start_monotonic> <end_monotonic>          a run ended (returned)
--   A <id> <reason> <complete> <bury> <extend>         (mode hold) the abort, and what the
--                                                      settle calls returned after it
--   C <id> <ok> <err>                                   (mode gate) ctx:complete()'s result
-- Environment: RB_MODE drain (sleep RB_SLEEP s, return) | hold (wait for the abort) | gate
-- (wait until the file RB_GATE exists, then complete); RB_TOPIC (default "work"), RB_LEASE,
-- RB_CONC, RB_POLL, RB_SLEEP, RB_JITTER (extra random sleep up to this), RB_SHUTDOWN.
local relaybus = require "relaybus"
local C = dofile((arg[0]:match("^(.*/)") or "./") .. "child.lua")

local url, tbl, logpath = ...
assert(url and logpath, "usage: worker.lua STORE_URL TABLE LOGFILE")
local store = C.open(url, tbl)

local say, t = C.logger(logpath), C.t

local function num(name, default) return tonumber(os.getenv(name) or "") or default end
local mode = os.getenv("RB_MODE") or "drain"
local topic = os.getenv("RB_TOPIC") or "work"
local sleep_s = num("RB_SLEEP", 0)
local jitter = num("RB_JITTER", 0)
local gate = os.getenv("RB_GATE")

math.randomseed(os.time() + math.floor(relaybus.now() * 1e6) % 100000)

local function exists(path)
  local f = io.open(path, "r")
  if f then f:close() return true end
  return false
end

local d = relaybus.dispatcher(store, {
  lease_duration = num("RB_LEASE", 2),
  concurrency = num("RB_CONC", 8),
  poll_interval = num("RB_POLL", 0.05),
  shutdown_timeout = num("RB_SHUTDOWN", 2),
  backoff = function() return 0 end,
})

d:handle(topic, function(delivery, ctx)
  local start = relaybus.now()
  say("S", delivery.id, t(start), delivery.fence, delivery.attempts, t(relaybus.time()))
  if mode == "hold" then
    while not ctx.signal.aborted do
      if not ctx:sleep(0.05) then break end
    end
    local c = ctx:complete()
    local b = ctx:bury("stale bury")
    local e = ctx:extend_lease(60)
    say("A", delivery.id, ctx.signal.reason, c, b, e)
    return
  elseif mode == "gate" then
    while not exists(gate) do
      if not ctx:sleep(0.02) then break end
    end
    local ok, err = ctx:complete()
    say("C", delivery.id, ok, err and err:gsub("%s", "_"))
  else
    local s = sleep_s
    if jitter > 0 then s = s + math.random() * jitter end
    if s > 0 then ctx:sleep(s) end
  end
  say("E", delivery.id, t(start), t(relaybus.now()))
end)

d:start()
say("READY", t(relaybus.now()))
