-- one_line_errors_spec.lua -- what users and servers get wrong: bad store URLs, unknown options and
-- wrong types, payloads JSON cannot hold, a payload row that is not JSON, handlers that raise
-- odd values, broken scripts, read-only paths, and the command's exit codes. Each gives a
-- one-line error or a buried delivery with last_error: never a crash, and nothing is lost.
local S = require "spec.support.stores"
local H = require "spec.support.harness"
local relaybus = S.relaybus()

local raises_relaybus, refused = H.raises_relaybus, H.refused

describe("bad input:", function()
  teardown(function() S.cleanup() end)

  describe("opening a store", function()
    it("returns nil and a one-line error for a URL of no known scheme", function()
      for _, u in ipairs { "nosuch://host/db", "not a url", "", "sqlite" } do
        local s, err = relaybus.open(u)
        assert.is_nil(s, "opened '" .. u .. "'")
        H.one_line(err, "error for '" .. u .. "'")
      end
    end)

    it("returns nil and a one-line error for an unreachable PostgreSQL server, quickly", function()
      local t0 = relaybus.now()
      local s, err = relaybus.open("postgresql://relaybus@127.0.0.1:1/none?connect_timeout=2")
      assert.is_nil(s)
      H.one_line(err)
      assert.is_true(relaybus.now() - t0 < 10)
    end)

    it("returns nil and a one-line error for an unreachable MongoDB server, quickly", function()
      local t0 = relaybus.now()
      local s, err = relaybus.open("mongodb://127.0.0.1:1/none?serverSelectionTimeoutMS=1000&connectTimeoutMS=1000")
      assert.is_nil(s)
      H.one_line(err)
      assert.is_true(relaybus.now() - t0 < 15)
    end)

    it("returns nil and a one-line error for a SQLite file on a read-only or missing path", function()
      for _, path in ipairs { "/proc/relaybus-spec.db", "/proc/self/none/relaybus.db",
                               S.tmpdir() .. "/no/such/dir/relaybus.db" } do
        local s, err = relaybus.open("sqlite:" .. path)
        assert.is_nil(s, "opened " .. path)
        H.one_line(err, "error for " .. path)
      end
    end)

    it("refuses a table name that is not an identifier", function()
      for _, name in ipairs { "bad\"name", "drop table x;", "1abc", "a-b", "", string.rep("a", 200) } do
        local msg = refused(relaybus.open, "sqlite:" .. S.tmpfile("t") .. ".db", { table = name })
        assert.is_string(msg, "table '" .. name .. "'")
      end
    end)

    it("raises relaybus: for an unknown option and for wrong types", function()
      local url = "sqlite:" .. S.tmpfile("t") .. ".db"
      raises_relaybus(relaybus.open, url, { tabel = "x" })
      raises_relaybus(relaybus.open, url, { table = 5 })
      raises_relaybus(relaybus.open, url, { migrate = "yes please" })
      raises_relaybus(relaybus.open, 42)
    end)
  end)

  describe("the API", function()
    local store
    before_each(function()
      store = assert(relaybus.open("sqlite:" .. S.tmpfile("api") .. ".db"))
    end)
    after_each(function() store:close() end)

    it("raises relaybus: for an unknown option of enqueue, list, purge, dispatcher and handle", function()
      raises_relaybus(store.enqueue, store, "t", 1, { dealy = 5 })
      raises_relaybus(store.list, store, { statuss = "pending" })
      raises_relaybus(store.purge, store, { status = "completed", older_thn = 5 })
      raises_relaybus(relaybus.dispatcher, store, { leese_duration = 5 })
      local d = relaybus.dispatcher(store, {})
      raises_relaybus(d.handle, d, "t", function() end, { timout = 5 })
      assert.equal(0, (H.total(store)))
    end)

    it("raises relaybus: for wrong types", function()
      raises_relaybus(store.enqueue, store, nil, 1)
      raises_relaybus(store.enqueue, store, {}, 1)
      raises_relaybus(store.enqueue, store, "t", 1, { delay = "soon" })
      raises_relaybus(store.enqueue, store, "t", 1, { max_attempts = "many" })
      raises_relaybus(store.enqueue_many, store, "not a list")
      raises_relaybus(relaybus.dispatcher, store, { concurrency = "lots" })
      raises_relaybus(relaybus.dispatcher, "not a store", {})
      local d = relaybus.dispatcher(store, {})
      raises_relaybus(d.handle, d, "t", "not a function")
      assert.equal(0, (H.total(store)))
    end)

    it("close is idempotent", function()
      assert.has_no.errors(function() store:close(); store:close() end)
    end)

    it("d:handle refuses the topics enqueue refuses (empty, a NUL byte, not a string), in enqueue's words", function()
      local d = relaybus.dispatcher(store, {})
      for _, bad in ipairs { "", "a\0b", "\0", 5, {}, true } do
        local eerr = raises_relaybus(store.enqueue, store, bad, 1)
        local herr = raises_relaybus(d.handle, d, bad, function() end)
        assert.equal(eerr:gsub("enqueue", "handle"), herr)
      end
      assert.equal(0, (H.total(store)))
      -- the dispatcher took none of them: it still takes a good topic, and starts and stops
      d:handle("t", function() end)
      d:start()
      d:stop():wait()
    end)

    it("d:handle's errors stay one line whatever the topic and option names hold", function()
      local d = relaybus.dispatcher(store, {})
      d:handle("a\nb\27[31m", function() end)
      local err = raises_relaybus(d.handle, d, "a\nb\27[31m", function() end)
      assert.truthy(err:find("already has a handler", 1, true), err)
      assert.is_nil(err:find("\27", 1, true), err)
      raises_relaybus(d.handle, d, "u", function() end, { ["time\nout"] = 5 })
      raises_relaybus(store.enqueue, store, "t", 1, { ["de\nlay"] = 5 })
      err = raises_relaybus(d.handle, d, "u", "not a function")
      assert.equal("relaybus: handle: expected a function", err)
    end)

    -- enqueue_many's list, whichever way it was made: a constructor with a nil, or keys set one
    -- by one (then # may stop at the hole, and the items after it were dropped unseen).
    local function holed(kind)
      local a, b, c = { "h.a", 1 }, { "h.b", 2 }, { "h.c", 3 }
      if kind == "constructor" then return { a, nil, c }, "no item 2 " end
      if kind == "set" then
        local t = { a }
        t[3] = c
        return t, "no item 2 "
      end
      if kind == "1, 2, 4" then
        local t = {}
        t[1], t[2], t[4] = a, b, c
        return t, "no item 3 "
      end
      return { a, b, [2.5] = c }, "key 2.5 is no item index"
    end

    for _, kind in ipairs { "constructor", "set", "1, 2, 4", "2.5" } do
      it("enqueue_many refuses a list with a hole (" .. kind .. "), naming it, and writes nothing; tx:enqueue_many too", function()
        local list, hole = holed(kind)
        local err = raises_relaybus(store.enqueue_many, store, list)
        assert.truthy(err:find("^relaybus: enqueue_many: the list is not a sequence"), err)
        assert.truthy(err:find(hole, 1, true), err)
        local ok, terr = store:transaction(function(tx)
          tx:enqueue("h.before", 0)
          return tx:enqueue_many(list)
        end)
        assert.is_nil(ok)
        assert.equal(err, terr)
        assert.equal(0, (H.total(store)))
      end)
    end

    it("enqueue_many names the item in each of its errors, and writes nothing", function()
      local good = { "m.ok", 1 }
      local cases = {
        { { good, good, { "", 1 } }, "relaybus: enqueue_many: item 3: topic must be a non-empty string" },
        { { good, "x" }, "relaybus: enqueue_many: item 2: must be a table {topic, payload [, opts]}" },
        { { { "a\0b", 1 } }, "relaybus: enqueue_many: item 1: topic must not contain a NUL byte" },
        { { good, { "m", print } }, "relaybus: enqueue_many: item 2: payload is not JSON-encodable" },
        { { good, good, good, { "m", 1, { dealy = 1 } } }, "relaybus: enqueue_many: item 4: unknown option 'dealy'" },
        { { { "m", 1, { max_attempts = 0 } } }, "relaybus: enqueue_many: item 1: max_attempts must be a positive integer" },
        { { good, { "m", 1, { key = "k\0" } } }, "relaybus: enqueue_many: item 2: key must not contain a NUL byte" },
      }
      for _, c in ipairs(cases) do
        local err = raises_relaybus(store.enqueue_many, store, c[1])
        assert.equal(c[2], err:sub(1, #c[2]), err)
        local _, terr = store:transaction(function(tx) return tx:enqueue_many(c[1]) end)
        assert.equal(err, terr)
      end
      assert.equal(0, (H.total(store)))
      -- a list with other keys beside its items is a sequence still (table.pack's n)
      assert.equal(2, #assert(store:enqueue_many(table.pack(good, good))))
    end)

    it("enqueue_many takes a list longer than Lua's stack holds (200,000 items with keys)", function()
      local list = {}
      for i = 1, 200000 do list[i] = { "m.long", i, { key = i } } end
      local ids = assert(store:enqueue_many(list))
      assert.equal(200000, #ids)
      assert.equal(200000, (H.total(store)))
      -- the keys were kept to the end of the call: each dedupes
      assert.equal(ids[123456], assert(store:enqueue_many { { "m.long", 0, { key = 123456 } } })[1])
    end)
  end)

  for _, entry in ipairs(S.list()) do
    describe("payloads and handlers on " .. entry.name .. ":", function()
      local store, url, opts, tbl
      before_each(function() store, url, opts, tbl = S.open(entry) end)
      after_each(S.reset)

      it("refuses a payload JSON cannot hold (function, NaN, infinity, nested function) and writes nothing", function()
        local bad = { function() end, 0 / 0, math.huge, -math.huge, { ok = 1, f = print },
                      { 1, 2, coroutine.create(function() end) } }
        for i, p in ipairs(bad) do
          local msg = refused(store.enqueue, store, "bi.json", p)
          assert.is_string(msg, "payload #" .. i)
        end
        assert.equal(0, (H.total(store)))
        -- and the store still works
        local id = assert(store:enqueue("bi.json", { fine = true }))
        assert.same({ fine = true }, assert(store:get(id)).payload)
      end)

      it("a handler that raises a table or nil buries with a string last_error; nothing is lost", function()
        local ids = assert(store:enqueue_many {
          { "bi.table", 1, { max_attempts = 1 } },
          { "bi.nil", 2, { max_attempts = 1 } },
          { "bi.obj", 3, { max_attempts = 1 } },
        })
        local d = H.dispatcher(store)
        local stop = H.stopper(d)
        local runs = 0
        local function count() runs = runs + 1; if runs == 3 then stop() end end
        d:handle("bi.table", function() count(); error({ code = 42 }) end)
        d:handle("bi.nil", function() count(); error(nil) end)
        d:handle("bi.obj", function()
          count()
          error(setmetatable({}, { __tostring = function() return "custom error object" end }))
        end)
        assert.is_true(H.run(d, 10))
        assert.equal(3, runs)
        for _, id in ipairs(ids) do
          local r = assert(store:get(id))
          assert.equal("buried", r.status)
          assert.is_string(r.last_error)
          assert.is_true(#r.last_error > 0)
        end
        assert.truthy(assert(store:get(ids[3])).last_error:find("custom error object", 1, true))
      end)

      -- an error value that cannot even be turned into text: its __tostring raises
      local function evil()
        return setmetatable({}, { __tostring = function() error("no text for you") end })
      end

      it("store:transaction whose fn raises a value whose __tostring raises rolls back and returns nil, err", function()
        local before = assert(store:enqueue("bi.tx", 0))
        if entry.kind == "mongodb" and not H.mongo_replica_set(store) then
          -- no transaction can begin there: still nil, err, not a raise
          local ok, res, err = pcall(store.transaction, store, function() error(evil()) end)
          assert.is_true(ok, tostring(res))
          assert.is_nil(res)
          assert.truthy(tostring(err):find("replica set", 1, true), err)
          return
        end
        for _, value in ipairs { evil(), setmetatable({}, { __tostring = function() return {} end }) } do
          local ok, res, err = pcall(store.transaction, store, function(tx)
            tx:enqueue("bi.tx", 1)
            error(value)
          end)
          assert.is_true(ok, "store:transaction raised: " .. tostring(res))
          assert.is_nil(res)
          assert.equal("error (a value whose __tostring raised)", err)
        end
        -- rolled back, and the store is free: another transaction and plain calls work
        assert.equal(1, (H.total(store)))
        assert.is_true((store:transaction(function(tx) tx:enqueue("bi.tx", 2) end)))
        assert.equal(2, (H.total(store)))
        assert.equal("pending", assert(store:get(before)).status)
      end)

      it("a handler that raises a value whose __tostring raises is retried, its last_error saying so", function()
        local id = assert(store:enqueue("bi.evil", 1, { max_attempts = 2 }))
        local d = H.dispatcher(store)
        local stop = H.stopper(d)
        local outcomes = {}
        d:on("settled", function(ev)
          outcomes[#outcomes + 1] = ev.outcome .. ": " .. tostring(ev.error)
          if #outcomes == 2 then stop() end
        end)
        local runs = 0
        d:handle("bi.evil", function()
          runs = runs + 1
          if runs == 1 then error(evil()) end
        end)
        assert.is_true(H.run(d, 10))
        assert.same({ "retried: error (a value whose __tostring raised)", "completed: nil" }, outcomes)
        assert.equal("completed", assert(store:get(id)).status)
      end)
    end)
  end

  describe("a payload row that is not valid JSON (written by hand into the SQLite table)", function()
    it("is buried by the dispatcher with last_error about the payload; get and list do not crash", function()
      local store = assert(relaybus.open("sqlite:" .. S.tmpfile("rows") .. ".db"))
      local good = assert(store:enqueue("bi.row", { fine = 1 }))
      local now = relaybus.time()
      local ok, err = store:transaction(function(tx)
        return tx:exec("INSERT INTO relaybus_deliveries (topic, payload, status, attempts, max_attempts,"
          .. " fence, run_at, created_at) VALUES ('bi.row', '{not json', 'pending', 0, 5, 0, ?, ?)", now - 1, now - 1)
      end)
      assert.is_true(ok, err)
      local rows = assert(store:list { topic = "bi.row" })
      assert.equal(2, #rows)
      local bad
      for _, r in ipairs(rows) do if r.id ~= good then bad = r.id end end
      assert.is_string(bad)
      local okget, rec = pcall(store.get, store, bad)
      assert.is_true(okget, rec)
      assert.is_table(rec)
      assert.equal("pending", rec.status)

      local d = H.dispatcher(store)
      local stop = H.stopper(d)
      local seen = {}
      d:handle("bi.row", function(delivery)
        seen[#seen + 1] = delivery.id
      end)
      -- the good one runs; the bad one is buried without running: wait until both settled
      relaybus.spawn(function()
        H.poll(function()
          local b, g = store:get(bad), store:get(good)
          return b and g and g.status == "completed" and b.status ~= "pending" and b.status ~= "processing"
        end, 5)
        stop()
      end)
      assert.is_true(H.run(d, 10))
      assert.same({ good }, seen)
      assert.equal("completed", assert(store:get(good)).status)
      local r = assert(store:get(bad))
      assert.equal("buried", r.status)
      assert.is_string(r.last_error)
      assert.truthy(r.last_error:lower():find("payload", 1, true), r.last_error)
      assert.is_true(pcall(store.list, store, {}))
      store:close()
    end)
  end)

  describe("the command", function()
    local function relaybus_cmd(args, env)
      local argv = { S.bin }
      for _, a in ipairs(args) do argv[#argv + 1] = a end
      return S.run_command(argv, env)
    end
    local function db() return "sqlite:" .. S.tmpfile("cli") .. ".db" end

    it("relaybus run of a script with a syntax error exits 1 with one line on stderr", function()
      local script = S.tmpfile("syntax") .. ".lua"
      S.write(script, "local x = = 1\nprint('never')\n")
      local code, out, err = relaybus_cmd { "run", script }
      assert.equal(1, code)
      assert.equal("", out)
      H.one_line((err:gsub("\n$", "")), "stderr")
    end)

    it("relaybus run of a script that raises exits 1 with one line on stderr", function()
      local script = S.tmpfile("raise") .. ".lua"
      S.write(script, "error('deliberate failure')\n")
      local code, _, err = relaybus_cmd { "run", script }
      assert.equal(1, code)
      H.one_line((err:gsub("\n$", "")), "stderr")
      assert.truthy(err:find("deliberate failure", 1, true))
    end)

    it("relaybus run passes the arguments as ... and arg, and exits 0", function()
      local script = S.tmpfile("args") .. ".lua"
      S.write(script, "local a, b = ...\nio.write(a, ' ', b, ' ', arg[1], ' ', arg[2], '\\n')\n")
      local code, out = relaybus_cmd { "run", script, "one", "two" }
      assert.equal(0, code)
      assert.equal("one two one two\n", out)
    end)

    it("exits 0 on success: enqueue prints the id, stats and list --json print JSON", function()
      local url = db()
      local code, out, err = relaybus_cmd { "enqueue", "cli.t", '{"a":1}', "--store", url }
      assert.equal(0, code, err)
      local id = out:match("^%s*(%S+)%s*$")
      assert.is_string(id)
      code, out = relaybus_cmd { "stats", "--json", "--store", url }
      assert.equal(0, code)
      local st = relaybus.json.decode(out)
      assert.equal(1, st.pending)
      code, out = relaybus_cmd { "list", "--json", "--store", url }
      assert.equal(0, code)
      local list = relaybus.json.decode(out)
      assert.equal(1, #list)
      assert.equal(id, tostring(list[1].id))
      assert.same({ a = 1 }, list[1].payload)
      local store = assert(relaybus.open(url))
      assert.same({ a = 1 }, assert(store:get(id)).payload)
      store:close()
    end)

    it("uses RELAYBUS_STORE when --store is not given", function()
      local url = db()
      local code = relaybus_cmd({ "enqueue", "cli.env", "[1,2]" }, { RELAYBUS_STORE = url })
      assert.equal(0, code)
      local store = assert(relaybus.open(url))
      assert.equal(1, assert(store:stats()).pending)
      store:close()
    end)

    it("exits 2 with one line on stderr on a usage error", function()
      local url = db()
      for _, args in ipairs {
        { "frobnicate" },
        {},
        { "enqueue", "--store", url },
        { "enqueue", "t", "{not json", "--store", url },
        { "stats", "--no-such-flag", "--store", url },
        { "enqueue", "t", "1", "--delay", "soon", "--store", url },
        { "list", "--status", "sideways", "--store", url },
        { "run" },
      } do
        local code, _, err = relaybus_cmd(args)
        local what = "relaybus " .. table.concat(args, " ")
        assert.equal(2, code, what)
        H.one_line((err:gsub("\n$", "")), "stderr of " .. what)
      end
      local store = assert(relaybus.open(url))
      assert.equal(0, (H.total(store)))
      store:close()
    end)

    it("exits 1 with one line on stderr on a runtime failure", function()
      for _, args in ipairs {
        { "stats", "--store", "sqlite:/proc/relaybus-spec/none.db" },
        { "enqueue", "t", "1", "--store", "nosuch://x" },
        { "run", S.tmpdir() .. "/no-such-script.lua" },
      } do
        local code, _, err = relaybus_cmd(args)
        local what = "relaybus " .. table.concat(args, " ")
        assert.equal(1, code, what)
        H.one_line((err:gsub("\n$", "")), "stderr of " .. what)
      end
    end)

    it("exits 0 for --help", function()
      local code, out = relaybus_cmd { "--help" }
      assert.equal(0, code)
      assert.truthy(out:find("run", 1, true))
      code = relaybus_cmd { "enqueue", "--help" }
      assert.equal(0, code)
    end)
  end)
end)
