-- harness.lua -- running dispatchers inside a spec: fast defaults, a loop run that always ends
-- (a guard stops every dispatcher of the test after a limit, so a broken build fails a test
-- instead of hanging the suite), and a stopper a handler can call without waiting for itself.
local S = require "spec.support.stores"
local relaybus = S.relaybus()

local H = {}

-- Short leases and polls so the suite is fast; a backoff of 0 unless a spec says otherwise.
H.defaults = {
  lease_duration = 3,
  shutdown_timeout = 2,
  concurrency = 8,
  poll_interval = 0.05,
  backoff = function() return 0 end,
}

function H.dispatcher(store, opts)
  local o = {}
  for k, v in pairs(H.defaults) do o[k] = v end
  for k, v in pairs(opts or {}) do o[k] = v end
  return relaybus.dispatcher(store, o)
end

-- Returns stop(timeout): the first call stops `d` from a new task (a handler must not wait for
-- its own end); later calls do nothing. stop.elapsed is the stop's duration once it returned.
function H.stopper(d, default_timeout)
  local st = { called = false }
  setmetatable(st, { __call = function(self, timeout)
    if self.called then return end
    self.called = true
    relaybus.spawn(function()
      local t0 = relaybus.now()
      d:stop { timeout = timeout or default_timeout or 2 }
      self.elapsed = relaybus.now() - t0
    end)
  end })
  return st
end

-- Starts the dispatchers and runs the loop until they have all stopped, or until `limit` s
-- passed (then the guard stops them and the result is false). Returns ok, elapsed.
function H.run(ds, limit)
  if ds.start then ds = { ds } end
  for _, d in ipairs(ds) do d:start() end
  local done, timed_out = false, false
  local t0 = relaybus.now()
  relaybus.spawn(function()
    while not done and relaybus.now() - t0 < (limit or 10) do relaybus.sleep(0.05) end
    if not done then
      timed_out = true
      for _, d in ipairs(ds) do d:stop { timeout = 1 } end
    end
  end)
  relaybus.run()
  done = true
  return not timed_out, relaybus.now() - t0
end

-- Inside a relaybus coroutine: polls `cond` every 20 ms until true (returned) or `limit` s.
function H.poll(cond, limit)
  local t0 = relaybus.now()
  while relaybus.now() - t0 < (limit or 5) do
    local v = cond()
    if v then return v end
    relaybus.sleep(0.02)
  end
  return nil
end

-- In a spec: the counts of a store, summed.
-- Enqueues n deliveries of topic, payloads { i = 1.. n }, in one enqueue_many.
function H.fill(store, topic, n)
  local batch = {}
  for i = 1, n do batch[i] = { topic, { i = i } } end
  return assert(store:enqueue_many(batch))
end

function H.total(store)
  local st = assert(store:stats())
  return st.pending + st.processing + st.completed + st.buried, st
end

-- Is `x` within `tol` of `want`? (numbers; a readable failure message)
function H.near(want, x, tol, what)
  assert(type(x) == "number", (what or "value") .. " is not a number: " .. tostring(x))
  assert(math.abs(x - want) <= tol, string.format("%s: expected %.3f +- %.3f, got %.3f",
    what or "value", want, tol, x))
  return true
end

-- Are `want` and `got` the same value exactly: the same types, integers as integers, floats
-- to the last bit (-0.0 is not 0.0), tables key by key (raw)? Returns true, or false and where
-- they differ. assert.same cannot tell 1 from 1.0 or 0.0 from -0.0.
function H.exactly(want, got, path)
  path = path or "value"
  if type(want) ~= type(got) then
    return false, string.format("%s: %s expected, got %s", path, type(want), type(got))
  end
  if type(want) == "number" then
    if math.type(want) ~= math.type(got) then
      return false, string.format("%s: %s %s expected, got %s %s", path, math.type(want),
        tostring(want), math.type(got), tostring(got))
    end
    if string.pack("<n", want) ~= string.pack("<n", got) then
      return false, string.format("%s: %.17g expected, got %.17g", path, want, got)
    end
    return true
  end
  if type(want) ~= "table" then
    if rawequal(want, got) then return true end
    return false, string.format("%s: %q expected, got %q", path, tostring(want), tostring(got))
  end
  for k, v in next, want do
    local ok, why = H.exactly(v, rawget(got, k), path .. "[" .. string.format("%q", k) .. "]")
    if not ok then return false, why end
  end
  for k in next, got do
    if rawget(want, k) == nil then return false, path .. ": unexpected key " .. tostring(k) end
  end
  return true
end

function H.assert_exactly(want, got, what)
  local ok, why = H.exactly(want, got, what)
  require("luassert").is_true(ok, why)
  return true
end

