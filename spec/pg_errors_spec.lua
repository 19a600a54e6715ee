-- pg_errors_spec.lua -- what users and servers get wrong on PostgreSQL (RELAYBUS_TEST_PG only):
-- wrong credentials, table names with quotes, values PostgreSQL refuses (a NUL in a payload, a
-- topic or a key), and the documented plain SQL enqueue that any language can use, which a
-- running dispatcher must pick up at once (the NOTIFY trigger), not at its next poll.
-- Runtime failures give nil and a one-line error; misuse raises "relaybus: ...". Nothing is
-- lost and nothing is half-written.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local F = require "spec.support.fault_util"
local relaybus = S.relaybus()

local WORKER = S.support .. "/worker.lua"

local refused = H.refused

-- A runtime failure: nil and a one-line error (no raise). Returns the message.
local function fails(fn, ...)
  local ok, res, err = pcall(fn, ...)
  assert.is_true(ok, "raised instead of returning nil, err: " .. tostring(res))
  assert.is_nil(res, "accepted")
  H.one_line(err)
  return err
end

-- The server's URL with another user (or database): postgresql://USER@host:port/DB?query
local function with_user(url, user)
  local scheme, rest = url:match("^(%a+://)(.*)$")
  rest = rest:gsub("^[^@/]*@", "")
  return scheme .. user .. "@" .. rest
end
local function with_db(url, db)
  return (url:gsub("^(%a+://[^/]*/)[^?]*", "%1" .. db))
end

local entry
for _, e in ipairs(S.list()) do if e.name == "postgresql" then entry = e end end

