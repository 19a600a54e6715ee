-- set_push.lua -- RFC 8935 push delivery of Security Event Tokens (SETs, RFC 8417), on the
-- public relaybus API only. Any number of instances may run on one store.
--
--   build/relaybus run examples/set_push.lua --receiver URL [--store URL] [--table NAME]
--       [--streams N | --stream NAME ...] [--enqueue M] [--until-done] [--quiet]
--       [--lease S] [--timeout S] [--tries N] [--idle S] [--poll S] [--max-hold S] [--backoff S]
--
-- Demo against the specs' receiver (it answers 202 and logs every SET; GET /pushes shows it):
--   make && make examples
--   build/http_receiver - &                 # prints "PORT PID"
--   build/relaybus run examples/set_push.lua --store sqlite:push.db \
--       --receiver 'http://127.0.0.1:PORT/push/{stream}' --streams 3 --enqueue 20 --until-done
--
-- THE QUEUE. Each stream has its own topic, "set.push.<stream>", and a SET is a delivery with
-- payload {stream=, seq=, jti=, set=<the compact JWT>}. `seq` is the SET's position in its
-- stream: integers that grow in enqueue order (the producer's counter for the stream). The
-- streams are configuration (--streams / --stream), as RFC 8935 streams are: each has its own
-- push endpoint, the --receiver URL with "{stream}" replaced by the stream's name.
--
-- A SET is POSTed with Content-Type: application/secevent+jwt and Accept: application/json.
--   2xx (RFC 8935 says 202 Accepted)        the receipt: the delivery completes
--   400 and other 4xx ({err=, description=}) a permanent refusal: buried with the error
--   408, 429, 5xx, network failures         retried: a few times in place (no sooner than a
--                                            Retry-After), then by the dispatcher's backoff
--
-- THE DESIGN, and why. Two guarantees are wanted: one stream is never pushed by two instances
-- at once (and keeps its order), and a SET is not transmitted again unless an earlier
-- transmission may have failed.
--
-- * A dispatcher per stream, run only by the holder of the stream's named lease. Each instance
--   runs, per stream, a watcher task: when the stream has work it tries
--   store:try_acquire("set-push:" .. stream, lease); the instance that gets it starts a
--   dispatcher handling only that stream's topic, with concurrency 1, extends the lease every
--   sixth of its duration, and when the stream has been idle for --idle seconds (or the lease
--   is lost, or the instance stops, or --max-hold seconds have passed: a busy stream is then
--   handed to another instance) stops that dispatcher and releases the lease. Instances
--   without the lease do not claim the stream's SETs at all.
--   The alternative -- one shared handler that takes the stream's lease per delivery and
--   ctx:release(delay)s when another instance holds it -- is as safe but not as good: every
--   instance keeps claiming every stream's SETs, the loser puts them back with a delay, and the
--   holder then finds its next SET delayed (a ping-pong that costs latency and round trips).
--   A d:every pusher cannot settle deliveries at all: only a handler's ctx can.
-- * The lease bounds every transmission. The handler POSTs only while the stream lease has time
--   left, and its HTTP timeout ends before the lease's deadline (which itself ends before the
--   store's expiry). So even a holder that stalls or loses its lease has finished (or cut) its
--   transfer before another instance can acquire the stream: pushes never overlap.
-- * Stream order. Concurrency 1 runs one SET of the stream at a time; transient failures are
--   retried in place first, so the SET keeps its place; and before a POST the handler checks
--   that no earlier SET of its stream (smaller seq) is still pending or processing (one being
--   retried after backoff, or left processing by a holder that crashed). If one is, it is not
--   this SET's turn: ctx:release(until that one is due). Buried SETs do not block the stream.
--   This check keeps the order; it is not what keeps pushes apart (two list reads can miss a
--   SET moving between pending and processing): the named lease is.
-- * No retransmission without a possible failure. Each SET is POSTed once per try; a new try
--   (or a new claim) happens only after a failure answer, a network error or timeout, or an
--   abort that cut the transfer -- all cases where the receiver may not have it. The delivery's
--   own lease and fencing (relaybus's dispatcher) keep one run of a SET at a time.
local relaybus = require "relaybus"
local http, json = relaybus.http, relaybus.json

-- ---- options ---------------------------------------------------------------------------------
local function usage(msg)
  io.stderr:write("set_push: ", msg, "\nusage: relaybus run examples/set_push.lua --receiver URL",
    " [--store URL] [--table NAME] [--streams N | --stream NAME ...] [--enqueue M]",
    " [--until-done] [--quiet] [--lease S] [--timeout S] [--tries N] [--idle S] [--poll S]",
    " [--max-hold S] [--backoff S]\n")
  os.exit(2)
end

local cfg = {
  store = os.getenv("RELAYBUS_STORE") or "sqlite:relaybus.db",
  table = os.getenv("RELAYBUS_TABLE"),
  streams = {},
  enqueue = 0,
  lease = 10,     -- s: the stream lease
  timeout = 5,    -- s: one POST at most
  tries = 3,      -- POSTs per claim before the dispatcher's backoff takes over
  idle = 2,       -- s without work before a holder lets the stream go
  poll = 0.2,     -- s: how often idle instances look for work
  max_hold = nil, -- s: let a busy stream go after this long, so instances share the streams
  backoff = 0.5,  -- s: the dispatcher's retry delay is backoff * 2^attempts (at most 300)
}
local args = table.pack(...)
local i = 1
local function value(name)
  i = i + 1
  local v = args[i]
  if v == nil then usage(name .. " needs a value") end
  return v
end
local function number(name)
  local v = tonumber(value(name))
  if not v or v <= 0 then usage(name .. " needs a number > 0") end
  return v
end
while i <= args.n do
  local a = args[i]
  if a == "--store" then cfg.store = value(a)
  elseif a == "--table" then cfg.table = value(a)
  elseif a == "--receiver" then cfg.receiver = value(a)
  elseif a == "--stream" then cfg.streams[#cfg.streams + 1] = value(a)
  elseif a == "--streams" then
    for n = 1, math.floor(number(a)) do cfg.streams[#cfg.streams + 1] = "stream-" .. n end
  elseif a == "--enqueue" then cfg.enqueue = math.floor(tonumber(value(a)) or usage("--enqueue needs a number"))
  elseif a == "--until-done" then cfg.until_done = true
  elseif a == "--quiet" then cfg.quiet = true
  elseif a == "--lease" then cfg.lease = number(a)
  elseif a == "--timeout" then cfg.timeout = number(a)
  elseif a == "--tries" then cfg.tries = math.floor(number(a))
  elseif a == "--idle" then cfg.idle = number(a)
  elseif a == "--poll" then cfg.poll = number(a)
  elseif a == "--max-hold" then cfg.max_hold = number(a)
  elseif a == "--backoff" then cfg.backoff = number(a)
  else usage("unknown argument " .. tostring(a)) end
  i = i + 1
end
if not cfg.receiver then usage("--receiver URL is required") end
if #cfg.streams == 0 then cfg.streams = { "stream-1" } end
-- a POST must fit well inside one lease
if cfg.timeout > cfg.lease / 2 then usage("--timeout must be at most half of --lease") end

local function say(fmt, ...)
  if not cfg.quiet then io.stdout:write(string.format(fmt, ...), "\n"); io.stdout:flush() end
end

local store = assert(relaybus.open(cfg.store, { table = cfg.table }))
math.randomseed(os.time() ~ math.floor(relaybus.now() * 1e6))

local function topic_of(stream) return "set.push." .. stream end
local function endpoint(stream) return (cfg.receiver:gsub("{stream}", stream)) end

-- ---- demo SETs -----------------------------------------------------------------------------
local B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
local function b64url(s)
  local out = {}
  for p = 1, #s, 3 do
    local a, b, c = s:byte(p, p + 2)
    local n = (a << 16) | ((b or 0) << 8) | (c or 0)
    local k = c and 4 or b and 3 or 2
    for j = 1, k do
      local idx = (n >> (18 - 6 * (j - 1))) & 63
      out[#out + 1] = B64:sub(idx + 1, idx + 1)
    end
  end
  return table.concat(out)
end

-- An unsecured SET (RFC 8417; alg "none": a real transmitter signs it).
local function demo_set(stream, jti)
  local header = json.encode { typ = "secevent+jwt", alg = "none" }
  local claims = json.encode {
    iss = "https://transmitter.example", aud = "https://receiver.example/" .. stream,
    iat = math.floor(relaybus.time()), jti = jti,
    events = { ["https://schemas.openid.net/secevent/risc/event-type/account-disabled"] =
      { subject = { format = "email", email = jti .. "@example.com" } } },
  }
  return b64url(header) .. "." .. b64url(claims) .. "."
end

if cfg.enqueue > 0 then
  -- the demo's stream counter: milliseconds * 1000, so later runs continue the order
  local base = math.floor(relaybus.time() * 1000) * 1000
  for _, stream in ipairs(cfg.streams) do
    local batch = {}
    for n = 1, cfg.enqueue do
      local jti = string.format("%s-%d-%d", stream, base // 1000, n)
      batch[n] = { topic_of(stream), { stream = stream, seq = base + n, jti = jti,
                                       set = demo_set(stream, jti) } }
    end
    assert(store:enqueue_many(batch))
  end
  say("enqueued %d SETs on each of %d streams", cfg.enqueue, #cfg.streams)
end

-- ---- the stream's state in the store ---------------------------------------------------------
-- Does the stream have SETs that are not settled (pending, even if not yet due, or processing)?
local function has_work(topic)
  for _, status in ipairs { "processing", "pending" } do
    local recs, err = store:list { status = status, topic = topic, limit = 1 }
    if not recs then return nil, err end
    if #recs > 0 then return true end
  end
  return false
end

-- When an earlier SET of the stream (smaller seq) is unsettled: seconds to wait before this
-- one's turn may have come. nil when it is this SET's turn.
local function earlier_unsettled(topic, seq, id)
  local now = relaybus.time()
  for _, status in ipairs { "processing", "pending" } do
    -- list is oldest first and seq grows in enqueue order, so the first pending one should be
    -- the head; but PostgreSQL's list currently orders ids as text ("10" < "9"), so a window
    -- of the stream's backlog is scanned instead (a backlog beyond it is checked in part)
    local recs = assert(store:list { status = status, topic = topic,
                                     limit = status == "pending" and 1000 or 100 })
    for _, r in ipairs(recs) do
      if r.id ~= id and type(r.payload) == "table" and tonumber(r.payload.seq)
         and r.payload.seq < seq then
        local at = status == "pending" and r.run_at or r.lease_expires_at or now
        return math.min(math.max(at - now, 0.05), 5)
      end
    end
  end
end

-- ---- pushing -----------------------------------------------------------------------------------
local MARGIN, MIN_POST = 0.2, 0.5   -- s kept free before the lease's deadline; shortest POST
local counts = { pushes = 0, accepted = 0, refused = 0, failed = 0 }

local function retryable(status) return status == 408 or status == 429 or status >= 500 end

local function describe(res, err)
  if not res then return "network: " .. tostring(err) end
  local ok, body = pcall(json.decode, res.body or "")
  if ok and type(body) == "table" and body.err then
    return string.format("HTTP %d %s: %s", res.status, tostring(body.err), tostring(body.description or ""))
  end
  return string.format("HTTP %d: %s", res.status, (res.body or ""):sub(1, 200))
end

local function retry_after(res)
  local v = res and res.headers and tonumber(res.headers["retry-after"])
  return v and math.min(v, 60)
end

-- The handler of one stream's topic, for as long as `holding.h` (the stream lease) is held.
local function push_handler(stream, holding)
  local topic, url = topic_of(stream), endpoint(stream)
  return function(delivery, ctx)
    local p = delivery.payload
    if type(p) ~= "table" or type(p.set) ~= "string" or not tonumber(p.seq) then
      return ctx:bury("malformed SET delivery: payload needs set (string) and seq (number)")
    end
    local wait = earlier_unsettled(topic, p.seq, delivery.id)
    if wait then return ctx:release(wait) end     -- not its turn: keep the stream's order
    local last
    for try = 1, cfg.tries do
      local left = holding.h.deadline - relaybus.now() - MARGIN
      if holding.lost or left < MIN_POST then return ctx:release(0.1) end
      counts.pushes = counts.pushes + 1
      local res, err = http.request {
        method = "POST", url = url, body = p.set, timeout = math.min(cfg.timeout, left),
        headers = { ["Content-Type"] = "application/secevent+jwt", ["Accept"] = "application/json" },
      }
      if not res and err == "aborted" then return end   -- the run's abort decides the outcome
      if res and res.status >= 200 and res.status < 300 then
        counts.accepted = counts.accepted + 1
        return                                          -- the receipt: completed
      end
      if res and not retryable(res.status) then
        counts.refused = counts.refused + 1
        say("%s: SET %s refused: %s", stream, tostring(p.jti), describe(res))
        return ctx:bury(describe(res))
      end
      counts.failed = counts.failed + 1
      last = describe(res, err)
      if try < cfg.tries then
        local _, aborted = ctx:sleep(retry_after(res) or 0.05 * 2 ^ try)
        if aborted then return end
      end
    end
    error(last, 0)   -- pending again after the dispatcher's backoff; buried at max_attempts
  end
end

-- ---- holding streams ---------------------------------------------------------------------------
local control = relaybus.dispatcher(store, {})   -- no topics: keeps the loop, and retention
local finishing = false
local held = {}   -- stream -> lease handle, while held
local function stopping()
  local st = control:stats()
  return finishing or st.stopping or not st.running
end

local function hold(stream, h)
  local topic = topic_of(stream)
  local holding = { h = h, lost = false }
  held[stream] = h
  say("%s: pushing (lease %s) at %.6f", stream, h.name, relaybus.now())
  local d = relaybus.dispatcher(store, {
    concurrency = 1, lease_duration = cfg.lease, poll_interval = cfg.poll, retention = 0,
    shutdown_timeout = cfg.timeout + 1,
    backoff = function(attempts) return math.min(cfg.backoff * 2 ^ attempts, 300) end,
  })
  d:handle(topic, push_handler(stream, holding))
  d:start()
  local idle_since, since, handed = nil, relaybus.now(), false
  while true do
    relaybus.sleep(math.min(cfg.lease / 6, cfg.poll))
    if stopping() or d:stats().stopping then break end
    if h.deadline - relaybus.now() < cfg.lease * 5 / 6 then
      local ok, err = h:extend()
      if not ok then
        holding.lost = true
        say("%s: lease lost (%s)", stream, tostring(err))
        break
      end
    end
    if has_work(topic) ~= false then
      idle_since = nil
    else
      idle_since = idle_since or relaybus.now()
      if relaybus.now() - idle_since >= cfg.idle then break end
    end
    if cfg.max_hold and relaybus.now() - since >= cfg.max_hold then handed = true break end
  end
  holding.lost = true   -- no new POST from here on
  d:stop { timeout = cfg.timeout + 1 }
  local t_end = relaybus.now()   -- no POST of this holding after this
  held[stream] = nil
  h:release()
  say("%s: let go at %.6f", stream, t_end)
  return handed
end

local watchers = 0
local function watch(stream)
  watchers = watchers + 1
  local topic = topic_of(stream)
  local handed = false
  while not stopping() do
    if has_work(topic) then
      local h, err = store:try_acquire("set-push:" .. stream, cfg.lease)
      -- after handing a busy stream over, give the other instances the first chance
      if h then handed = hold(stream, h)
      elseif err then say("%s: try_acquire: %s", stream, err) end
    end
    if not stopping() then relaybus.sleep(cfg.poll * (handed and 3 or 0.5 + math.random())) end
    handed = false
  end
  watchers = watchers - 1
end

control:start()
for _, stream in ipairs(cfg.streams) do relaybus.spawn(watch, stream) end

if cfg.until_done then
  -- ends when no stream has work (twice in a row), letting every watcher finish first
  relaybus.spawn(function()
    local quiet = 0
    while not stopping() do
      relaybus.sleep(cfg.poll)
      local work = false
      for _, stream in ipairs(cfg.streams) do
        if has_work(topic_of(stream)) ~= false then work = true break end
      end
      quiet = work and 0 or quiet + 1
      if quiet >= 2 then finishing = true end
    end
    while watchers > 0 do relaybus.sleep(0.02) end
    control:stop()
  end)
end

relaybus.run()   -- until the control dispatcher stops (--until-done, SIGINT, SIGTERM)

for _, h in pairs(held) do h:release() end   -- a signal's stop may leave some held
local st = store:stats()
say("this instance: %d POSTs, %d accepted, %d refused, %d failed; store: %d pending, %d completed, %d buried",
  counts.pushes, counts.accepted, counts.refused, counts.failed,
  st and st.pending or -1, st and st.completed or -1, st and st.buried or -1)
store:close()
