-- fault_txworker.lua -- a worker with a transactional handler, for effectively_once_spec:
--   relaybus run spec/support/fault_txworker.lua STORE_URL TABLE APP_TABLE LOGFILE
-- Each run inserts one row (delivery_id, fence) into APP_TABLE through ctx.transaction (SQL
-- stores: tx:exec; MongoDB: tx:collection(APP_TABLE):insert_one), then sleeps RB_SLEEP s and
-- raises with probability RB_RAISE (after the insert, so the raise must roll the row back).
-- It appends one line per event to LOGFILE, flushed at once:
--   READY <monotonic>
--   S <id> <start> <fence> <attempts>     a run started
--   R <id> <start> <end>                  the run raised (after its insert)
--   E <id> <start> <end>                  the run returned (its commit follows)
--   X <id> <start> <end> <error>          the insert itself failed (the run raises)
--   OPENFAIL <error>                       relaybus.open failed (see RB_OPEN_RETRY)
-- Environment: RB_KIND (sqlite | postgresql | mongodb), RB_RAISE (0.2), RB_SLEEP (0.01),
-- RB_LEASE (2), RB_CONC (8), RB_POLL (0.05), RB_OPEN_RETRY (0), RB_LONG (0: the probability
-- that a run sleeps RB_LONG_SLEEP s, default 0.25, instead: a run a kill can land in).
local relaybus = require "relaybus"
local C = dofile((arg[0]:match("^(.*/)") or "./") .. "child.lua")

local url, tbl, app, logpath = ...
assert(url and tbl and app and logpath, "usage: fault_txworker.lua STORE_URL TABLE APP_TABLE LOGFILE")
local opts = C.store_opts(tbl)
local say, t = C.logger(logpath), C.t
local function num(name, default) return tonumber(os.getenv(name) or "") or default end

-- RB_OPEN_RETRY=S: keep retrying a failed open for up to S s, logging "OPENFAIL <err>" each
-- time (used on SQLite, where open can starve while another process runs transactional
-- handlers); without it a failed open ends the worker.
local store, open_err
local open_until = relaybus.now() + num("RB_OPEN_RETRY", 0)
repeat
  store, open_err = relaybus.open(url, opts)
  if not store then
    say("OPENFAIL", (tostring(open_err):gsub("%s", "_")))
    if relaybus.now() >= open_until then error(open_err, 0) end
    relaybus.sleep(0.05)
  end
until store

local kind = os.getenv("RB_KIND") or "sqlite"
local raise_p = num("RB_RAISE", 0.2)
local sleep_s = num("RB_SLEEP", 0.01)
local long_p, long_s = num("RB_LONG", 0), num("RB_LONG_SLEEP", 0.25)
local insert_sql = "INSERT INTO " .. app .. " (delivery_id, fence) VALUES "
  .. (kind == "postgresql" and "($1, $2)" or "(?, ?)")

math.randomseed(os.time() + math.floor(relaybus.now() * 1e6) % 100000)

local d = relaybus.dispatcher(store, {
  lease_duration = num("RB_LEASE", 2),
  concurrency = num("RB_CONC", 8),
  poll_interval = num("RB_POLL", 0.05),
  shutdown_timeout = 2,
  backoff = function() return 0 end,
})

d:handle("work", function(delivery, ctx)
  local start = relaybus.now()
  say("S", delivery.id, t(start), delivery.fence, delivery.attempts)
  local ok, err
  if kind == "mongodb" then
    ok, err = ctx.transaction:collection(app):insert_one { delivery_id = delivery.id, fence = delivery.fence }
  else
    ok, err = ctx.transaction:exec(insert_sql, delivery.id, delivery.fence)
  end
  if not ok then
    say("X", delivery.id, t(start), t(relaybus.now()), (tostring(err):gsub("%s", "_")))
    error("insert failed: " .. tostring(err))
  end
  if math.random() < long_p then ctx:sleep(long_s)
  elseif sleep_s > 0 then ctx:sleep(sleep_s * (0.5 + math.random())) end
  if math.random() < raise_p then
    say("R", delivery.id, t(start), t(relaybus.now()))
    error("random failure after the insert")
  end
  say("E", delivery.id, t(start), t(relaybus.now()))
end, { transactional = true })

d:start()
say("READY", t(relaybus.now()))
