-- http_spec.lua -- relaybus.http.request and relaybus.webhook against real HTTP servers on
-- loopback (spec/support/http_receiver.c, two started for this file, the second another origin):
-- answers, every retry class, Retry-After, burial, redirects, request smuggling, header
-- parsing, signatures, secrets, timeouts, refusals, body limits, aborts and stops cutting
-- transfers. Each attack on the transport or the webhook is kept here as a spec.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local relaybus = S.relaybus()
local http = relaybus.http
local json = relaybus.json

local REFUSED = "http://127.0.0.1:1/"   -- a privileged port nothing listens on

-- ---- the receivers --------------------------------------------------------------------------
-- Two of them: the second is another origin (another port) for redirects that leave the first.
local receiver, receiver2 = {}, {}

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

local function start_receiver(r)
  r.proc = assert(io.popen("exec " .. S.quote(receiver_binary()) .. " -"))
  local line = r.proc:read("l") or ""
  local port, pid = line:match("^(%d+) (%d+)$")
  assert(port, "the receiver printed no port: " .. line)
  r.port, r.pid = tonumber(port), tonumber(pid)
  r.base = "http://127.0.0.1:" .. port
end

local function stop_receiver(r)
  if r.pid then os.execute("kill " .. r.pid) end
  if r.proc then r.proc:close() end
  for k in pairs(r) do r[k] = nil end
end

local function url(path) return receiver.base .. path end

local function url2(path) return receiver2.base .. path end

-- Percent-encodes a text for a query parameter of /respond.
local function enc(s)
  return (s:gsub("[^%w%-_.~]", function(c) return string.format("%%%02X", c:byte()) end))
end

