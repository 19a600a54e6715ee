-- group_commit_spec.lua -- SQLite group commit under attack: a second process holding the write
-- lock while 64 tasks enqueue, store:close() while enqueues wait for the end of the iteration,
-- idempotency keys colliding in one group, a user transaction beside grouped enqueues.
local S = require "spec.support.stores"
local relaybus = S.relaybus()
local testing = S.testing()   -- the specs' own module (testing/lua_testing.c)

local entry
for _, e in ipairs(S.list()) do if e.name == "sqlite" then entry = e end end

describe("SQLite group commit under attack:", function()
  local store, url
  before_each(function() store, url = S.open(entry) end)
  after_each(S.reset)
  teardown(function() S.cleanup() end)

  local function count(topic)
    local f = io.popen("sqlite3 " .. url:gsub("^sqlite:", "") .. " \"SELECT COUNT(*) FROM "
                       .. S.default_table .. " WHERE topic = '" .. topic .. "'\"")
    local n = tonumber(f:read("a")); f:close()
    return n
  end

  it("64 tasks enqueue while another process holds the write lock for 2 s: every one succeeds", function()
    local file = url:gsub("^sqlite:", "")
    assert(store:enqueue("rg.warm", 1))
    local holder = io.popen("sqlite3 " .. file .. " 'BEGIN IMMEDIATE;' '.shell sleep 2' 'COMMIT;' 2>&1; echo held", "r")
    -- give the holder time to take the lock (it is not asserted: the enqueues must succeed either way)
    os.execute("sleep 0.3")
    local ok, bad = 0, {}
    for i = 1, 64 do
      relaybus.spawn(function()
        local id, err = store:enqueue("rg.busy", { i = i })
        if id then ok = ok + 1 else bad[#bad + 1] = tostring(err) end
      end)
    end
    relaybus.run()
    local out = holder:read("a"); holder:close()
    assert.matches("held", out)
    assert.same({}, bad)
    assert.equal(64, ok)
    assert.equal(64, count("rg.busy"))
  end)

  it("store:close() while enqueues wait for the end of the iteration: each one is told, none half written", function()
    local results = {}
    for i = 1, 10 do
      relaybus.spawn(function()
        local id, err = store:enqueue("rg.close", { i = i })
        results[#results + 1] = { id = id, err = err }
      end)
    end
    relaybus.spawn(function() store:close() end)
    relaybus.run()
    assert.equal(10, #results)
    local okn = 0
    for _, r in ipairs(results) do
      if r.id then okn = okn + 1 else assert.matches("closed", tostring(r.err)) end
    end
    local n = 0
    for _, r in ipairs(results) do if r.id then n = n + 1 end end
    assert.equal(okn, count("rg.close"))
  end)

  it("idempotency keys colliding inside one group give one delivery and the same id", function()
    local ids = {}
    for i = 1, 8 do
      relaybus.spawn(function() ids[i] = assert(store:enqueue("rg.key", { i = i }, { key = "same" })) end)
    end
    relaybus.run()
    for i = 2, 8 do assert.equal(ids[1], ids[i]) end
    assert.equal(1, count("rg.key"))
  end)

  it("a user transaction beside grouped enqueues: its rollback takes only its own", function()
    local done = 0
    for i = 1, 8 do
      relaybus.spawn(function() assert(store:enqueue("rg.out", { i = i })); done = done + 1 end)
    end
    local txr, txerr
    relaybus.spawn(function()
      txr, txerr = store:transaction(function(tx)
        assert(tx:enqueue("rg.in", 1))
        error("roll back")
      end)
    end)
    relaybus.run()
    assert.is_nil(txr)
    assert.matches("roll back", tostring(txerr))
    assert.equal(8, done)
    assert.equal(8, count("rg.out"))
    assert.equal(0, count("rg.in"))
  end)
end)

describe("SQLite group commit out of memory:", function()
  local store
  before_each(function() store = S.open(entry) end)
  after_each(function() testing.fail_alloc(0); S.reset() end)
  teardown(function() S.cleanup() end)

  it("an allocation failing during a group: what succeeded is there, what failed is not, errors are one line", function()
    local total = 0
    for n = 1, 60 do
      local topic = "rg.oom" .. n
      local ids, errs = {}, {}
      testing.fail_alloc(n)
      for i = 1, 8 do
        relaybus.spawn(function()
          local ok, id, err = pcall(store.enqueue, store, topic, { i = i })
          if ok and id then ids[#ids + 1] = id else errs[#errs + 1] = ok and err or id end
        end)
      end
      pcall(relaybus.run)
      testing.fail_alloc(0)
      for _, e in ipairs(errs) do
        assert.is_string(e)
        assert.is_nil(e:find("\n"), e)
      end
      for _, id in ipairs(ids) do
        local r = assert(store:get(id), "a reported id is missing: " .. id)
        assert.equal(topic, r.topic)
      end
      total = total + #ids
      local st = assert(store:stats())
      assert.equal(total, st.pending, "n=" .. n .. ": rows beside the ids reported")
    end
  end)
end)

describe("SQLite group commit and SIGKILL:", function()
  local store, url
  before_each(function() store, url = S.open(entry) end)
  after_each(S.reset)
  teardown(function() S.cleanup() end)

  it("an enqueuer killed mid-group: every id it was given is in the store", function()
    for round = 1, 3 do
      local log = S.tmpfile("enq") .. ".log"
      local p = S.spawn(S.support .. "/enqueuer.lua", { url, log })
      assert.truthy(S.wait_for(function() local t = S.read(log); return t and #t > 2000 * round end, 20),
        "the enqueuer logged nothing: " .. tostring(S.read(p.err)))
      S.kill(p)
      local n = 0
      for id in (S.read(log) or ""):gmatch("OK (%d+)\n") do
        n = n + 1
        assert(store:get(id), "round " .. round .. ": id " .. id .. " was reported but is missing")
      end
      assert.is_true(n > 0)
    end
  end)
end)

describe("SQLite group commit and a full database:", function()
  teardown(function() S.cleanup() end)

  -- A group whose commit finds the disk full fails whole, and says so to each of its callers;
  -- the groups before it are there, none half written. (A failure inside a group, which rolls
  -- SQLite's transaction back under the later jobs, is the out-of-memory case above.) The disk is full
  -- for real: a small tmpfs in a mount namespace of the child's own (`unshare -r -m` works
  -- without root where user namespaces are allowed, and as root).
  it("enqueues told they failed wrote nothing, and those told they succeeded are there", function()
    local dir = S.tmpfile("fulldisk")
    assert(os.execute("mkdir -p " .. S.quote(dir)))
    local inner = "mount -t tmpfs -o size=4m tmpfs " .. S.quote(dir) .. " && exec "
                  .. S.quote(S.bin) .. " run " .. S.quote(S.support .. "/full_disk.lua") .. " " .. S.quote(dir)
    local code, out, err = S.run_command({ "unshare", "-r", "-m", "sh", "-c", inner })
    assert.equal(0, code, "the child failed: " .. out .. err)
    local errs, ids, multiline, missing, pending =
      out:match("errs=(%d+) ids=(%d+) multiline=(%d+) missing=(%d+) pending=(%d+)")
    assert(errs, "no summary line: " .. out .. err)
    assert.is_true(tonumber(errs) > 0, "nothing failed: the disk did not fill: " .. out)
    assert.is_true(tonumber(ids) > 0, "nothing succeeded: the room left was too small: " .. out)
    assert.equal(64, tonumber(errs) + tonumber(ids))
    assert.equal(0, tonumber(multiline), "an error of more than one line: " .. out)
    assert.equal(0, tonumber(missing), "reported ids missing: " .. out)
    assert.equal(tonumber(ids), tonumber(pending), "rows written beside the ones reported: " .. out)
  end)
end)
