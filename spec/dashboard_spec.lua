-- dashboard_spec.lua -- relaybus.serve / runtime/serve/dashboard.c against every store: the JSON of
-- every endpoint, the metrics text through promtool and its counters against what ran, the
-- token (403 read-only, 401 wrong), escaping, a loop that keeps answering while 256 handlers
-- run, and attacks: bad ids, huge limits, bodies, wrong Host, slow clients, odd topics.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local D = require "spec.support.dash"
local relaybus = S.relaybus()
local ci = os.getenv("CI") == "true" or os.getenv("CI") == "1"

local function metric(text, name, labels)
  for line in text:gmatch("[^\n]+") do
    if line:sub(1, 1) ~= "#" then
      local n, l, v = line:match("^([%w_]+)(%b{}) (%S+)$")
      if not n then n, v = line:match("^([%w_]+) (%S+)$"); l = "" end
      if n == name and (labels == nil or l == labels) then return tonumber(v) end
    end
  end
end

local function promtool(text)
  local f = S.tmpfile("metrics") .. ".txt"
  S.write(f, text)
  local p = io.popen(S.foreign("promtool check metrics < " .. S.quote(f) .. " 2>&1; echo rc=$?"))
  local out = p:read("a")
  p:close()
  return out
end

describe("promtool", function()
  it("is installed (prometheus package; CI fails without it)", function()
    local ok = os.execute("command -v promtool >/dev/null 2>&1")
    if not ok and not ci then pending("promtool missing: scripts/install-deps.sh installs it") return end
    assert.truthy(ok, "promtool not found: run scripts/install-deps.sh")
  end)
end)