-- One line of text, not empty: how every error message must look.
function H.one_line(err, what)
  assert(type(err) == "string", (what or "error") .. " is not a string: " .. tostring(err))
  assert(#err > 0, (what or "error") .. " is empty")
  assert(not err:find("\n"), (what or "error") .. " has more than one line: " .. err)
  return true
end

-- MongoDB transactions need a replica set: probes the server once (RELAYBUS_TEST_MONGO_RS=1/0
-- overrides). An error that does not mention replica sets counts as "yes", so the full specs
-- run and show it.
local mongo_rs
function H.mongo_replica_set(store)
  if mongo_rs == nil then
    local forced = os.getenv("RELAYBUS_TEST_MONGO_RS")
    local url = os.getenv("RELAYBUS_TEST_MONGO") or ""
    if forced == "1" or forced == "0" then
      mongo_rs = forced == "1"
    elseif url:find("replicaSet=", 1, true) then
      mongo_rs = true
    else
      local ok, err = store:transaction(function() return 1 end)
      mongo_rs = ok and true or not tostring(err):lower():find("replica", 1, true)
    end
  end
  return mongo_rs
end

-- Whether the matrix entry's MongoDB runs transactions (H.mongo_replica_set); false for an
-- entry whose server is unavailable, true for one that cannot be opened (the specs then run
-- and fail instead of hiding it).
function H.mongo_rs(entry)
  if entry.unavailable then return false end
  local store = relaybus.open(entry.url())
  if not store then return true end
  local rs = H.mongo_replica_set(store)
  store:close()
  return rs
end

-- (luassert here: a support module does not get the spec files' assert)
local la = require "luassert"

-- Kills busy workers while a backlog drains: every `gap` s or so (jittered), one of the
-- worker slots o.busy(slot) says has runs in flight is SIGKILLed, its slot's ended_at set once
-- it is gone, and o.restart(slot) starts a new one there; while o.more(kills, ...) wants more
-- kills and under 90 % of the n deliveries are completed. A worker that exits by itself fails
-- the spec. Ends when all n are completed or after o.limit s (default 150); returns the
-- completed count and the kills (and o.on_kill(slot) may count what a kill cut).
function H.chaos(store, n, slots, o)
  local t0 = relaybus.now()
  local kills, done = 0, 0
  math.randomseed(os.time())
  local gap = o.gap or 0.3
  local next_kill = relaybus.now() + gap
  while relaybus.now() - t0 < (o.limit or 150) do
    S.sleep(o.poll or 0.1)
    done = la(store:stats()).completed
    if done == n then break end
    local busy = {}
    for slot = 1, #slots do
      if o.busy(slots[slot]) then busy[#busy + 1] = slot end
    end
    if o.more(kills) and done < n * 0.9 and #busy > 0 and relaybus.now() >= next_kill then
      next_kill = relaybus.now() + gap + math.random() * 3 * gap
      local slot = busy[math.random(1, #busy)]
      S.kill(slots[slot].proc)
      slots[slot].ended_at = relaybus.now()   -- the process is gone: no run of it goes past this
      kills = kills + 1
      if o.on_kill then o.on_kill(slots[slot]) end
      o.restart(slot)
    end
    for slot = 1, #slots do
      local rc = S.rc(slots[slot].proc)
      la.is_nil(rc, "worker " .. slot .. " exited by itself (" .. tostring(rc) .. "): "
        .. (S.read(slots[slot].proc.err) or ""))
    end
  end
  return done, kills
end

-- After H.chaos: all n deliveries completed, none left or buried, and a kill happened.
function H.drained_through_kills(store, n, t0, kills)
  local st = la(store:stats())
  la.equal(n, st.completed, string.format("completed %d of %d after %.0f s (%d kills)",
    st.completed, n, relaybus.now() - t0, kills))
  la.equal(0, st.pending + st.processing + st.buried)
  la.is_true(kills >= 1, "no worker was killed: the drain finished too fast to test")
end

-- Misuse raises an error that starts with "relaybus:"; returns the message.
function H.raises_relaybus(fn, ...)
  local ok, err = pcall(fn, ...)
  la.is_false(ok, "no error was raised")
  la.is_string(err)
  la.truthy(err:match("^relaybus:"), "the error does not start with relaybus: " .. err)
  H.one_line(err)
  return err
end

-- Refused either way the contract allows for a bad argument: a raise starting with
-- relaybus:, or nil, err. Returns the message.
function H.refused(fn, ...)
  local ok, res, err = pcall(fn, ...)
  if not ok then
    la.truthy(tostring(res):match("^relaybus:"), "raised without relaybus: " .. tostring(res))
    H.one_line(res)
    return res
  end
  la.is_nil(res, "accepted")
  H.one_line(err)
  return err
end

return H
