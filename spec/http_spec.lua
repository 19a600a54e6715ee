-- http_spec.lua -- relaybus.http.request and relaybus.webhook against a real HTTP server on
-- loopback (spec/support/http_receiver.c, started once for this file): answers, every retry
-- class, Retry-After, burial, timeouts, refusals, body limits, aborts and stops cutting transfers.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local relaybus = S.relaybus()
local http = relaybus.http
local json = relaybus.json

local REFUSED = "http://127.0.0.1:1/"   -- a privileged port nothing listens on

-- ---- the receiver ----------------------------------------------------------------------------
local receiver = {}

local function receiver_binary()
  local bin = S.build .. "/http_receiver"
  if not S.exists(bin) then
    -- built by `make`; compiled here too so the spec also runs on a bare build directory
    local ok = os.execute("cc -std=c11 -O2 -o " .. S.quote(bin) ..
                          " spec/support/http_receiver.c -lev")
    assert(ok, "cannot build " .. bin)
  end
  return bin
end

local function start_receiver()
  receiver.proc = assert(io.popen("exec " .. S.quote(receiver_binary()) .. " -"))
  local line = receiver.proc:read("l") or ""
  local port, pid = line:match("^(%d+) (%d+)$")
  assert(port, "the receiver printed no port: " .. line)
  receiver.port, receiver.pid = tonumber(port), tonumber(pid)
  receiver.base = "http://127.0.0.1:" .. port
end

local function stop_receiver()
  if receiver.pid then os.execute("kill " .. receiver.pid) end
  if receiver.proc then receiver.proc:close() end
  receiver = {}
end

local function url(path) return receiver.base .. path end

local function get_json(path)
  local res, err = http.request { url = url(path) }
  assert(res, err)
  assert.are.equal(200, res.status)
  return json.decode(res.body)
end

-- Waits until the receiver has seen every hanging request's connection closed: the proof that
-- a transfer was cut rather than left open. Returns the number still open.
local function hangs_left(limit)
  local left
  H.poll(function()
    left = get_json("/stats").hangs_open
    return left == 0
  end, limit or 3)
  return left
end

-- ---- running deliveries --------------------------------------------------------------------
local function open_store()
  return (S.open(S.list()[1]))
end

-- Enqueues one delivery of topic "hook", runs `handler` on it until its first attempt has
-- settled, stops, and returns the record and the epoch time at the end.
local function deliver(handler, o)
  o = o or {}
  local store = open_store()
  -- a failed run waits a minute before its retry, so the first attempt's outcome stays visible
  local d = H.dispatcher(store, o.dispatcher or { backoff = function() return 60 end })
  d:handle("hook", handler, o.handle)
  local id = assert(store:enqueue("hook", o.payload or { n = 1 }, o.enqueue))
  local stop = H.stopper(d)
  relaybus.spawn(function()
    H.poll(function()
      local r = store:get(id)
      return r and r.attempts >= 1 and r.status ~= "processing"
    end, o.limit or 10)
    stop(o.stop_timeout)
  end)
  assert.is_true((H.run(d, 20)))
  local rec = store:get(id)
  local now = relaybus.time()
  store:close()
  return rec, now
end

local function misuse(fn, ...)
  local ok, err = pcall(fn, ...)
  assert.is_false(ok)
  assert.are.equal("relaybus: ", tostring(err):sub(1, 10), "not a relaybus: error: " .. tostring(err))
end

setup(start_receiver)
teardown(function()
  stop_receiver()
  S.cleanup()
end)