for _, entry in ipairs(S.list()) do
  describe("dashboard on " .. entry.name, function()
    after_each(function() S.reset() end)

    it("serves stats, pages of deliveries and one delivery as JSON", function()
      local store = S.open(entry, { migrate = true })
      local ids = D.fill(store, { D.XSS })
      D.with_server(store, nil, function(_, call)
        local st, _, j = call("GET", "/api/stats")
        assert.equal(200, st)
        assert.same({ pending = 2, processing = 0, completed = 2, buried = 1, cancelled = 0 }, j.deliveries)
        assert.equal(1, j.due)
        assert.equal(0, j.stalled)
        assert.is_true(j.read_only)
        local topics = {}
        for _, t in ipairs(j.topics) do topics[t.topic] = t end
        assert.equal(2, topics.ok.completed)
        assert.equal(1, topics.bad.buried)
        assert.equal(1, topics[D.XSS].pending, "the topic comes back exactly as enqueued")
        -- pages, newest first, every delivery once
        local seen, after, pages = {}, nil, 0
        repeat
          local path = "/api/deliveries?limit=2" .. (after and ("&after=" .. after) or "")
          local s2, _, page = call("GET", path)
          assert.equal(200, s2)
          pages = pages + 1
          for _, d in ipairs(page.deliveries) do
            assert.is_nil(seen[d.id], "a delivery on two pages")
            seen[#seen + 1] = d.id
            seen[d.id] = d
            assert.is_nil(d.payload, "pages carry no payload")
          end
          after = page.next ~= relaybus.json.null and page.next or nil
        until not after or pages > 10
        assert.equal(5, #seen)
        assert.equal(ids.pending[2], seen[1], "the newest first")
        -- filters
        local _, _, b = call("GET", "/api/deliveries?status=buried")
        assert.equal(1, #b.deliveries)
        assert.equal(ids.buried[1], b.deliveries[1].id)
        assert.equal("card declined: <b>nope</b>", b.deliveries[1].last_error:match("card declined: <b>nope</b>"))
        local _, _, t = call("GET", "/api/deliveries?topic=" .. "%3Cimg%20src%3Dx%20onerror%3Dalert(1)%3E")
        assert.equal(1, #t.deliveries)
        assert.equal(D.XSS, t.deliveries[1].topic)
        -- one delivery
        local s3, _, one = call("GET", "/api/deliveries/" .. ids.buried[1])
        assert.equal(200, s3)
        assert.equal("buried", one.status)
        assert.equal(1, one.attempts)
        assert.equal(1, one.max_attempts)
        assert.equal("number", type(one.fence))
        assert.equal("number", type(one.run_at))
        assert.same({ order = 7, items = { "a", "b" } }, relaybus.json.decode(one.payload))
        local s4, _, none = call("GET", "/api/deliveries/999999999")
        assert.equal(404, s4)
        assert.equal("no such delivery", none.error)
        -- the schedules, as store:schedules() gives them
        local s5, _, sc = call("GET", "/api/schedules")
        assert.equal(200, s5)
        assert.same({}, sc.schedules)
        assert(store:schedule(D.XSS, { cron = "0 3 * * *", timezone = "Europe/Berlin", topic = "t", payload = { a = { 1, 2 } } }))
        local _, _, sc2 = call("GET", "/api/schedules")
        assert.equal(1, #sc2.schedules)
        local one_sc = sc2.schedules[1]
        assert.equal(D.XSS, one_sc.name)
        assert.equal("0 3 * * *", one_sc.cron)
        assert.equal("Europe/Berlin", one_sc.timezone)
        assert.same({ a = { 1, 2 } }, relaybus.json.decode(one_sc.payload))
        assert.equal(assert(store:schedules())[1].next_at, one_sc.next_at)
        assert.is_nil(one_sc.every)
        assert.equal(405, (call("POST", "/api/schedules")))
      end)
    end)

    it("writes metrics promtool accepts, with counters that match what ran", function()
      local store = S.open(entry, { migrate = true })
      D.with_server(store, nil, function(_, call)
        -- the process's counters add up over this file's tests: compare what this one added
        local _, before = call("GET", "/metrics")
        local function delta(name, labels)
          return (metric(S.last_metrics, name, labels) or 0) - (metric(before, name, labels) or 0)
        end
        -- the dispatcher starts after serve: lua_dispatcher.c attaches the metrics to it
        for i = 1, 5 do store:enqueue("m.ok", { i = i }) end
        for i = 1, 3 do store:enqueue("m.fail", { i = i }, { max_attempts = 2 }) end
        store:enqueue('we"ird\\topic', {})
        local d = H.dispatcher(store)
        d:handle("m.ok", function() end)
        d:handle("m.fail", function() error("no") end)
        d:handle('we"ird\\topic', function() end)
        d:start()
        assert.truthy(H.poll(function() local s = store:stats() return s.completed == 6 and s.buried == 3 end, 30))
        d:stop { timeout = 2 }
        relaybus.sleep(1.1)     -- past the stats cache
        local st, text, _, hd = call("GET", "/metrics")
        assert.equal(200, st)
        assert.matches("^text/plain; version=0.0.4", hd["content-type"])
        S.last_metrics = text
        local out = promtool(text)
        if out:match("not found") and not ci then pending("promtool missing") return end
        assert.matches("rc=0", out, 1, true)
        assert.equal(5, delta( "relaybus_runs_total", '{topic="m.ok",outcome="completed"}'))
        assert.equal(3, delta( "relaybus_runs_total", '{topic="m.fail",outcome="retried"}'))
        assert.equal(3, delta( "relaybus_runs_total", '{topic="m.fail",outcome="buried"}'))
        assert.equal(1, delta( "relaybus_runs_total", '{topic="we\\"ird\\\\topic",outcome="completed"}'),
                     "labels escaped as the format says")
        assert.equal(5, delta( "relaybus_run_duration_seconds_count", '{topic="m.ok"}'))
        assert.equal(5, delta( "relaybus_start_delay_seconds_count", '{topic="m.ok"}'))
        assert.equal(12, delta( "relaybus_claims_total"))
        assert.equal(0, metric(text, "relaybus_runs_active"))
        assert.equal(1, metric(text, "relaybus_store_up"))
        assert.equal(6, metric(text, "relaybus_deliveries", '{status="completed"}'))
        assert.equal(3, metric(text, "relaybus_deliveries", '{status="buried"}'))
        assert.equal(0, metric(text, "relaybus_due_deliveries"))
        assert.equal(0, metric(text, "relaybus_stalled_deliveries"))
        assert.equal(0, metric(text, "relaybus_oldest_due_age_seconds"))
        assert.truthy(metric(text, "relaybus_lease_renewals_total"))
        -- bucket bounds in their shortest exact form: "0.005", not "0.0050000000000000001"
        local les = {}
        for le in text:gmatch('relaybus_run_duration_seconds_bucket{topic="m%.ok",le="([^"]+)"}') do
          les[#les + 1] = le
        end
        assert.equal("0.005", les[1])
        assert.equal("+Inf", les[#les])
        for _, le in ipairs(les) do assert.is_true(#le <= 5, "le=" .. le) end
      end)
      -- the counts per topic (cached 10 s: a new server reads them now)
      D.with_server(store, nil, function(_, call)
        local _, text = call("GET", "/metrics")
        assert.equal(5, metric(text, "relaybus_topic_deliveries", '{topic="m.ok",status="completed"}'))
        assert.equal(3, metric(text, "relaybus_topic_deliveries", '{topic="m.fail",status="buried"}'))
        assert.equal(0, metric(text, "relaybus_topic_deliveries", '{topic="m.fail",status="cancelled"}'))
        assert.equal(0, metric(text, "relaybus_topic_oldest_due_seconds", '{topic="m.ok"}'))
        assert.equal(1, metric(text, "relaybus_topic_deliveries", '{topic="we\\"ird\\\\topic",status="completed"}'))
      end)
    end)

    it("says when the store is down: /metrics still answers, with relaybus_store_up 0; /healthz 503", function()
      local store = S.open(entry, { migrate = true })
      local testing = S.testing()
      assert(store:enqueue("m.idle", {}))      -- due, and nobody runs it
      relaybus.sleep(1.2)
      for _, case in ipairs { { fail = 0, up = 1, health = 200 }, { fail = 1, up = 0, health = 503 } } do
        -- (the faults store forwards no counts per topic: the store itself when it is up)
        local f = case.fail == 0 and store or assert(testing.faults(store, { seed = 7, fail = case.fail }))
        D.with_server(f, nil, function(_, call)
          local st, text = call("GET", "/metrics")
          assert.equal(200, st)
          assert.equal(case.up, metric(text, "relaybus_store_up"))
          local due = metric(text, "relaybus_due_deliveries")
          local idle = metric(text, "relaybus_topic_deliveries", '{topic="m.idle",status="pending"}')
          if case.up == 1 then
            assert.equal(1, due)
            assert.equal(1, idle)
          else
            assert.is_nil(due, "a store series though the store is down")
            assert.is_nil(idle)
          end
          local age = metric(text, "relaybus_topic_oldest_due_seconds", '{topic="m.idle"}')
          if case.up == 1 then
            assert.is_true(age >= 1 and age < 60, "oldest due " .. tostring(age))
          else
            assert.is_nil(age)
          end
          assert.truthy(metric(text, "relaybus_claims_total"), "the process's own metrics are there")
          local out = promtool(text)
          if not out:match("not found") then assert.matches("rc=0", out, 1, true) end
          local hs, _, hj = call("GET", "/healthz")
          assert.equal(case.health, hs)
          if case.up == 1 then assert.is_true(hj.ok) else assert.matches("injected", hj.error) end
          assert.equal(405, (call("POST", "/healthz")))
        end)
      end
    end)

    it("refuses actions without a token (403) and with a wrong one (401)", function()
      local store = S.open(entry, { migrate = true })
      local ids = D.fill(store)
      local b = ids.buried[1]
      D.with_server(store, nil, function(_, call)
        for _, a in ipairs { { "POST", "/api/deliveries/" .. b .. "/kick" },
                             { "POST", "/api/deliveries/kick?status=buried" },
                             { "POST", "/api/deliveries/" .. ids.pending[1] .. "/bury" },
                             { "POST", "/api/deliveries/" .. ids.pending[1] .. "/cancel" },
                             { "DELETE", "/api/deliveries/" .. b } } do
          local st, _, j = call(a[1], a[2], D.auth)
          assert.equal(403, st, a[2])
          assert.matches("read%-only", j.error)
        end
      end)
      D.with_server(store, { token = D.TOKEN }, function(_, call)
        for _, h in ipairs { {}, { Authorization = "Bearer wrong-token-0123456789" },
                             { Authorization = "Bearer " .. D.TOKEN .. "x" },
                             { Authorization = "Bearer " .. D.TOKEN:sub(1, -2) },
                             { Authorization = D.TOKEN }, { Authorization = "Basic " .. D.TOKEN },
                             { Authorization = "Bearer " } } do
          local st, _, _, hd = call("POST", "/api/deliveries/" .. b .. "/kick", h)
          assert.equal(401, st)
          assert.equal("Bearer", hd["www-authenticate"])
        end
        assert.equal("buried", store:get(b).status, "nothing happened")
        local st = call("POST", "/api/deliveries/" .. ids.pending[1] .. "/cancel")
        assert.equal(401, st)
        assert.equal("pending", store:get(ids.pending[1]).status, "nothing was cancelled")
      end)
    end)

    if entry.kind ~= "mongodb" then
      it("on a table of more than 100,000 rows estimates the completed, says so everywhere, and counts the rest exactly", function()
        local store, _, _, tbl = S.open(entry, { migrate = true })
        assert(store:transaction(function(tx)
          if entry.name == "postgresql" then
            assert(tx:exec("INSERT INTO " .. tbl .. " (topic, payload, status, attempts, fence, settled_at)"
              .. " SELECT 'big' || (i % 3), '{}'::jsonb, CASE WHEN i % 5000 = 0 THEN 'buried' ELSE 'completed' END,"
              .. " 1, 1, now() FROM generate_series(1, 150000) AS i"))
          else
            assert(tx:exec("WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < 150000)"
              .. " INSERT INTO " .. tbl .. " (topic, payload, status, attempts, max_attempts, fence, run_at,"
              .. " created_at, settled_at) SELECT 'big' || (i % 3), '{}', CASE WHEN i % 5000 = 0 THEN 'buried'"
              .. " ELSE 'completed' END, 1, 25, 1, 1.7e9, 1.7e9, 1.7e9 FROM g"))
          end
        end))
        if entry.name == "postgresql" then
          assert(store:transaction(function(tx) assert(tx:exec("ANALYZE " .. tbl)) end))
        end
        for i = 1, 7 do assert(store:enqueue("big0", { i = i }, { delay = 3600 })) end
        local st = assert(store:stats())
        assert.is_true(st.completed_estimated)
        assert.is_true(math.abs(st.completed - 149970) < 7500, "estimate " .. st.completed)
        assert.equal(30, st.buried)
        assert.equal(7, st.pending)
        local topics = assert(store:_topic_stats())
        assert.equal(3, #topics)
        assert.is_nil(topics[1].completed, "no estimate per topic")
        assert.equal(7, topics[1].pending)
        assert.equal(10, topics[1].buried)      -- i % 5000 == 0: a third of them each
        D.with_server(store, nil, function(_, call)
          local _, text = call("GET", "/metrics")
          assert.truthy(text:find('relaybus_deliveries_estimated{status="completed"} 1', 1, true), text)
          assert.is_nil(text:find('relaybus_topic_deliveries{topic="big0",status="completed"}', 1, true))
          assert.truthy(text:find('relaybus_topic_deliveries{topic="big0",status="buried"} 10', 1, true))
          local _, _, j = call("GET", "/api/stats")
          assert.is_true(j.completed_estimated)
          assert.equal(relaybus.json.null, j.topics[1].completed)
        end)
        -- a small table counts them
        local small = S.open(entry, { migrate = true, table = S.unique("small") })
        assert(small:enqueue("s", 1))
        assert.is_nil(assert(small:stats()).completed_estimated)
      end)
    end

    it("cancels every live delivery of a topic and deletes every settled one of a status and topic, with the token", function()
      local store = S.open(entry, { migrate = true })
      local a1 = assert(store:enqueue("bulk.a", 1, { delay = 3600 }))
      assert(store:enqueue("bulk.a", 2, { delay = 3600 }))
      local b1 = assert(store:enqueue("bulk.b", 3, { delay = 3600 }))
      D.with_server(store, { token = D.TOKEN }, function(_, call)
        assert.equal(401, (call("POST", "/api/deliveries/cancel?topic=bulk.a")))
        assert.equal(401, (call("DELETE", "/api/deliveries?status=cancelled")))
        assert.equal("pending", store:get(a1).status, "nothing was cancelled")
        local st, _, j = call("POST", "/api/deliveries/cancel?status=buried", D.auth)
        assert.equal(400, st)
        assert.truthy(j.error:find("status=pending", 1, true), j.error)
        st, _, j = call("POST", "/api/deliveries/cancel?topic=bulk.a&status=pending", D.auth)
        assert.equal(200, st)
        assert.equal(2, j.count)
        assert.equal("cancelled", store:get(a1).status)
        assert.equal("cancelled from the dashboard", store:get(a1).last_error)
        assert.equal("pending", store:get(b1).status)
        for _, q in ipairs { "", "?status=pending", "?status=processing&topic=bulk.b", "?status=x",
                             -- (found by attack: a mistyped or empty filter deleted every one)
                             "?status=cancelled&topci=bulk.a", "?status=cancelled&topic=",
                             "?status=cancelled&topic" } do
          local s2 = call("DELETE", "/api/deliveries" .. q, D.auth)
          assert.equal(400, s2, q)
        end
        for _, q in ipairs { "?topci=bulk.b", "?topic=", "?topic", "?status=pending&nope=1" } do
          local s2, _, e = call("POST", "/api/deliveries/cancel" .. q, D.auth)
          assert.equal(400, s2, q)
          assert.truthy(e.error:find("parameter", 1, true), e.error)
        end
        assert.equal(400, (call("POST", "/api/deliveries/kick?status=buried&topci=x", D.auth)))
        assert.equal("pending", store:get(b1).status, "a refused filter cancelled something")
        st, _, j = call("DELETE", "/api/deliveries?status=cancelled&topic=bulk.b", D.auth)
        assert.equal(200, st)
        assert.equal(0, j.count)
        st, _, j = call("DELETE", "/api/deliveries?status=cancelled&topic=bulk.a", D.auth)
        assert.equal(200, st)
        assert.equal(2, j.count)
        assert.is_nil(store:get(a1))
        st, _, j = call("POST", "/api/deliveries/cancel", D.auth)     -- every topic
        assert.equal(200, st)
        assert.equal(1, j.count)
        assert.equal(405, (call("PUT", "/api/deliveries/cancel", D.auth)))
      end)
    end)

    it("kicks the buried of one topic only; a topic with a NUL byte is refused, not taken as every topic", function()
      local store = S.open(entry, { migrate = true })
      local ids = D.fill(store)
      D.with_server(store, { token = D.TOKEN }, function(_, call)
        assert.equal(200, (call("POST", "/api/deliveries/" .. ids.pending[1] .. "/bury", D.auth)))
        local st, _, j = call("POST", "/api/deliveries/kick?status=buried&topic=no.such", D.auth)
        assert.equal(200, st)
        assert.equal(0, j.count)
        for _, q in ipairs { "topic=%00", "topic=later%00", "topic=%00later" } do
          st, _, j = call("POST", "/api/deliveries/kick?status=buried&" .. q, D.auth)
          assert.equal(400, st, q)
          assert.equal("a URL here cannot hold %00", j.error)   -- (refused before any route)
          st = call("GET", "/api/deliveries?" .. q)
          assert.equal(400, st, q)
        end
        assert.equal(2, store:stats().buried, "nothing was kicked")
        st, _, j = call("POST", "/api/deliveries/kick?status=buried&topic=later", D.auth)
        assert.equal(200, st)
        assert.equal(1, j.count)
        assert.equal("pending", store:get(ids.pending[1]).status)
        assert.equal("buried", store:get(ids.buried[1]).status, "the other topic's stays buried")
        st, _, j = call("POST", "/api/deliveries/kick?status=buried&topic=", D.auth)
        assert.equal(200, st)
        assert.equal(1, j.count, "an empty topic filter is every topic")
      end)
    end)

    it("searches by key, topic prefix and error text; a NUL byte in any is refused", function()
      local store = S.open(entry, { migrate = true })
      local ids = D.fill(store)
      local keyed = assert(store:enqueue("later.keyed", { n = 1 }, { key = "k-42" }))
      D.with_server(store, nil, function(_, call)
        local function page(q)
          local st, _, j = call("GET", "/api/deliveries?" .. q)
          assert.equal(200, st, q)
          local out = {}
          for _, d in ipairs(j.deliveries) do out[#out + 1] = d.id end
          return out
        end
        assert.same({ keyed }, page("key=k-42"))
        assert.same({ keyed, ids.pending[1] }, page("topic_prefix=later"))
        assert.same({ ids.buried[1] }, page("error=declined"))
        assert.same({}, page("error=declined&status=completed"))
        for _, q in ipairs { "key=%00", "topic_prefix=a%00", "error=%00x" } do
          local st, _, j = call("GET", "/api/deliveries?" .. q)
          assert.equal(400, st, q)
          assert.equal("a URL here cannot hold %00", j.error)   -- (refused before any route)
        end
      end)
    end)

    it("cancels a pending delivery with the token; a settled one is a conflict; kick and delete take a cancelled one", function()
      local store = S.open(entry, { migrate = true })
      local ids = D.fill(store)
      D.with_server(store, { token = D.TOKEN }, function(_, call)
        local p = ids.pending[1]
        local st, _, j = call("POST", "/api/deliveries/" .. p .. "/cancel", D.auth)
        assert.equal(200, st)
        assert.equal(1, j.count)
        local g = store:get(p)
        assert.equal("cancelled", g.status)
        assert.equal("cancelled from the dashboard", g.last_error)
        st, _, j = call("POST", "/api/deliveries/" .. p .. "/cancel", D.auth)
        assert.equal(409, st, "cancelled already")
        assert.matches("not pending or processing", j.error)
        st = call("POST", "/api/deliveries/" .. ids.completed[1] .. "/cancel", D.auth)
        assert.equal(409, st, "a completed one is not cancelled")
        st = call("GET", "/api/deliveries/" .. p .. "/cancel")
        assert.equal(405, st)
        local _, _, s = call("GET", "/api/stats")
        assert.equal(1, s.deliveries.cancelled)
        local _, _, page = call("GET", "/api/deliveries?status=cancelled")
        assert.equal(1, #page.deliveries)
        assert.equal(p, page.deliveries[1].id)
        st = call("POST", "/api/deliveries/" .. p .. "/kick", D.auth)
        assert.equal(200, st)
        assert.equal("pending", store:get(p).status)
        assert.equal(200, (call("POST", "/api/deliveries/" .. p .. "/cancel", D.auth)))
        assert.equal(200, (call("DELETE", "/api/deliveries/" .. p, D.auth)))
        assert.is_nil(store:get(p))
      end)
    end)

    it("kicks, buries and deletes with the token", function()
      local store = S.open(entry, { migrate = true })
      local ids = D.fill(store)
      D.with_server(store, { token = D.TOKEN }, function(_, call)
        local st, _, j = call("POST", "/api/deliveries/" .. ids.buried[1] .. "/kick", D.auth)
        assert.equal(200, st)
        assert.equal(1, j.count)
        local g = store:get(ids.buried[1])
        assert.equal("pending", g.status)
        assert.equal(0, g.attempts)
        st = call("POST", "/api/deliveries/" .. ids.buried[1] .. "/kick", D.auth)
        assert.equal(409, st, "not buried any more")
        st = call("POST", "/api/deliveries/" .. ids.pending[1] .. "/bury", D.auth)
        assert.equal(200, st)
        g = store:get(ids.pending[1])
        assert.equal("buried", g.status)
        assert.equal("buried from the dashboard", g.last_error)
        st = call("POST", "/api/deliveries/" .. ids.completed[1] .. "/bury", D.auth)
        assert.equal(409, st, "a completed one is not buried")
        st = call("DELETE", "/api/deliveries/" .. ids.buried[1], D.auth)
        assert.equal(409, st, "a pending one is not deleted")
        st = call("DELETE", "/api/deliveries/" .. ids.completed[1], D.auth)
        assert.equal(200, st)
        assert.is_nil(store:get(ids.completed[1]))
        st = call("DELETE", "/api/deliveries/" .. ids.completed[1], D.auth)
        assert.equal(409, st, "gone already")
        st, _, j = call("POST", "/api/deliveries/kick?status=buried", D.auth)
        assert.equal(200, st)
        assert.equal(1, j.count)
        assert.equal(0, store:stats().buried)
        st = call("POST", "/api/deliveries/kick?status=completed", D.auth)
        assert.equal(400, st)
        -- the stats cache is dropped by an action: the counts are current at once
        local _, _, s = call("GET", "/api/stats")
        assert.equal(0, s.deliveries.buried)
      end)
    end)

    it("keeps answering while 256 handlers run", function()
      local store = S.open(entry, { migrate = true })
      local items = {}
      for i = 1, 256 do items[i] = { "slow", { i = i } } end
      store:enqueue_many(items)
      local release = false
      D.with_server(store, nil, function(_, call)
        local d = H.dispatcher(store, { concurrency = 256, lease_duration = 60 })
        d:handle("slow", function() while not release do relaybus.sleep(0.05) end end)
        d:start()
        local text
        assert.truthy(H.poll(function()
          local st, body = call("GET", "/metrics")
          text = body
          return st == 200 and metric(body, "relaybus_runs_active") == 256
        end, 60), "256 runs active")
        for _ = 1, 5 do
          local st, _, j = call("GET", "/api/deliveries?status=processing&limit=500")
          assert.equal(200, st)
          assert.equal(256, #j.deliveries)
          assert.equal(200, (call("GET", "/")))
        end
        release = true
        assert.truthy(H.poll(function() return store:stats().completed == 256 end, 60))
        d:stop { timeout = 5 }
        assert.truthy(metric(text, "relaybus_claims_total") >= 256)
      end)
    end)

    it("refuses bad ids, bad limits, bodies, wrong methods and a foreign Host", function()
      local store = S.open(entry, { migrate = true })
      D.fill(store)
      D.with_server(store, { token = D.TOKEN }, function(srv, call)
        for _, p in ipairs { "/api/deliveries/abc'def", "/api/deliveries/" .. string.rep("9", 65),
                             "/api/deliveries/%00", "/api/deliveries/a%20b", "/api/deliveries/..%2F..",
                             "/api/deliveries/1%FF" } do
          local st, _, j = call("GET", p)
          assert.equal(400, st, p)
          assert.equal("bad delivery id", j.error)
        end
        for _, q in ipairs { "limit=0", "limit=501", "limit=100000000000000000000", "limit=-1",
                             "limit=abc", "limit=1.5", "status=bogus", "after=x'y",
                             "topic=" .. string.rep("t", 2000) } do
          local st = call("GET", "/api/deliveries?" .. q)
          assert.equal(400, st, q)
        end
        local _, _, all = call("GET", "/api/deliveries?limit=500")
        local oldest = all.deliveries[#all.deliveries].id
        local st, _, j = call("GET", "/api/deliveries?after=" .. oldest)
        assert.equal(200, st, "nothing is older than the oldest: an empty page")
        assert.equal(0, #j.deliveries)
        assert.equal(404, (call("GET", "/nope")))
        assert.equal(404, (call("POST", "/api/deliveries/1/explode", D.auth)))
        assert.equal(405, (call("PUT", "/api/deliveries/1", D.auth)))
        assert.equal(405, (call("POST", "/metrics")))
        assert.equal(405, (call("GET", "/api/deliveries/1/kick")))
        assert.equal(413, (call("POST", "/api/deliveries/1/kick", D.auth, string.rep("x", 100000))))
        assert.equal(421, (call("GET", "/api/stats", { Host = "rebind.example:" .. srv:port() })))
        -- a non-UTF-8 topic, where the store takes one, comes back as valid JSON
        local ok, id = pcall(store.enqueue, store, "bad\255topic", {})
        if ok and id then
          local s2, body, t = call("GET", "/api/deliveries/" .. id)
          assert.equal(200, s2)
          assert.truthy(t, "valid JSON: " .. body)
          assert.equal("bad\239\191\189topic", t.topic)
          local _, mtext = call("GET", "/metrics")
          assert.matches("rc=0", promtool(mtext), 1, true)
        end
      end)
    end)

    it("is not stalled by slow clients", function()
      local ok_socket, socket = pcall(require, "socket")
      if not ok_socket and not ci then pending("luasocket missing (lua-socket)") return end
      assert.truthy(ok_socket, "luasocket (lua-socket) missing: run scripts/install-deps.sh")
      local store = S.open(entry, { migrate = true })
      D.fill(store)
      D.with_server(store, nil, function(srv, call)
        local held = {}
        for i = 1, 20 do
          local c = assert(socket.tcp())
          c:settimeout(2)
          assert(c:connect("127.0.0.1", srv:port()))
          c:settimeout(0)
          -- half a request line, then nothing; and one that asks for a page and never reads
          if i % 2 == 0 then c:send("GET /api/deli")
          else c:send("GET /api/deliveries?limit=500 HTTP/1.1\r\nHost: 127.0.0.1:" .. srv:port() .. "\r\n\r\n") end
          held[i] = c
        end
        for _ = 1, 5 do
          local st = call("GET", "/api/stats")
          assert.equal(200, st)
        end
        -- headers past the memory limit are refused, the server goes on
        local st = call("GET", "/api/stats", { ["X-Big"] = string.rep("a", 40000) })
        assert.truthy(st >= 400, "oversized headers refused, got " .. tostring(st))
        assert.equal(200, (call("GET", "/api/stats")))
        for _, c in ipairs(held) do c:close() end
      end)
    end)

    it("serves the page with a strict CSP and script that never uses innerHTML", function()
      local store = S.open(entry, { migrate = true })
      D.with_server(store, nil, function(_, call)
        local st, html, _, hd = call("GET", "/")
        assert.equal(200, st)
        assert.matches("text/html", hd["content-type"])
        assert.matches("default-src 'none'", hd["content-security-policy"], 1, true)
        assert.matches("<script src=\"/app.js\"", html, 1, true)
        assert.falsy(html:match("https?://"), "nothing fetched from elsewhere")
        local _, js = call("GET", "/app.js")
        assert.falsy(js:match("%.innerHTML") or js:match("outerHTML") or js:match("insertAdjacentHTML"))
        assert.falsy(js:match("https?://"))
        local _, css = call("GET", "/app.css")
        assert.falsy(css:match("url%("))
      end)
    end)
  end)
end

describe("relaybus.serve", function()
  after_each(function() S.reset() end)

  it("refuses bad options", function()
    local store = S.open(S.list()[1], { migrate = true })
    H.raises_relaybus(function() relaybus.serve {} end)
    H.raises_relaybus(function() relaybus.serve { store = store, listen = 5 } end)
    H.raises_relaybus(function() relaybus.serve { store = store, bogus = 1 } end)
    H.raises_relaybus(function() relaybus.serve { store = store, token = "short" } end)
    for _, l in ipairs { "nohost", "127.0.0.1:", "127.0.0.1:99999", "256.1.1.1:80", ":80" } do
      local srv, err = relaybus.serve { store = store, listen = l }
      assert.is_nil(srv, l)
      assert.matches("^dashboard: ", err)
    end
  end)

  it("refuses a token or listen address holding a NUL byte instead of reading it cut short", function()
    local store = S.open(S.list()[1], { migrate = true })
    -- "0123456789\0x" read as "0123456789" would let that prefix act
    local err = H.raises_relaybus(function()
      return relaybus.serve { store = store, listen = "127.0.0.1:0", token = D.TOKEN .. "\0tail" }
    end)
    assert.truthy(err:find("token", 1, true) and err:find("NUL", 1, true), err)
    err = H.raises_relaybus(function()
      return relaybus.serve { store = store, listen = "127.0.0.1:0\0:8480", token = D.TOKEN }
    end)
    assert.truthy(err:find("listen", 1, true) and err:find("NUL", 1, true), err)
    err = H.raises_relaybus(function()
      return relaybus.serve { store = store, listen = "127.0.0.1:0", token = "\0" .. D.TOKEN }
    end)
    assert.truthy(err:find("NUL", 1, true), err)
  end)

  -- Slow clients: each sends its request head a byte at a time, never finishing it.
  local function luasocket()
    local ok, socket = pcall(require, "socket")
    if not ok and not ci then pending("luasocket missing (lua-socket)") return nil end
    assert.truthy(ok, "luasocket (lua-socket) missing: run scripts/install-deps.sh")
    return socket
  end

  it("answers a scrape of /metrics within 2 s beside 1,000 slow connections from five addresses", function()
    if not luasocket() then return end
    local store = S.open(S.list()[1], { migrate = true })
    local worst, scrapes, started = 0, 0, nil
    D.with_server(store, nil, function(srv)
      local ready = S.tmpfile("slow")
      -- its own process, its descriptor limit raised (as far as the hard limit allows)
      local p = S.spawn(nil, { S.support .. "/slow_clients.lua", tostring(srv:port()), "1000", "5", "16", ready },
        { argv = { "sh", "-c", 'ulimit -n 4096 2>/dev/null || ulimit -n "$(ulimit -Hn)"; exec lua5.4 "$@"', "sh" } })
      assert.truthy(H.poll(function() return S.exists(ready) end, 60),
        "the slow clients did not connect: " .. (S.read(p.err) or ""))
      started = S.read(ready)
      -- a scrape a second for 12 s: past a byte of every slow one and past the head deadline
      for _ = 1, 12 do
        local t0 = relaybus.now()
        local r, err = relaybus.http.request { url = srv:url() .. "metrics", timeout = 10 }
        local took = relaybus.now() - t0
        assert.truthy(r, err)
        assert.equal(200, r.status)
        assert.matches("relaybus_deliveries", r.body)
        scrapes = scrapes + 1
        if took > worst then worst = took end
        relaybus.sleep(math.max(0, 1 - took))
      end
      S.signal(p, "TERM")
    end)
    assert.matches("^connected 1000 ", started)
    assert.equal(12, scrapes)
    assert.is_true(worst < 2, ("the slowest scrape took %.2f s"):format(worst))
  end)

  it("closes a connection whose request head is not done 10 s after it connected, however it trickles", function()
    local socket = luasocket()
    if not socket then return end
    local store = S.open(S.list()[1], { migrate = true })
    local closed_after
    D.with_server(store, nil, function(srv)
      local c = assert(socket.tcp())
      c:settimeout(2)
      assert(c:connect("127.0.0.1", srv:port()))
      c:settimeout(0)
      local t0 = relaybus.now()
      local head = "GET /metrics HTTP/1.1\r\nX-Slow: " .. string.rep("a", 100)
      for i = 1, 150 do     -- a byte every 0.1 s, for 15 s at most
        local _, err = c:receive(1)
        if err ~= "timeout" then closed_after = relaybus.now() - t0 break end
        c:send(head:sub(i, i))
        relaybus.sleep(0.1)
      end
      c:close()
    end)
    assert.truthy(closed_after, "still open after 15 s")
    assert.is_true(closed_after >= 9.5 and closed_after < 12, ("closed after %.1f s"):format(closed_after))
  end)

  it("times the next request head on a kept-alive connection from its last answer", function()
    local socket = luasocket()
    if not socket then return end
    local store = S.open(S.list()[1], { migrate = true })
    local answered, closed_after
    D.with_server(store, nil, function(srv)
      local c = assert(socket.tcp())
      c:settimeout(2)
      assert(c:connect("127.0.0.1", srv:port()))
      c:settimeout(0)
      c:send("GET /app.css HTTP/1.1\r\nHost: 127.0.0.1:" .. srv:port() .. "\r\n\r\n")
      local got = ""
      for _ = 1, 100 do     -- the answer, within 10 s
        local data, err, part = c:receive(65536)
        got = got .. (data or part or "")
        local len = tonumber(got:match("\r\n[Cc]ontent%-[Ll]ength: (%d+)\r\n"))
        local body_at = got:find("\r\n\r\n", 1, true)
        if len and body_at and #got >= body_at + 3 + len then answered = true break end
        if err == "closed" then break end
        relaybus.sleep(0.1)
      end
      assert.truthy(answered, "no answer: " .. got:sub(1, 200))
      local t0 = relaybus.now()
      local head = "GET /metrics HTTP/1.1\r\nX-Slow: " .. string.rep("a", 200)
      for i = 1, 150 do     -- the next head a byte every 0.1 s, for 15 s at most
        local _, err = c:receive(1)
        if err ~= "timeout" then closed_after = relaybus.now() - t0 break end
        c:send(head:sub(i, i))
        relaybus.sleep(0.1)
      end
      c:close()
    end)
    assert.truthy(closed_after, "still open 15 s after its answer")
    assert.is_true(closed_after >= 9.5 and closed_after < 12, ("closed after %.1f s"):format(closed_after))
  end)

  it("says so when the port is taken", function()
    local store = S.open(S.list()[1], { migrate = true })
    D.with_server(store, nil, function(srv)
      local other, err = relaybus.serve { store = store, listen = "127.0.0.1:" .. srv:port() }
      assert.is_nil(other)
      assert.matches("cannot listen", err)
    end)
  end)
end)

describe("relaybus dashboard", function()
  after_each(function() S.reset() end)

  it("prints its URL, serves, and stops on SIGTERM and SIGINT", function()
    local url = "sqlite:" .. S.tmpfile("cli") .. ".db"
    local store = relaybus.open(url, { migrate = true })
    store:enqueue("cli", {})
    store:close()
    for _, sig in ipairs { "TERM", "INT" } do
      local p = S.spawn(nil, nil, { argv = { S.bin, "dashboard", "--listen", "127.0.0.1:0", url },
                                    env = { RELAYBUS_DASHBOARD_TOKEN = D.TOKEN } })
      assert.truthy(S.wait_for(function() return (S.read(p.out) or ""):match("http://%S+") end, 20),
                    "no URL printed: " .. tostring(S.read(p.err)))
      local base = S.read(p.out):match("(http://%S+)/")
      local c = io.popen(S.foreign("curl -m 30 -s -X POST -H 'Authorization: Bearer " .. D.TOKEN .. "' " ..
                                   base .. "/api/deliveries/kick?status=buried"))
      local body = c:read("a")
      c:close()
      assert.equal('{"ok":true,"count":0}', body)
      -- each action leaves one audit line with what it changed
      assert.truthy(S.wait_for(function()
        return (S.read(p.err) or ""):find("dashboard: kick every buried delivery: 0 changed", 1, true)
      end, 10), "no audit line: " .. tostring(S.read(p.err)))
      S.signal(p, sig)
      assert.truthy(S.wait_for(function() return S.rc(p) end, 20), "did not stop on SIG" .. sig)
      assert.equal(0, S.rc(p))
    end
  end)

  it("logs one audit line per action, with what it changed and the filter it took", function()
    local url = "sqlite:" .. S.tmpfile("cli") .. ".db"
    local store = relaybus.open(url, { migrate = true })
    local ids = D.fill(store)       -- 2 completed "ok", 1 buried "bad", 1 pending "later"
    store:close()
    local p = S.spawn(nil, nil, { argv = { S.bin, "dashboard", "--listen", "127.0.0.1:0", url },
                                  env = { RELAYBUS_DASHBOARD_TOKEN = D.TOKEN } })
    assert.truthy(S.wait_for(function() return (S.read(p.out) or ""):match("http://%S+") end, 20))
    local base = S.read(p.out):match("(http://%S+)/")
    local function post(path, method)
      local c = io.popen(S.foreign("curl -m 30 -s -X " .. (method or "POST") .. " -H 'Authorization: Bearer "
        .. D.TOKEN .. "' '" .. base .. path .. "'"))
      local body = c:read("a")
      c:close()
      return body
    end
    assert.equal('{"ok":true,"count":0}', post("/api/deliveries/kick?status=buried&topic=ok"))
    assert.equal('{"ok":true,"count":1}', post("/api/deliveries/kick?status=buried&topic=bad"))
    post("/api/deliveries/" .. ids.completed[1] .. "/cancel")     -- completed: nothing to cancel
    post("/api/deliveries/" .. ids.pending[1] .. "/cancel")
    post("/api/deliveries/" .. ids.completed[2], "DELETE")
    -- a topic that would break the line, or pass for another's words, stays quoted on one line
    post("/api/deliveries/cancel?topic=x%0Adashboard:%20delete%20every%20%22delivery")
    post("/api/deliveries?status=buried&topic=" .. ("%C3%A9"):rep(40), "DELETE")
    local want = { 'dashboard: kick every buried delivery of topic "ok": 0 changed',
                   'dashboard: kick every buried delivery of topic "bad": 1 changed',
                   'dashboard: cancel every pending or processing delivery of topic'
                     .. ' "x\\u000adashboard: delete every \\"delivery": 0 changed',
                   'dashboard: delete every buried delivery of topic "' .. ("\u{e9}"):rep(30) .. '" [cut]: 0 changed',
                   "dashboard: cancel delivery " .. ids.completed[1] .. ": 0 changed",
                   "dashboard: cancel delivery " .. ids.pending[1] .. ": 1 changed",
                   "dashboard: delete delivery " .. ids.completed[2] .. ": 1 changed" }
    assert.truthy(S.wait_for(function()
      local err = S.read(p.err) or ""
      for _, line in ipairs(want) do if not err:find(line, 1, true) then return false end end
      return true
    end, 10), "audit lines: " .. tostring(S.read(p.err)))
    S.signal(p, "TERM")
    assert.truthy(S.wait_for(function() return S.rc(p) end, 20))
  end)

  it("stats --topics counts per topic", function()
    local url = "sqlite:" .. S.tmpfile("cli") .. ".db"
    local store = relaybus.open(url, { migrate = true })
    store:enqueue("a", {}); store:enqueue("a", {}); store:enqueue(D.XSS, {})
    store:close()
    local f = io.popen(S.quote(S.bin) .. " stats --topics --json --store " .. S.quote(url))
    local rows = relaybus.json.decode(f:read("a"))
    f:close()
    assert.same({ { topic = D.XSS, pending = 1, processing = 0, completed = 0, buried = 0, cancelled = 0 },
                  { topic = "a", pending = 2, processing = 0, completed = 0, buried = 0, cancelled = 0 } }, rows)
    f = io.popen(S.quote(S.bin) .. " stats --topics --store " .. S.quote(url))
    local text = f:read("a")
    f:close()
    assert.matches("TOPIC%s+PENDING%s+PROCESSING%s+COMPLETED%s+BURIED%s+CANCELLED", text)
    assert.matches("\na%s+2%s+0%s+0%s+0%s+0", text)
  end)

  it("refuses bad arguments", function()
    for _, a in ipairs { { "dashboard", "--listen", "nope" }, { "dashboard", "--token", "short" },
                         { "dashboard", "a", "b" } } do
      local cmd = S.quote(S.bin)
      for _, x in ipairs(a) do cmd = cmd .. " " .. S.quote(x) end
      local ok, _, code = os.execute(cmd .. " >/dev/null 2>&1")
      assert.falsy(ok)
      assert.equal(2, code)
    end
    -- a short token from the environment: one "relaybus:" prefix, not two
    local url = "sqlite:" .. S.tmpfile("dash") .. ".db"
    assert(relaybus.open(url, { migrate = true })):close()
    local f = io.popen("RELAYBUS_DASHBOARD_TOKEN=short " .. S.quote(S.bin) .. " dashboard " .. S.quote(url) .. " 2>&1")
    local out = f:read("a")
    f:close()
    assert.equal("relaybus: dashboard: serve: token must be at least 8 characters\n", out)
  end)
end)
