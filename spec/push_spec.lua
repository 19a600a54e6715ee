-- push_spec.lua -- examples/set_push.lua (RFC 8935 push of Security Event Tokens) run as two
-- `relaybus run` instances on one store, against the receiver's /push/STREAM endpoint
-- (spec/support/http_receiver.c), which logs every arrival in order and counts overlapping
-- requests per stream. Every SET arrives, once, in its stream's order, and only the SETs the
-- receiver made fail are transmitted again.
local S = require "spec.support.stores"
local relaybus = S.relaybus()
local http, json = relaybus.http, relaybus.json

local EXAMPLE = (os.getenv("PWD") or ".") .. "/examples/set_push.lua"

-- ---- the receiver ----------------------------------------------------------------------------
local receiver = {}

local function start_receiver()
  local bin = S.build .. "/http_receiver"
  if not S.exists(bin) then
    assert(os.execute("cc -std=c11 -O2 -o " .. S.quote(bin) .. " spec/support/http_receiver.c -lev"),
      "cannot build " .. bin)
  end
  receiver.proc = assert(io.popen("exec " .. S.quote(bin) .. " -"))
  local line = receiver.proc:read("l") or ""
  local port, pid = line:match("^(%d+) (%d+)$")
  assert(port, "the receiver printed no port: " .. line)
  receiver.pid = tonumber(pid)
  receiver.base = "http://127.0.0.1:" .. port
end

local function stop_receiver()
  if receiver.pid then os.execute("kill " .. receiver.pid) end
  if receiver.proc then receiver.proc:close() end
  receiver = {}
end

-- {overlaps=, log={{path=, body=, status=}, ...}} in arrival order
local function pushes()
  local res = assert(http.request { url = receiver.base .. "/pushes", timeout = 10 })
  assert.are.equal(200, res.status)
  return json.decode(res.body)
end