-- ---- relaybus.http.request -----------------------------------------------------------------
describe("relaybus.http.request", function()
  it("returns the status, lower-cased headers and the body", function()
    local res, err = http.request {
      method = "PUT", url = url("/echo"), body = "hello",
      headers = { ["X-Test"] = "1", ["Content-Type"] = "text/plain" },
    }
    assert.is_nil(err)
    assert.are.equal(200, res.status)
    assert.are.equal("application/json", res.headers["content-type"])
    local echoed = json.decode(res.body)
    assert.are.equal("PUT", echoed.method)
    assert.are.equal("hello", echoed.body)
    assert.are.equal("1", echoed.headers["x-test"])
    assert.are.equal("text/plain", echoed.headers["content-type"])
  end)

  it("returns non-2xx answers as responses, not errors", function()
    local res = assert(http.request { url = url("/status/503") })
    assert.are.equal(503, res.status)
    assert.are.equal("status", res.body)
  end)

  it("joins a repeated response header with a comma", function()
    local res = assert(http.request { url = url("/repeat") })
    assert.are.equal("a, b", res.headers["x-multi"])
  end)

  it("reuses one connection for sequential requests", function()
    local before = get_json("/stats").connections
    for _ = 1, 5 do assert.are.equal(204, assert(http.request { url = url("/status/204") }).status) end
    assert.are.equal(before, get_json("/stats").connections)
  end)

  it("does not follow redirects unless asked", function()
    local res = assert(http.request { url = url("/redirect/201") })
    assert.are.equal(302, res.status)
    res = assert(http.request { url = url("/redirect/201"), follow_redirects = true })
    assert.are.equal(201, res.status)
  end)

  it("fails with 'connection refused' when nothing listens", function()
    local res, err = http.request { url = REFUSED }
    assert.is_nil(res)
    assert.are.equal("connection refused", err)
  end)

  it("times out on a receiver that accepts and never answers", function()
    local t0 = relaybus.now()
    local res, err = http.request { url = url("/hang"), timeout = 0.3 }
    local elapsed = relaybus.now() - t0
    assert.is_nil(res)
    assert.are.equal("timed out after 0.3 s", err)
    assert.is_true(elapsed >= 0.25 and elapsed < 2, "elapsed " .. elapsed)
    assert.are.equal(0, hangs_left())
  end)

  it("ends with an error, not a crash, when the body exceeds max_body", function()
    local res, err = http.request { url = url("/big/100000"), max_body = 1000 }
    assert.is_nil(res)
    assert.are.equal("response body exceeds 1000 bytes", err)
    res = assert(http.request { url = url("/big/1000"), max_body = 1000 })
    assert.are.equal(1000, #res.body)
    res = assert(http.request { url = url("/big/3000000") })
    assert.are.equal(3000000, #res.body)
  end)

  it("returns nil, err for a URL it cannot use", function()
    local res, err = http.request { url = "ftp://127.0.0.1/" }
    assert.is_nil(res)
    H.one_line(err)
    res, err = http.request { url = "not a url" }
    assert.is_nil(res)
    H.one_line(err)
  end)

  it("raises relaybus: errors on misuse", function()
    misuse(http.request)
    misuse(http.request, "http://x/")
    misuse(http.request, {})
    misuse(http.request, { url = 1 })
    misuse(http.request, { url = url("/status/200"), nope = true })
    misuse(http.request, { url = url("/status/200"), timeout = "1" })
    misuse(http.request, { url = url("/status/200"), headers = { a = "x\r\nb: y" } })
    misuse(http.request, { url = url("/status/200"), max_body = -1 })
  end)

  it("yields inside a task, so requests run concurrently", function()
    local done = 0
    local t0 = relaybus.now()
    for _ = 1, 4 do
      relaybus.spawn(function()
        local res = http.request { url = url("/slow/300") }
        if res and res.status == 200 then done = done + 1 end
      end)
    end
    relaybus.run()
    assert.are.equal(4, done)
    assert.is_true(relaybus.now() - t0 < 1.0, "the requests ran one after another")
  end)

  it("computes HMAC-SHA256 as hex", function()
    assert.are.equal("f7bc83f430538424b13298e6aa6fb143ef4d59a14946175997479dbc2d1a3cd8",
      http.hmac_sha256("key", "The quick brown fox jumps over the lazy dog"))
  end)
end)

-- ---- relaybus.webhook ------------------------------------------------------------------------
describe("relaybus.webhook", function()
  it("completes on 2xx, posting the payload as JSON with id, topic, attempt and signature", function()
    local payload = { order = 42, items = { "a", "b" } }
    local rec = deliver(relaybus.webhook { url = url("/echo"), secret = "s3cret",
                                           headers = { ["X-Custom"] = "yes" } },
                        { payload = payload })
    assert.are.equal("completed", rec.status)
    local seen = get_json("/last")
    assert.are.same(payload, json.decode(seen.body))
    assert.are.equal("POST", seen.method)
    assert.are.equal("application/json", seen.headers["content-type"])
    assert.are.equal(rec.id, seen.headers["x-relaybus-id"])
    assert.are.equal("hook", seen.headers["x-relaybus-topic"])
    assert.are.equal("1", seen.headers["x-relaybus-attempt"])
    assert.are.equal("yes", seen.headers["x-custom"])
    assert.are.equal("sha256=" .. http.hmac_sha256("s3cret", seen.body),
                     seen.headers["x-relaybus-signature"])
  end)

  it("delivers each of several deliveries exactly once when the receiver answers 2xx", function()
    local store = open_store()
    local d = H.dispatcher(store)
    d:handle("hook", relaybus.webhook { url = url("/count") })
    local ids = {}
    for i = 1, 5 do ids[i] = assert(store:enqueue("hook", { i = i })) end
    local stop = H.stopper(d)
    relaybus.spawn(function()
      H.poll(function() return assert(store:stats()).completed == 5 end, 10)
      stop()
    end)
    assert.is_true((H.run(d, 20)))
    local counts = get_json("/counts")
    for _, id in ipairs(ids) do
      assert.are.equal("completed", store:get(id).status)
      assert.are.equal(1, counts[id])
    end
    store:close()
  end)

  for _, status in ipairs { 408, 429, 503 } do
    it("retries with backoff on HTTP " .. status, function()
      local rec, now = deliver(relaybus.webhook { url = url("/status/" .. status) })
      assert.are.equal("pending", rec.status)
      assert.are.equal(1, rec.attempts)
      assert.are.equal("HTTP " .. status .. ": status", rec.last_error)
      -- the default backoff after attempt 1 is 2 s
      assert.is_true(rec.run_at - now > 1, "run_at is only " .. (rec.run_at - now) .. " s away")
      assert.is_true(rec.run_at - now <= 2.5, "run_at is " .. (rec.run_at - now) .. " s away")
    end)
  end

  it("retries with backoff when the connection is refused", function()
    local rec, now = deliver(relaybus.webhook { url = REFUSED })
    assert.are.equal("pending", rec.status)
    assert.are.equal("connection refused", rec.last_error)
    assert.is_true(rec.run_at - now > 1)
  end)

  it("retries when the receiver never answers, with the timeout as the error", function()
    local rec = deliver(relaybus.webhook { url = url("/hang"), timeout = 0.3 })
    assert.are.equal("pending", rec.status)
    assert.are.equal("timed out after 0.3 s", rec.last_error)
    assert.are.equal(0, hangs_left())
  end)

  it("honours Retry-After when it is later than the backoff", function()
    local rec, now = deliver(relaybus.webhook { url = url("/retry-after/120") })
    assert.are.equal("pending", rec.status)
    assert.are.equal("HTTP 503: busy", rec.last_error)
    H.near(120, rec.run_at - now, 3, "delay")
  end)

  it("keeps the backoff when it is later than Retry-After", function()
    local rec, now = deliver(relaybus.webhook {
      url = url("/retry-after/1"), backoff = function() return 60 end })
    H.near(60, rec.run_at - now, 3, "delay")
  end)

  it("buries on another status, keeping the status and the body's start", function()
    local rec = deliver(relaybus.webhook { url = url("/status/404") })
    assert.are.equal("buried", rec.status)
    assert.are.equal("HTTP 404: status", rec.last_error)
  end)

  it("buries a retryable failure on the last attempt", function()
    local rec = deliver(relaybus.webhook { url = url("/status/500") },
                        { enqueue = { max_attempts = 1 } })
    assert.are.equal("buried", rec.status)
    assert.are.equal("HTTP 500: status", rec.last_error)
  end)

  it("raises relaybus: errors on misuse", function()
    misuse(relaybus.webhook, {})
    misuse(relaybus.webhook, "http://x/")
    misuse(relaybus.webhook, { url = url("/status/200"), nope = 1 })
    misuse(relaybus.webhook, { url = url("/status/200"), timeout = "soon" })
  end)
end)

-- ---- aborts and stops ------------------------------------------------------------------------
describe("HTTP in handlers", function()
  it("cuts the transfer and returns nil, 'aborted' at once when the handler is aborted", function()
    local res, err, elapsed
    local rec = deliver(function()
      local t0 = relaybus.now()
      res, err = http.request { url = url("/hang"), timeout = 30 }
      elapsed = relaybus.now() - t0
    end, { handle = { timeout = 0.3 } })
    assert.is_nil(res)
    assert.are.equal("aborted", err)
    assert.is_true(elapsed < 1, "the handler waited " .. tostring(elapsed) .. " s")
    assert.are.equal("timeout", rec.last_error)
    assert.are.equal(0, hangs_left())
  end)

  it("lets an aborted webhook return promptly without settling", function()
    local t0 = relaybus.now()
    local rec = deliver(relaybus.webhook { url = url("/hang"), timeout = 30 },
                        { handle = { timeout = 0.3 } })
    assert.is_true(relaybus.now() - t0 < 3)
    assert.are.equal("pending", rec.status)
    assert.are.equal("timeout", rec.last_error)
    assert.are.equal(0, hangs_left())
  end)

  it("fails new requests of an aborted handler at once", function()
    local res, err
    deliver(function(_, ctx)
      ctx:sleep(5)
      res, err = http.request { url = url("/status/200") }
    end, { handle = { timeout = 0.2 } })
    assert.is_nil(res)
    assert.are.equal("aborted", err)
  end)

  it("cuts transfers still open when a stop reaches its timeout", function()
    -- The stop can only reach its timeout while a run is unsettled: a second connection holds
    -- SQLite's write lock past the timeout, so the aborted handler's release is not confirmed.
    local store, store_url, store_opts = S.open(S.list()[1])
    local locker = assert(relaybus.open(store_url, store_opts))
    local d = H.dispatcher(store)
    local started, locked, unlocked = false, false, false
    local handler_err, task_res, task_err, task_elapsed
    d:handle("hook", function()
      started = true
      local _, e = http.request { url = url("/hang"), timeout = 30 }
      handler_err = e
    end)
    assert(store:enqueue("hook", {}))
    relaybus.spawn(function()
      H.poll(function() return started end, 10)
      assert(locker:transaction(function(tx)
        tx:exec("CREATE TABLE IF NOT EXISTS spec_lock (x INTEGER)")
        tx:exec("INSERT INTO spec_lock VALUES (1)")
        locked = true
        relaybus.sleep(2.5)
      end))
      unlocked = true
    end)
    relaybus.spawn(function()
      H.poll(function() return locked end, 10)
      local t0 = relaybus.now()
      task_res, task_err = http.request { url = url("/hang"), timeout = 30 }
      task_elapsed = relaybus.now() - t0
    end)
    relaybus.spawn(function()
      H.poll(function() return locked end, 10)
      d:stop { timeout = 1 }
    end)
    assert.is_true((H.run(d, 20)))
    -- the handler was aborted at 4/5 of the timeout: its own transfer ended then
    assert.are.equal("aborted", handler_err)
    -- the task's transfer did not outlive the stop
    assert.is_nil(task_res)
    assert.are.equal("cut by shutdown", task_err)
    assert.is_true(task_elapsed < 2, "the cut came after " .. tostring(task_elapsed) .. " s")
    assert.are.equal(0, hangs_left())
    assert.is_truthy(H.poll(function() return unlocked end, 5))
    locker:close()
    store:close()
  end)
end)