if entry then
  describe("bad input on PostgreSQL:", function()
    local store, url, opts, tbl

    before_each(function() store, url, opts, tbl = S.open(entry) end)
    after_each(S.reset)
    teardown(function() S.cleanup() end)

    -- relnames in the database that start with `prefix`
    local function relations(prefix)
      local ok, rows = store:transaction(function(tx)
        return tx:query("SELECT relname FROM pg_class WHERE starts_with(relname, $1)", prefix)
      end)
      assert.is_true(ok, rows)
      return rows
    end

    it("wrong credentials (a role that does not exist): open returns nil and a one-line error naming the role", function()
      local role = S.unique("nosuchrole")
      local t0 = relaybus.now()
      local s, err = relaybus.open(with_user(url, role), { table = S.unique("rb") })
      assert.is_nil(s)
      H.one_line(err)
      assert.truthy(err:find(role, 1, true) or err:lower():find("auth", 1, true), err)
      assert.is_true(relaybus.now() - t0 < 10)
    end)

    it("a database that does not exist: open returns nil and a one-line error", function()
      local db = S.unique("nosuchdb")
      local s, err = relaybus.open(with_db(url, db), { table = S.unique("rb") })
      assert.is_nil(s)
      H.one_line(err)
      assert.truthy(err:find(db, 1, true), err)
    end)

    it("the command with wrong credentials exits 1 with a one-line error", function()
      local code, out, err = S.run_command({ S.bin, "stats", "--store", with_user(url, S.unique("nosuchrole")) })
      assert.equal(1, code, out .. err)
      H.one_line((err:gsub("\n$", "")), "stderr")
    end)

    it("refuses a table name with a quote in it and creates nothing", function()
      local prefix = S.unique("q")
      for _, name in ipairs { prefix .. '"x', prefix .. "'x", prefix .. '"; DROP TABLE x; --',
                              prefix .. '""', prefix .. "\\x" } do
        local msg = refused(relaybus.open, url, { table = name })
        assert.is_string(msg, "table " .. name)
      end
      assert.same({}, relations(prefix))
    end)

    it("a payload PostgreSQL rejects (a NUL in a string, jsonb refuses \\u0000) gives nil, err and writes nothing", function()
      for i, p in ipairs { "a\0b", { note = "x\0" }, { list = { "ok", "\0" } } } do
        local err = fails(store.enqueue, store, "pi.nul", p)
        assert.truthy(err:find("NUL", 1, true), "payload #" .. i .. ": " .. err)
      end
      -- a NUL in a key is refused before any store sees it (JSON parsers cannot read it back)
      assert.is_string(refused(store.enqueue, store, "pi.nul", { ["k\0ey"] = 1 }))
      fails(store.enqueue_json, store, "pi.nul", '{"note": "x\\u0000"}')
      assert.equal(0, (H.total(store)))
      -- enqueue_many is all or none
      fails(store.enqueue_many, store, { { "pi.nul", 1 }, { "pi.nul", "bad\0" }, { "pi.nul", 3 } })
      assert.equal(0, (H.total(store)))
      -- in a transaction: the transaction fails and nothing of it is written
      local app = tbl .. "_app"
      assert(store:transaction(function(tx) tx:exec("CREATE TABLE " .. app .. " (n integer)") end))
      local ok, err = store:transaction(function(tx)
        tx:exec("INSERT INTO " .. app .. " (n) VALUES (1)")
        assert(tx:enqueue("pi.nul", "a\0b"))
      end)
      assert.is_nil(ok)
      H.one_line(err)
      assert.equal(0, (H.total(store)))
      local _, rows = store:transaction(function(tx) return tx:query("SELECT n FROM " .. app) end)
      assert.same({}, rows)
      -- and the store still works
      local id = assert(store:enqueue("pi.nul", { fine = "yes" }))
      assert.same({ fine = "yes" }, assert(store:get(id)).payload)
    end)

    -- (found by a hostile review of the group hand-off; as old as groups: an operator's
    -- cancel of a held delivery locks its row, then its trigger waits for the group's lock,
    -- which a claim settling the group's head holds while it waits for that row)
    it("an operator's cancel that PostgreSQL aborts to break a deadlock goes again and cancels", function()
      assert(store:enqueue("dl", 1, { group = "g" }))
      local held = assert(store:enqueue("dl", 2, { group = "g" }))
      local other = assert(relaybus.open(url, opts))
      local key = "(('\"" .. tbl .. "\"'::regclass::oid::bigint << 32) | (hashtext('g')::bigint & 4294967295))"
      local tx_ok, tx_err, cancelled, cancel_err, done = nil, nil, nil, nil, 0
      relaybus.spawn(function()
        -- the group's lock first, then (once the cancel holds the row) the row
        tx_ok, tx_err = other:transaction(function(tx)
          assert(tx:query("SELECT pg_advisory_xact_lock(" .. key .. ")"))
          relaybus.sleep(0.4)
          assert(tx:exec('UPDATE "' .. tbl .. '" SET payload = payload WHERE id = ' .. held))
          return true
        end)
        done = done + 1
      end)
      relaybus.spawn(function()
        relaybus.sleep(0.1)
        cancelled, cancel_err = store:cancel(held)
        done = done + 1
      end)
      assert.is_true(H.poll(function() return done == 2 end, 15), "the two did not finish")
      other:close()
      -- PostgreSQL aborted one of the two (the cancel, which waited first): both succeed
      assert.is_true(tx_ok, tx_err)
      assert.is_nil(cancel_err)
      assert.is_true(cancelled)
      assert.equal("cancelled", assert(store:get(held)).status)
    end)

    it("a statement of a user's transaction that a deadlock aborts is not sent again: the transaction fails", function()
      local a = assert(store:enqueue("dl", 1))
      local b = assert(store:enqueue("dl", 2))
      local other = assert(relaybus.open(url, opts))
      local upd = 'UPDATE "' .. tbl .. '" SET payload = payload WHERE id = '
      local res, done = {}, 0
      -- two transactions that lock the two rows in opposite orders
      local function side(st, first, second, wait)
        relaybus.spawn(function()
          local ok, err = st:transaction(function(tx)
            assert(tx:exec(upd .. first))
            relaybus.sleep(wait)
            local ok2, err2 = tx:exec(upd .. second)
            if not ok2 then error(err2, 0) end
            return true
          end)
          res[#res + 1] = { ok = ok, err = err }
          done = done + 1
        end)
      end
      side(store, a, b, 0.3)
      side(other, b, a, 0.5)
      assert.is_true(H.poll(function() return done == 2 end, 15), "the two did not finish")
      other:close()
      local failed = 0
      for _, r in ipairs(res) do
        if not r.ok then
          failed = failed + 1
          H.one_line(tostring(r.err))
          assert.truthy(tostring(r.err):find("deadlock", 1, true), tostring(r.err))
        end
      end
      assert.equal(1, failed)
    end)

    it("a topic or dedupe key with a NUL in it is refused or kept whole, never cut at the NUL", function()
      local function check(topic, key)
        local ok, id, err = pcall(store.enqueue, store, topic, 1, { key = key })
        if not ok then
          assert.truthy(tostring(id):match("^relaybus:"), tostring(id))
          return
        end
        if id == nil then H.one_line(err) return end
        local r = assert(store:get(id))
        assert.equal(#topic, #r.topic, "the topic was stored as '" .. r.topic .. "'")
        assert.equal(#key, #(r.key or ""), "the key was stored as '" .. tostring(r.key) .. "'")
      end
      check("pi.topic\0x", "k1")
      check("pi.key", "k\0x")
      -- two keys that differ after the NUL are two deliveries (or both refused)
      local oka, a = pcall(store.enqueue, store, "pi.key2", 1, { key = "same\0a" })
      local okb, b = pcall(store.enqueue, store, "pi.key2", 2, { key = "same\0b" })
      assert.equal(oka, okb, "one key with a NUL was refused, the other not")
      if oka and a and b then assert.are_not.equal(a, b, "keys that differ after a NUL deduplicated") end
    end)

    describe("plain SQL enqueue (its own database, the default table)", function()
      local db, dburl

      setup(function()
        db = S.unique("rbin")
        local ok, _, err = F.psql(entry.url(), "CREATE DATABASE " .. db)
        assert(ok, "CREATE DATABASE: " .. tostring(err))
        dburl = with_db(entry.url(), db)
      end)
      teardown(function()
        S.kill_all()
        if db then F.psql(entry.url(), "DROP DATABASE IF EXISTS " .. db .. " WITH (FORCE)") end
      end)

      it("INSERT INTO relaybus_deliveries (topic, payload) VALUES (...) is picked up by an idle dispatcher well within its 10 s poll interval", function()
        local s = assert(relaybus.open(dburl))
        local log = S.tmpfile("w") .. ".log"
        local p = S.spawn(WORKER, { dburl, "-", log }, { env = { RB_POLL = "10", RB_CONC = "4" } })
        assert.truthy(S.wait_for(function() return F.count(log, "READY") > 0 end, 20),
          "the worker did not start: " .. (S.read(p.err) or ""))
        local function insert(n)
          local t0 = relaybus.now()
          local ok, _, err = F.psql(dburl, string.format(
            "INSERT INTO relaybus_deliveries (topic, payload) VALUES ('work', '{\"n\": %d}')", n))
          assert.is_true(ok, "psql: " .. tostring(err))
          return t0
        end
        local function started(count)
          return S.wait_for(function() return F.count(log, "S") >= count end, 15)
        end
        -- the first one also waits for the listener to be up (at worst it comes with a poll)
        insert(0)
        assert.truthy(started(1), "the first plain insert never ran: " .. (S.read(p.err) or ""))
        assert.truthy(S.wait_for(function() return F.count(log, "E") >= 1 end, 10))
        local delays = {}
        for n = 1, 3 do
          local t0 = insert(n)
          assert.truthy(started(n + 1), "plain insert " .. n .. " never ran")
          local starts = {}
          for _, f in ipairs(F.parse(log)) do if f[1] == "S" then starts[#starts + 1] = tonumber(f[3]) end end
          delays[n] = starts[n + 1] - t0
          assert.truthy(S.wait_for(function() return F.count(log, "E") >= n + 1 end, 10))
        end
        if os.getenv("RELAYBUS_SPEC_VERBOSE") then
          io.stderr:write(string.format("\nplain insert to start: %.3f %.3f %.3f s\n", delays[1], delays[2], delays[3]))
        end
        for n, d in ipairs(delays) do
          assert.is_true(d < 1.0, string.format("plain insert %d started %.2f s later (poll interval 10 s)", n, d))
        end
        -- and they completed with their payloads
        assert.truthy(S.wait_for(function() return assert(s:stats()).completed == 4 end, 10))
        local done = assert(s:list { status = "completed" })
        assert.equal(4, #done)
        for i, r in ipairs(done) do
          assert.equal("work", r.topic)
          assert.same({ n = i - 1 }, r.payload)
          assert.equal(25, r.max_attempts)
        end
        S.signal(p, "TERM")
        assert.equal(0, S.wait_exit(p, 15))
        s:close()
      end)
    end)
  end)
end