-- ---- SETs ------------------------------------------------------------------------------------
local B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
local function b64url(s)
  local out = {}
  for p = 1, #s, 3 do
    local a, b, c = s:byte(p, p + 2)
    local n = (a << 16) | ((b or 0) << 8) | (c or 0)
    for j = 1, (c and 4 or b and 3 or 2) do
      local idx = (n >> (18 - 6 * (j - 1))) & 63
      out[#out + 1] = B64:sub(idx + 1, idx + 1)
    end
  end
  return table.concat(out)
end
local HEADER = b64url(json.encode { typ = "secevent+jwt", alg = "HS256" })

-- `per` SETs on each of `nstreams` fresh streams. kind(n) names the n-th SET of a stream "ok",
-- "flaky" or "bad", written into its signature segment ("~" never occurs in base64url, so the
-- receiver's fail=/reject= markers match nothing else). Returns the streams, the SETs (in
-- enqueue order: the streams interleaved) and a map body -> SET.
local function make_sets(nstreams, per, kind)
  local streams, sets, by_body = {}, {}, {}
  for s = 1, nstreams do streams[s] = S.unique("st") end
  for n = 1, per do
    for _, stream in ipairs(streams) do
      local jti = stream .. "-" .. n
      local k = kind and kind(n) or "ok"
      local claims = json.encode {
        iss = "https://transmitter.example", aud = "https://receiver.example", jti = jti,
        iat = 1700000000 + n, events = { ["urn:example:event"] = { n = n } },
      }
      local set = HEADER .. "." .. b64url(claims) .. ".sig~" .. k .. "~" .. n
      local rec = { stream = stream, seq = n, jti = jti, set = set, kind = k }
      sets[#sets + 1] = rec
      by_body[set] = rec
    end
  end
  return streams, sets, by_body
end

local function enqueue(store, sets)
  for first = 1, #sets, 200 do
    local batch = {}
    for i = first, math.min(first + 199, #sets) do
      local s = sets[i]
      batch[#batch + 1] = { "set.push." .. s.stream,
                            { stream = s.stream, seq = s.seq, jti = s.jti, set = s.set } }
    end
    assert(store:enqueue_many(batch))
  end
end

-- Runs two instances of the example on `store` until they end by themselves (--until-done);
-- returns what each printed. They hand busy streams to each other every 0.3 s (--max-hold), so
-- every stream changes hands while it still has SETs.
local function run_two(url, opts, streams, query, extra)
  local args = { "--store", url, "--receiver", receiver.base .. "/push/{stream}" .. (query or ""),
                 "--until-done", "--lease", "3", "--timeout", "1", "--poll", "0.05",
                 "--idle", "0.5", "--max-hold", "0.3", "--backoff", "0.02" }
  for _, a in ipairs(extra or {}) do args[#args + 1] = a end
  if opts.table then
    args[#args + 1] = "--table"
    args[#args + 1] = opts.table
  end
  for _, s in ipairs(streams) do
    args[#args + 1] = "--stream"
    args[#args + 1] = s
  end
  -- (at warn: the command logs each raise at info, and a 503 raises on purpose here)
  local quiet = { env = { RELAYBUS_LOG = "warn" } }
  local procs = { S.spawn(EXAMPLE, args, quiet), S.spawn(EXAMPLE, args, quiet) }
  local outs = {}
  for i, p in ipairs(procs) do
    local rc = S.wait_exit(p, 90)
    local err = S.read(p.err) or ""
    assert.are.equal(0, rc, "instance " .. i .. " exit " .. tostring(rc) .. ": " .. err)
    assert.are.equal("", err, "instance " .. i .. " wrote to stderr")
    local out = S.read(p.out) or ""
    local posts = tonumber(out:match("this instance: (%d+) POSTs"))
    assert(posts, "instance " .. i .. " printed no summary:\n" .. out)
    local _, holds = out:gsub(": pushing %(lease set%-push:", "")
    outs[i] = { out = out, posts = posts, holds = holds }
  end
  -- the holdings of each stream (monotonic times, one clock for both) never overlap
  local spans = {}
  for i, o in ipairs(outs) do
    local open = {}
    for line in o.out:gmatch("[^\n]+") do
      local s, t = line:match("^(%S+): pushing %(lease set%-push:%S+%) at ([%d.]+)$")
      if s then open[s] = tonumber(t) end
      s, t = line:match("^(%S+): let go at ([%d.]+)$")
      if s then
        assert(open[s], "let go without pushing: " .. line)
        spans[s] = spans[s] or {}
        table.insert(spans[s], { open[s], tonumber(t), i })
        open[s] = nil
      end
    end
    assert.is_nil(next(open), "instance " .. i .. " ended holding a stream")
  end
  for s, list in pairs(spans) do
    table.sort(list, function(a, b) return a[1] < b[1] end)
    for k = 2, #list do
      assert(list[k][1] >= list[k - 1][2], string.format(
        "%s held by instance %d from %.6f while instance %d held it until %.6f",
        s, list[k][3], list[k][1], list[k - 1][3], list[k - 1][2]))
    end
  end
  return outs
end

-- The arrivals of this test's streams: stream -> list of {seq=, kind=, status=} in order.
local function arrivals(log, from, by_body)
  local per = {}
  for i = from + 1, #log do
    local e = log[i]
    local set = by_body[e.body]
    if set then
      assert.are.equal("/push/" .. set.stream, e.path, "SET posted to another stream's endpoint")
      per[set.stream] = per[set.stream] or {}
      table.insert(per[set.stream], { seq = set.seq, kind = set.kind, status = e.status })
    end
  end
  return per
end

setup(start_receiver)
teardown(function()
  stop_receiver()
  S.cleanup()
end)

-- SQLite and PostgreSQL: FerretDB, our MongoDB-wire test server, scans its whole collection
-- for every query, too slow for two instances trading streams several times a second.
for _, entry in ipairs(S.list()) do
  if entry.name == "mongodb" then goto next_store end
  describe("set_push.lua (" .. entry.name .. ")", function()
    it("pushes every SET once, in stream order, with two instances sharing the streams", function()
      local NSTREAMS, PER = 4, 75     -- 300 SETs
      local store, url, opts = S.open(entry)
      local streams, sets, by_body = make_sets(NSTREAMS, PER)
      enqueue(store, sets)
      local before = pushes()

      -- the receiver answers each POST 3 ms late: two pushes of one stream at once would overlap
      local outs = run_two(url, opts, streams, "?delay=3")

      local after = pushes()
      assert.are.equal(before.overlaps, after.overlaps, "two POSTs of one stream overlapped")
      local per = arrivals(after.log, #before.log, by_body)
      for _, stream in ipairs(streams) do
        local got = per[stream] or {}
        assert.are.equal(PER, #got, stream .. ": SETs received")
        for n, a in ipairs(got) do
          -- every SET once, in order, accepted: seq 1..PER
          assert.are.equal(n, a.seq, stream .. ": arrival " .. n)
          assert.are.equal(202, a.status)
        end
      end
      -- each POST was one arrival, and both instances pushed (the streams changed hands)
      assert.are.equal(#sets, outs[1].posts + outs[2].posts)
      assert.is_true(outs[1].posts > 0 and outs[2].posts > 0,
        "one instance pushed nothing:\n" .. outs[1].out .. "\n" .. outs[2].out)
      assert.is_true(outs[1].holds + outs[2].holds > NSTREAMS, "no stream changed hands")

      local st = assert(store:stats())
      assert.are.same({ #sets, 0, 0, 0 }, { st.completed, st.pending, st.processing, st.buried })
      store:close()
    end)

    -- --tries 3: a failed POST is retried in place; --tries 1: the run fails, the dispatcher
    -- retries it after backoff, and the stream's later SETs wait for their turn meanwhile
    for _, tries in ipairs { 3, 1 } do
    it("transmits again only the SETs whose transmission failed, and buries the refused (--tries "
       .. tries .. ")", function()
      local NSTREAMS, PER = 3, 70     -- 210 SETs
      local function kind(n)
        if n % 7 == 3 then return "flaky" end   -- 503 on the first arrival, then 202
        if n % 11 == 5 then return "bad" end    -- 400 {err=invalid_request}
        return "ok"
      end
      local store, url, opts = S.open(entry)
      local streams, sets, by_body = make_sets(NSTREAMS, PER, kind)
      enqueue(store, sets)
      local before = pushes()

      local outs = run_two(url, opts, streams, "?delay=2&fail=~flaky~&reject=~bad~",
                           { "--tries", tostring(tries) })

      local after = pushes()
      assert.are.equal(before.overlaps, after.overlaps, "two POSTs of one stream overlapped")
      local per = arrivals(after.log, #before.log, by_body)
      local want_status = { ok = { 202 }, flaky = { 503, 202 }, bad = { 400 } }
      local total, flaky, bad = 0, 0, 0
      for _, stream in ipairs(streams) do
        local got = per[stream] or {}
        -- group consecutive arrivals by seq: order means each SET's arrivals are together and
        -- the SETs come in seq order
        local n, i = 0, 1
        while i <= #got do
          n = n + 1
          local seq, statuses = got[i].seq, {}
          assert.are.equal(n, seq, stream .. ": out of order at arrival " .. i)
          while got[i] and got[i].seq == seq do
            statuses[#statuses + 1] = got[i].status
            i = i + 1
          end
          local k = kind(seq)
          assert.are.same(want_status[k], statuses, stream .. " SET " .. seq .. " (" .. k .. ")")
          if k == "flaky" then flaky = flaky + 1 elseif k == "bad" then bad = bad + 1 end
        end
        assert.are.equal(PER, n, stream .. ": SETs received")
        total = total + #got
      end
      assert.is_true(flaky > 0 and bad > 0)
      assert.are.equal(#sets + flaky, total)   -- one retransmission per failed transmission
      assert.are.equal(total, outs[1].posts + outs[2].posts)

      local st = assert(store:stats())
      assert.are.same({ #sets - bad, bad, 0, 0 }, { st.completed, st.buried, st.pending, st.processing })
      for _, r in ipairs(assert(store:list { status = "buried", limit = 1000 })) do
        assert.are.equal("bad", r.payload.set:match("~(%a+)~"))
        assert.matches("HTTP 400 invalid_request", r.last_error, 1, true)
        assert.are.equal(1, r.attempts)
      end
      for _, r in ipairs(assert(store:list { status = "completed", limit = 1000 })) do
        local want = (tries == 1 and r.payload.set:find("~flaky~", 1, true)) and 2 or 1
        assert.are.equal(want, r.attempts, r.payload.jti .. " attempts")
      end
      store:close()
    end)
    end
  end)
  ::next_store::
end
