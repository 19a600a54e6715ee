-- faults_worker.lua -- a worker for faults_random_spec: its store wrapped by testing.faults,
-- handlers that do something random on every run. Run as
--   relaybus run spec/support/faults_worker.lua STORE_URL TABLE LOGFILE
-- Environment: RB_SEED (the fault seed; the handlers' choices come from it too), RB_FAIL,
-- RB_LOST, RB_LATE (rates for every operation), RB_MAX_DELAY, RB_LEASE (1), RB_CONC (8),
-- RB_STOPFILE (stop when it exists), RB_APP (an application table: handle topic "tx"
-- transactionally, inserting (delivery_id, fence) into it), RB_KIND (sqlite | postgresql |
-- mongodb).
--
-- LOGFILE is shared by every worker of a test: one line per event, appended and flushed at once
-- (one write each, so lines of several processes never mix). Times are relaybus.now().
--   READY <pid> <t>
--   S <id> <fence> <attempts> <start> <pid> <what>   a run started (what it will do)
--   E <id> <fence> <end> <how>          it ended: ret (returned) or raise
--   C <id> <fence> <result> <asked> <answered>   ctx:complete() answered: ok, or its error;
--                                       asked, answered: when it was called and when it returned
--   G <id> <fence> <t>                  about to call ctx:release/reschedule: from here on the
--                                       delivery may run elsewhere (the run gave it up)
--   X <id> <fence> <call> <result> <asked> <answered>
--                                       ctx:reschedule/bury/release/extend_lease answered
--   Q <id> <fence> <child>              an enqueue from the handler returned the child's id
--   T <pid> <start> <end>               a run of d:every (while holding its named lease)
--   P <pid> <from> <to> <cpu> <runq>    the loop did not run from..to (> 0.25 s): a stalled
--                                       process; cpu, runq: seconds of it on a CPU and waiting
--                                       for one (/proc/self/schedstat)
--   STATS <pid> <json>                  testing.fault_stats(store) once the dispatcher stopped
--   DONE <pid>
-- Errors are logged with blanks as _ ; one with a newline counts in STATS as multiline_errors.
local relaybus = require "relaybus"
local testing = require "relaybus_testing"   -- the command provides what it calls of relaybus
local C = dofile((arg[0]:match("^(.*/)") or "./") .. "child.lua")

local url, tbl, logpath = ...
assert(url and tbl and logpath, "usage: faults_worker.lua STORE_URL TABLE LOGFILE")
local function num(name, default) return tonumber(os.getenv(name) or "") or default end

local say, t = C.logger(logpath), C.t
local pid = tostring(num("RB_PID", 0))
do  -- the pid of this process (/proc/self is the process reading it)
  local f = io.open("/proc/self/stat")
  if f then pid = f:read("*l"):match("^(%d+)") or pid; f:close() end
end

local seed = math.tointeger(num("RB_SEED", 1))
local lease = num("RB_LEASE", 1)
local kind = os.getenv("RB_KIND") or "sqlite"
local app = os.getenv("RB_APP")
local stopfile = os.getenv("RB_STOPFILE")
math.randomseed(seed)

-- Opening may fail while other processes hold SQLite's write lock: retry for a while.
local inner, open_err
for _ = 1, 100 do
  inner, open_err = relaybus.open(url, C.store_opts(tbl))
  if inner then break end
  relaybus.sleep(0.05)
end
assert(inner, open_err)
local store = assert(testing.faults(inner, {
  seed = seed,
  fail = num("RB_FAIL", 0.05),
  lost = num("RB_LOST", 0.05),
  late = num("RB_LATE", 0.2),
  max_delay = num("RB_MAX_DELAY", 0.05),
}))

local multiline = 0
local function word(v)
  local s = tostring(v)
  if s:find("\n") then multiline = multiline + 1 end
  s = s:gsub("%s", "_")
  return s
end
local function result(ok, err) return ok and "ok" or word(err) end

-- Runs call (a settle: ctx:complete() and the like) and logs its answer as `name` (record C
-- for complete, X for the others) with the times it was asked and answered: a settle's answer is
-- waited for even past the run's deadline (it is the truth), so the spec needs both times to
-- tell a late answer from an overlap.
local function settle(name, id, fence, call)
  local asked = t(relaybus.now())
  local res = result(call())
  if name == "complete" then say("C", id, fence, res, asked, t(relaybus.now()))
  else say("X", id, fence, name, res, asked, t(relaybus.now())) end
end

local d = relaybus.dispatcher(store, {
  lease_duration = lease,
  concurrency = num("RB_CONC", 8),
  poll_interval = 0.05,
  shutdown_timeout = 3,
  backoff = function() return 0 end,
})

-- What a run does, with weights. "long" sleeps past the lease (kept by renewals, which the
-- faults may break); the handler's timeout (2.5 s) cuts the longest.
local WHAT = {
  {"ret", 38}, {"raise", 10}, {"complete", 12}, {"reschedule", 6}, {"reschedule_long", 1},
  {"bury", 4}, {"release", 6}, {"extend", 4}, {"long", 5}, {"child", 4}, {"settle_twice", 3},
}
local total_weight = 0
for _, w in ipairs(WHAT) do total_weight = total_weight + w[2] end
local function pick()
  local r = math.random() * total_weight
  for _, w in ipairs(WHAT) do
    r = r - w[2]
    if r < 0 then return w[1] end
  end
  return "ret"
end

local function short() return math.random() * 0.02 end

d:handle("work", function(delivery, ctx)
  local what = pick()
  if delivery.payload and delivery.payload.child and what == "child" then what = "ret" end
  local id, fence = delivery.id, delivery.fence
  say("S", id, fence, delivery.attempts, t(relaybus.now()), pid, what)
  local how = "ret"
  local function finish() say("E", id, fence, t(relaybus.now()), how) end
  local function give_up() say("G", id, fence, t(relaybus.now())) end
  ctx:sleep(short())
  if what == "raise" then
    how = "raise"
    finish()
    error("handler raised on purpose")
  elseif what == "complete" or what == "settle_twice" then
    settle("complete", id, fence, function() return ctx:complete() end)
    if what == "settle_twice" then
      settle("bury", id, fence, function() return ctx:bury("bury after complete") end)
    end
    ctx:sleep(short())
    if math.random() < 0.3 then    -- a raise after a settle changes nothing
      how = "raise"
      finish()
      error("raise after complete")
    end
  elseif what == "reschedule" then
    give_up()
    local delay = math.random() * 0.2
    settle("reschedule", id, fence,
      function() return ctx:reschedule(delay, "rescheduled by the handler") end)
  elseif what == "reschedule_long" then
    give_up()
    settle("reschedule_long", id, fence,
      function() return ctx:reschedule(3600, "rescheduled for an hour") end)
  elseif what == "bury" then
    settle("bury", id, fence, function() return ctx:bury("buried by the handler") end)
  elseif what == "release" then
    give_up()
    local delay = math.random() * 0.1
    settle("release", id, fence, function() return ctx:release(delay) end)
  elseif what == "extend" then
    settle("extend", id, fence, function() return ctx:extend_lease(lease * 1.5) end)
    ctx:sleep(lease * (0.5 + math.random()))
  elseif what == "long" then
    ctx:sleep(lease * (1.2 + math.random() * 1.8))
  elseif what == "child" then
    local child, err = store:enqueue("work", { child = true, parent = id })
    if child then say("Q", id, fence, child) else say("X", id, fence, "enqueue", word(err)) end
  end
  finish()
end, { timeout = 2.5 })

if app then
  local insert_sql = "INSERT INTO " .. app .. " (delivery_id, fence) VALUES "
    .. (kind == "postgresql" and "($1, $2)" or "(?, ?)")
  d:handle("tx", function(delivery, ctx)
    local id, fence = delivery.id, delivery.fence
    local raise = math.random() < 0.2
    say("S", id, fence, delivery.attempts, t(relaybus.now()), pid, raise and "tx_raise" or "tx")
    local ok, err
    if kind == "mongodb" then
      ok, err = ctx.transaction:collection(app):insert_one { delivery_id = id, fence = fence }
    else
      ok, err = ctx.transaction:exec(insert_sql, id, fence)
    end
    if not ok then
      say("E", id, fence, t(relaybus.now()), "raise")
      error("insert failed: " .. tostring(err))
    end
    ctx:sleep(math.random() * 0.005)
    say("E", id, fence, t(relaybus.now()), raise and "raise" or "ret")
    if raise then error("raise after the insert") end
  end, { transactional = true })
end

-- A named lease through the faulty store: at most one process runs this at a time.
d:every("tick", 0.3, function(ctx)
  local start = relaybus.now()
  ctx:sleep(math.random() * 0.1)
  say("T", pid, t(start), t(relaybus.now()))
end)

-- A heartbeat: a gap in it means this process's loop did not run (starved of CPU, blocked in
-- a call), and a run frozen in it cannot be aborted at its deadline.
local function schedstat()
  local f = io.open("/proc/self/schedstat")
  local line = f and f:read("*l")
  if f then f:close() end
  local on, wait = (line or ""):match("^(%d+) (%d+)")
  return (tonumber(on) or 0) / 1e9, (tonumber(wait) or 0) / 1e9