-- The receiver's /respond: an answer with this status, these raw header lines and body.
local function respond_url(status, header_lines, body, base)
  local q = { "status=" .. status }
  for _, h in ipairs(header_lines or {}) do q[#q + 1] = "h=" .. enc(h) end
  if body then q[#q + 1] = "body=" .. enc(body) end
  return (base or receiver.base) .. "/respond?" .. table.concat(q, "&")
end

-- The receiver's /reflect: an error (400 unless status=) quoting a request header back.
local function reflect_url(params, base)
  local q = {}
  for k, v in pairs(params) do q[#q + 1] = k .. "=" .. v end
  table.sort(q)
  return (base or receiver.base) .. "/reflect?" .. table.concat(q, "&")
end

local function get_json(path, base)
  local res, err = http.request { url = (base or receiver.base) .. path }
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

-- Enqueues one delivery of topic "hook" (or o.topic), runs `handler` on it until its first
-- attempt has settled, stops, and returns the record and the epoch time at the end.
local function deliver(handler, o)
  o = o or {}
  local store = open_store()
  -- a failed run waits a minute before its retry, so the first attempt's outcome stays visible
  local d = H.dispatcher(store, o.dispatcher or { backoff = function() return 60 end })
  d:handle(o.topic or "hook", handler, o.handle)
  local id = assert(store:enqueue(o.topic or "hook", o.payload or { n = 1 }, o.enqueue))
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

-- One attempt of a webhook handler outside a dispatcher, against the real receiver, with a ctx
-- that only records the settle: for the attacks of many cases, where only last_error's text
-- matters. Returns the reason and "buried" or "rescheduled".
local function attempt(hook, delivery)
  local got = {}
  local ctx = {
    bury = function(_, reason) got.reason, got.outcome = reason, "buried"; return true end,
    reschedule = function(_, _, reason) got.reason, got.outcome = reason, "rescheduled"; return true end,
    backoff = function() return 60 end,
  }
  hook(delivery or { id = "7", topic = "hook", attempts = 1, payload = { n = 1 } }, ctx)
  return got.reason, got.outcome
end

-- Fails when text holds the secret or any run of 8 of its bytes (all of it when shorter).
local function assert_hidden(text, secret, what)
  local n = math.min(8, #secret)
  for i = 1, #secret - n + 1 do
    local piece = secret:sub(i, i + n - 1)
    assert.is_nil(text:find(piece, 1, true), (what or "") .. ": '" .. piece .. "' shown in " .. text)
  end
end

-- ---- Standard Webhooks, verified independently ----------------------------------------------
-- Base64 in plain Lua, so a signature is checked without the code that made it; only the HMAC
-- primitive is shared (and checked against its RFC 4231-style vector above).
local B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

local function b64encode(s)
  return (s:gsub("..?.?", function(chunk)
    local a, b, c = chunk:byte(1, 3)
    local n = a * 65536 + (b or 0) * 256 + (c or 0)
    local out = {}
    for i = 1, 4 do
      local k = (n >> (6 * (4 - i))) & 63
      out[i] = B64:sub(k + 1, k + 1)
    end
    if not b then out[3] = "=" end
    if not c then out[4] = "=" end
    return table.concat(out)
  end))
end

local function b64decode(s)
  s = s:gsub("=+$", "")
  local bits, n, out = 0, 0, {}
  for ch in s:gmatch(".") do
    n = n * 64 + (B64:find(ch, 1, true) - 1)
    bits = bits + 6
    if bits >= 8 then
      bits = bits - 8
      out[#out + 1] = string.char((n >> bits) & 255)
      n = n & ((1 << bits) - 1)
    end
  end
  return table.concat(out)
end

-- What a receiver does: the key from the secret, HMAC-SHA256 over id.timestamp.body, the
-- signature among the space-separated "v1,..." entries, and a timestamp no older than 5 min.
local function verify(headers, body, secret, now)
  local key = secret:sub(1, 6) == "whsec_" and b64decode(secret:sub(7)) or secret
  local id, ts = headers["webhook-id"], headers["webhook-timestamp"]
  if not (id and ts and headers["webhook-signature"]) then return false, "missing headers" end
  if math.abs((now or relaybus.time()) - tonumber(ts)) > 300 then return false, "too old" end
  local want = "v1," .. b64encode(http.hmac_sha256(key, id .. "." .. ts .. "." .. body, "raw"))
  for sig in headers["webhook-signature"]:gmatch("%S+") do
    if http.equal(sig, want) then return true end
  end
  return false, "no signature matches"
end

setup(function()
  start_receiver(receiver)
  start_receiver(receiver2)
end)
teardown(function()
  stop_receiver(receiver)
  stop_receiver(receiver2)
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
    assert.are.equal("unsupported scheme: ftp", err)
    res, err = http.request { url = "notaurl" }
    assert.is_nil(res)
    H.one_line(err)
  end)

  it("never shows the password of a URL it cannot use", function()
    local res, err = http.request { url = "https://ada:hunter2@[::1/" }
    assert.is_nil(res)
    assert.are.equal("invalid url: https://ada:***@[::1/", err)
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
    misuse(http.request, { url = url("/status/200"), truncate_body = 1 })
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

  it("computes HMAC-SHA256 as hex, base64 or raw bytes", function()
    local msg = "The quick brown fox jumps over the lazy dog"
    local hex = "f7bc83f430538424b13298e6aa6fb143ef4d59a14946175997479dbc2d1a3cd8"
    assert.are.equal(hex, http.hmac_sha256("key", msg))
    assert.are.equal(hex, http.hmac_sha256("key", msg, "hex"))
    local raw = http.hmac_sha256("key", msg, "raw")
    assert.are.equal(hex, (raw:gsub(".", function(c) return string.format("%02x", c:byte()) end)))
    assert.are.equal(b64encode(raw), http.hmac_sha256("key", msg, "base64"))
    misuse(http.hmac_sha256, "key", msg, "b64")
  end)

  it("encodes and decodes base64, refusing what is not base64", function()
    for _, s in ipairs { "", "f", "fo", "foo", "foob", "fooba", "foobar", "\0\255\1" } do
      assert.are.equal(b64encode(s), http.base64_encode(s))
      assert.are.equal(s, http.base64_decode(http.base64_encode(s)))
    end
    assert.are.equal("foob", http.base64_decode("Zm9vYg"))
    for _, bad in ipairs { "Zm9vYg=", "Zm9v Yg==", "Zm9vY", "Zm9v\nYg==", "Zm9vYg===", "Zm9_", "====" } do
      local v, err = http.base64_decode(bad)
      assert.is_nil(v, bad)
      assert.are.equal("not base64", err)
    end
  end)

  it("compares texts with equal", function()
    assert.is_true(http.equal("v1,abc", "v1,abc"))
    assert.is_false(http.equal("v1,abc", "v1,abd"))
    assert.is_false(http.equal("v1,abc", "v1,ab"))
  end)
end)

-- ---- redirects -------------------------------------------------------------------------------
describe("relaybus.http.request following redirects", function()
  local creds = { ["X-Api-Key"] = "k1", Authorization = "Bearer t1", Cookie = "c=1",
                  ["Proxy-Authorization"] = "Basic p", Accept = "text/plain",
                  ["Content-Type"] = "text/plain", ["User-Agent"] = "ua/1" }

  local function follow(o)
    o.follow_redirects = true
    return assert(http.request(o))
  end

  it("drops every credential but keeps method and body on a 307 to another port", function()
    local res = follow { method = "POST", body = "hello", headers = creds,
                         url = respond_url(307, { "Location: " .. url2("/echo") }) }
    assert.are.equal(200, res.status)
    local seen = json.decode(res.body)
    assert.are.equal("POST", seen.method)
    assert.are.equal("hello", seen.body)
    assert.are.equal("127.0.0.1:" .. receiver2.port, seen.headers.host)
    for _, name in ipairs { "x-api-key", "authorization", "cookie", "proxy-authorization" } do
      assert.is_nil(seen.headers[name], name .. " went to another origin")
    end
    assert.are.equal("text/plain", seen.headers.accept)
    assert.are.equal("text/plain", seen.headers["content-type"])
    assert.are.equal("ua/1", seen.headers["user-agent"])
  end)

  it("keeps the caller's headers, method and body on a 308 within the origin", function()
    local res = follow { method = "PUT", body = "hello", headers = creds,
                         url = respond_url(308, { "Location: /echo" }) }
    local seen = json.decode(res.body)
    assert.are.equal("PUT", seen.method)
    assert.are.equal("hello", seen.body)
    assert.are.equal("k1", seen.headers["x-api-key"])
    assert.are.equal("Bearer t1", seen.headers.authorization)
    assert.are.equal("c=1", seen.headers.cookie)
  end)

  for _, status in ipairs { 301, 302, 303 } do
    it("continues a POST as a GET without body after a " .. status, function()
      local res = follow { method = "POST", body = "hello", headers = { ["Content-Type"] = "text/plain" },
                           url = respond_url(status, { "Location: /echo" }) }
      local seen = json.decode(res.body)
      assert.are.equal("GET", seen.method)
      assert.are.equal("", seen.body)
      assert.is_nil(seen.headers["content-type"])
      assert.is_nil(seen.headers["content-length"])
    end)
  end

  it("keeps a HEAD a HEAD after a 301", function()
    local res = follow { method = "HEAD", url = respond_url(301, { "Location: /status/204" }) }
    assert.are.equal(204, res.status)
  end)

  it("sends the URL's user-info within the origin only", function()
    local with_user = "http://ada:pw1@127.0.0.1:" .. receiver.port
    local seen = json.decode(follow { url = with_user .. "/respond?status=302&h=" ..
                                      enc("Location: /echo") }.body)
    assert.are.equal("Basic " .. b64encode("ada:pw1"), seen.headers.authorization)
    seen = json.decode(follow { url = with_user .. "/respond?status=302&h=" ..
                                enc("Location: " .. url2("/echo")) }.body)
    assert.is_nil(seen.headers.authorization)
  end)

  it("does not send credentials again when the chain comes back to the first origin", function()
    -- first -> second -> first: the second host chose the last URL
    local back = respond_url(302, { "Location: " .. url("/echo") }, nil, receiver2.base)
    local res = follow { headers = { ["X-Api-Key"] = "k1" },
                         url = respond_url(302, { "Location: " .. back }) }
    local seen = json.decode(res.body)
    assert.are.equal("127.0.0.1:" .. receiver.port, seen.headers.host)
    assert.is_nil(seen.headers["x-api-key"])
  end)

  it("follows 10 redirects and fails on the 11th", function()
    assert.are.equal(200, follow { url = url("/chain/10") }.status)
    local res, err = http.request { url = url("/chain/11"), follow_redirects = true }
    assert.is_nil(res)
    assert.are.equal("more than 10 redirects", err)
  end)

  it("fails on a redirect loop instead of going round", function()
    local t0 = relaybus.now()
    local res, err = http.request { url = url("/loop"), follow_redirects = true }
    assert.is_nil(res)
    assert.are.equal("more than 10 redirects", err)
    assert.is_true(relaybus.now() - t0 < 2)
  end)

  it("refuses a redirect to a scheme other than http and https", function()
    for _, target in ipairs { "ftp://127.0.0.1/x", "file:///etc/passwd", "gopher://127.0.0.1/" } do
      local res, err = http.request { url = respond_url(302, { "Location: " .. target }),
                                      follow_redirects = true }
      assert.is_nil(res)
      assert.are.equal("redirect to an unsupported scheme: " .. target:match("^%a+"), err)
    end
  end)

  it("returns a 3xx it does not follow with its Location as an absolute URL", function()
    local res = assert(http.request { url = respond_url(307, { "Location: /elsewhere?a=1" }) })
    assert.are.equal(307, res.status)
    assert.are.equal(url("/elsewhere?a=1"), res.redirect_url)
    assert.are.equal("/elsewhere?a=1", res.headers.location)
    res = assert(http.request { url = respond_url(300, { "Location: /x" }), follow_redirects = true })
    assert.are.equal(300, res.status)
  end)

  it("counts the timeout over the whole chain", function()
    local res, err = http.request { url = respond_url(302, { "Location: /slow/600" }),
                                    follow_redirects = true, timeout = 0.3 }
    assert.is_nil(res)
    assert.are.equal("timed out after 0.3 s", err)
  end)

  it("does not count a followed redirect's body against max_body", function()
    local res = follow { url = respond_url(302, { "Location: /status/200" }, string.rep("r", 5000)),
                         max_body = 100 }
    assert.are.equal(200, res.status)
    assert.are.equal("status", res.body)
  end)
end)

-- ---- what a request may hold -----------------------------------------------------------------
describe("relaybus.http.request refusing request smuggling", function()
  local ok_url = "http://127.0.0.1:1/"

  local function refused(o, pattern)
    local ok, err = pcall(http.request, o)
    assert.is_false(ok)
    err = tostring(err)
    assert.are.equal("relaybus: http.request: ", err:sub(1, 24), err)
    assert.is_truthy(err:find(pattern, 1, true), err)
    H.one_line(err)
  end

  it("refuses a method that is not a token of 1 to 32 characters", function()
    for _, m in ipairs { "", "GET /x HTTP/1.1\r\nX:", "GE T", "GET\0", "P\tUT", "(GET)",
                         string.rep("A", 33) } do
      refused({ url = ok_url, method = m }, "invalid method")
    end
    refused({ url = ok_url, method = "G\r\nX" }, "'G\\x0d\\x0aX'")
  end)

  it("accepts any token as a method", function()
    local res = assert(http.request { url = url("/echo"), method = "M-SEARCH_1.0~!" })
    assert.are.equal("M-SEARCH_1.0~!", json.decode(res.body).method)
    assert.is_truthy(http.request { url = url("/status/200"), method = string.rep("A", 32) })
  end)

  it("refuses header names that are not tokens", function()
    for _, name in ipairs { "", "X Y", "X:Y", "X\r\nY", "X\0", "(X)", "X;" } do
      refused({ url = ok_url, headers = { [name] = "v" } }, "invalid header name")
    end
  end)

  it("refuses header values with CR, LF or NUL", function()
    for _, value in ipairs { "a\r\nX-Injected: 1", "a\nb", "a\rb", "a\0b", "\r\n\r\nGET / HTTP/1.1" } do
      refused({ url = ok_url, headers = { ["X-A"] = value } }, "invalid value of header 'X-A'")
    end
  end)

  it("refuses a Content-Length or Transfer-Encoding of the caller's", function()
    refused({ url = ok_url, body = "x", headers = { ["Content-Length"] = "0" } }, "Content-Length")
    refused({ url = ok_url, headers = { ["transfer-encoding"] = "chunked" } }, "transfer-encoding")
  end)

  it("refuses a URL with control characters or spaces", function()
    for _, u in ipairs { "http://127.0.0.1/a b", "http://127.0.0.1/\r\nX: y", "http://127.0.0.1/\0x",
                         "http://127.0.0.1/\t", " http://127.0.0.1/", "http://127.0.0.1/\127", "" } do
      refused({ url = u }, "invalid url")
    end
  end)

  it("sends tabs and non-ASCII bytes in a header value as they are", function()
    local res = assert(http.request { url = url("/echo"), headers = { ["X-A"] = "a\tb \xff" } })
    -- (the echo is JSON with the bytes as they came: not UTF-8, so no decoder takes it)
    assert.truthy(res.body:find('"x-a":"a\\u0009b \xff"', 1, true), res.body)
  end)
end)

-- ---- what a server sends ---------------------------------------------------------------------
describe("relaybus.http.request reading answers", function()
  it("joins folded header lines, trims values and skips lines with a bad name", function()
    local res = assert(http.request { url = respond_url(200, {
      "X-Fold: a", "   b", "X-CR: a\rb", "Bad Name: x", "X-Trail: v \t", "X-Empty:" }) })
    assert.are.equal("a b", res.headers["x-fold"])
    assert.are.equal("a b", res.headers["x-cr"])
    assert.are.equal("v", res.headers["x-trail"])
    assert.are.equal("", res.headers["x-empty"])
    assert.is_nil(res.headers["bad name"])
  end)

  it("fails with one line on a header line curl will not read", function()
    for _, line in ipairs { "X-Nul: a\0b", "no colon here" } do
      local res, err = http.request { url = respond_url(200, { line }) }
      assert.is_nil(res)
      H.one_line(err)
    end
  end)

  it("stops reading at max_body: a 50 MB body fails at once, or is cut with truncate_body", function()
    local t0 = relaybus.now()
    local res, err = http.request { url = url("/big/52428800"), max_body = 1000 }
    assert.is_nil(res)
    assert.are.equal("response body exceeds 1000 bytes", err)
    res = assert(http.request { url = url("/big/52428800"), max_body = 1000, truncate_body = true })
    assert.are.equal(200, res.status)
    assert.are.equal(string.rep("x", 1000), res.body)
    assert.is_true(res.truncated)
    assert.is_true(relaybus.now() - t0 < 3, "read for " .. (relaybus.now() - t0) .. " s")
    res = assert(http.request { url = url("/big/1000"), max_body = 1000, truncate_body = true })
    assert.is_nil(res.truncated)
  end)

  it("returns a body that is not UTF-8 as its bytes", function()
    local res = assert(http.request { url = respond_url(200, nil, "\xff\xfe\0\xc3") })
    assert.are.equal("\xff\xfe\0\xc3", res.body)
  end)
end)

-- ---- Retry-After -----------------------------------------------------------------------------
describe("relaybus.http.retry_after", function()
  local now = 1700000000   -- Tue, 14 Nov 2023 22:13:20 GMT

  it("reads delta-seconds and HTTP-dates in all three forms", function()
    assert.are.equal(120, http.retry_after("120", now))
    assert.are.equal(120, http.retry_after(" 120\t", now))
    assert.are.equal(0, http.retry_after("0", now))
    assert.are.equal(120, http.retry_after("Tue, 14 Nov 2023 22:15:20 GMT", now))
    assert.are.equal(120, http.retry_after("Tuesday, 14-Nov-23 22:15:20 GMT", now))
    assert.are.equal(120, http.retry_after("Tue Nov 14 22:15:20 2023", now))
    assert.are.equal(0, http.retry_after("Sun, 06 Nov 1994 08:49:37 GMT", now))
    local later = http.retry_after("120")   -- now defaults to the wall clock
    assert.are.equal(120, later)
  end)

  it("clamps to 30 days and never goes below 0", function()
    assert.are.equal(30 * 86400, http.retry_after("99999999999999999999", now))
    assert.are.equal(30 * 86400, http.retry_after("Fri, 31 Dec 9999 23:59:59 GMT", now))
    assert.are.equal(30 * 86400, http.retry_after("2592001", now))
    assert.are.equal(0, http.retry_after("Thu, 01 Jan 1970 00:00:00 GMT", now))
  end)

  it("treats anything else as absent", function()
    for _, v in ipairs { "-1", "1e999", "1.5", "+5", "0x10", "inf", "nan", "garbage", "", " ",
                         "12\0", "120, 130", "Tue, 31 Feb 2023 22:15:20 GMT",
                         "Tue, 14 Nov 2023 24:00:00 GMT", "tue, 14 nov 2023 22:15:20 gmt",
                         "Tue, 14 Nov 2023 22:15:20 UTC", "Tue, 14 Nov 23 22:15:20 GMT",
                         "Tue,  14 Nov 2023 22:15:20 GMT", "\xff\xfe" } do
      assert.is_nil(http.retry_after(v, now), string.format("%q", v))
    end
    assert.is_nil(http.retry_after(nil))
  end)

  it("raises relaybus: errors on misuse", function()
    misuse(http.retry_after, {})
    misuse(http.retry_after, "1", 0 / 0)
    misuse(http.retry_after, "1", math.huge)
  end)
end)

-- ---- relaybus.webhook ------------------------------------------------------------------------
describe("relaybus.webhook", function()
  it("completes on 2xx, posting the payload as JSON with id, topic, attempt and Standard Webhooks headers", function()
    local payload = { order = 42, items = { "a", "b" } }
    local before = math.floor(relaybus.time())
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
    assert.are.equal(rec.id, seen.headers["webhook-id"])
    local ts = tonumber(seen.headers["webhook-timestamp"])
    assert.is_true(math.type(ts) == "integer" and ts >= before and ts <= relaybus.time(),
                   "webhook-timestamp " .. tostring(seen.headers["webhook-timestamp"]))
    assert.is_nil(seen.headers["x-relaybus-signature"])
    assert.is_true(verify(seen.headers, seen.body, "s3cret"))
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
    it("retries with the dispatcher's backoff on HTTP " .. status, function()
      -- deliver()'s dispatcher backs off 60 s
      local rec, now = deliver(relaybus.webhook { url = url("/status/" .. status) })
      assert.are.equal("pending", rec.status)
      assert.are.equal(1, rec.attempts)
      assert.are.equal("HTTP " .. status .. ": status", rec.last_error)
      H.near(60, rec.run_at - now, 3, "delay")
    end)
  end

  it("retries with its own backoff when given one", function()
    local seen
    local rec, now = deliver(relaybus.webhook { url = url("/status/503"),
      backoff = function(attempts) seen = attempts; return 7 end })
    assert.are.equal(1, seen)
    assert.are.equal("pending", rec.status)
    H.near(7, rec.run_at - now, 2, "delay")
  end)

  it("retries with backoff when the connection is refused", function()
    local rec, now = deliver(relaybus.webhook { url = REFUSED })
    assert.are.equal("pending", rec.status)
    assert.are.equal("connection refused", rec.last_error)
    H.near(60, rec.run_at - now, 3, "delay")
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

  -- ---- settles that fail --------------------------------------------------------------------
  -- A ctx whose settles fail as a store error would make them fail; the rest is the real ctx.
  local function failing_settles(ctx, calls)
    local function fail(what)
      return function(_, ...)
        calls[#calls + 1] = { what, ... }
        return nil, "store error (injected)"
      end
    end
    local fake = { reschedule = fail("reschedule"), bury = fail("bury") }
    return setmetatable({}, { __index = function(_, k)
      if fake[k] then return fake[k] end
      local v = ctx[k]
      if type(v) == "function" then return function(_, ...) return v(ctx, ...) end end
      return v
    end })
  end

  local function with_failing_settles(hook, calls)
    return function(delivery, ctx) return hook(delivery, failing_settles(ctx, calls)) end
  end

  it("raises when its reschedule cannot be written, so the delivery is not completed", function()
    local calls = {}
    local rec = deliver(with_failing_settles(relaybus.webhook { url = url("/status/503") }, calls))
    assert.are.equal("reschedule", calls[1][1])
    assert.are.equal("pending", rec.status)      -- the dispatcher's retry of a raise
    assert.are.equal("HTTP 503: status (and the reschedule failed: store error (injected))",
                     rec.last_error)
  end)

  it("raises when its bury cannot be written, so the delivery is not completed", function()
    local calls = {}
    local rec = deliver(with_failing_settles(relaybus.webhook { url = url("/status/404") }, calls))
    assert.are.equal("bury", calls[1][1])
    assert.are.equal("pending", rec.status)
    assert.are.equal("HTTP 404: status (and the bury failed: store error (injected))",
                     rec.last_error)
  end)

  it("raises on a failed bury at the last attempt: the dispatcher buries it", function()
    local rec = deliver(with_failing_settles(relaybus.webhook { url = url("/status/503") }, {}),
                        { enqueue = { max_attempts = 1 } })
    assert.are.equal("buried", rec.status)
    assert.are.equal("HTTP 503: status (and the bury failed: store error (injected))",
                     rec.last_error)
  end)

  -- ---- Retry-After attacks ------------------------------------------------------------------
  local day30 = 30 * 86400
  for _, case in ipairs {
    { "-1", 60 }, { "1e999", 60 }, { "garbage", 60 }, { "0", 60 }, { "1.5", 60 },
    { "99999999999999999999", day30 }, { "Fri, 31 Dec 9999 23:59:59 GMT", day30 },
    { "Thu, 01 Jan 1970 00:00:00 GMT", 60 },
  } do
    it("retries after max(backoff, Retry-After) for Retry-After: " .. case[1], function()
      local rec, now = deliver(relaybus.webhook { url = respond_url(503, { "Retry-After: " .. case[1] }, "busy") })
      assert.are.equal("pending", rec.status)
      assert.are.equal(1, rec.attempts)
      assert.are.equal("HTTP 503: busy", rec.last_error)
      H.near(case[2], rec.run_at - now, 3, "delay")
    end)
  end

  it("honours an HTTP-date in Retry-After", function()
    local at = math.floor(relaybus.time()) + 300
    local days = at // 86400
    -- format the date here, independently of the C formatter
    local wd = ({ "Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed" })[days % 7 + 1]
    local date = os.date("!%d %b %Y %H:%M:%S GMT", at)
    local rec, now = deliver(relaybus.webhook {
      url = respond_url(503, { "Retry-After: " .. wd .. ", " .. date }, "busy") })
    H.near(300, rec.run_at - now, 3, "delay")
  end)

  -- ---- redirects ----------------------------------------------------------------------------
  it("buries a 3xx, naming where it points, instead of following it", function()
    local rec = deliver(relaybus.webhook { url = url("/redirect/201") })
    assert.are.equal("buried", rec.status)
    assert.are.equal("HTTP 302 redirect to " .. url("/status/201") .. ": webhooks do not "
                     .. "follow redirects; point url at the final address", rec.last_error)
  end)

  it("does not deliver through a 307 to another port", function()
    local before = get_json("/counts", receiver2.base)
    local rec = deliver(relaybus.webhook { url = respond_url(307, { "Location: " .. url2("/count") }) })
    assert.are.equal("buried", rec.status)
    assert.is_truthy(rec.last_error:find("HTTP 307 redirect to " .. url2("/count"), 1, true))
    assert.are.same(before, get_json("/counts", receiver2.base))
  end)

  it("buries a redirect loop at once", function()
    local rec = deliver(relaybus.webhook { url = url("/loop") })
    assert.are.equal("buried", rec.status)
    assert.are.equal(1, rec.attempts)
    assert.is_truthy(rec.last_error:find("HTTP 302 redirect to " .. url("/loop"), 1, true))
  end)

  it("buries a 3xx without a Location, saying so", function()
    local rec = deliver(relaybus.webhook { url = respond_url(301, nil, "moved") })
    assert.are.equal("buried", rec.status)
    assert.are.equal("HTTP 301 redirect without a Location: webhooks do not follow redirects; "
                     .. "point url at the final address", rec.last_error)
  end)

  -- ---- bodies --------------------------------------------------------------------------------
  it("completes on a 2xx with a 50 MB body, reading only max_body of it", function()
    local t0 = relaybus.now()
    local rec = deliver(relaybus.webhook { url = url("/big/52428800"), max_body = 1000 })
    assert.are.equal("completed", rec.status)
    assert.is_true(relaybus.now() - t0 < 5, "took " .. (relaybus.now() - t0) .. " s")
  end)

  it("keeps at most the first 200 bytes of the body in last_error, on one line", function()
    local rec = deliver(relaybus.webhook { url = respond_url(404, nil, "a\r\nb" .. string.rep("x", 400)) })
    assert.are.equal("buried", rec.status)
    assert.are.equal("HTTP 404: a b" .. string.rep("x", 196), rec.last_error)
  end)

  it("stores a body that is not UTF-8 as valid UTF-8", function()
    local rec = deliver(relaybus.webhook { url = respond_url(400, nil, "\xff\xfe\xc3(" .. string.rep("\x80", 300)) })
    assert.are.equal("buried", rec.status)
    assert.is_truthy(utf8.len(rec.last_error), "last_error is not UTF-8")
    assert.are.equal("HTTP 400: ", rec.last_error:sub(1, 10))
  end)

  -- ---- secrets ------------------------------------------------------------------------------
  it("never writes the URL's password or the secret into last_error", function()
    local base = "http://ada:hunter2pw@127.0.0.1:" .. receiver.port
    -- a receiver that echoes both back in its answer
    local rec = deliver(relaybus.webhook {
      url = base .. "/respond?status=400&body=" .. enc("pw hunter2pw, key s3cr3t-value, basic "
                                                        .. b64encode("ada:hunter2pw")),
      secret = "s3cr3t-value" })
    assert.are.equal("buried", rec.status)
    assert.are.equal("HTTP 400: pw ***, key ***, basic ***", rec.last_error)
    -- a redirect to a URL with user-info of its own
    rec = deliver(relaybus.webhook {
      url = base .. "/respond?status=302&h=" .. enc("Location: http://bob:locpw@127.0.0.1/x?token=t0k") })
    assert.are.equal("HTTP 302 redirect to http://bob:***@127.0.0.1/x?token=***: webhooks do "
                     .. "not follow redirects; point url at the final address", rec.last_error)
    -- a secret parameter of the webhook's own URL, echoed
    rec = deliver(relaybus.webhook {
      url = url("/respond?status=500&body=tok-12345&token=tok-12345") })
    assert.are.equal("HTTP 500: ***", rec.last_error)
    rec = deliver(relaybus.webhook { url = "http://ada:hunter2pw@127.0.0.1:1/" })
    assert.are.equal("connection refused", rec.last_error)
  end)

  it("hides a secret that the body's 200-byte cut runs through, wherever the cut falls", function()
    local secret = "topsecret-signing-key-01234567"
    local pad = string.rep(".", 190)
    local rec = deliver(relaybus.webhook { url = respond_url(400, nil, pad .. secret .. " tail"),
                                           secret = secret })
    assert.are.equal("buried", rec.status)
    assert.are.equal("HTTP 400: " .. pad .. "***", rec.last_error)
    for cut = 1, #secret do
      pad = string.rep(".", 200 - cut)
      local reason = attempt(relaybus.webhook { url = respond_url(400, nil, pad .. secret), secret = secret })
      assert.are.equal("HTTP 400: " .. pad .. "***", reason, "cut after " .. cut .. " bytes of it")
    end
  end)

  it("hides the Authorization value a receiver echoes, whole, across the cut, or a piece of 8 or more", function()
    local auth = "Bearer eyJhbGciOi.J9-0123456789abcdefXYZ"
    local rec = deliver(relaybus.webhook { url = reflect_url { h = "Authorization" },
                                           headers = { Authorization = auth } })
    assert.are.equal("buried", rec.status)
    assert.are.equal("HTTP 400: ***", rec.last_error)
    local function shown(params)
      params.h = "Authorization"
      return (attempt(relaybus.webhook { url = reflect_url(params), headers = { Authorization = auth } }))
    end
    assert.are.equal("HTTP 400: " .. string.rep(".", 185) .. "***", shown { pad = 185 })
    assert.are.equal("HTTP 400: " .. string.rep(".", 199) .. "***", shown { pad = 199 })
    assert.are.equal("HTTP 400: ***", shown { from = 12, len = 10 })        -- a 10-byte piece
    assert.are.equal("HTTP 400: ***", shown { from = 20, len = 8 })
    assert.are.equal("HTTP 400: ***", shown { from = 0, len = 8 })          -- "Bearer e"
    for from = 0, #auth - 8 do
      assert_hidden(shown { from = from, pad = 100 }, auth:sub(from + 1), "from " .. from)
      assert_hidden(shown { from = from, len = 8 }, auth:sub(from + 1, from + 8), "8 from " .. from)
    end
  end)

  it("hides every header value it sent, in percent-encoded and JSON-escaped echoes too", function()
    local headers = { Authorization = 'Token t\u{f6}k/"en+ 0123 \u{1F600}end', ["X-Api-Key"] = "k3y-abcdef-9876",
                      ["X-Short"] = "s7x" }
    for name, value in pairs(headers) do
      for _, e in ipairs { "raw", "json", "pct" } do
        local reason = attempt(relaybus.webhook { url = reflect_url { h = name, enc = e, pad = 3 }, headers = headers })
        assert.are.equal("HTTP 400: ...***", reason, name .. " as " .. e)
        reason = attempt(relaybus.webhook { url = reflect_url { h = name, enc = e, pad = 195 }, headers = headers })
        assert.are.equal("HTTP 400: " .. string.rep(".", 195) .. "***", reason, name .. " as " .. e .. " across the cut")
      end
    end
    -- the whole request as JSON: every value of ours is hidden, the rest stays
    local reason = attempt(relaybus.webhook { url = reflect_url { status = 500 }, headers = headers,
                                              secret = "whsec_" .. b64encode("0123456789abcdef") })
    for _, value in pairs(headers) do assert_hidden(reason, value) end
    assert.is_truthy(reason:find('"method":"POST"', 1, true), reason)
    -- Content-Type, Accept and User-Agent are no secrets (the transport keeps them across
    -- origins for that reason): a receiver may say which one it wanted
    reason = attempt(relaybus.webhook { url = reflect_url { h = "Content-Type" },
                                        headers = { ["Content-Type"] = "application/cloudevents+json" } })
    assert.are.equal("HTTP 400: application/cloudevents+json", reason)
  end)

  it("hides the signing secret as the receiver spells it: JSON, percent, form, HTML, repeated, split", function()
    local secret = 'sig"n\u{e9}/k\\ey 0123+\u{1F600}-end'
    local hook = function(body)
      return relaybus.webhook { url = respond_url(422, nil, body), secret = secret }
    end
    local json_form = 'sig\\"n\\u00e9\\/k\\\\ey 0123+\\ud83d\\ude00-end'
    local pct = secret:gsub("[^%w%-_.~]", function(c) return string.format("%%%02X", c:byte()) end)
    local pct_lower = secret:gsub("[^%w%-_.~]", function(c) return string.format("%%%02x", c:byte()) end)
    local form = secret:gsub("[^%w%-_.~ ]", function(c) return string.format("%%%02X", c:byte()) end):gsub(" ", "+")
    local twice = pct:gsub("%%", "%%25")
    local html = 'sig&quot;n&#233;/k\\ey 0123+&#x1F600;-end'
    for what, body in pairs { raw = secret, json = json_form, pct = pct, pct_lower = pct_lower,
                              form = form, twice = twice, html = html } do
      assert.are.equal("HTTP 422: <***>", (attempt(hook("<" .. body .. ">"))), what)
      assert.are.equal("HTTP 422: ***", (attempt(hook(body .. body .. body))), what .. " repeated")
      assert.are.equal("HTTP 422: " .. string.rep(".", 190) .. "***",
                       (attempt(hook(string.rep(".", 190) .. body))), what .. " across the cut")
    end
    -- pieces of 8 bytes or more, cut anywhere, with other bytes (bad UTF-8, NUL, CR LF) between
    assert.are.equal("HTTP 422: *** \u{FFFD} *** ***", (attempt(hook('sig"n\u{e9}/k \xff k\\ey 0123+\0\r\n0123+\u{1F600}-end'))))
    assert.are.equal("HTTP 422: ***", (attempt(hook('n\\u00e9\\/k\\\\ey'))))
    assert.are.equal('HTTP 422: sig"n\u{e9} x', (attempt(hook('sig"n\u{e9} x'))))   -- 7 bytes stay
  end)

  it("hides a secret shorter than 8 bytes only as a whole, and no header value of 1 or 2 bytes", function()
    local reason = attempt(relaybus.webhook { url = respond_url(400, nil, "k3y, k3, K3Y, %6B3y"), secret = "k3y" })
    assert.are.equal("HTTP 400: ***, k3, K3Y, ***", reason)
    reason = attempt(relaybus.webhook { url = respond_url(400, nil, "field 1 of v2: abc"),
                                        headers = { ["X-Version"] = 1, ["X-Api"] = "v2", ["X-K"] = "abc" } })
    assert.are.equal("HTTP 400: field 1 of v2: ***", reason)
  end)

  it("stays quick on a secret of one byte repeated, hiding the rest rather than showing it", function()
    local t0 = relaybus.now()
    local secret = string.rep("a", 1000)
    local reason = attempt(relaybus.webhook { url = respond_url(400, nil, string.rep("aaaaaaab", 60)),
                                              headers = { ["X-A"] = secret }, secret = secret .. "b" })
    assert.is_true(relaybus.now() - t0 < 2, "took " .. (relaybus.now() - t0) .. " s")
    assert_hidden(reason, secret)
    assert.are.equal("HTTP 400: ***", (attempt(relaybus.webhook {
      url = respond_url(400, nil, string.rep("a", 300)), headers = { ["X-A"] = secret } })))
  end)

  it("hides what it sent in a redirect's Location, and in the URL's password as echoed", function()
    local headers = { ["X-Api-Key"] = "key-abcdef123456" }
    local reason = attempt(relaybus.webhook { headers = headers,
      url = respond_url(302, { "Location: http://127.0.0.1/cb?k=key-abcdef123456&n=1" }) })
    assert.are.equal("HTTP 302 redirect to http://127.0.0.1/cb?k=***&n=1: webhooks do not follow "
                     .. "redirects; point url at the final address", reason)
    local base = "http://ada:p%C3%A4ssw0rd-42@127.0.0.1:" .. receiver.port
    reason = attempt(relaybus.webhook { url = base .. "/reflect?h=Authorization" })
    assert.are.equal("HTTP 400: Basic ***", reason)
    reason = attempt(relaybus.webhook { url = base .. "/respond?status=400&body=" .. enc("p\u{e4}ssw0rd p%C3%A4ssw0 ssw0rd-42") })
    assert.are.equal("HTTP 400: *** *** ***", reason)
  end)

  -- ---- topics in a header -------------------------------------------------------------------
  it("sends any topic, CR and LF included, percent-encoding '%', space and control bytes in X-Relaybus-Topic", function()
    for _, case in ipairs {
      { "hook\r\nX-Evil: 1", "hook%0D%0AX-Evil:%201" },
      { "50%off", "50%25off" },
      { " tab\there \127", "%20tab%09here%20%7F" },
      { "commande.cr\u{e9}\u{e9}e", "commande.cr\u{e9}\u{e9}e" },
      { "order.created", "order.created" },
    } do
      local rec = deliver(relaybus.webhook { url = url("/echo") }, { topic = case[1] })
      assert.are.equal("completed", rec.status, case[2])
      local seen = get_json("/last")
      assert.are.equal(case[2], seen.headers["x-relaybus-topic"])
      assert.are.equal(case[1], (seen.headers["x-relaybus-topic"]:gsub("%%(%x%x)", function(h)
        return string.char(tonumber(h, 16)) end)))
      assert.is_nil(seen.headers["x-evil"])
    end
  end)

  -- ---- Standard Webhooks signatures ---------------------------------------------------------
  it("signs id, timestamp and body so that a receiver verifies it and rejects a tampered one", function()
    local secret = "whsec_" .. b64encode("0123456789abcdef0123456789abcdef")
    local rec = deliver(relaybus.webhook { url = url("/echo"), secret = secret },
                        { payload = { hello = "world" } })
    assert.are.equal("completed", rec.status)
    local seen = get_json("/last")
    assert.is_true(verify(seen.headers, seen.body, secret))
    -- a replay with a fresh timestamp, another body, another id, or an old timestamp fails
    local h = {}
    for k, v in pairs(seen.headers) do h[k] = v end
    h["webhook-timestamp"] = tostring(tonumber(seen.headers["webhook-timestamp"]) + 1)
    assert.is_false(verify(h, seen.body, secret))
    assert.is_false(verify(seen.headers, seen.body .. " ", secret))
    h = {}
    for k, v in pairs(seen.headers) do h[k] = v end
    h["webhook-id"] = "other"
    assert.is_false(verify(h, seen.body, secret))
    assert.is_false(verify(seen.headers, seen.body, secret, relaybus.time() + 301))
    -- the whsec_ prefix is not part of the key: its base64 is decoded
    assert.is_false(verify(seen.headers, seen.body, secret:sub(7)))
  end)

  it("matches the Standard Webhooks reference vector", function()
    -- from the Standard Webhooks libraries' tests
    local key = assert(http.base64_decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"))
    local msg = 'msg_p5jXN8AQM9LWM0D4loKWxJek.1614265330.{"test": 2432232314}'
    assert.are.equal("g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=", http.hmac_sha256(key, msg, "base64"))
    assert.is_true(verify({ ["webhook-id"] = "msg_p5jXN8AQM9LWM0D4loKWxJek",
                            ["webhook-timestamp"] = "1614265330",
                            ["webhook-signature"] = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=" },
                          '{"test": 2432232314}', "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", 1614265330))
  end)

  it("sends the delivery id as webhook-id on every attempt, and no signature without a secret", function()
    local first = relaybus.webhook { url = url("/status/503") }
    local second = relaybus.webhook { url = url("/echo") }
    local store = open_store()
    local d = H.dispatcher(store)     -- backoff 0: the retry comes at once
    d:handle("hook", function(delivery, ctx)
      return (delivery.attempts == 1 and first or second)(delivery, ctx)
    end)
    local id = assert(store:enqueue("hook", {}))
    local stop = H.stopper(d)
    relaybus.spawn(function()
      H.poll(function() return store:get(id).status == "completed" end, 10)
      stop()
    end)
    assert.is_true((H.run(d, 20)))
    assert.are.equal("completed", store:get(id).status)
    store:close()
    local seen = get_json("/last")
    assert.are.equal("2", seen.headers["x-relaybus-attempt"])
    assert.are.equal(id, seen.headers["webhook-id"])
    assert.is_truthy(seen.headers["webhook-timestamp"])
    assert.is_nil(seen.headers["webhook-signature"])
  end)

  it("drops a caller's webhook-* and X-Relaybus-* headers for its own", function()
    deliver(relaybus.webhook { url = url("/echo"), secret = "k",
      headers = { ["Webhook-Id"] = "forged", ["webhook-signature"] = "v1,forged",
                  ["X-Relaybus-Topic"] = "forged" } })
    local seen = get_json("/last")
    assert.are_not.equal("forged", seen.headers["webhook-id"])
    assert.are_not.equal("v1,forged", seen.headers["webhook-signature"])
    assert.are.equal("hook", seen.headers["x-relaybus-topic"])
    assert.is_true(verify(seen.headers, seen.body, "k"))
  end)

  it("fails the run with a clear error when its backoff returns no number", function()
    local rec = deliver(relaybus.webhook { url = url("/status/503"), backoff = function() end })
    assert.are.equal("pending", rec.status)
    assert.are.equal("relaybus: webhook: backoff(1) returned nil, not a number of seconds",
                     rec.last_error)
  end)

  it("raises relaybus: errors on misuse", function()
    misuse(relaybus.webhook, {})
    misuse(relaybus.webhook, "http://x/")
    misuse(relaybus.webhook, { url = url("/status/200"), nope = 1 })
    misuse(relaybus.webhook, { url = url("/status/200"), timeout = "soon" })
    misuse(relaybus.webhook, { url = url("/status/200"), timeout = 0 })
    misuse(relaybus.webhook, { url = url("/status/200"), max_body = 0 })
    misuse(relaybus.webhook, { url = url("/status/200"), max_body = 1.5 })
    misuse(relaybus.webhook, { url = url("/status/200"), backoff = 5 })
    misuse(relaybus.webhook, { url = "ftp://127.0.0.1/" })
    misuse(relaybus.webhook, { url = url("/status/200 HTTP/1.1\r\nX: y") })
    misuse(relaybus.webhook, { url = url("/status/200"), headers = { ["X-A"] = "1\r\nX-B: 2" } })
    misuse(relaybus.webhook, { url = url("/status/200"), headers = { ["X A"] = "1" } })
    misuse(relaybus.webhook, { url = url("/status/200"), headers = { ["Content-Length"] = "0" } })
    misuse(relaybus.webhook, { url = url("/status/200"), secret = "" })
    misuse(relaybus.webhook, { url = url("/status/200"), secret = "whsec_not base64!" })
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

  it("a stop that reaches its timeout cuts its own runs' transfers, not those of others", function()
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
      task_res, task_err = http.request { url = url("/slow/1500"), timeout = 30 }
      task_elapsed = relaybus.now() - t0
    end)
    relaybus.spawn(function()
      H.poll(function() return locked end, 10)
      d:stop { timeout = 1 }
    end)
    assert.is_true((H.run(d, 20)))
    -- the handler was aborted at 4/5 of the timeout: its own transfer ended then
    assert.are.equal("aborted", handler_err)
    assert.are.equal(0, hangs_left())
    -- a transfer of a task of its own is not the dispatcher's: the stop leaves it be
    assert.is_truthy(H.poll(function() return task_elapsed end, 5))
    assert.is_nil(task_err)
    assert.are.equal(200, task_res.status)
    assert.is_true(task_elapsed >= 1.4, "the transfer ended after " .. tostring(task_elapsed) .. " s")
    assert.is_truthy(H.poll(function() return unlocked end, 5))
    locker:close()
    store:close()
  end)
end)
