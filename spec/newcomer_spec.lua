-- newcomer_spec.lua -- the documentation's programs run as written. The spec extracts the code
-- blocks marked `<!-- file: NAME -->` from README.md and docs/*.md and runs them the way the text
-- says, with only the addresses replaced (the test's own PostgreSQL, a local receiver) and
-- `relaybus` found on PATH: a doc change that breaks an example fails here.
local S = require "spec.support.stores"

local ROOT = os.getenv("PWD") or "."
local BUILD = S.build

-- Every `<!-- file: NAME -->` block of the docs, by name.
local function doc_files()
  local files = {}
  local docs = { ROOT .. "/README.md" }
  local p = io.popen("ls " .. S.quote(ROOT .. "/docs") .. "/*.md 2>/dev/null")
  for line in p:lines() do docs[#docs + 1] = line end
  p:close()
  for _, path in ipairs(docs) do
    local text = assert(S.read(path))
    for name, body in text:gmatch("<!%-%- file: (%S+) %-%->%s*```%w*\n(.-)\n```") do
      assert(not files[name], name .. " appears twice in the docs")
      files[name] = body .. "\n"
    end
  end
  return files
end

local files = doc_files()

local function sh(script, env, cwd)
  local path = S.tmpfile("block") .. ".sh"
  local lines = { "set -e", "cd " .. S.quote(cwd or S.tmpdir()),
                  "export PATH=" .. S.quote(BUILD) .. ":$PATH" }
  for k, v in pairs(env or {}) do lines[#lines + 1] = "export " .. k .. "=" .. S.quote(v) end
  lines[#lines + 1] = script
  S.write(path, table.concat(lines, "\n") .. "\n")
  return S.run_command({ "timeout", "60", "sh", path })
end

describe("the first hour (docs/first-hour.md, run as written)", function()
  local receiver
  setup(function()
    local bin = BUILD .. "/http_receiver"
    assert(S.exists(bin), "build/http_receiver is missing (make examples)")
    -- kept open for the whole spec: the receiver lives as long as its pipe
    local p = assert(io.popen("exec " .. S.quote(bin) .. " -"))
    local port, pid = (p:read("l") or ""):match("^(%d+) (%d+)$")
    assert(port, "the receiver printed no port")
    receiver = { url = "http://127.0.0.1:" .. port, pid = pid, proc = p }
  end)
  teardown(function()
    if receiver then
      os.execute("kill " .. receiver.pid)
      receiver.proc:close()
    end
    S.cleanup()
  end)

  it("the docs hold every program this spec runs", function()
    for _, name in ipairs { "outbox.lua", "outbox.sh", "kick.sh", "credits.lua", "groups.lua", "schedules.lua", "flow.lua", "partner.lua", "embed.sh" } do
      assert.is_string(files[name], name .. " is not in the docs")
    end
  end)

  -- The receiver's count of webhook POSTs to /count, all deliveries together.
  local function posts()
    local res = assert(S.relaybus().http.request { url = receiver.url .. "/counts" })
    local n = 0
    for _, c in pairs(S.relaybus().json.decode(res.body)) do n = n + c end
    return n
  end

  it("the PostgreSQL outbox delivers through the webhook, buries a refused one, a kick brings it back, runs again send nothing more, and each run exits while other work is pending", function()
    local pg = assert(os.getenv("RELAYBUS_TEST_PG"), "RELAYBUS_TEST_PG is not set")
    local dir = S.tmpdir() .. "/" .. S.unique("outbox")
    os.execute("mkdir -p " .. S.quote(dir))
    S.write(dir .. "/outbox.lua", files["outbox.lua"])
    -- a fresh database of our own, so the block's table and the default table start empty
    local db = S.unique("app"):lower()
    local crc, _, cerr = S.run_command({ "psql", "-q", pg, "-c", "CREATE DATABASE " .. db })
    assert.equal(0, crc, cerr)
    local url = pg:gsub("/[^/]*$", "/" .. db)
    -- work of another program in the same store, which no run of outbox.lua handles: each run
    -- must exit when its own work is done all the same
    local other = assert(S.relaybus().open(url))
    assert(other:enqueue("invoice.due", { invoice = 7 }))
    other:close()
    local function run_outbox(hook)
      local script = files["outbox.sh"]:gsub("postgresql://localhost/app", url)
        :gsub("http://127%.0%.0%.1:8080/hooks", hook)
      local t0 = S.mono()
      local rc, out, err = sh(script, nil, dir)
      assert.is_true(S.mono() - t0 < 20, string.format("outbox.lua ran %.1f s (exit %s): %s",
        S.mono() - t0, tostring(rc), err))
      return rc, out, err
    end
    -- a receiver whose route is missing: buried
    local rc, out, err = run_outbox(receiver.url .. "/status/404")
    assert.equal(0, rc, err)
    assert.truthy(out:find("order.created%s+%S+%s+buried%s+HTTP 404"), out)
    rc, out, err = sh(files["kick.sh"], { RELAYBUS_STORE = url }, dir)
    assert.equal(0, rc, err)
    assert.truthy(out:find("buried"), out)
    assert.truthy(out:match("\n1\n$"), "kick did not report one delivery: " .. out)
    -- fixed: the next run delivers it (the transaction adds no second order: ON CONFLICT)
    local before = posts()
    rc, out, err = run_outbox(receiver.url .. "/count")
    assert.equal(0, rc, err)
    assert.truthy(out:find("order.created%s+%S+%s+completed"), out)
    -- the order exists: runs again enqueue nothing, so nothing more is sent
    for _ = 1, 2 do
      rc, out, err = run_outbox(receiver.url .. "/count")
      assert.equal(0, rc, err)
      assert.is_nil(out:find("order.created", 1, true), out)
    end
    assert.equal(1, posts() - before, "POSTs of the one order over three runs")
    local store = assert(S.relaybus().open(url))
    local orders = assert(store:list { topic = "order.created" })
    assert.equal(1, #orders, "deliveries of the one order")
    assert.equal("completed", orders[1].status)
    assert.equal("pending", assert(store:list { topic = "invoice.due" })[1].status)
    store:close()
  end)

  it("the transactional handler on SQLite credits each payment once", function()
    local dir = S.tmpdir() .. "/" .. S.unique("credits")
    os.execute("mkdir -p " .. S.quote(dir))
    S.write(dir .. "/credits.lua", files["credits.lua"])
    local rc, out, err = sh("relaybus run credits.lua", nil, dir)
    assert.equal(0, rc, err)
    assert.truthy(out:find("payment%s+%S+%s+completed"), out)
    assert.truthy(out:find("ada has%s+1500"), out)
    rc, out, err = sh("relaybus run credits.lua", nil, dir)
    assert.equal(0, rc, err)
    assert.truthy(out:find("ada has%s+3000"), out)
  end)

  it("the groups example runs each account's events in order, the failed one retried in its place", function()
    local dir = S.tmpdir() .. "/" .. S.unique("groups")
    os.execute("mkdir -p " .. S.quote(dir))
    S.write(dir .. "/groups.lua", files["groups.lua"])
    local rc, out, err = sh("relaybus run groups.lua", nil, dir)
    assert.equal(0, rc, err)
    local seen = {}
    for account, event in out:gmatch("(%a+)%s+(%a+)\n") do
      seen[account] = seen[account] or {}
      table.insert(seen[account], event)
    end
    assert.same({ "opened", "paid", "closed" }, seen.ada, out)
    assert.same({ "opened", "closed" }, seen.bob, out)
    assert.truthy(err:find("the ledger is busy", 1, true), err)
  end)

  it("the schedules example fires three heartbeats a second apart, and lists the nightly report", function()
    local dir = S.tmpdir() .. "/" .. S.unique("schedules")
    os.execute("mkdir -p " .. S.quote(dir))
    S.write(dir .. "/schedules.lua", files["schedules.lua"])
    local rc, out, err = sh("relaybus run schedules.lua", nil, dir)
    assert.equal(0, rc, err)
    local ticks = {}
    for h, m, sec in out:gmatch("beat%s+heartbeat@%d+%-%d+%-%d+T(%d+):(%d+):([%d.]+)Z\n") do
      ticks[#ticks + 1] = tonumber(h) * 3600 + tonumber(m) * 60 + tonumber(sec)
    end
    assert.equal(3, #ticks, out)
    for i = 2, 3 do
      local gap = (ticks[i] - ticks[i - 1]) % 86400
      assert.is_true(math.abs(gap - 1) < 0.01, out)
    end
    rc, out, err = sh("relaybus schedules --store sqlite:schedules.db", nil, dir)
    assert.equal(0, rc, err)
    assert.truthy(out:find("nightly%-report%s+report%.build%s+cron 0 3 %* %* %* %(Europe/Berlin%)%s+%d+%-%d+%-%d+ 0[12]:00:00"), out)
    assert.is_nil(out:find("heartbeat", 1, true), out)
  end)

  it("the dependencies example runs the report after its three parts", function()
    local dir = S.tmpdir() .. "/" .. S.unique("flow")
    os.execute("mkdir -p " .. S.quote(dir))
    S.write(dir .. "/flow.lua", files["flow.lua"])
    local rc, out, err = sh("relaybus run flow.lua", nil, dir)
    assert.equal(0, rc, err)
    assert.truthy(out:find("^report waits for%s+3%s+parts\n"), out)
    local lines = {}
    for line in out:gmatch("[^\n]+") do lines[#lines + 1] = line end
    assert.equal(5, #lines, out)
    local regions = {}
    for i = 2, 4 do regions[#regions + 1] = lines[i]:match("^figures%s+(%a+)$") end
    table.sort(regions)
    assert.same({ "east", "north", "south" }, regions, out)
    assert.truthy(lines[5]:match("^report%s+2026%-11$"), out)
  end)

  it("the partner example keeps its limits and its pause, replaces by key, cancels, and shows progress", function()
    local dir = S.tmpdir() .. "/" .. S.unique("partner")
    os.execute("mkdir -p " .. S.quote(dir))
    S.write(dir .. "/partner.lua", files["partner.lua"])
    local t0 = S.mono()
    local rc, out, err = sh("relaybus run partner.lua", nil, dir)
    local took = S.mono() - t0
    assert.equal(0, rc, err)
    local lines = {}
    for line in out:gmatch("[^\n]+") do lines[#lines + 1] = line end
    assert.equal(10, #lines, out)
    assert.equal("paused: synced 0", lines[1])
    local names = {}
    for i = 2, 9 do
      local user, name = lines[i]:match("^synced%s+(%d+)%s+(.+)$")
      assert.truthy(user, out)
      names[tonumber(user)] = name
    end
    assert.equal("Ada L.", names[1], out)
    for user = 2, 8 do assert.equal("u" .. user, names[user], out) end
    assert.equal("at most 2 at once; user 1 sent; export cancelled", lines[10])
    -- 8 starts at 5 a second take over a second after the half-second pause
    assert.is_true(took > 1.5, ("ran %.2f s"):format(took))
    rc, out, err = sh("relaybus limits --store sqlite:partner.db", nil, dir)
    assert.equal(0, rc, err)
    assert.truthy(out:find("partner.sync", 1, true), out)
  end)

  it("the embedding commands build and run a host, shared and static, from a fresh prefix", function()
    local home = S.tmpdir() .. "/" .. S.unique("home")
    os.execute("mkdir -p " .. S.quote(home))
    -- the block builds and runs in the checkout, as a reader would; what it leaves goes after
    local rc, out, err = sh(files["embed.sh"], { HOME = home }, ROOT)
    for _, f in ipairs { "embed_host", "embed_host_static", "demo.db", "demo.db-wal", "demo.db-shm" } do
      os.remove(ROOT .. "/" .. f)
    end
    assert.equal(0, rc, out .. err)
    local _, n = out:gsub("deliveries done: 100 of 100", "")
    assert.equal(2, n, out)
  end)
end)