end
testing.daemon(function()
  local last = relaybus.now()
  local on0, wait0 = schedstat()
  while true do
    relaybus.sleep(0.05)
    local now = relaybus.now()
    local on, wait = schedstat()
    if now - last > 0.25 then
      say("P", pid, t(last), t(now), string.format("%.3f", on - on0), string.format("%.3f", wait - wait0))
    end
    last, on0, wait0 = now, on, wait
  end
end)

local function exists(path)
  local f = io.open(path, "r")
  if f then f:close() return true end
  return false
end

d:start()
say("READY", pid, t(relaybus.now()))
relaybus.spawn(function()   -- ends with the dispatcher too (a SIGTERM stops it)
  while not (stopfile and exists(stopfile)) and d:stats().running and not d:stats().stopping do
    relaybus.sleep(0.1)
  end
  d:stop { timeout = 5 }
end)
relaybus.run()   -- until the dispatcher has stopped

-- Let the operations still out (late answers, settles of abandoned runs) come back.
relaybus.spawn(function()
  local until_t = relaybus.now() + 5
  while testing.fault_stats(store).waiting > 0 and relaybus.now() < until_t do relaybus.sleep(0.05) end
end)
relaybus.run()
local st = testing.fault_stats(store)
st.multiline_errors = multiline
say("STATS", pid, relaybus.json.encode(st))
store:close()
inner:close()
say("DONE", pid)
